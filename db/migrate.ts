import { readdir, readFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { isPgUnavailable, pgCode } from './pool.js';
import type { Db } from './pool.js';

const MIGRATIONS_DIR = fileURLToPath(new URL('./migrations/', import.meta.url));
// Arbitrary constant shared by every mnemos process: serialises concurrent migrators.
export const MIGRATION_LOCK_KEY = 724_518_301;

export interface Migration {
  version: number;
  name: string;
  sql: string;
}

export async function loadMigrations(dir = MIGRATIONS_DIR): Promise<Migration[]> {
  const files = (await readdir(dir)).filter((f) => /^\d{3}_[a-z0-9_]+\.sql$/.test(f)).sort();
  return Promise.all(
    files.map(async (f) => ({
      version: Number(f.slice(0, 3)),
      name: f.replace(/\.sql$/, ''),
      sql: await readFile(`${dir}${f}`, 'utf8'),
    })),
  );
}

export interface MigrateOptions {
  /** How long migrations may keep giving way to transactions that hold locks they need (15 min). */
  lockWaitMs?: number;
  /** Told about each give-way, so that a process that seems stuck at start says why. */
  logger?: { warn(fields: Record<string, unknown>, msg: string): void };
}

/**
 * Applies pending migrations in one transaction under a transaction-scoped advisory lock, so
 * several processes starting at once apply each file exactly once. Returns the names applied.
 */
export async function migrate(
  db: Db,
  migrations?: Migration[],
  opts: MigrateOptions = {},
): Promise<string[]> {
  const all = migrations ?? (await loadMigrations());
  try {
    // Read first, without writing: on a database that is read-only (a standby after a failover,
    // `default_transaction_read_only`), CREATE TABLE IF NOT EXISTS is a write, and a process with
    // nothing to migrate could not start to serve the reads that still work there.
    // (pendingMigrations reads the ledger; without one, it lists every migration.)
    const pending = await pendingMigrations(db, all);
    await refuseNonUtf8(db, pending.length === all.length);
    if (pending.length === 0) return [];
    return await applyGivingWay(db, all, opts);
  } catch (err) {
    throw explainConnectError(err);
  }
}

/**
 * mnemos stores any Unicode text, and its full-text and keyword matching fold case in Postgres.
 * A LATIN1 database refused a migration with a bare "character with byte sequence 0xe2 0x86 0x92
 * in encoding UTF8 has no equivalent in encoding LATIN1"; a SQL_ASCII one took everything as
 * bytes, and a keyword `σοφια` no longer found `ΣΟΦΙΑ`.
 */
async function refuseNonUtf8(db: Db, fresh: boolean): Promise<void> {
  const r = await db.query<{ encoding: string; database: string }>(
    `SELECT current_setting('server_encoding') AS encoding, current_database() AS database`,
  );
  const { encoding, database } = r.rows[0]!;
  if (encoding === 'UTF8') return;
  // A SQL_ASCII database migrated by an earlier build stores text byte for byte and ran: it is not
  // refused now (export, every command, would have been; re-tester r5), only a new one is. No other
  // encoding could ever take the migrations.
  if (encoding === 'SQL_ASCII' && !fresh) return;
  throw new Error(
    `database "${database}" is encoded in ${encoding}; mnemos needs UTF8: create one with ` +
      `CREATE DATABASE <name> ENCODING 'UTF8' TEMPLATE template0 and point DATABASE_URL at it ` +
      `(README "Managed Postgres")`,
  );
}

/**
 * How long a migration statement waits for a table lock before it gives way. A lock request
 * queues every later one on the table behind it: a plain CREATE INDEX on `sessions` waiting for
 * an old process's long reset made every drain of every session wait too (an unrelated UPDATE
 * took 36 s). Giving way after a second and trying again later lets that traffic through.
 */
const MIGRATION_LOCK_TIMEOUT = '1s';
const LOCK_WAIT_MS = 15 * 60_000;
const FIRST_RETRY_MS = 500;
const MAX_RETRY_MS = 15_000;

/** applyPending, rolled back and tried again (backing off) while a lock it needs is held. */
async function applyGivingWay(db: Db, all: Migration[], opts: MigrateOptions): Promise<string[]> {
  const lockWaitMs = opts.lockWaitMs ?? LOCK_WAIT_MS;
  const until = performance.now() + lockWaitMs;
  for (let attempt = 0; ; attempt++) {
    const at: { migration?: string } = {};
    try {
      return await applyPending(db, all, at);
    } catch (err) {
      if (pgCode(err) !== '55P03') throw err;
      const what = at.migration ? `migration ${at.migration}` : 'the migration ledger (schema_migrations)';
      // Growing, with jitter: processes that start together do not all come back at once.
      const backoff = Math.min(MAX_RETRY_MS, FIRST_RETRY_MS * 2 ** attempt);
      const waitMs = Math.round(backoff / 2 + Math.random() * (backoff / 2));
      if (performance.now() + waitMs > until) {
        const waited =
          lockWaitMs >= 60_000
            ? `${Math.round(lockWaitMs / 60_000)} min`
            : `${Math.round(lockWaitMs / 1000)} s`;
        throw Object.assign(
          new Error(
            `${what} could not take a lock it needs in ${waited} of trying: a long transaction holds a ` +
              'lock on a table it changes (find it with SELECT pid, xact_start, query FROM ' +
              'pg_stat_activity WHERE xact_start IS NOT NULL ORDER BY xact_start; let it finish or ' +
              'end it with pg_terminate_backend(pid)), then start again',
            { cause: err },
          ),
          { code: '55P03' },
        );
      }
      opts.logger?.warn(
        { retryInMs: waitMs },
        `${what} gave way to a transaction holding a lock it needs; trying again`,
      );
      await new Promise((resolve) => setTimeout(resolve, waitMs));
    }
  }
}

/** The first statement of every process: a connection that cannot be made names the setting to look at. */
function explainConnectError(err: unknown): unknown {
  const code = pgCode(err);
  if (isPgUnavailable(err) || (code !== undefined && CONNECT_CODES.has(code))) {
    return new Error(`cannot reach Postgres (DATABASE_URL): ${(err as Error).message}`, { cause: err });
  }
  return err;
}

/**
 * Whether mnemos's schema is in this database (the ledger records at least one migration), and the
 * database's name as Postgres reports it (a DATABASE_URL without one gets the user's). Read without
 * creating anything, so a command pointed at the wrong database can refuse it untouched.
 */
export async function schemaState(db: Db): Promise<{ database: string; installed: boolean }> {
  try {
    const r = await db.query<{ database: string; ledger: boolean }>(
      `SELECT current_database() AS database, to_regclass('schema_migrations') IS NOT NULL AS ledger`,
    );
    const { database, ledger } = r.rows[0]!;
    if (!ledger) return { database, installed: false };
    // Rails, golang-migrate and dbmate keep a schema_migrations table too: ours has these columns.
    const ours = await db.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM information_schema.columns
       WHERE table_schema = current_schema() AND table_name = 'schema_migrations'
         AND column_name IN ('version', 'name', 'applied_at')`,
    );
    if (ours.rows[0]!.n < 3) return { database, installed: false };
    const any = await db.query('SELECT 1 FROM schema_migrations LIMIT 1');
    return { database, installed: any.rows.length > 0 };
  } catch (err) {
    throw explainConnectError(err);
  }
}

/**
 * Unknown host, no socket in the socket directory (ENOENT, ENOTDIR, EACCES), no such database,
 * authentication refused: a connection that cannot be made.
 */
const CONNECT_CODES = new Set([
  'ENOENT',
  'ENOTDIR',
  'EACCES',
  'ENOTFOUND',
  'EAI_AGAIN',
  'EHOSTUNREACH',
  'ENETUNREACH',
  '3D000',
  '28P01',
  '28000',
]);

/**
 * The errors a managed Postgres gives a role that may not create extensions, or whose
 * `search_path` lacks the schema the provider put `vector` in (Supabase: `extensions`), with
 * what to do: the bare messages (`permission denied to create extension "vector"`, `type "vector"
 * does not exist`) named neither the migration nor the fix. Code and message stay as they were.
 */
function explainMigrationError(err: unknown, migration: string): unknown {
  const e = err as { code?: string; message?: string };
  if (typeof e?.message !== 'string') return err;
  let hint: string | undefined;
  if (e.code === '42501' && /extension/i.test(e.message)) {
    hint =
      'this role may not create extensions: have an admin run CREATE EXTENSION vector; and CREATE EXTENSION pg_trgm; ' +
      'in this database once, then start again (README "Managed Postgres")';
  } else if (e.code === '42704' && /type "vector"/.test(e.message)) {
    hint =
      "the vector extension is in a schema that is not on this role's search_path (Supabase puts it in " +
      '"extensions"): ALTER ROLE <role> SET search_path = public, extensions; or add ' +
      '?options=-c%20search_path%3Dpublic,extensions to DATABASE_URL (README "Managed Postgres")';
  }
  if (!hint) return err;
  return Object.assign(new Error(`${e.message} (migration ${migration}): ${hint}`), { code: e.code });
}

async function applyPending(db: Db, all: Migration[], at: { migration?: string }): Promise<string[]> {
  return db.transaction(async (tx) => {
    // Another process migrating is normal, and nobody else queues behind this lock: wait for it
    // as long as it takes, whatever lock_timeout the role or database sets.
    await tx.query('SET LOCAL lock_timeout = 0');
    // Nor does statement_timeout: it cut the wait for the lock, and a migration's own statements
    // are background work (unbounded, as drains and index builds are).
    await tx.query('SET LOCAL statement_timeout = 0');
    await tx.query('SELECT pg_advisory_xact_lock($1)', [MIGRATION_LOCK_KEY]);
    await tx.query(`SET LOCAL lock_timeout = '${MIGRATION_LOCK_TIMEOUT}'`);
    await tx.query(`CREATE TABLE IF NOT EXISTS schema_migrations (
      version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`);
    const done = await tx.query<{ version: number }>('SELECT version FROM schema_migrations');
    const applied = new Set(done.rows.map((r) => r.version));
    const names: string[] = [];
    for (const m of all) {
      if (applied.has(m.version)) continue;
      at.migration = m.name;
      await tx.query(m.sql).catch((err: unknown) => {
        throw explainMigrationError(err, m.name);
      });
      await tx.query('INSERT INTO schema_migrations (version, name) VALUES ($1, $2)', [m.version, m.name]);
      names.push(m.name);
    }
    return names;
  });
}

/**
 * Migrations the database has that this build does not know: a newer version migrated it (a
 * rollback, or old and new processes side by side). Nothing refuses to run on such a schema
 * (side by side is supported), but the operator is told.
 */
export async function unknownMigrations(db: Db, migrations?: Migration[]): Promise<string[]> {
  const all = migrations ?? (await loadMigrations());
  const known = new Set(all.map((m) => m.version));
  const done = await db.query<{ version: number; name: string }>(
    'SELECT version, name FROM schema_migrations ORDER BY version',
  );
  return done.rows.filter((r) => !known.has(r.version)).map((r) => r.name);
}

export const newerSchemaWarning = (names: string[]) =>
  `the database has migrations this build does not know (${names.join(', ')}): a newer mnemos ` +
  `migrated it. Running side by side with it during an upgrade is supported; as a rollback, this ` +
  `build does not know what those migrations changed (see README "Upgrading")`;

/** Pending migration names; empty when the schema is current (used by /readyz). */
export async function pendingMigrations(db: Db, migrations?: Migration[]): Promise<string[]> {
  const all = migrations ?? (await loadMigrations());
  try {
    const done = await db.query<{ version: number }>('SELECT version FROM schema_migrations');
    const applied = new Set(done.rows.map((r) => r.version));
    return all.filter((m) => !applied.has(m.version)).map((m) => m.name);
  } catch {
    return all.map((m) => m.name);
  }
}
