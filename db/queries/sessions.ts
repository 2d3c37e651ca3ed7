import type { Queryable } from '../pool.js';

export interface SessionRow {
  tenant_id: string;
  id: string;
  generation: number;
  next_seq: string;
  message_count: number;
  hot_bytes: string;
  start_seq: string;
  start_at_ns: string | null;
  created_at: Date;
  last_message_at: Date | null;
  /** A tombstone (`deleted_at` set), decided in SQL as every boolean of a timestamp. */
  deleted: boolean;
  /** Highest seq of the history the last reset/delete cleared (0 = never cleared). */
  cleared_through_seq: string;
}

const COLS = `tenant_id, id, generation, next_seq, message_count, hot_bytes, start_seq, start_at_ns,
  created_at, last_message_at, deleted_at IS NOT NULL AS deleted, cleared_through_seq`;

/**
 * Locks the session row, creating it first if needed; the caller holds a transaction. The row
 * almost always exists (it is created when the session is seeded), so try the lock first and pay
 * the INSERT only on a miss.
 */
export async function lockOrCreateSession(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<SessionRow> {
  const existing = await lockSession(q, tenantId, sessionId);
  if (existing) return existing;
  await q.query(`INSERT INTO sessions (tenant_id, id) VALUES ($1, $2) ON CONFLICT DO NOTHING`, [
    tenantId,
    sessionId,
  ]);
  return (await lockSession(q, tenantId, sessionId))!;
}

export async function lockSession(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<SessionRow | null> {
  const r = await q.query<SessionRow>(
    `SELECT ${COLS} FROM sessions WHERE tenant_id = $1 AND id = $2 FOR UPDATE`,
    [tenantId, sessionId],
  );
  return r.rows[0] ?? null;
}

/** A live (not deleted) session. */
export async function getSession(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<SessionRow | null> {
  const r = await q.query<SessionRow>(
    `SELECT ${COLS} FROM sessions WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL`,
    [tenantId, sessionId],
  );
  return r.rows[0] ?? null;
}

/** Keyset page over live sessions in id order (cursor = last id of the previous page). */
export async function listSessions(
  q: Queryable,
  tenantId: string,
  afterId: string | null,
  limit: number,
): Promise<SessionRow[]> {
  const r = await q.query<SessionRow>(
    `SELECT ${COLS} FROM sessions
     WHERE tenant_id = $1 AND deleted_at IS NULL AND ($2::text IS NULL OR id > $2)
     ORDER BY id LIMIT $3`,
    [tenantId, afterId, limit],
  );
  return r.rows;
}

/**
 * The SET list of what a drain archived (recordArchived, archiveBatch), from SQL expressions of
 * the seq after the batch, the count and bytes archived and the highest `sent_at_ns` among them
 * (null when none).
 */
export function archivedSetSql(nextSeq: string, count: string, bytes: string, lastNs: string): string {
  return `next_seq = GREATEST(next_seq, ${nextSeq}),
       message_count = message_count + ${count},
       hot_bytes = hot_bytes + ${bytes},
       last_message_at = CASE WHEN ${lastNs} IS NULL THEN last_message_at
         ELSE GREATEST(last_message_at, to_timestamp(${lastNs} / 1000000000)
           + (${lastNs} % 1000000000 / 1000) * interval '1 microsecond') END,
       deleted_at = CASE WHEN ${count} > 0 THEN NULL ELSE deleted_at END,
       -- A deleted session written to again is a new session: it starts now (SET reads old values).
       created_at = CASE WHEN ${count} > 0 AND deleted_at IS NOT NULL THEN now() ELSE created_at END`;
}

/** Records what a drain archived: the mark readers respect, counters, and the session's liveness. */
export async function recordArchived(
  q: Queryable,
  a: {
    tenantId: string;
    sessionId: string;
    nextSeq: number;
    count: number;
    bytes: number;
    lastSentNs: string | null;
  },
): Promise<{ hot_bytes: string; message_count: number }> {
  const r = await q.query<{ hot_bytes: string; message_count: number }>(
    `UPDATE sessions SET
       ${archivedSetSql('$3::bigint', '$4::int', '$5::bigint', '$6::bigint')}
     WHERE tenant_id = $1 AND id = $2
     RETURNING hot_bytes, message_count`,
    [a.tenantId, a.sessionId, a.nextSeq, a.count, a.bytes, a.lastSentNs],
  );
  return r.rows[0]!;
}
