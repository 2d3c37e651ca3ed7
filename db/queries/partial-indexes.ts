import { createHash } from 'node:crypto';
import type { Queryable } from '../pool.js';

/**
 * What the per-session partial indexes (HNSW on message_vectors: ann-indexes.ts; full text and
 * trigrams on messages: session-indexes.ts) share: stable names, and building and dropping
 * without blocking reads and writes (CONCURRENTLY, so never inside a transaction). DDL is always
 * assembled by Postgres's `format` (%I, %L) from values, never by string concatenation.
 */

/** A stable index name Postgres accepts (≤ 63 bytes): `prefix` plus a hash of `parts`. */
export function partialIndexName(prefix: string, ...parts: Array<string | number>): string {
  const h = createHash('sha256').update(parts.join('\n')).digest('hex');
  return `${prefix}${h.slice(0, 24)}`;
}

/**
 * SQL: true when the index named by the text expression exists and is valid. A CREATE INDEX
 * CONCURRENTLY that failed, or whose backend died (a Postgres restart, a killed worker), leaves an
 * INVALID index: never used by the planner, yet maintained by every write.
 */
export const VALID_INDEX_SQL = (nameExpr: string) =>
  `EXISTS (SELECT 1 FROM pg_index i WHERE i.indexrelid = to_regclass(${nameExpr}) AND i.indisvalid)`;

/**
 * SQL: true while a CREATE INDEX CONCURRENTLY builds the index named by the text expression, or
 * waits to begin (for its table lock, before the index is in the catalog): the backend of a worker
 * killed meanwhile goes on, and the pass that found the record with no index forgot it, so the
 * index the build then made was known to no one (a re-tester's kill -9 during a manual VACUUM).
 */
export const BUILDING_INDEX_SQL = (nameExpr: string) =>
  // (Aliases of their own: the caller's, `a` or `x`, name the registry row in nameExpr.)
  `(EXISTS (SELECT 1 FROM pg_stat_progress_create_index build_p
            WHERE build_p.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND build_p.index_relid = to_regclass(${nameExpr}))
    OR EXISTS (SELECT 1 FROM pg_stat_activity build_a
               WHERE build_a.datname = current_database() AND build_a.state <> 'idle'
                 AND build_a.pid <> pg_backend_pid() AND build_a.query LIKE 'CREATE INDEX CONCURRENTLY%'
                 AND strpos(build_a.query, ${nameExpr}) > 0))`;

// An invalid index is only a leftover when no CREATE INDEX CONCURRENTLY is still building it.
const LEFTOVER_SQL = `NOT i.indisvalid
  AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.index_relid = i.indexrelid)`;

/**
 * Drops the INVALID indexes whose names start with one of `prefixes` and that no build is working
 * on: what a build left when its drop could not run either (Postgres was down), registered or
 * not, of a live session or of one deleted since. Returns their names.
 */
export async function dropInvalidLeftovers(q: Queryable, prefixes: string[]): Promise<string[]> {
  const r = await q.query<{ name: string }>(
    `SELECT c.relname AS name FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
     WHERE ${LEFTOVER_SQL}
       AND EXISTS (SELECT 1 FROM unnest($1::text[]) p WHERE starts_with(c.relname, p))
     ORDER BY 1`,
    [prefixes],
  );
  for (const { name } of r.rows) await dropIndexConcurrently(q, name);
  return r.rows.map((x) => x.name);
}

/**
 * Runs `SELECT format(template, ...args)` and executes the result: a CREATE INDEX CONCURRENTLY
 * ... IF NOT EXISTS. An invalid leftover of the same name is dropped first (IF NOT EXISTS would
 * keep it), and a build that fails leaves an INVALID index behind, which is dropped before the
 * error is thrown (or by dropInvalidLeftovers, when that drop fails too).
 */
export async function buildIndexConcurrently(
  q: Queryable,
  name: string,
  template: string,
  args: unknown[],
): Promise<void> {
  const leftover = await q.query(
    `SELECT 1 FROM pg_index i WHERE i.indexrelid = to_regclass($1) AND ${LEFTOVER_SQL}`,
    [name],
  );
  if ((leftover.rowCount ?? 0) > 0) await dropIndexConcurrently(q, name);
  const ddl = await q.query<{ ddl: string }>(`SELECT format(${template}) AS ddl`, args);
  try {
    await q.query(ddl.rows[0]!.ddl);
  } catch (err) {
    await dropIndexConcurrently(q, name).catch(() => undefined);
    throw err;
  }
}

/** The tables that record per-session indexes, one row an index, keyed by `index_name`. */
export type IndexRegistry = 'session_search_indexes' | 'vector_ann_indexes';

/**
 * What a maintenance pass reads of a recorded index: `exists` (valid), `building` (a build of
 * it runs: another pass's, whose table lock expired; left alone), and whether its session is live.
 */
export interface RecordedState {
  exists: boolean;
  building: boolean;
  live: boolean;
}

/**
 * Records the index in `registry` (`record`: an upsert of its row), then builds it
 * (buildIndexConcurrently), then stamps its `built_at`. Recorded first, a build whose worker is
 * killed at any point leaves a row the next pass acts on: an index left INVALID, or none, is
 * forgotten and built again while its session is live; a valid one is kept (and a later build of
 * the same name is a no-op), or dropped once its session is gone. Recorded after the build, a
 * worker killed between the two left a valid index nothing knew of, which no pass dropped after
 * its session was deleted. A build that fails forgets the row again.
 */
export async function buildRecordedIndex(
  q: Queryable,
  registry: IndexRegistry,
  name: string,
  record: { sql: string; params: unknown[] },
  build: { template: string; args: unknown[] },
): Promise<void> {
  await q.query(record.sql, record.params);
  try {
    await buildIndexConcurrently(q, name, build.template, build.args);
  } catch (err) {
    await q.query(`DELETE FROM ${registry} WHERE index_name = $1`, [name]).catch(() => undefined);
    throw err;
  }
  await q.query(`UPDATE ${registry} SET built_at = now() WHERE index_name = $1`, [name]);
}

/** DROP INDEX CONCURRENTLY IF EXISTS: idempotent. */
export async function dropIndexConcurrently(q: Queryable, name: string): Promise<void> {
  const ddl = await q.query<{ ddl: string }>(
    `SELECT format('DROP INDEX CONCURRENTLY IF EXISTS %I', $1::text) AS ddl`,
    [name],
  );
  await q.query(ddl.rows[0]!.ddl);
}
