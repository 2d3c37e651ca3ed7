import type { Queryable } from '../pool.js';
import { SHADOW_TABLE, shadowTableExists } from './vectors.js';

/** Queries of session reset/delete, import, export, the temp reaper and tenant erasure. */

export async function deleteSessionMessages(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<number> {
  const r = await q.query('DELETE FROM messages WHERE tenant_id = $1 AND session_id = $2', [
    tenantId,
    sessionId,
  ]);
  return r.rowCount ?? 0;
}

/**
 * The recent index and its refusals (the skips hold no content, but belong to the old messages),
 * and the session's rows of a reembed's shadow table when there is one: a reembed that was
 * stopped and never rerun (the operator went back to the old embedder) never swaps, so nothing
 * else would remove them. The live table first: its lock holds off a swap (whose DROP waits for
 * it) until this transaction ends, so the shadow table cannot be renamed away in between.
 */
export async function deleteSessionVectorRows(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<void> {
  await q.query('DELETE FROM message_vectors WHERE tenant_id = $1 AND session_id = $2', [
    tenantId,
    sessionId,
  ]);
  await q.query('DELETE FROM message_vector_skips WHERE tenant_id = $1 AND session_id = $2', [
    tenantId,
    sessionId,
  ]);
  if (await shadowTableExists(q)) {
    await q.query(`DELETE FROM ${SHADOW_TABLE} WHERE tenant_id = $1 AND session_id = $2`, [
      tenantId,
      sessionId,
    ]);
  }
}

export async function deleteSessionSummary(q: Queryable, tenantId: string, sessionId: string): Promise<void> {
  await q.query('DELETE FROM summaries WHERE tenant_id = $1 AND session_id = $2', [tenantId, sessionId]);
}

export async function deleteSessionSummaryLease(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<void> {
  await q.query('DELETE FROM summary_leases WHERE tenant_id = $1 AND session_id = $2', [tenantId, sessionId]);
}

/** Usage outlives a deleted session: the counts stay, the session id goes. */
export async function detachSessionUsage(q: Queryable, tenantId: string, sessionId: string): Promise<number> {
  const r = await q.query('UPDATE llm_usage SET session_id = NULL WHERE tenant_id = $1 AND session_id = $2', [
    tenantId,
    sessionId,
  ]);
  return r.rowCount ?? 0;
}

/**
 * A summary kept by a reset starts the new history without the cleared one's failures: the
 * messages that made its chunks fail are gone, and a stall's back-off (up to 6 h) would hold back
 * the new ones. A placeholder that holds only failures (version 0) goes.
 */
export async function clearSummaryFailures(q: Queryable, tenantId: string, sessionId: string): Promise<void> {
  await q.query('DELETE FROM summaries WHERE tenant_id = $1 AND session_id = $2 AND version = 0', [
    tenantId,
    sessionId,
  ]);
  await q.query(
    `UPDATE summaries SET status = 'ok', failures = 0, last_error = NULL, next_attempt_at = NULL,
       failed_config = NULL
     WHERE tenant_id = $1 AND session_id = $2
       AND (status <> 'ok' OR failures > 0 OR next_attempt_at IS NOT NULL)`,
    [tenantId, sessionId],
  );
}

/** True when a written summary (not a version-0 placeholder) exists. */
export async function hasWrittenSummary(q: Queryable, tenantId: string, sessionId: string): Promise<boolean> {
  const r = await q.query(
    'SELECT 1 FROM summaries WHERE tenant_id = $1 AND session_id = $2 AND summary IS NOT NULL AND version > 0',
    [tenantId, sessionId],
  );
  return r.rows.length > 0;
}

/**
 * After reset/delete: the new generation, empty counters, no cutoff. `next_seq` is untouched (seq
 * is never reused). A delete makes the row a content-free tombstone; the ingest worker clears
 * `deleted_at` again when messages of the new generation are archived.
 */
export async function markSessionCleared(
  q: Queryable,
  a: { tenantId: string; sessionId: string; generation: number; deleted: boolean; clearedThroughSeq: number },
): Promise<void> {
  await q.query(
    `UPDATE sessions SET generation = $3::int, message_count = 0, hot_bytes = 0, start_seq = 0,
       start_at_ns = NULL, compact_blocked_at_bytes = NULL, last_message_at = NULL,
       deleted_at = CASE WHEN $4::boolean THEN now() ELSE NULL END,
       cleared_through_seq = GREATEST(cleared_through_seq, $5::bigint),
       next_seq = GREATEST(next_seq, $5::bigint + 1)
     WHERE tenant_id = $1 AND id = $2`,
    [a.tenantId, a.sessionId, a.generation, a.deleted, a.clearedThroughSeq],
  );
}

/**
 * After the Redis step of a reset/delete: records that Redis holds `generation` (never moving
 * backwards) and, when the step dropped inbox entries, moves `next_seq` past the seq numbers they
 * had been given, so those are never handed out again, even if Redis later loses its counter
 * (`next_seq` seeds it). Safe against the ingest worker: every entry of the new generation has a
 * higher seq.
 */
export async function recordRedisCaughtUp(
  q: Queryable,
  a: { tenantId: string; sessionId: string; generation: number; nextSeq: number | null },
): Promise<void> {
  await q.query(
    `UPDATE sessions SET redis_generation = GREATEST(redis_generation, $3::int),
       next_seq = GREATEST(next_seq, COALESCE($4::bigint, next_seq))
     WHERE tenant_id = $1 AND id = $2`,
    [a.tenantId, a.sessionId, a.generation, a.nextSeq],
  );
}

/** Sessions whose Redis state still holds an older generation (an interrupted reset/delete). */
export async function sessionsBehindInRedis(
  q: Queryable,
  limit: number,
): Promise<
  Array<{ tenant_id: string; id: string; generation: number; cleared_through_seq: string; deleted: boolean }>
> {
  const r = await q.query<{
    tenant_id: string;
    id: string;
    generation: number;
    cleared_through_seq: string;
    deleted: boolean;
  }>(
    // Ordered as the partial index sessions_redis_behind (migration 004) is: the planner cannot
    // estimate `redis_generation <> generation` (it guesses 99.5 % of rows) and, without the
    // ORDER BY, read the whole table to find none (0.4 s a run at a million sessions).
    `SELECT tenant_id, id, generation, cleared_through_seq, deleted_at IS NOT NULL AS deleted FROM sessions
     WHERE redis_generation <> generation ORDER BY tenant_id, id LIMIT $1`,
    [limit],
  );
  return r.rows;
}

export async function sessionHasMessages(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<boolean> {
  const r = await q.query('SELECT 1 FROM messages WHERE tenant_id = $1 AND session_id = $2 LIMIT 1', [
    tenantId,
    sessionId,
  ]);
  return r.rows.length > 0;
}

/**
 * Brings back the row of a deleted session when something is written to it again (an import, or
 * the first messages accepted since the delete: a new session under the same id exists from its
 * first accepted message), unless a later reset or delete moved its generation on meanwhile. The
 * drain does the same when it archives (recordArchived).
 */
export async function reviveSession(
  q: Queryable,
  tenantId: string,
  sessionId: string,
  generation: number,
): Promise<void> {
  await q.query(
    `UPDATE sessions SET deleted_at = NULL, created_at = now()
     WHERE tenant_id = $1 AND id = $2 AND generation = $3 AND deleted_at IS NOT NULL`,
    [tenantId, sessionId, generation],
  );
}

/**
 * An imported summary replaces whatever the session had; the version still moves forward, so
 * caches keyed by version never confuse the two. `cursor_seq` null = set by the next summary job.
 */
export async function upsertImportedSummary(
  q: Queryable,
  a: { tenantId: string; sessionId: string; summary: unknown; cursorSeq: number | null },
): Promise<number> {
  const r = await q.query<{ version: number }>(
    `INSERT INTO summaries (tenant_id, session_id, summary, cursor_seq, version, status, failures, updated_at)
     VALUES ($1, $2, $3::jsonb, $4::bigint, 1, 'ok', 0, now())
     ON CONFLICT (tenant_id, session_id) DO UPDATE SET summary = EXCLUDED.summary,
       cursor_seq = EXCLUDED.cursor_seq, version = summaries.version + 1, status = 'ok', failures = 0,
       last_error = NULL, next_attempt_at = NULL, failed_config = NULL, updated_at = now()
     RETURNING version`,
    [a.tenantId, a.sessionId, JSON.stringify(a.summary), a.cursorSeq],
  );
  return r.rows[0]!.version;
}

/**
 * Whether the `temp-` session `s` is idle: no message sent, no message archived and no creation
 * within `idleMs` before `now`. Activity is the newest of `last_message_at` (a message's own time,
 * which an import may set far in the past), the newest archival and the row's creation. A message
 * time after `now` is the client's clock, not activity: a `sent_at` in 2030 kept a throwaway
 * session until 2030. `now` is Postgres's clock unless a test gives one: the times compared are
 * Postgres's own (created_at, archived_at), and a worker whose clock ran an hour ahead deleted a
 * session posted a minute earlier.
 */
const IDLE_TEMP_SQL = `s.deleted_at IS NULL AND s.id LIKE 'temp-%'
   AND s.created_at < t.now - t.idle
   AND (s.last_message_at IS NULL OR s.last_message_at < t.now - t.idle OR s.last_message_at > t.now)
   AND NOT EXISTS (SELECT 1 FROM messages m
                   WHERE m.tenant_id = s.tenant_id AND m.session_id = s.id AND m.archived_at >= t.now - t.idle)`;

/** `t.now` and `t.idle` for IDLE_TEMP_SQL, from the parameters `now` (null: Postgres's now()) and `idleMs`. */
const idleClock = (now: string, idleMs: string) =>
  `(SELECT COALESCE(${now}::timestamptz, now()) AS now, ${idleMs}::bigint * interval '1 millisecond' AS idle) t`;

/** Live `temp-` sessions idle for `idleMs` (IDLE_TEMP_SQL), oldest first. */
export async function idleTempSessions(
  q: Queryable,
  idleMs: number,
  now: Date | null,
  limit: number,
): Promise<Array<{ tenant_id: string; id: string }>> {
  const r = await q.query<{ tenant_id: string; id: string }>(
    `SELECT s.tenant_id, s.id FROM sessions s, ${idleClock('$3', '$1')}
     WHERE ${IDLE_TEMP_SQL}
     ORDER BY s.created_at
     LIMIT $2`,
    [idleMs, limit, now],
  );
  return r.rows;
}

/** The same test for one row, under its lock (the reaper re-checks before it deletes). */
export async function isTempSessionIdle(
  q: Queryable,
  tenantId: string,
  sessionId: string,
  idleMs: number,
  now: Date | null,
): Promise<boolean> {
  const r = await q.query(
    `SELECT 1 FROM sessions s, ${idleClock('$4', '$3')}
     WHERE s.tenant_id = $1 AND s.id = $2 AND ${IDLE_TEMP_SQL}`,
    [tenantId, sessionId, idleMs, now],
  );
  return r.rows.length > 0;
}

export async function getTenantById(q: Queryable, id: string): Promise<{ id: string; name: string } | null> {
  const r = await q.query<{ id: string; name: string }>('SELECT id, name FROM tenants WHERE id = $1', [id]);
  return r.rows[0] ?? null;
}

/**
 * Bulk rows of an erased tenant go in bounded batches (short transactions, no giant WAL burst);
 * returns how many went. `table` is one of a fixed list, never input.
 */
export async function deleteTenantBatch(
  q: Queryable,
  table: 'messages' | 'message_vectors' | 'message_vector_skips' | 'llm_usage' | typeof SHADOW_TABLE,
  tenantId: string,
  batch: number,
): Promise<number> {
  const r = await q.query(
    `DELETE FROM ${table} WHERE ctid = ANY (ARRAY(SELECT ctid FROM ${table} WHERE tenant_id = $1 LIMIT $2))`,
    [tenantId, batch],
  );
  return r.rowCount ?? 0;
}

/** The tenants row; every other table goes with it through ON DELETE CASCADE. */
export async function deleteTenant(q: Queryable, tenantId: string): Promise<boolean> {
  const r = await q.query('DELETE FROM tenants WHERE id = $1', [tenantId]);
  return (r.rowCount ?? 0) > 0;
}
