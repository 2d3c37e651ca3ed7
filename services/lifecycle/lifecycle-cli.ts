import { constants, createReadStream, existsSync } from 'node:fs';
import { once } from 'node:events';
import { access, open, realpath, rename, rm, stat } from 'node:fs/promises';
import path from 'node:path';
import type { Writable } from 'node:stream';
import type { Command } from 'commander';
import { migrate, schemaState } from '../../db/migrate.js';
import type { MigrateOptions } from '../../db/migrate.js';
import type { Db } from '../../db/pool.js';
import { findTenant } from '../../db/queries/tenants.js';
import type { AfterArchive } from '../../workers/ingest.js';
import { drainSession } from '../../workers/ingest.js';
import { loadConfig, shownUrl } from '../config.js';
import type { Config } from '../config.js';
import type { CoreDeps } from '../deps.js';
import { AppError } from '../errors.js';
import type { Extension, ExtensionFactory } from '../extension.js';
import { makeLogger } from '../logger.js';
import { assertSessionId } from '../messages/message-input.js';
import { waitForRedis } from '../redis.js';
import { refuseOtherNamespace } from '../redis-namespace.js';
import { closeDeps, openDeps } from '../runtime.js';
import { agenvoyExitStatus, importAgenvoySessions } from './agenvoy-migrate.js';
import type { AgenvoySessionReport } from './agenvoy-migrate.js';
import { openSessionExport } from './export-session.js';
import { parseImportLines, readJsonLines } from './import-input.js';
import { importSession } from './import-session.js';
import { eraseTenant } from './tenant-erasure.js';

/**
 * CLI commands of the lifecycle module (SPEC §5): `tenant delete`, `import agenvoy`, `import jsonl`,
 * `export`. Imports are archived in this process (the same drain as the ingest worker, with every
 * module's post-archive hooks), so they are durable when the command returns, worker or not.
 */

const print = (s: string) => process.stdout.write(`${s}\n`);

/**
 * CLI commands other than `migrate` refuse a Postgres database without mnemos's schema instead of
 * installing it: pointed at another application's database by mistake (or at the shared `postgres`
 * one), `tenant list` left 14 tables and the vector extension there. A database with the schema
 * and pending migrations is still migrated by them (the upgrade path). Embedded mode's data
 * directory is mnemos's own: `tenant create` and `import` install a fresh one (README Quick start:
 * `tenant create` before any `serve`), the commands that only read or need an existing tenant
 * refuse a directory without a database (services/cli.ts, refuseWithoutEmbeddedDb).
 */
export async function refuseWithoutSchema(db: Db, config: Config): Promise<void> {
  if (!config.databaseUrl) return;
  const { database, installed } = await schemaState(db);
  if (installed) return;
  throw new Error(
    `database "${database}" (${shownUrl(config.databaseUrl)}) has no mnemos schema, and this command ` +
      `does not install one: check DATABASE_URL, or run \`mnemos migrate\` first to install it there`,
  );
}

interface Runtime {
  deps: CoreDeps;
  extensions: Extension[];
}

/** Where a CLI command's migrations say they give way to a long transaction: one stderr line each. */
export const cliMigrationLog: MigrateOptions['logger'] = {
  warn: (_fields, msg) => void process.stderr.write(`mnemos: warning: ${msg}\n`),
};

async function withRuntime<T>(
  factories: ExtensionFactory[] | null,
  fn: (rt: Runtime) => Promise<T>,
): Promise<T> {
  const config = loadConfig(process.env);
  // Results go to stdout; logs only when asked for, and to stderr: an export to stdout with
  // LOG_LEVEL=info began with the "PGlite opened" log line, and its import then failed.
  const logger = makeLogger(process.env.LOG_LEVEL ? config.logLevel : 'warn', { stderr: true });
  const deps = await openDeps(config, logger, { poolSize: 4, quietQueueErrors: true });
  const extensions: Extension[] = [];
  try {
    await refuseWithoutSchema(deps.db, config);
    // An export or an import that applies a migration is as vocal as `mnemos migrate` (it was
    // silent for as long as the migration gave way: up to 15 minutes).
    await migrate(deps.db, undefined, { logger: cliMigrationLog });
    if (!(await waitForRedis(deps.redis, 5000)))
      throw new Error(`cannot reach Redis at ${shownUrl(config.redisUrl)}`);
    await refuseOtherNamespace(deps.db, config);
    for (const f of factories ?? []) extensions.push(await f(deps, extensions));
    return await fn({ deps, extensions });
  } finally {
    for (const e of extensions.reverse()) await e.close?.().catch(() => undefined);
    await closeDeps(deps).catch(() => undefined);
  }
}

async function tenantIdOf(deps: CoreDeps, idOrName: string): Promise<string> {
  const t = await findTenant(deps.db, idOrName);
  // An API key passed by mistake is not printed (keys never are: README "Security notes").
  if (!t)
    throw new AppError(
      404,
      'not_found',
      /^mn_/.test(idOrName)
        ? 'no tenant of that name or id (an API key is not a tenant)'
        : `no tenant "${idOrName}"`,
    );
  return t.id;
}

/** Archives what an import queued, here and now (any running worker may help; they serialise). */
export async function drainNow(
  deps: CoreDeps,
  extensions: readonly Extension[],
  tenantId: string,
  sessionId: string,
) {
  const hooks = extensions.flatMap((e) => (e.afterArchive ? [e.afterArchive] : []));
  const after: AfterArchive = async (a) => {
    for (const h of hooks) await h(a);
  };
  for (;;) {
    const r = await drainSession(deps, tenantId, sessionId, after);
    if (!r.more) return;
  }
}

function assertTimeZone(zone: string): void {
  try {
    new Intl.DateTimeFormat('en-US', { timeZone: zone });
  } catch {
    throw new Error(`--tz: unknown time zone "${zone}" (use an IANA name such as Asia/Taipei or UTC)`);
  }
}

/**
 * Writes `lines`, throwing the stream's error: a write that failed (`--out` on a full disk) left
 * the export waiting for a 'drain' that never came, forever.
 */
async function writeAll(out: Writable, lines: AsyncIterable<string>): Promise<number> {
  let n = 0;
  for await (const line of lines) {
    n++;
    // A stream that failed (a full disk) emits no 'drain': its error is thrown, whether it came
    // before this write or while waiting (once() rejects on 'error').
    if (out.errored) throw out.errored;
    if (!out.write(line)) await once(out, 'drain');
  }
  return n;
}

/**
 * Writes an export to `file` whole or not at all. Written in place, an export cut midway (the
 * session reset or deleted during it, a full disk) left the lines written so far, and that file
 * imported as a shorter session. So the lines go to a temporary file beside the target, renamed
 * over it once the export is complete; a failure removes the temporary, and an earlier file at
 * the target stays as it was. A symlink is followed (the file it names is replaced, not the link);
 * a target that is not a regular file (/dev/null, a FIFO) is written in place, as renaming over it
 * would replace the device itself. An earlier file is replaced only where it could be written to,
 * and keeps its permissions (an export chmod-ed 600 must not become world-readable).
 */
async function writeExportFile(file: string, lines: AsyncIterable<string>): Promise<number> {
  const target = await realpath(file).catch(() => file);
  const existing = await stat(target).catch(() => null);
  const inPlace = existing !== null && !existing.isFile();
  if (existing?.isFile()) await access(target, constants.W_OK);
  const dest = inPlace ? target : `${target}.${process.pid}.part`;
  // Opened before anything is written, so a missing directory or a read-only file is a
  // one-line error, not an unhandled stream 'error' event.
  const handle = await open(dest, 'w');
  const out = handle.createWriteStream();
  let failed: Error | null = null;
  out.on('error', (err) => (failed ??= err));
  try {
    if (existing?.isFile()) await handle.chmod(existing.mode & 0o7777);
    const n = await writeAll(out, lines);
    // The write's error is the one to report (`errored`: its 'error' event waits for the file to
    // close): `end` on the stream it destroyed fails with "Cannot call end after a stream was
    // destroyed", which said nothing of a full disk.
    await new Promise<void>((resolve, reject) =>
      out.end((err?: Error | null) => {
        const e = out.errored ?? failed ?? err;
        if (e) reject(e);
        else resolve();
      }),
    );
    if (!inPlace) await rename(dest, target);
    return n;
  } catch (err) {
    out.destroy();
    if (!inPlace) await rm(dest, { force: true }).catch(() => undefined);
    throw err;
  }
}

function describe(r: AgenvoySessionReport): string {
  const parts = [
    `${r.session_id}: ${r.status}`,
    `${r.imported} messages (${r.from_history_json} from history.json, ${r.from_history_db} only in history.db, ${r.duplicates_merged} duplicates merged, ${r.messages_skipped} skipped)`,
  ];
  if (r.first_seq !== null) parts.push(`seq ${r.first_seq}-${r.last_seq}`);
  parts.push(
    r.summary
      ? `summary restored (cursor_seq ${r.summary.cursor_seq ?? 'set by the next summary job'})`
      : 'no summary',
  );
  return [parts.join(', '), ...r.notes.map((n) => `    note: ${n}`)].join('\n');
}

export function addLifecycleCommands(program: Command, tenant: Command, factories: ExtensionFactory[]): void {
  tenant
    .command('delete <id|name>')
    .description(
      'erase a tenant and all its data (Postgres and Redis); its keys stop working (within 5 s in running API processes: their key cache)',
    )
    .action((idOrName: string) =>
      withRuntime(factories, async ({ deps, extensions }) => {
        const id = await tenantIdOf(deps, idOrName);
        await eraseTenant(deps, () => extensions, id);
        print(`erased tenant ${id}`);
      }),
    );

  const imp = program.command('import').description('import past conversations into empty sessions');
  imp
    .command('agenvoy <sessions_dir>')
    .description(
      "import Agenvoy sessions: each directory's history.json, summary.json, summary cursor, and the archived messages of .store/history.db",
    )
    .requiredOption('--tenant <id|name>', 'tenant id or name')
    .option('--tz <zone>', 'time zone of the naive timestamps (default: TZ)')
    .option('--session <id...>', 'only these session directories')
    .option('--json', 'print the report as JSON')
    .addHelpText(
      'after',
      '\nExit status: 0 when every session is in mnemos (imported now, or by an earlier run) or held\n' +
        'nothing to import, and at least one is; 2 when some are and others failed (fix those, run\n' +
        'again: the rest are skipped); 3 when none is (every session failed, held nothing, or had an\n' +
        'invalid name); 1 on an error (no session directories in <sessions_dir>, an unknown tenant,\n' +
        "a history.db that is not Agenvoy's, Postgres or Redis refusing or gone: the run stops there;\n" +
        'run it again later).',
    )
    .action(async (dir: string, o: { tenant: string; tz?: string; session?: string[]; json?: boolean }) => {
      if (o.tz !== undefined) assertTimeZone(o.tz);
      await withRuntime(factories, async ({ deps, extensions }) => {
        const tenantId = await tenantIdOf(deps, o.tenant);
        const report = await importAgenvoySessions(deps, tenantId, dir, {
          ...(o.tz ? { timeZone: o.tz } : {}),
          ...(o.session ? { only: o.session } : {}),
        });
        for (const s of report.sessions)
          if (s.status === 'imported') await drainNow(deps, extensions, tenantId, s.session_id);
        if (o.json) {
          print(JSON.stringify(report));
        } else {
          print(`history.db: ${report.historyDb ?? 'not found'}`);
          for (const n of report.notes) print(`note: ${n}`);
          for (const s of report.sessions) print(describe(s));
          for (const d of report.invalidDirs) print(`${d}: failed (its name is not a valid session id)`);
          for (const d of report.missing) print(`${d}: failed (no such session directory in ${dir})`);
          const nested = path.join(dir, 'sessions');
          if (!report.sessions.some((s) => s.status === 'imported') && existsSync(nested)) {
            print(`hint: ${dir} holds a "sessions" directory; Agenvoy's sessions are usually in ${nested}`);
          }
          const done = report.sessions.filter((s) => s.status === 'imported');
          print(
            `imported ${done.length} of ${report.sessions.length} sessions, ${done.reduce((a, s) => a + s.imported, 0)} messages`,
          );
        }
        const status = agenvoyExitStatus(report);
        if (status.problem) process.stderr.write(`mnemos: import agenvoy: ${status.problem}\n`);
        process.exitCode = status.code;
      });
    });
  imp
    .command('jsonl <file>')
    .description('import a JSON Lines export (message lines, optional summary line) into an empty session')
    .requiredOption('--tenant <id|name>', 'tenant id or name')
    .requiredOption('--session <id>', 'target session id')
    .addHelpText(
      'after',
      '\nAn empty file (the export of a session with neither messages nor a summary) is not imported:\n' +
        'the command exits 1 with "nothing to import", and the session stays as it was.',
    )
    .action((file: string, o: { tenant: string; session: string }) =>
      withRuntime(factories, async ({ deps, extensions }) => {
        const sid = assertSessionId(o.session);
        const tenantId = await tenantIdOf(deps, o.tenant);
        const input = await parseImportLines(readJsonLines(createReadStream(file)), deps.config.timeZone);
        const outcome = await importSession(deps, tenantId, sid, input);
        await drainNow(deps, extensions, tenantId, sid);
        print(
          `${sid}: imported ${outcome.imported} messages${outcome.first_seq !== null ? ` (seq ${outcome.first_seq}-${outcome.last_seq})` : ''}${outcome.summary ? ', summary restored' : ''}`,
        );
      }),
    );

  program
    .command('export <session>')
    .description('write a session as JSON Lines (messages, then the summary) to stdout or --out')
    .requiredOption('--tenant <id|name>', 'tenant id or name')
    .option('--out <file>', 'write to this file instead of stdout')
    .addHelpText(
      'after',
      '\nWith --out, the file is written whole or not at all (through <file>.<pid>.part beside it):\n' +
        'an export that fails, such as one whose session is reset or deleted meanwhile (exit 1),\n' +
        'leaves an earlier file there as it was. To stdout, a failure midway has already written\n' +
        'some lines: check the exit status (in a pipeline too), or use --out.',
    )
    .action((session: string, o: { tenant: string; out?: string }) =>
      withRuntime(null, async ({ deps }) => {
        const sid = assertSessionId(session);
        const lines = await openSessionExport(deps.db, await tenantIdOf(deps, o.tenant), sid);
        if (!lines) throw new AppError(404, 'not_found', `no session "${sid}" for this tenant`);
        if (!o.out) {
          await writeAll(process.stdout, lines);
          return;
        }
        const n = await writeExportFile(o.out, lines);
        process.stderr.write(`wrote ${n} lines to ${o.out}\n`);
      }),
    );
}
