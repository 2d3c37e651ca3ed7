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
 * Runs `SELECT format(template, ...args)` and executes the result: a CREATE INDEX CONCURRENTLY.
 * A build that fails leaves an INVALID index behind, which is dropped before the error is thrown.
 */
export async function buildIndexConcurrently(
  q: Queryable,
  name: string,
  template: string,
  args: unknown[],
): Promise<void> {
  const ddl = await q.query<{ ddl: string }>(`SELECT format(${template}) AS ddl`, args);
  try {
    await q.query(ddl.rows[0]!.ddl);
  } catch (err) {
    await dropIndexConcurrently(q, name).catch(() => undefined);
    throw err;
  }
}

/** DROP INDEX CONCURRENTLY IF EXISTS: idempotent. */
export async function dropIndexConcurrently(q: Queryable, name: string): Promise<void> {
  const ddl = await q.query<{ ddl: string }>(
    `SELECT format('DROP INDEX CONCURRENTLY IF EXISTS %I', $1::text) AS ddl`,
    [name],
  );
  await q.query(ddl.rows[0]!.ddl);
}
