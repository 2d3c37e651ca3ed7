import { AsyncLocalStorage } from 'node:async_hooks';
import { createHash } from 'node:crypto';
import { constants, readFileSync } from 'node:fs';
import { access, link, mkdir, readdir, readFile, realpath, unlink, writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import type { Server } from 'node:net';
import { hostname } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { inspect } from 'node:util';
import { PGlite } from '@electric-sql/pglite';
import type { Results, Transaction } from '@electric-sql/pglite';
import { vector } from '@electric-sql/pglite-pgvector';
import type { Db, QueryResult, Queryable } from './pool.js';

/**
 * The embedded database: PGlite (PostgreSQL 18 in WebAssembly) with pgvector, behind the same
 * `Db` interface as the pg pool. PGlite is one connection in this process, so the adapter is a
 * pool of exactly one: every statement and every transaction takes one FIFO mutex. A statement
 * issued outside a transaction while one is open waits for it to finish; it never interleaves.
 *
 * Two traps this module closes:
 * - PGlite does not lock its data directory: two processes can open the same directory and
 *   silently lose each other's writes. A lock file (`mnemos.lock`, holding the owner's pid) and,
 *   on Linux, a socket only one process can bind make a second opener fail with
 *   `EmbeddedLockedError` instead (see `takeLock`).
 * - Code that holds `db.transaction(...)` and then awaits `db.query(...)` (not the tx) would wait
 *   for itself forever. Such a call fails at once with `EmbeddedReentryError`, naming the fix.
 */

/** PGlite's files live below the data dir, beside the lock file and the first API key. */
export const PGDATA_SUBDIR = 'pgdata';
const LOCK_FILE = 'mnemos.lock';

const INT8 = 20;
const INT8_ARRAY = 1016;
const BYTEA = 17;

// Aligned with node-postgres as configured in db/pool.ts: int8 (and int8[]) as strings, bytea as
// Buffer. timestamptz is a Date in both; numeric and unknown types (vector) are text in both.
const parsers = {
  [INT8]: (v: string) => v,
  [INT8_ARRAY]: (v: string) =>
    v === '{}'
      ? []
      : v
          .slice(1, -1)
          .split(',')
          .map((x) => (x === 'NULL' ? null : x)),
  [BYTEA]: (v: string) => Buffer.from(v.startsWith('\\x') ? v.slice(2) : v, 'hex'),
};

export class EmbeddedLockedError extends Error {
  readonly code = 'EMBEDDED_LOCKED';
  constructor(
    readonly dataDir: string,
    readonly owner: { pid: number; host: string },
  ) {
    super(
      `the embedded database in ${dataDir} is in use by ${owner.pid > 0 ? `process ${owner.pid}` : 'another process'}` +
        (owner.host !== hostname() ? ` on host ${owner.host}` : '') +
        ` (PGlite is single-process). Stop that process first, or, while "mnemos serve" runs, use its admin API` +
        ` (POST /v1/admin/tenants with MNEMOS_ADMIN_TOKEN). If no such process exists, delete ${path.join(dataDir, LOCK_FILE)}.`,
    );
    this.name = 'EmbeddedLockedError';
  }
}

/**
 * The major version of the PostgreSQL that PGlite (package.json pins the version) is built from:
 * the PG_VERSION it writes into a data directory, and the only one it can open.
 */
export const PGLITE_PG_MAJOR = '18';

async function pgliteVersion(): Promise<string> {
  const pkg = fileURLToPath(new URL('../package.json', import.meta.url));
  try {
    const deps = (JSON.parse(await readFile(pkg, 'utf8')) as { dependencies?: Record<string, string> })
      .dependencies;
    return deps?.['@electric-sql/pglite'] ?? 'unknown version';
  } catch {
    return 'unknown version';
  }
}

/**
 * PGlite could not open an existing data directory. Its own error says only "PGlite failed to
 * initialize properly"; this one names the directory, what its PG_VERSION holds, and what to do.
 */
export class EmbeddedOpenError extends Error {
  readonly code = 'EMBEDDED_OPEN_FAILED';
  constructor(
    readonly pgdata: string,
    readonly foundVersion: string | null,
    pgliteVersion: string,
    cause: unknown,
  ) {
    const found =
      foundVersion === null
        ? 'it has no PG_VERSION file'
        : foundVersion === PGLITE_PG_MAJOR
          ? `its PG_VERSION says ${foundVersion}, the right version, so it is more likely damaged or not writable`
          : `its PG_VERSION says ${JSON.stringify(foundVersion)}: it was written by another Postgres version, not PGlite's ${PGLITE_PG_MAJOR}`;
    super(
      `the data directory ${pgdata} could not be opened by the embedded Postgres (PGlite ${pgliteVersion}, ` +
        `which uses PostgreSQL ${PGLITE_PG_MAJOR} data directories; ${found}). ` +
        `Likely causes: a directory of another Postgres version or build (a Postgres server's cluster is ` +
        `not a PGlite directory), a damaged one, or one this user cannot write. ` +
        `Restore it from a backup, or move ${pgdata} away to start afresh with an empty database ` +
        `(PGlite said: ${describeCause(cause)})`,
      { cause },
    );
    this.name = 'EmbeddedOpenError';
  }
}

/**
 * The data directory (or part of PGlite's files in it) cannot be written by this process: typically
 * files left owned by root after running the CLI with sudo. Said instead of EmbeddedOpenError's
 * "damaged ... move it away", which would invite throwing away a sound database.
 */
export class EmbeddedNotWritableError extends Error {
  readonly code = 'EMBEDDED_NOT_WRITABLE';
  constructor(
    readonly dataDir: string,
    readonly blocked: string,
    errno: string,
    cause: unknown,
  ) {
    const uid = process.getuid?.() ?? -1;
    super(
      `the data directory ${dataDir} is not writable by this user (uid ${uid}): ${blocked} (${errno}). ` +
        (errno === 'EROFS'
          ? 'It is on a read-only file system; use a writable MNEMOS_DATA_DIR.'
          : `Fix the ownership (chown -R ${uid} ${dataDir}, as root), or run mnemos as the user that owns it.`),
      { cause },
    );
    this.name = 'EmbeddedNotWritableError';
  }
}

/** One readable line for whatever PGlite threw (Emscripten can throw non-Error objects). */
function describeCause(cause: unknown): string {
  if (cause instanceof Error) return cause.message;
  if (typeof cause !== 'object' || cause === null) return String(cause);
  const o = cause as Record<string, unknown>;
  const parts = ['name', 'message', 'code', 'errno']
    .filter((k) => typeof o[k] === 'string' || typeof o[k] === 'number')
    .map((k) => `${k}: ${String(o[k])}`);
  return parts.length > 0
    ? parts.join(', ')
    : inspect(cause, { depth: 1, breakLength: Infinity, maxStringLength: 200 }).slice(0, 300);
}

/**
 * The first of the data dir, `pgdata/` and pgdata's direct entries that this process cannot read
 * and write (directories: and enter), with the errno; null when all can. A cheap look, not a walk
 * of every file: what it catches is a tree left behind by another user (root) as a whole.
 */
async function firstUnwritable(dataDir: string): Promise<{ path: string; errno: string } | null> {
  const pgdata = path.join(dataDir, PGDATA_SUBDIR);
  const entries = await readdir(pgdata, { withFileTypes: true }).catch(() => []);
  const dirMode = constants.R_OK | constants.W_OK | constants.X_OK;
  const checks: Array<[string, number]> = [
    [dataDir, dirMode],
    [pgdata, dirMode],
    ...entries.map((e): [string, number] => [
      path.join(pgdata, e.name),
      e.isDirectory() ? dirMode : constants.R_OK | constants.W_OK,
    ]),
  ];
  for (const [p, mode] of checks) {
    try {
      await access(p, mode);
    } catch (err) {
      const errno = (err as NodeJS.ErrnoException).code ?? 'EACCES';
      if (errno !== 'ENOENT') return { path: p, errno };
    }
  }
  return null;
}

/**
 * Whether `dataDir` holds an embedded database: a non-empty `pgdata/`. Commands that only read
 * refuse a directory without one instead of creating it (a CLI run from the wrong directory made
 * a 39 MB empty database there). A `pgdata/` that cannot be read counts as present: opening it
 * then says why it cannot be used.
 */
export async function hasEmbeddedDatabase(dataDir: string): Promise<boolean> {
  try {
    return (await readdir(path.join(path.resolve(dataDir), PGDATA_SUBDIR))).length > 0;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code !== 'ENOENT';
  }
}

export class EmbeddedReentryError extends Error {
  readonly code = 'EMBEDDED_REENTRY';
  constructor() {
    super(
      'embedded database: a query was issued on the Db while this call chain holds a transaction on it; ' +
        'with one connection it would wait for itself forever. Use the transaction object (tx) instead.',
    );
    this.name = 'EmbeddedReentryError';
  }
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

// Data dirs this process holds: a second open in the same process must fail too, and the pid in
// the lock file cannot tell that apart from a stale lock of an earlier process with the same pid.
const heldHere = new Set<string>();

/**
 * Locks `dataDir` (an existing directory) for this process, as `openPgliteDb` does; resolves to
 * the release. Fails with `EmbeddedLockedError` while another live process holds it.
 */
export async function lockDataDir(dataDir: string): Promise<() => Promise<void>> {
  const dir = path.resolve(dataDir);
  if (heldHere.has(dir)) throw new EmbeddedLockedError(dir, { pid: process.pid, host: hostname() });
  heldHere.add(dir);
  let release: () => Promise<void>;
  try {
    release = await takeLock(dir);
  } catch (err) {
    heldHere.delete(dir);
    throw err;
  }
  return async () => {
    heldHere.delete(dir);
    await release();
  };
}

interface Owner {
  pid: number;
  host: string;
  /** When the lock was taken (its `started_at`), if it says. */
  startedAtMs: number | null;
}

function parseOwner(text: string): Owner {
  let owner: { pid?: unknown; host?: unknown; started_at?: unknown } = {};
  try {
    owner = JSON.parse(text) as typeof owner;
  } catch {
    /* unreadable: pid 0, stale */
  }
  return {
    pid: typeof owner.pid === 'number' ? owner.pid : 0,
    host: typeof owner.host === 'string' ? owner.host : hostname(),
    startedAtMs: typeof owner.started_at === 'string' ? Date.parse(owner.started_at) || null : null,
  };
}

/**
 * A lock left by a dead process on this host, or by this very pid (pid 1 in a restarted
 * container), or naming a process that started after the lock was taken: its pid was reused
 * (pids start over after a reboot, and such a lock refused every start until it was deleted by
 * hand). Not "any lock while this process holds the directory's socket": abstract sockets are per
 * network namespace, and a process in another one took a live serve's lock over.
 */
const isStale = (o: Owner) =>
  o.pid === 0 ||
  (o.host === hostname() && (o.pid === process.pid || !isAlive(o.pid) || startedAfter(o.pid, o.startedAtMs)));

/**
 * Whether process `pid` started (by Linux's /proc) more than a few seconds after `atMs`, the time
 * its lock says it was taken: then it is not the lock's process. False when either is unknown
 * (another OS, a lock without `started_at`). The slack covers /proc's whole-second boot time.
 */
function startedAfter(pid: number, atMs: number | null): boolean {
  if (atMs === null || process.platform !== 'linux') return false;
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // Fields after the command name (which may hold spaces and parentheses): the 22nd, starttime,
    // in clock ticks (USER_HZ, 100 on Linux) since boot.
    const ticks = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19]);
    const boot = Number(/^btime (\d+)$/m.exec(readFileSync('/proc/stat', 'utf8'))?.[1]);
    if (!Number.isFinite(ticks) || !Number.isFinite(boot)) return false;
    return boot * 1000 + ticks * 10 > atMs + 5000;
  } catch {
    return false;
  }
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * Binds a listening Unix socket in Linux's abstract namespace, named after the data dir's real
 * path. Only one live process can bind a name, the kernel frees it when the process dies (no stale
 * state, unlike a file), and it is not inherited by child processes (libuv opens it CLOEXEC).
 * Resolves to the server, 'busy' when another process has it, or null where abstract sockets do
 * not exist (not Linux) or are refused (a sandbox): the file lock alone decides there.
 */
function bindHostLock(realDir: string): Promise<Server | 'busy' | null> {
  if (process.platform !== 'linux') return Promise.resolve(null);
  const name = `\0mnemos-lock-${createHash('sha256').update(realDir).digest('hex')}`;
  return new Promise((resolve) => {
    // Anyone on the host may connect to an abstract socket; nobody needs to.
    const server = createServer((socket) => socket.destroy());
    server.once('error', (err: NodeJS.ErrnoException) => resolve(err.code === 'EADDRINUSE' ? 'busy' : null));
    server.listen(name, () => {
      server.on('error', () => undefined);
      // Holding the lock must not keep the process alive.
      server.unref();
      resolve(server);
    });
  });
}

/**
 * The lock has two parts.
 *
 * `<dataDir>/mnemos.lock` is created atomically with its content (pid, host): a temp file, then
 * `link`, which fails if the lock exists. It names the owner in messages and is the only lock
 * between hosts sharing a volume (a lock of another host is never taken over).
 *
 * Taking over a stale lock file (its process is gone) is a check-then-unlink, which is not atomic:
 * two starters that judged the same stale lock could each unlink and link, the second removing the
 * first one's fresh lock, and both would open the database (measured: 6 of 25 rounds of 4
 * simultaneous starters). So on Linux the whole procedure, and then the lifetime of the lock, is
 * guarded by `bindHostLock`'s socket: on this host only its holder touches the lock file, so the
 * stale file it judged is still the one it unlinks. Another host's starter never unlinks a lock
 * of this host and can only create a missing one, which makes our `link` fail and the loop see it.
 * Holding the socket for the lock's whole life (not just around the takeover) also means a second
 * opener on this host is refused by the kernel even if the file was deleted by hand, and the
 * socket dies with the process, so it never needs cleaning up. Limits: abstract names are per
 * network namespace (containers without `--network host` do not share them; they normally differ
 * in host name too, which the file lock handles), and another local user could bind the name
 * first and block mnemos from starting on that directory ("in use by another process").
 * Elsewhere (macOS, or a sandbox refusing the socket) only the file lock remains, and the race
 * above stays possible there, for starters within the same moment after a crash.
 */
async function takeLock(dataDir: string): Promise<() => Promise<void>> {
  const file = path.join(dataDir, LOCK_FILE);
  const realDir = await realpath(dataDir);
  let host = await bindHostLock(realDir);
  // Another process on this host holds the socket. Its lock file names it, except for a moment
  // while it is starting (the file still stale, or not there yet) or stopping: look again then.
  for (let i = 0; host === 'busy'; i++) {
    const owner = parseOwner(await readFile(file, 'utf8').catch(() => ''));
    if (!isStale(owner) || i >= 100)
      throw new EmbeddedLockedError(dataDir, isStale(owner) ? { pid: 0, host: hostname() } : owner);
    await sleep(20);
    host = await bindHostLock(realDir);
  }
  const server = host;
  const content = `${JSON.stringify({ pid: process.pid, host: hostname(), started_at: new Date().toISOString() })}\n`;
  const tmp = `${file}.${process.pid}.${Date.now()}.tmp`;
  let taken = false;
  try {
    await writeFile(tmp, content, { mode: 0o600 });
    for (let attempt = 0; ; attempt++) {
      try {
        await link(tmp, file);
        taken = true;
        return async () => {
          // Only remove a lock that is still ours; then let the next process bind the socket.
          if ((await readFile(file, 'utf8').catch(() => '')) === content)
            await unlink(file).catch(() => undefined);
          await new Promise((resolve) => (server ? server.close(resolve) : resolve(undefined)));
        };
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
      }
      const seen = await readFile(file, 'utf8').catch(() => null);
      if (seen === null) {
        // Removed since our link failed: try again (a few times; then someone keeps winning).
        if (attempt >= 5) throw new EmbeddedLockedError(dataDir, { pid: 0, host: hostname() });
        continue;
      }
      const owner = parseOwner(seen);
      // Losing the race to another starter ends here too: its fresh lock names a live process.
      if (!isStale(owner) || attempt >= 5) throw new EmbeddedLockedError(dataDir, owner);
      // Remove only the stale lock we judged. With the socket held nobody else on this host can
      // replace it between the two steps; without it (see above) this is the racy part.
      if ((await readFile(file, 'utf8').catch(() => '')) === seen) await unlink(file).catch(() => undefined);
    }
  } finally {
    await unlink(tmp).catch(() => undefined);
    if (!taken && server) await new Promise((resolve) => server.close(resolve));
  }
}

/** A FIFO mutex: callers run one at a time, in arrival order. */
function makeMutex() {
  let tail: Promise<unknown> = Promise.resolve();
  return <T>(fn: () => Promise<T>): Promise<T> => {
    const run = tail.then(fn, fn);
    tail = run.catch(() => undefined);
    return run;
  };
}

type Target = Pick<PGlite, 'query' | 'exec'> | Transaction;

async function runOn<R>(target: Target, text: string, params?: unknown[]): Promise<QueryResult<R>> {
  // Without parameters node-postgres uses the simple protocol, which allows several statements in
  // one string (migrations rely on it); PGlite's `query` always prepares, so use `exec` there.
  const r: Results | undefined =
    params && params.length > 0 ? await target.query(text, params) : (await target.exec(text)).at(-1);
  if (!r) return { rows: [], rowCount: null };
  return { rows: r.rows as R[], rowCount: r.rowCount ?? r.affectedRows ?? null };
}

export interface EmbeddedDb extends Db {
  readonly kind: 'embedded';
  /** Absolute path of the data directory (lock file, PGlite files under `pgdata/`). */
  readonly dataDir: string;
}

/**
 * Opens (creating if needed) the embedded database under `dataDir`. Fails with
 * `EmbeddedLockedError` when another live process has it open, and with `EmbeddedOpenError`
 * when PGlite cannot open what is there.
 */
export async function openPgliteDb(dataDir: string): Promise<EmbeddedDb> {
  const dir = path.resolve(dataDir);
  const pgdata = path.join(dir, PGDATA_SUBDIR);
  // Not writable is said as such: the same EACCES from PGlite read "damaged ... move it away".
  const notWritable = async (err: unknown) => {
    const blocked = await firstUnwritable(dir);
    return blocked ? new EmbeddedNotWritableError(dir, blocked.path, blocked.errno, err) : null;
  };
  let release: () => Promise<void>;
  try {
    await mkdir(pgdata, { recursive: true, mode: 0o700 });
    release = await lockDataDir(dir);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === 'EACCES' || code === 'EPERM' || code === 'EROFS') throw (await notWritable(err)) ?? err;
    throw err;
  }
  let pg: PGlite;
  try {
    pg = await PGlite.create(pgdata, { extensions: { vector }, parsers });
  } catch (err) {
    await release();
    const unwritable = await notWritable(err);
    if (unwritable) throw unwritable;
    const found = await readFile(path.join(pgdata, 'PG_VERSION'), 'utf8').then(
      (v) => v.trim().slice(0, 40),
      () => null,
    );
    throw new EmbeddedOpenError(pgdata, found, await pgliteVersion(), err);
  }
  const exclusive = makeMutex();
  // The transaction (if any) the current async call chain is running inside.
  const inTx = new AsyncLocalStorage<{ open: boolean }>();
  let closed = false;

  const guard = () => {
    if (closed) throw new Error('embedded database is closed');
    if (inTx.getStore()?.open) throw new EmbeddedReentryError();
  };

  return {
    kind: 'embedded',
    dataDir: dir,
    async query<R = Record<string, unknown>>(text: string, params?: unknown[]) {
      guard();
      return exclusive(() => runOn<R>(pg, text, params));
    },
    async transaction<T>(fn: (tx: Queryable) => Promise<T>): Promise<T> {
      guard();
      return exclusive(() => {
        const state = { open: true };
        return inTx.run(state, () =>
          pg
            .transaction(async (tx) => {
              // PGlite commits when the callback returns and rolls back when it throws.
              const q: Queryable = { query: (text, params) => runOn(tx, text, params) };
              return fn(q);
            })
            .finally(() => {
              state.open = false;
            }),
        );
      });
    },
    async close() {
      if (closed) return;
      closed = true;
      // Waits for whatever is queued, then closes PGlite (which flushes its files) and unlocks.
      await exclusive(async () => {
        await pg.close();
      }).finally(release);
    },
  };
}
