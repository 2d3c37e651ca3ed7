import type { Queryable } from '../pool.js';
import {
  BUILDING_INDEX_SQL,
  VALID_INDEX_SQL,
  buildRecordedIndex,
  dropIndexConcurrently,
  partialIndexName,
} from './partial-indexes.js';
import type { RecordedState } from './partial-indexes.js';

/**
 * Per-session partial HNSW indexes on `message_vectors` (migration 007): an index over one huge
 * session's rows only, `(embedding::vector(D)) vector_cosine_ops WHERE tenant_id = '…' AND
 * session_id = '…'`. The semantic search orders by the same expression, so for that session the
 * planner can prove the predicate (node-postgres sends unnamed statements: custom plans with the
 * parameter values) and take the index; every other session keeps the exact k-NN over the
 * primary key. Measured in bench/partial-hnsw.ts; see docs/recent-index.md.
 */

export interface AnnIndexRow {
  index_name: string;
  tenant_id: string;
  session_id: string;
  dimensions: number;
  vectors: number;
}

/**
 * The most dimensions pgvector (0.8) indexes with HNSW over `vector`: a build over more fails
 * ("column cannot have more than 2000 dimensions for hnsw index"), so a recent index wider than
 * this (text-embedding-3-large's 3,072) gets no per-session index and its search stays exact.
 */
export const HNSW_MAX_DIMENSIONS = 2000;

/** The index of a session at a dimension: a stable name Postgres accepts (≤ 63 bytes). */
export const ANN_INDEX_PREFIX = 'mv_ann_';

export function annIndexName(tenantId: string, sessionId: string, dimensions: number): string {
  return partialIndexName(ANN_INDEX_PREFIX, tenantId, sessionId, dimensions);
}

export async function listAnnIndexes(
  q: Queryable,
  filter: { tenantId?: string; sessionId?: string } = {},
): Promise<Array<AnnIndexRow & RecordedState & { current_vectors: number }>> {
  const r = await q.query<AnnIndexRow & RecordedState & { current_vectors: number }>(
    `SELECT a.index_name, a.tenant_id, a.session_id, a.dimensions, a.vectors,
       ${VALID_INDEX_SQL('a.index_name')} AS exists, ${BUILDING_INDEX_SQL('a.index_name')} AS building,
       EXISTS (SELECT 1 FROM sessions s
               WHERE s.tenant_id = a.tenant_id AND s.id = a.session_id AND s.deleted_at IS NULL
                 AND NOT EXISTS (SELECT 1 FROM tenants t WHERE t.id = s.tenant_id AND t.erasing_at IS NOT NULL)) AS live,
       (SELECT count(*)::int FROM message_vectors v
        WHERE v.tenant_id = a.tenant_id AND v.session_id = a.session_id) AS current_vectors
     FROM vector_ann_indexes a
     WHERE ($1::text IS NULL OR a.tenant_id = $1) AND ($2::text IS NULL OR a.session_id = $2)
     ORDER BY a.index_name`,
    [filter.tenantId ?? null, filter.sessionId ?? null],
  );
  return r.rows;
}

/**
 * Live sessions with at least `minVectors` vectors and no index yet, largest first. The hot span
 * (`next_seq - start_seq`) bounds the vector count from above, so only those sessions are counted.
 */
export async function sessionsNeedingAnnIndex(
  q: Queryable,
  a: { minVectors: number; limit: number },
): Promise<Array<{ tenantId: string; sessionId: string; vectors: number }>> {
  const r = await q.query<{ tenant_id: string; id: string; n: number }>(
    `SELECT s.tenant_id, s.id, c.n FROM sessions s
     CROSS JOIN LATERAL (SELECT count(*)::int AS n FROM message_vectors v
                         WHERE v.tenant_id = s.tenant_id AND v.session_id = s.id) c
     WHERE s.deleted_at IS NULL AND s.next_seq - s.start_seq >= $1
       AND c.n >= $1
       AND NOT EXISTS (SELECT 1 FROM tenants t WHERE t.id = s.tenant_id AND t.erasing_at IS NOT NULL)
       AND NOT EXISTS (SELECT 1 FROM vector_ann_indexes a WHERE a.tenant_id = s.tenant_id AND a.session_id = s.id)
     ORDER BY c.n DESC
     LIMIT $2`,
    [a.minVectors, a.limit],
  );
  return r.rows.map((x) => ({ tenantId: x.tenant_id, sessionId: x.id, vectors: x.n }));
}

/**
 * Builds the session's index without blocking writes (CREATE INDEX CONCURRENTLY: must not run in
 * a transaction) and records it. The DDL is assembled by Postgres's `format` (%I, %L), never by
 * string concatenation. A build that fails leaves an INVALID index behind, which is dropped.
 */
export async function buildAnnIndex(
  q: Queryable,
  a: { tenantId: string; sessionId: string; dimensions: number; vectors: number },
): Promise<string> {
  const name = annIndexName(a.tenantId, a.sessionId, a.dimensions);
  await buildRecordedIndex(
    q,
    'vector_ann_indexes',
    name,
    {
      sql: `INSERT INTO vector_ann_indexes (index_name, tenant_id, session_id, dimensions, vectors)
            VALUES ($1, $2, $3, $4, $5)
            ON CONFLICT (index_name) DO UPDATE SET vectors = EXCLUDED.vectors`,
      params: [name, a.tenantId, a.sessionId, a.dimensions, a.vectors],
    },
    {
      template: `'CREATE INDEX CONCURRENTLY IF NOT EXISTS %I ON message_vectors USING hnsw
         ((embedding::vector(%s)) vector_cosine_ops) WHERE tenant_id = %L AND session_id = %L',
       $1::text, $2::int, $3::text, $4::text`,
      args: [name, a.dimensions, a.tenantId, a.sessionId],
    },
  );
  return name;
}

/** Drops the index (without blocking reads and writes) and forgets it. Idempotent. */
export async function dropAnnIndex(q: Queryable, name: string): Promise<void> {
  await dropIndexConcurrently(q, name);
  await q.query('DELETE FROM vector_ann_indexes WHERE index_name = $1', [name]);
}
