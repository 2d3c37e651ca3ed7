import type { Queryable } from '../pool.js';
import { PAGE_MAX_BYTES } from './messages.js';

/** One archived message as the context endpoint needs it (content = parts when structured). */
export interface WindowMessageRow {
  seq: number;
  role: string;
  content: unknown;
  name: string | null;
  tool_call_id: string | null;
  tool_calls: unknown[] | null;
}

export interface ContextRow {
  start_seq: string;
  next_seq: string;
  deleted: boolean;
  summary: unknown;
  summary_version: number | null;
  /** Oldest first; null when the hot history is empty. */
  messages: WindowMessageRow[] | null;
}

/** Longest tool-result run fetched in front of a window (one assistant message has ≤ 128 calls). */
export const MAX_TOOL_RUN = 256;

const WINDOW_JSON = `json_build_object('seq', w.seq, 'role', w.role,
  'content', COALESCE(w.parts::json, to_json(w.content)), 'name', w.name,
  'tool_call_id', w.tool_call_id, 'tool_calls', w.tool_calls)`;

/**
 * Session state, summary and hot window (the last `maxMessages` messages at or after the cutoff,
 * newest first up to PAGE_MAX_BYTES: at least one, then as many as fit) in one round trip and one
 * snapshot. The window comes back as one JSON array, oldest first; the
 * window scan walks the primary key backwards and stops after `maxMessages` rows. Kept this
 * simple on purpose: planning dominates the cost of such a query (pgbench: a variant that also
 * did the tool-run extension in SQL took twice as long), and the extension is rarely needed.
 * No row: the session was never written to.
 */
export async function loadContext(
  q: Queryable,
  a: { tenantId: string; sessionId: string; maxMessages: number },
): Promise<ContextRow | null> {
  const r = await q.query<ContextRow>(
    `SELECT s.start_seq, s.next_seq, s.deleted_at IS NOT NULL AS deleted, sm.summary,
       sm.version AS summary_version,
       (SELECT json_agg(${WINDOW_JSON} ORDER BY w.seq) FROM (
          SELECT m.seq, m.role, m.content, m.parts, m.name, m.tool_call_id, m.tool_calls,
            sum(m.bytes) OVER (ORDER BY m.seq DESC) - m.bytes AS bytes_before FROM messages m
          WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq >= s.start_seq AND s.deleted_at IS NULL
          ORDER BY m.seq DESC LIMIT $3::int) w WHERE w.bytes_before < $4) AS messages
     FROM sessions s LEFT JOIN summaries sm ON sm.tenant_id = $1 AND sm.session_id = $2
     WHERE s.tenant_id = $1 AND s.id = $2`,
    [a.tenantId, a.sessionId, a.maxMessages, PAGE_MAX_BYTES],
  );
  return r.rows[0] ?? null;
}

/**
 * The messages in front of `beforeSeq` back to (and including) the nearest non-tool message at or
 * after the cutoff, oldest first: the assistant message a window-leading tool result answers, and
 * the results between; the assistant message alone when the run is longer than MAX_TOOL_RUN rows
 * or PAGE_MAX_BYTES. Empty when there is no such message.
 */
export async function loadToolRunBefore(
  q: Queryable,
  a: { tenantId: string; sessionId: string; beforeSeq: number; startSeq: number },
): Promise<WindowMessageRow[]> {
  // All of the run when it fits in PAGE_MAX_BYTES and MAX_TOOL_RUN rows; else the assistant message
  // alone, whose calls the well-formed window then trims to those the window's results answer
  // (with nothing, a run of huge results left no message at all: each was an orphan; so did a run
  // of more than MAX_TOOL_RUN rows, duplicate or stray results re-posted after retries, whose
  // rows read stopped short of the assistant message).
  const r = await q.query<{ messages: WindowMessageRow[] | null }>(
    `WITH head AS (
       SELECT p.seq FROM messages p
       WHERE p.tenant_id = $1 AND p.session_id = $2 AND p.seq < $3::bigint AND p.seq >= $4::bigint
         AND p.role <> 'tool'
       ORDER BY p.seq DESC LIMIT 1),
     w AS (
       SELECT m.seq, m.role, m.content, m.parts, m.name, m.tool_call_id, m.tool_calls, m.bytes FROM messages m
       WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq < $3::bigint AND m.seq >= (SELECT seq FROM head)
       ORDER BY m.seq DESC LIMIT ${MAX_TOOL_RUN + 1})
     SELECT CASE WHEN (SELECT sum(bytes) FROM w) <= $5 AND (SELECT min(seq) FROM w) = (SELECT seq FROM head)
       THEN (SELECT json_agg(${WINDOW_JSON} ORDER BY w.seq) FROM w)
       ELSE (SELECT json_agg(${WINDOW_JSON}) FROM messages w
             WHERE w.tenant_id = $1 AND w.session_id = $2 AND w.seq = (SELECT seq FROM head)) END AS messages`,
    [a.tenantId, a.sessionId, a.beforeSeq, a.startSeq, PAGE_MAX_BYTES],
  );
  return r.rows[0]?.messages ?? [];
}
