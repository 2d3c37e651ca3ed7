import type { Queryable } from '../pool.js';

/** The hot history (seq >= start_seq) as compaction needs it: sizes and turn structure, no text. */
export interface HotRow {
  seq: string;
  role: string;
  bytes: number;
  sent_at_ns: string;
  tool_call_id: string | null;
  /** Ids of the tool calls an assistant message makes (null when none). */
  call_ids: string[] | null;
}

export async function hotHistory(
  q: Queryable,
  tenantId: string,
  sessionId: string,
  startSeq: string,
): Promise<HotRow[]> {
  const r = await q.query<HotRow>(
    `SELECT seq, role, bytes, sent_at_ns, tool_call_id,
       CASE WHEN jsonb_typeof(tool_calls) = 'array'
         THEN ARRAY(SELECT c->>'id' FROM jsonb_array_elements(tool_calls) AS c WHERE c->>'id' IS NOT NULL)
       END AS call_ids
     FROM messages
     WHERE tenant_id = $1 AND session_id = $2 AND seq >= $3::bigint
     ORDER BY seq`,
    [tenantId, sessionId, startSeq],
  );
  return r.rows;
}

/**
 * Moves the cutoff forward (caller holds the session row FOR UPDATE): the new start, the bytes
 * that stay hot, and the recent vectors (and skip marks) below the cutoff go. The archive is not
 * touched.
 */
export async function moveCutoff(
  q: Queryable,
  a: { tenantId: string; sessionId: string; startSeq: string; startAtNs: string; hotBytes: number },
): Promise<{ vectorsDeleted: number }> {
  await q.query(
    `UPDATE sessions SET start_seq = $3::bigint, start_at_ns = $4::bigint, hot_bytes = $5::bigint,
       compact_blocked_at_bytes = NULL
     WHERE tenant_id = $1 AND id = $2`,
    [a.tenantId, a.sessionId, a.startSeq, a.startAtNs, a.hotBytes],
  );
  const v = await q.query(
    'DELETE FROM message_vectors WHERE tenant_id = $1 AND session_id = $2 AND seq < $3::bigint',
    [a.tenantId, a.sessionId, a.startSeq],
  );
  await q.query(
    'DELETE FROM message_vector_skips WHERE tenant_id = $1 AND session_id = $2 AND seq < $3::bigint',
    [a.tenantId, a.sessionId, a.startSeq],
  );
  return { vectorsDeleted: v.rowCount ?? 0 };
}

/** Remembers that the hot history had no cut point at this size (see shouldCompact). */
export async function markCompactBlocked(
  q: Queryable,
  tenantId: string,
  sessionId: string,
  hotBytes: number,
): Promise<void> {
  await q.query(
    'UPDATE sessions SET compact_blocked_at_bytes = $3::bigint WHERE tenant_id = $1 AND id = $2',
    [tenantId, sessionId, hotBytes],
  );
}

/**
 * What the post-archive hook needs to decide on a compact job: the blocked mark, and whether the
 * batch just archived (seq range) holds a user message, the only thing that can create a cut point.
 */
export async function compactTriggerState(
  q: Queryable,
  a: { tenantId: string; sessionId: string; firstSeq: number; lastSeq: number },
): Promise<{ blockedAtBytes: number | null; newUserMessage: boolean } | null> {
  const r = await q.query<{ blocked: string | null; new_user: boolean }>(
    `SELECT s.compact_blocked_at_bytes AS blocked,
       EXISTS (SELECT 1 FROM messages m
               WHERE m.tenant_id = s.tenant_id AND m.session_id = s.id
                 AND m.seq BETWEEN $3::bigint AND $4::bigint AND m.role = 'user') AS new_user
     FROM sessions s WHERE s.tenant_id = $1 AND s.id = $2`,
    [a.tenantId, a.sessionId, a.firstSeq, a.lastSeq],
  );
  const row = r.rows[0];
  if (!row) return null;
  return { blockedAtBytes: row.blocked === null ? null : Number(row.blocked), newUserMessage: row.new_user };
}
