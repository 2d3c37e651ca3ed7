import { readdir, readFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { isPgUnavailable, pgCode } from './pool.js';
import type { Db } from './pool.js';

const MIGRATIONS_DIR = fileURLToPath(new URL('./migrations/', import.meta.url));
// Arbitrary constant shared by every mnemos process: serialises concurrent migrators.
const MIGRATION_LOCK_KEY = 724_518_301;

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

/**
 * Applies pending migrations in one transaction under a transaction-scoped advisory lock, so
 * several processes starting at once apply each file exactly once. Returns the names applied.
 */
export async function migrate(db: Db, migrations?: Migration[]): Promise<string[]> {
  const all = migrations ?? (await loadMigrations());
  try {
    return await applyPending(db, all);
  } catch (err) {
    // The first statement of every process: say which setting to look at.
    const code = pgCode(err);
    if (isPgUnavailable(err) || (code !== undefined && CONNECT_CODES.has(code))) {
      throw new Error(`cannot reach Postgres (DATABASE_URL): ${(err as Error).message}`, { cause: err });
    }
    throw err;
  }
}

/** Unknown host, no such database, authentication refused: a connection that cannot be made. */
const CONNECT_CODES = new Set([
  'ENOTFOUND',
  'EAI_AGAIN',
  'EHOSTUNREACH',
  'ENETUNREACH',
  '3D000',
  '28P01',
  '28000',
]);

async function applyPending(db: Db, all: Migration[]): Promise<string[]> {
  return db.transaction(async (tx) => {
    await tx.query('SELECT pg_advisory_xact_lock($1)', [MIGRATION_LOCK_KEY]);
    await tx.query(`CREATE TABLE IF NOT EXISTS schema_migrations (
      version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`);
    const done = await tx.query<{ version: number }>('SELECT version FROM schema_migrations');
    const applied = new Set(done.rows.map((r) => r.version));
    const names: string[] = [];
    for (const m of all) {
      if (applied.has(m.version)) continue;
      await tx.query(m.sql);
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
