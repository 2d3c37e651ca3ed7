import { AsyncLocalStorage } from 'node:async_hooks';
import { link, mkdir, readFile, unlink, writeFile } from 'node:fs/promises';
import { hostname } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
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
 *   silently lose each other's writes. A lock file (`mnemos.lock`, holding the owner's pid) makes
 *   a second opener fail with `EmbeddedLockedError` instead.
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
      `the embedded database in ${dataDir} is in use by process ${owner.pid}` +
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
        `(PGlite said: ${cause instanceof Error ? cause.message : String(cause)})`,
      { cause },
    );
    this.name = 'EmbeddedOpenError';
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

async function acquireLock(dataDir: string): Promise<() => Promise<void>> {
  if (heldHere.has(dataDir)) throw new EmbeddedLockedError(dataDir, { pid: process.pid, host: hostname() });
  heldHere.add(dataDir);
  let release: () => Promise<void>;
  try {
    release = await takeLockFile(dataDir);
  } catch (err) {
    heldHere.delete(dataDir);
    throw err;
  }
  return async () => {
    heldHere.delete(dataDir);
    await release();
  };
}

/**
 * Creates `<dataDir>/mnemos.lock` atomically with its content (write a temp file, then `link`,
 * which fails if the lock exists). A lock left by a dead process on this host, or by this very pid
 * (pid 1 in a restarted container), is stale and taken over.
 */
async function takeLockFile(dataDir: string): Promise<() => Promise<void>> {
  const file = path.join(dataDir, LOCK_FILE);
  const content = `${JSON.stringify({ pid: process.pid, host: hostname(), started_at: new Date().toISOString() })}\n`;
  const tmp = `${file}.${process.pid}.${Date.now()}.tmp`;
  await writeFile(tmp, content, { mode: 0o600 });
  try {
    for (let attempt = 0; ; attempt++) {
      try {
        await link(tmp, file);
        return async () => {
          // Only remove a lock that is still ours.
          if ((await readFile(file, 'utf8').catch(() => '')) === content)
            await unlink(file).catch(() => undefined);
        };
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'EEXIST' || attempt > 0) throw err;
      }
      const seen = await readFile(file, 'utf8').catch(() => '');
      let owner: { pid?: unknown; host?: unknown } = {};
      try {
        owner = JSON.parse(seen) as typeof owner;
      } catch {
        /* unreadable: stale */
      }
      const pid = typeof owner.pid === 'number' ? owner.pid : 0;
      const host = typeof owner.host === 'string' ? owner.host : hostname();
      const stale = pid === 0 || (host === hostname() && (pid === process.pid || !isAlive(pid)));
      if (!stale) throw new EmbeddedLockedError(dataDir, { pid, host });
      // Remove only the stale lock we judged (another starter may have replaced it meanwhile).
      if ((await readFile(file, 'utf8').catch(() => '')) === seen) await unlink(file).catch(() => undefined);
    }
  } finally {
    await unlink(tmp).catch(() => undefined);
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
  await mkdir(path.join(dir, PGDATA_SUBDIR), { recursive: true, mode: 0o700 });
  const release = await acquireLock(dir);
  const pgdata = path.join(dir, PGDATA_SUBDIR);
  let pg: PGlite;
  try {
    pg = await PGlite.create(pgdata, { extensions: { vector }, parsers });
  } catch (err) {
    await release();
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
