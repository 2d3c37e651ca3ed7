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
 * Per-session partial indexes on `messages` for huge sessions (migration 008), built by the
 * search-indexes maintenance task (services/search/session-indexes.ts):
 *
 * - `fts`: `USING gin (search_tsv) WHERE tenant_id = '…' AND session_id = '…'`. The table-wide
 *   GIN index `messages_fts` returns every match of a word in every session (43,000 entries for
 *   `connect & pool` at 200,000 messages), which a big session's full-text match then intersects
 *   with its own rows; this index holds that session's entries only.
 * - `trgm`: `USING gin ((coalesce(content, '')) gin_trgm_ops) WHERE …`, the expression the
 *   substring match tests, so a rare substring no longer reads the whole recent part.
 *
 * Search statements name the session by parameters; node-postgres sends unnamed statements, which
 * Postgres plans with the values (custom plans), so the planner can prove the predicate and take
 * the index for that session only.
 */

export type SessionIndexKind = 'fts' | 'trgm';

export interface SessionIndexRow {
  index_name: string;
  tenant_id: string;
  session_id: string;
  kind: SessionIndexKind;
  messages: number;
}

/** What each kind indexes, and how many of the session's messages it is worth for. */
const KINDS: Record<SessionIndexKind, { prefix: string; using: string; size: string }> = {
  // The whole archive of the session.
  fts: { prefix: 'ms_fts_', using: 'gin (search_tsv)', size: 's.message_count' },
  // The substring match reads the recent part only (seq >= start_seq).
  trgm: {
    prefix: 'ms_trgm_',
    using: `gin ((coalesce(content, '')) gin_trgm_ops)`,
    size: '(SELECT count(*) FROM messages m WHERE m.tenant_id = s.tenant_id AND m.session_id = s.id AND m.seq >= s.start_seq)',
  },
};

export const SESSION_INDEX_PREFIXES = Object.values(KINDS).map((k) => k.prefix);

export function sessionIndexName(tenantId: string, sessionId: string, kind: SessionIndexKind): string {
  return partialIndexName(KINDS[kind].prefix, tenantId, sessionId);
}

/**
 * The recorded indexes, whether each still exists and is valid or is being built, whether its
 * session is live, and its size now.
 */
export async function listSessionIndexes(
  q: Queryable,
  filter: { tenantId?: string; sessionId?: string } = {},
): Promise<Array<SessionIndexRow & RecordedState & { current_messages: number }>> {
  const r = await q.query<SessionIndexRow & RecordedState & { current_messages: number }>(
    `SELECT x.index_name, x.tenant_id, x.session_id, x.kind, x.messages,
       ${VALID_INDEX_SQL('x.index_name')} AS exists, ${BUILDING_INDEX_SQL('x.index_name')} AS building,
       s.id IS NOT NULL AS live,
       coalesce(CASE x.kind WHEN 'fts' THEN ${KINDS.fts.size} ELSE ${KINDS.trgm.size} END, 0)::int
         AS current_messages
     FROM session_search_indexes x
     LEFT JOIN sessions s ON s.tenant_id = x.tenant_id AND s.id = x.session_id AND s.deleted_at IS NULL
       AND NOT EXISTS (SELECT 1 FROM tenants t WHERE t.id = s.tenant_id AND t.erasing_at IS NOT NULL)
     WHERE ($1::text IS NULL OR x.tenant_id = $1) AND ($2::text IS NULL OR x.session_id = $2)
     ORDER BY x.index_name`,
    [filter.tenantId ?? null, filter.sessionId ?? null],
  );
  return r.rows;
}

/**
 * Live sessions worth an index of `kind` (at least `minMessages` messages it would cover) that have
 * none, largest first. `next_seq - start_seq` bounds the recent part from above, so only those
 * sessions are counted.
 */
export async function sessionsNeedingIndex(
  q: Queryable,
  a: { kind: SessionIndexKind; minMessages: number; limit: number },
): Promise<Array<{ tenantId: string; sessionId: string; messages: number }>> {
  const bound = a.kind === 'fts' ? 's.message_count' : 's.next_seq - s.start_seq';
  const r = await q.query<{ tenant_id: string; id: string; n: number }>(
    `SELECT s.tenant_id, s.id, c.n FROM sessions s
     CROSS JOIN LATERAL (SELECT (${KINDS[a.kind].size})::int AS n) c
     WHERE s.deleted_at IS NULL AND ${bound} >= $1 AND c.n >= $1
       AND NOT EXISTS (SELECT 1 FROM tenants t WHERE t.id = s.tenant_id AND t.erasing_at IS NOT NULL)
       AND NOT EXISTS (SELECT 1 FROM session_search_indexes x
                       WHERE x.tenant_id = s.tenant_id AND x.session_id = s.id AND x.kind = $2)
     ORDER BY c.n DESC
     LIMIT $3`,
    [a.minMessages, a.kind, a.limit],
  );
  return r.rows.map((x) => ({ tenantId: x.tenant_id, sessionId: x.id, messages: x.n }));
}

/** Builds the session's index of `kind` without blocking writes, and records it. */
export async function buildSessionIndex(
  q: Queryable,
  a: { tenantId: string; sessionId: string; kind: SessionIndexKind; messages: number },
): Promise<string> {
  const name = sessionIndexName(a.tenantId, a.sessionId, a.kind);
  await buildRecordedIndex(
    q,
    'session_search_indexes',
    name,
    {
      sql: `INSERT INTO session_search_indexes (index_name, tenant_id, session_id, kind, messages)
            VALUES ($1, $2, $3, $4, $5)
            ON CONFLICT (index_name) DO UPDATE SET messages = EXCLUDED.messages`,
      params: [name, a.tenantId, a.sessionId, a.kind, a.messages],
    },
    {
      // The method and expression (%s) are this module's constants; the values go through %L.
      template: `'CREATE INDEX CONCURRENTLY IF NOT EXISTS %I ON messages USING %s WHERE tenant_id = %L AND session_id = %L',
       $1::text, $2::text, $3::text, $4::text`,
      args: [name, KINDS[a.kind].using, a.tenantId, a.sessionId],
    },
  );
  return name;
}

/** Drops the index (without blocking reads and writes) and forgets it. Idempotent. */
export async function dropSessionIndex(q: Queryable, name: string): Promise<void> {
  await dropIndexConcurrently(q, name);
  await q.query('DELETE FROM session_search_indexes WHERE index_name = $1', [name]);
}

/** Makes pg_trgm available (a trusted extension since Postgres 13); false when it cannot be. */
export async function ensureTrigramExtension(q: Queryable): Promise<boolean> {
  try {
    await q.query('CREATE EXTENSION IF NOT EXISTS pg_trgm');
    return true;
  } catch {
    // Not installed, not allowed, or another process created it at the same moment.
    const r = await q.query(`SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm'`).catch(() => null);
    return (r?.rowCount ?? 0) > 0;
  }
}

/**
 * Every session that has an index of its own, by kind: `ann` (HNSW, vector_ann_indexes) or
 * `search` (full text or trigrams, session_search_indexes).
 */
export async function sessionsWithOwnIndexes(
  q: Queryable,
): Promise<Array<{ tenant_id: string; session_id: string; kind: 'ann' | 'search' }>> {
  const r = await q.query<{ tenant_id: string; session_id: string; kind: 'ann' | 'search' }>(
    `SELECT tenant_id, session_id, 'ann' AS kind FROM vector_ann_indexes
     UNION SELECT tenant_id, session_id, 'search' FROM session_search_indexes`,
  );
  return r.rows;
}
