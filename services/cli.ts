import { Command } from 'commander';
import path from 'node:path';
import { hasEmbeddedDatabase, openPgliteDb } from '../db/embedded.js';
import { migrate, newerSchemaWarning, unknownMigrations } from '../db/migrate.js';
import { makePgDb } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import { loadConfig, ConfigError, pgConnectionOptions } from './config.js';
import type { Config } from './config.js';
import { AppError } from './errors.js';
import { defaultExtensions } from './extensions.js';
import { afterRestoreCommand } from './lifecycle/after-restore.js';
import { addLifecycleCommands, cliMigrationLog, refuseWithoutSchema } from './lifecycle/lifecycle-cli.js';
import { runFromEnv } from './main.js';
import { reembedCommand } from './recent-index/reembed.js';
import { redisNamespaceCommand } from './redis-namespace.js';
import { createKey, createTenant, keyIdOf, keyList, revokeKey, tenantList } from './tenants.js';

/**
 * Opens the database, applies pending migrations (`applied` names them) and runs `fn`. Only with
 * `install` (the `migrate` command) is a Postgres database without mnemos's schema given one.
 */
async function withDb<T>(
  fn: (db: Db, applied: string[]) => Promise<T>,
  opts: { install?: boolean } = {},
): Promise<T> {
  const config = loadConfig(process.env);
  // Embedded mode: open the data dir directly; it fails with a clear message while "mnemos serve" holds it.
  const db = config.databaseUrl
    ? makePgDb({ ...pgConnectionOptions(config, config.databaseUrl), max: 2 })
    : await openPgliteDb(config.dataDir);
  try {
    if (!opts.install) await refuseWithoutSchema(db, config);
    // A migration giving way to a long transaction says so, rather than hang silently.
    const applied = await migrate(db, undefined, { logger: cliMigrationLog });
    return await fn(db, applied);
  } finally {
    await db.close();
  }
}

const print = (s: string) => process.stdout.write(`${s}\n`);

/**
 * What is lost with stdout beyond the output itself: set before the one showing of an API key.
 * `tenant create > /dev/full` created the tenant, never showed its only key, and said nothing but a
 * stack trace; now stderr names what was created and the way on.
 */
let lostWithStdout: string | null = null;
const printKey = (s: string, lost: string) => {
  lostWithStdout = lost;
  print(s);
};

/**
 * A CLI command whose stdout fails stops there (it died of an unhandled 'error' event, with a stack
 * trace, or waited forever for a 'drain'). A reader that went away (`mnemos export … | head`, EPIPE)
 * ends it as SIGPIPE ends a Unix tool: without a word and with status 141 (128 + 13). Any other
 * failure (a full disk) is one line on stderr and status 1.
 */
function stdoutFailed(err: NodeJS.ErrnoException): never {
  if (err.code !== 'EPIPE' || lostWithStdout)
    process.stderr.write(
      `mnemos: cannot write to stdout (${err.message})${lostWithStdout ? `: ${lostWithStdout}` : ''}\n`,
    );
  process.exit(err.code === 'EPIPE' ? 141 : 1);
}

/** The way on from a new key that was not shown: it exists and works, and only its id is shown again. */
const unseenKeyWayOn = (tenantId: string, keyId: string) =>
  `run \`mnemos key create --tenant ${tenantId}\` for a new key, and \`mnemos key revoke ${keyId}\` to revoke the unseen one`;

/**
 * Embedded mode: the commands that only read, change what exists, or need a tenant that a new
 * database cannot have. On a data directory without a database they refuse, creating nothing (run
 * from the wrong directory, `tenant list` printed nothing and left a 39 MB empty database there,
 * `export` a tenant "default" and a key file too). `serve`, `migrate`, `tenant create` and
 * `import` (whose `--tenant default` is the tenant a new database starts with) create one.
 */
const NEEDS_EMBEDDED_DB = new Set([
  'tenant list',
  'tenant delete',
  'key create',
  'key list',
  'key revoke',
  'export',
  'reembed',
  'redis-namespace',
]);

async function refuseWithoutEmbeddedDb(command: Command, config: Config): Promise<void> {
  const names: string[] = [];
  for (let c: Command | null = command; c && c !== program; c = c.parent) names.unshift(c.name());
  const name = names.join(' ');
  if (config.databaseUrl || !NEEDS_EMBEDDED_DB.has(name) || (await hasEmbeddedDatabase(config.dataDir)))
    return;
  throw new Error(
    `no embedded database in ${path.resolve(config.dataDir)} (MNEMOS_DATA_DIR, default ./data of the current ` +
      `directory), and "${name}" does not create one: set MNEMOS_DATA_DIR to your data directory (or DATABASE_URL ` +
      `for Postgres); "mnemos serve" or "mnemos tenant create <name>" creates a new database`,
  );
}

const program = new Command('mnemos')
  .description('Tiered conversation memory for multi-agent LLM backends')
  .showHelpAfterError()
  // serve, api and worker log the configuration's warnings at start; the other commands say them
  // here: a DATABASE_URL without a database name or a mistyped MNEMOS_PREFIX matters to `migrate`
  // and `after-restore` as much as to a service.
  .hook('preAction', async (_, command) => {
    if (['serve', 'api', 'worker'].includes(command.name()) && command.parent === program) return;
    process.stdout.on('error', stdoutFailed);
    const config = loadConfig(process.env);
    for (const w of config.warnings) process.stderr.write(`mnemos: warning: ${w}\n`);
    await refuseWithoutEmbeddedDb(command, config);
  });

program
  .command('serve')
  .description('API and workers in one process (what npm start runs)')
  .action(() => runFromEnv('serve', defaultExtensions));
program
  .command('api')
  .description('HTTP API only')
  .action(() => runFromEnv('api', defaultExtensions));
program
  .command('worker')
  .description('all job processors and schedules')
  .action(() => runFromEnv('worker', defaultExtensions));
program
  .command('migrate')
  .description('apply pending database migrations')
  .action(() =>
    withDb(
      async (db, applied) => {
        const newer = await unknownMigrations(db);
        if (newer.length > 0) process.stderr.write(`mnemos: warning: ${newerSchemaWarning(newer)}\n`);
        print(
          applied.length
            ? `applied: ${applied.join(', ')}`
            : newer.length > 0
              ? 'schema is ahead of this build'
              : 'schema is up to date',
        );
      },
      { install: true },
    ),
  );

const tenant = program.command('tenant').description('manage tenants');
tenant
  .command('create <name>')
  .option('--json', 'print one JSON line {"tenant_id","api_key"}')
  .action((name: string, o: { json?: boolean }) =>
    withDb(async (db) => {
      const t = await createTenant(db, name);
      const keyId = keyIdOf(t.api_key) ?? '?';
      const lost =
        `tenant ${t.tenant_id} was created, but its API key (key id ${keyId}) was not shown and cannot be ` +
        `shown again: ${unseenKeyWayOn(t.tenant_id, keyId)}`;
      if (o.json) printKey(JSON.stringify(t), lost);
      else
        printKey(
          `tenant_id: ${t.tenant_id}\napi_key:   ${t.api_key}\n(the key is shown once; store it now)`,
          lost,
        );
    }),
  );
tenant
  .command('list')
  .option('--json', 'JSON output')
  .action((o: { json?: boolean }) =>
    withDb(async (db) => {
      const rows = (await tenantList(db)).items;
      if (o.json) print(JSON.stringify(rows));
      else
        for (const t of rows)
          print(
            `${t.tenant_id}\t${t.name}\t${t.created_at}${t.erasing_at ? `\tERASING since ${t.erasing_at}` : ''}`,
          );
    }),
  );
// tenant delete, import agenvoy|jsonl, export (services/lifecycle/).
addLifecycleCommands(program, tenant, defaultExtensions);

const key = program.command('key').description('manage API keys');
key
  .command('create')
  .requiredOption('--tenant <id|name>', 'tenant id or name')
  .option('--name <name>', 'a label for the key', '')
  .option('--json', 'print one JSON line {"key_id","tenant_id","api_key"}')
  .action((o: { tenant: string; name: string; json?: boolean }) =>
    withDb(async (db) => {
      const k = await createKey(db, o.tenant, o.name);
      const lost =
        `key ${k.key_id} of tenant ${k.tenant_id} was created, but it was not shown and cannot be shown ` +
        `again: ${unseenKeyWayOn(k.tenant_id, k.key_id)}`;
      if (o.json) printKey(JSON.stringify(k), lost);
      else
        printKey(`key_id:  ${k.key_id}\napi_key: ${k.api_key}\n(the key is shown once; store it now)`, lost);
    }),
  );
key
  .command('list')
  .option('--tenant <id|name>', 'only this tenant')
  .option('--json', 'JSON output')
  .action((o: { tenant?: string; json?: boolean }) =>
    withDb(async (db) => {
      const rows = (await keyList(db, o.tenant)).items;
      if (o.json) print(JSON.stringify(rows));
      else
        for (const k of rows)
          print(
            `${k.key_id}\t${k.tenant_id}\t${k.name || '-'}\tcreated ${k.created_at}\tlast used ${k.last_used_at ?? 'never'}${k.revoked_at ? `\tREVOKED ${k.revoked_at}` : ''}`,
          );
    }),
  );
key
  .command('revoke <key_id>')
  .description('revoke a key, given its id or the key itself (only the id is printed)')
  .action((arg: string) =>
    withDb(async (db) => {
      // Keys are never printed (README "Security notes"): a whole key pasted here was echoed in
      // "no active key mn_…". It is revoked by its id, and no message shows more than an id.
      const id = keyIdOf(arg);
      if (id === null)
        throw new AppError(
          400,
          'invalid_key_id',
          'not a key id (12 characters of a-z and 2-7, as `mnemos key list` shows) or an API key (mn_<key id>_<secret>)',
        );
      if (!(await revokeKey(db, id))) throw new AppError(404, 'not_found', `no active key ${id}`);
      print(`revoked ${id}`);
    }),
  );

program
  .command('reembed')
  .description(
    'rebuild the recent index for the configured EMBEDDING_MODEL/EMBEDDING_DIMENSIONS (stop the service first)',
  )
  .option('--batch-size <n>', 'messages per embeddings call', '128')
  .option('--force', 'rebuild even when the index matches, or take over a run that looks alive')
  .action((o: { batchSize: string; force?: boolean }) => {
    // Checked before anything starts (it printed that the rebuild began, then "got NaN").
    if (!/^\d{1,4}$/.test(o.batchSize) || Number(o.batchSize) < 1 || Number(o.batchSize) > 2048)
      throw new AppError(
        400,
        'invalid_option',
        `--batch-size must be a whole number from 1 to 2048, got "${o.batchSize}"`,
      );
    return withDb(async (db) => {
      await reembedCommand(db, loadConfig(process.env), {
        batchSize: Number(o.batchSize),
        force: o.force === true,
        print,
      });
    });
  });

program
  .command('redis-namespace')
  .description(
    'show the Redis namespace (MNEMOS_PREFIX and REDIS_URL database number) the database is used with; ' +
      '--accept records the configured one',
  )
  .option(
    '--accept',
    'record the configured namespace (after the old one is drained and every process is stopped)',
  )
  .option('--force', 'with --accept: record it even while messages still wait under the old namespace')
  .addHelpText(
    'after',
    '\nThe first start records the namespace; serve, api, worker and the commands that use Redis refuse\n' +
      'another one. To move a deployment: stop the API processes, let the workers archive what waits\n' +
      'under the old settings, stop every mnemos process, run `mnemos redis-namespace --accept` with the\n' +
      'new settings, then start them. --accept refuses while messages still wait in the old inboxes on\n' +
      'this Redis.',
  )
  .action((o: { accept?: boolean; force?: boolean }) =>
    withDb((db) =>
      redisNamespaceCommand(db, loadConfig(process.env), {
        accept: o.accept === true,
        force: o.force === true,
        print,
      }),
    ),
  );

program
  .command('after-restore')
  .description(
    'after restoring the database from a backup: remove the per-session state Redis keeps for ' +
      'MNEMOS_PREFIX, so that it is seeded again from the restored database (stop every mnemos process first)',
  )
  .option('--force', 'skip the check for running workers')
  .option('--json', 'print the counts as one JSON line')
  .addHelpText(
    'after',
    '\nStop every mnemos process (serve, worker and api) that uses this Redis and MNEMOS_PREFIX first.\n' +
      'Running workers are found and the command refuses; API-only processes cannot be seen.\n' +
      'Accepted messages still waiting to be archived are dropped (counted in the output).\n' +
      'Error memory, dead letters, rate-limit counters and the job queues are kept.',
  )
  .action((o: { force?: boolean; json?: boolean }) =>
    afterRestoreCommand(loadConfig(process.env), { force: o.force === true, json: o.json === true, print }),
  );

try {
  await program.parseAsync(process.argv);
} catch (err) {
  // A command that failed because stdout did (export's writes) ends as stdoutFailed says.
  if (process.stdout.errored) stdoutFailed(process.stdout.errored);
  if (err instanceof ConfigError || err instanceof AppError) {
    process.stderr.write(`mnemos: ${err.message}\n`);
  } else {
    process.stderr.write(`mnemos: ${err instanceof Error ? err.message : String(err)}\n`);
  }
  process.exit(err instanceof ConfigError ? 78 : 1);
}
