import type { Queryable } from '../pool.js';

export interface SummaryStateRow {
  version: number;
  cursor_seq: string | null;
  status: string;
}

export async function getSummaryState(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<SummaryStateRow | null> {
  const r = await q.query<SummaryStateRow>(
    'SELECT version, cursor_seq, status FROM summaries WHERE tenant_id = $1 AND session_id = $2',
    [tenantId, sessionId],
  );
  return r.rows[0] ?? null;
}

/**
 * A summaries row. `version` 0 with `summary` null is a placeholder: it records the cursor and
 * failures of a session whose first summary has not been written yet (SPEC: version 0 = none).
 * `cursor_seq` null means an imported summary whose cursor is still unknown.
 */
export interface SummaryRow extends SummaryStateRow {
  summary: unknown;
  failures: number;
  last_error: string | null;
  next_attempt_at: Date | null;
  updated_at: Date;
}

export async function getSummaryRow(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<SummaryRow | null> {
  const r = await q.query<SummaryRow>(
    `SELECT summary, version, cursor_seq, status, failures, last_error, next_attempt_at, updated_at
     FROM summaries WHERE tenant_id = $1 AND session_id = $2`,
    [tenantId, sessionId],
  );
  return r.rows[0] ?? null;
}

/** Between the tool calls of one message in `tool_calls_text` (ASCII record separator). */
export const TOOL_CALL_SEPARATOR = '\u001e';

/** An archived message as the summarizer reads it: content capped in SQL so a page stays small. */
export interface SummarySourceRow {
  seq: string;
  role: string;
  name: string | null;
  sent_at_ns: string;
  /** At most `maxChars` code points of the text content ('' when none). */
  content: string;
  /** Code points of the whole text content. */
  content_chars: number;
  /** `name(arguments)` per tool call (arguments capped), separated by TOOL_CALL_SEPARATOR, or null. */
  tool_calls_text: string | null;
}

/** The columns of a SummarySourceRow from `messages m`, with the placeholders of its two caps. */
const sourceColumns = (maxChars: string, maxArgChars: string) =>
  `m.seq, m.role, m.name, m.sent_at_ns,
   left(coalesce(m.content, ''), ${maxChars}::int) AS content,
   char_length(coalesce(m.content, '')) AS content_chars,
   CASE WHEN jsonb_typeof(m.tool_calls) = 'array' THEN (
     SELECT string_agg(
       coalesce(tc -> 'function' ->> 'name', 'tool') || '(' ||
         CASE WHEN char_length(coalesce(tc -> 'function' ->> 'arguments', '')) > ${maxArgChars}::int
           THEN left(tc -> 'function' ->> 'arguments', ${maxArgChars}::int) || '…'
           ELSE coalesce(tc -> 'function' ->> 'arguments', '') END || ')',
       chr(30) ORDER BY x.ord)
     FROM jsonb_array_elements(m.tool_calls) WITH ORDINALITY AS x (tc, ord)
   ) END AS tool_calls_text`;

/** The next page of archived messages after `afterSeq`, in seq order. */
export async function pageSummarySource(
  q: Queryable,
  a: {
    tenantId: string;
    sessionId: string;
    afterSeq: number;
    limit: number;
    maxChars: number;
    maxArgChars: number;
  },
): Promise<SummarySourceRow[]> {
  const r = await q.query<SummarySourceRow>(
    `SELECT ${sourceColumns('$5', '$6')}
     FROM messages m
     WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq > $3::bigint
     ORDER BY m.seq
     LIMIT $4::int`,
    [a.tenantId, a.sessionId, a.afterSeq, a.limit, a.maxChars, a.maxArgChars],
  );
  return r.rows;
}

/**
 * The request of the turn going on at `atSeq`: the last user message at or before it, with the
 * number of the turn's messages up to `atSeq` (the request included). Null when there is none.
 * The scan reads back over the turn's replies (the primary key, newest first).
 */
export async function turnOpenerAt(
  q: Queryable,
  a: { tenantId: string; sessionId: string; atSeq: number; maxChars: number; maxArgChars: number },
): Promise<(SummarySourceRow & { turn_messages: string }) | null> {
  const r = await q.query<SummarySourceRow & { turn_messages: string }>(
    `SELECT ${sourceColumns('$4', '$5')},
       (SELECT count(*) FROM messages t
        WHERE t.tenant_id = $1 AND t.session_id = $2 AND t.seq BETWEEN m.seq AND $3::bigint)
         AS turn_messages
     FROM messages m
     WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq <= $3::bigint AND m.role = 'user'
     ORDER BY m.seq DESC
     LIMIT 1`,
    [a.tenantId, a.sessionId, a.atSeq, a.maxChars, a.maxArgChars],
  );
  return r.rows[0] ?? null;
}

export async function hasMessagesAfter(
  q: Queryable,
  tenantId: string,
  sessionId: string,
  afterSeq: number,
): Promise<boolean> {
  const r = await q.query(
    'SELECT 1 FROM messages WHERE tenant_id = $1 AND session_id = $2 AND seq > $3::bigint LIMIT 1',
    [tenantId, sessionId, afterSeq],
  );
  return r.rows.length > 0;
}

// ---- the per-session lease (migration 003) ----

/** Takes the lease when free or expired; false when another holder has it. */
export async function acquireSummaryLease(
  q: Queryable,
  a: { tenantId: string; sessionId: string; holder: string; ttlMs: number },
): Promise<boolean> {
  const r = await q.query(
    `INSERT INTO summary_leases (tenant_id, session_id, holder, expires_at)
     SELECT $1, $2, $3, now() + make_interval(secs => $4::double precision / 1000)
     WHERE EXISTS (SELECT 1 FROM sessions WHERE tenant_id = $1 AND id = $2)
     ON CONFLICT (tenant_id, session_id) DO UPDATE
       SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
       WHERE summary_leases.expires_at < now()
     RETURNING holder`,
    [a.tenantId, a.sessionId, a.holder, a.ttlMs],
  );
  return r.rows.length > 0;
}

/**
 * Who holds the session's lease and until when (Postgres's clock, epoch ms), with the time left
 * by Postgres's clock; null when there is none.
 */
export async function readSummaryLease(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<{ holder: string; expiresAtMs: number; remainingMs: number } | null> {
  const r = await q.query<{ holder: string; expires_ms: number; remaining_ms: number }>(
    `SELECT holder, extract(epoch FROM expires_at)::float8 * 1000 AS expires_ms,
            extract(epoch FROM expires_at - now())::float8 * 1000 AS remaining_ms
     FROM summary_leases WHERE tenant_id = $1 AND session_id = $2`,
    [tenantId, sessionId],
  );
  const row = r.rows[0];
  return row
    ? { holder: row.holder, expiresAtMs: Number(row.expires_ms), remainingMs: Number(row.remaining_ms) }
    : null;
}

/** Extends the lease; false when it is no longer ours (expired and taken over). */
export async function renewSummaryLease(
  q: Queryable,
  a: { tenantId: string; sessionId: string; holder: string; ttlMs: number },
): Promise<boolean> {
  const r = await q.query(
    `UPDATE summary_leases SET expires_at = now() + make_interval(secs => $4::double precision / 1000)
     WHERE tenant_id = $1 AND session_id = $2 AND holder = $3
     RETURNING 1`,
    [a.tenantId, a.sessionId, a.holder, a.ttlMs],
  );
  return r.rows.length > 0;
}

export async function releaseSummaryLease(
  q: Queryable,
  a: { tenantId: string; sessionId: string; holder: string },
): Promise<void> {
  await q.query('DELETE FROM summary_leases WHERE tenant_id = $1 AND session_id = $2 AND holder = $3', [
    a.tenantId,
    a.sessionId,
    a.holder,
  ]);
}

export async function deleteSummaryLease(q: Queryable, tenantId: string, sessionId: string): Promise<void> {
  await q.query('DELETE FROM summary_leases WHERE tenant_id = $1 AND session_id = $2', [tenantId, sessionId]);
}

/**
 * Inside a save transaction: locks the session row (FOR SHARE, so a concurrent delete or reset
 * that bumps the generation serialises with the save) and checks that the session is still the
 * live generation the run started on and that the run still holds the lease.
 */
export async function lockForSummarySave(
  q: Queryable,
  a: { tenantId: string; sessionId: string; generation: number; holder: string },
): Promise<boolean> {
  const r = await q.query(
    `SELECT 1 FROM sessions s
     WHERE s.tenant_id = $1 AND s.id = $2 AND s.generation = $3 AND s.deleted_at IS NULL
       AND EXISTS (SELECT 1 FROM summary_leases l
                   WHERE l.tenant_id = $1 AND l.session_id = $2 AND l.holder = $4)
     FOR SHARE OF s`,
    [a.tenantId, a.sessionId, a.generation, a.holder],
  );
  return r.rows.length > 0;
}

/**
 * Whether a run may still spend an LLM call on the session: the generation it started on, live,
 * its tenant not under erasure. Checked before each call, so a run whose session was deleted,
 * reset or erased meanwhile stops instead of paying for an answer its save would refuse.
 */
export async function summaryRunCurrent(
  q: Queryable,
  a: { tenantId: string; sessionId: string; generation: number },
): Promise<boolean> {
  const r = await q.query(
    `SELECT 1 FROM sessions s JOIN tenants t ON t.id = s.tenant_id
     WHERE s.tenant_id = $1 AND s.id = $2 AND s.generation = $3 AND s.deleted_at IS NULL
       AND t.erasing_at IS NULL`,
    [a.tenantId, a.sessionId, a.generation],
  );
  return r.rows.length > 0;
}

/** First row of a session; false when one exists already (a concurrent run won). */
export async function insertSummary(
  q: Queryable,
  a: { tenantId: string; sessionId: string; summary: unknown; version: number; cursorSeq: number },
): Promise<boolean> {
  const r = await q.query(
    `INSERT INTO summaries (tenant_id, session_id, summary, cursor_seq, version, status, failures, updated_at)
     VALUES ($1, $2, $3::jsonb, $4::bigint, $5::int, 'ok', 0, now())
     ON CONFLICT (tenant_id, session_id) DO NOTHING
     RETURNING 1`,
    [a.tenantId, a.sessionId, JSON.stringify(a.summary), a.cursorSeq, a.version],
  );
  return r.rows.length > 0;
}

/**
 * Saves a step only if the row is still exactly what this run last saw (version and cursor), so a
 * concurrent or replayed run can never overwrite a newer summary or move the cursor backwards.
 * A successful save clears the failure state.
 */
export async function updateSummaryGuarded(
  q: Queryable,
  a: {
    tenantId: string;
    sessionId: string;
    expectVersion: number;
    expectCursor: number | null;
    summary: unknown;
    version: number;
    cursorSeq: number;
  },
): Promise<boolean> {
  const r = await q.query(
    `UPDATE summaries SET summary = $5::jsonb, version = $6::int, cursor_seq = $7::bigint,
       status = 'ok', failures = 0, last_error = NULL, next_attempt_at = NULL, failed_config = NULL,
       updated_at = now()
     WHERE tenant_id = $1 AND session_id = $2 AND version = $3::int
       AND cursor_seq IS NOT DISTINCT FROM $4::bigint
       AND ($7::bigint >= coalesce(cursor_seq, 0))
     RETURNING 1`,
    [
      a.tenantId,
      a.sessionId,
      a.expectVersion,
      a.expectCursor,
      JSON.stringify(a.summary),
      a.version,
      a.cursorSeq,
    ],
  );
  return r.rows.length > 0;
}

/**
 * Counts a failed run. The first failure of a session without a summary creates a placeholder
 * row (version 0, summary null, cursor 0) so the failure is visible. From `stallAfter`
 * consecutive failures on, the row is `stalled` with an exponential back-off the sweep respects.
 * Failures count under one LLM configuration (`config`, a fingerprint): the first failure under
 * another starts the count, and the back-off, again from 1. `updated_at` moves with each failure.
 * Only while the session is still at `generation`: a run over messages that a reset cleared
 * meanwhile counts for nothing (its failure would outlive them).
 */
export async function recordSummaryFailure(
  q: Queryable,
  a: {
    tenantId: string;
    sessionId: string;
    generation: number;
    error: string;
    /** The LLM configuration the run failed under (summaryConfigFingerprint). */
    config: string;
    stallAfter: number;
    backoffBaseSeconds: number;
    backoffMaxSeconds: number;
  },
): Promise<{ failures: number; status: string; next_attempt_at: Date | null } | null> {
  // The failure count with this one: from 1 again when the last failure had another configuration.
  const n = '(CASE WHEN summaries.failed_config IS DISTINCT FROM $8 THEN 0 ELSE summaries.failures END + 1)';
  const r = await q.query<{ failures: number; status: string; next_attempt_at: Date | null }>(
    `INSERT INTO summaries (tenant_id, session_id, summary, cursor_seq, version, status, failures, last_error,
       failed_config, updated_at)
     SELECT $1, $2, 'null'::jsonb, 0, 0, CASE WHEN 1 >= $4::int THEN 'stalled' ELSE 'ok' END, 1, $3, $8, now()
     WHERE EXISTS (SELECT 1 FROM sessions
                   WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL AND generation = $7)
     ON CONFLICT (tenant_id, session_id) DO UPDATE SET
       failures = ${n},
       last_error = EXCLUDED.last_error,
       failed_config = EXCLUDED.failed_config,
       updated_at = now(),
       status = CASE WHEN ${n} >= $4::int THEN 'stalled'
         WHEN summaries.failed_config IS DISTINCT FROM $8 THEN 'ok' ELSE summaries.status END,
       next_attempt_at = CASE WHEN ${n} >= $4::int
         THEN now() + make_interval(secs => least($6::double precision,
           $5::double precision * power(2, ${n} - $4::int)))
         ELSE NULL END
     WHERE EXISTS (SELECT 1 FROM sessions WHERE tenant_id = $1 AND id = $2 AND generation = $7)
     RETURNING failures, status, next_attempt_at`,
    [
      a.tenantId,
      a.sessionId,
      a.error,
      a.stallAfter,
      a.backoffBaseSeconds,
      a.backoffMaxSeconds,
      a.generation,
      a.config,
    ],
  );
  return r.rows[0] ?? null;
}

/**
 * The admin retry (POST /v1/admin/summaries/retry): every failed or stalled summary, of all tenants
 * or of one, is due at the next sweep. Its failures count as under another configuration, so the
 * next failure counts from 1 again (recordSummaryFailure); a success resets all. How many rows.
 */
export async function clearSummaryBackoff(q: Queryable, tenantId: string | null): Promise<number> {
  const r = await q.query(
    `UPDATE summaries SET next_attempt_at = NULL, failed_config = NULL
     WHERE failures > 0 AND ($1::text IS NULL OR tenant_id = $1)`,
    [tenantId],
  );
  return r.rowCount ?? 0;
}

/**
 * Notes a run that failed for the LLM endpoint's reasons (down, failing, slow, or pushing back):
 * `last_error` says why, and nothing else changes: no failure is counted, so an outage stalls no
 * session (workers/summarize.ts backs off the queue instead). A session without a row gets the
 * placeholder (failures 0) so the error is visible. Only while the session is at `generation`.
 */
export async function recordSummaryProviderError(
  q: Queryable,
  a: { tenantId: string; sessionId: string; generation: number; error: string },
): Promise<{ status: string } | null> {
  const r = await q.query<{ status: string }>(
    `INSERT INTO summaries (tenant_id, session_id, summary, cursor_seq, version, status, failures, last_error, updated_at)
     SELECT $1, $2, 'null'::jsonb, 0, 0, 'ok', 0, $3, now()
     WHERE EXISTS (SELECT 1 FROM sessions
                   WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL AND generation = $4)
     ON CONFLICT (tenant_id, session_id) DO UPDATE SET last_error = EXCLUDED.last_error, updated_at = now()
     WHERE EXISTS (SELECT 1 FROM sessions WHERE tenant_id = $1 AND id = $2 AND generation = $4)
     RETURNING status`,
    [a.tenantId, a.sessionId, a.error, a.generation],
  );
  return r.rows[0] ?? null;
}

export interface SummaryCandidate {
  tenant_id: string;
  id: string;
}

/**
 * One keyset page of sessions the sweep should summarise: live, of a tenant not under erasure, not
 * `temp-`, with an archived
 * message past the summary cursor (or no summary yet), and not stalled in back-off unless its
 * failures were under another LLM configuration than `config` (the sweep's). The cheap
 * `next_seq` test filters first; the EXISTS probe on the primary key makes it exact (a reset
 * removes archive rows without lowering next_seq).
 */
export async function pageSummaryCandidates(
  q: Queryable,
  a: { afterTenantId: string; afterSessionId: string; limit: number; config: string },
): Promise<SummaryCandidate[]> {
  const r = await q.query<SummaryCandidate>(
    `SELECT s.tenant_id, s.id
     FROM sessions s
     LEFT JOIN summaries m ON m.tenant_id = s.tenant_id AND m.session_id = s.id
     WHERE (s.tenant_id, s.id) > ($1, $2)
       AND s.deleted_at IS NULL
       AND NOT EXISTS (SELECT 1 FROM tenants t WHERE t.id = s.tenant_id AND t.erasing_at IS NOT NULL)
       AND left(s.id, 5) <> 'temp-'
       AND s.next_seq - 1 > coalesce(m.cursor_seq, 0)
       AND (m.next_attempt_at IS NULL OR m.next_attempt_at <= now() OR m.failed_config IS DISTINCT FROM $4)
       AND EXISTS (SELECT 1 FROM messages x
                   WHERE x.tenant_id = s.tenant_id AND x.session_id = s.id
                     AND x.seq > coalesce(m.cursor_seq, 0))
     ORDER BY s.tenant_id, s.id
     LIMIT $3::int`,
    [a.afterTenantId, a.afterSessionId, a.limit, a.config],
  );
  return r.rows;
}

export async function countStalledSummaries(q: Queryable): Promise<number> {
  const r = await q.query<{ n: number }>(`SELECT count(*)::int AS n FROM summaries WHERE status = 'stalled'`);
  return r.rows[0]?.n ?? 0;
}

/**
 * How long (seconds) the oldest archived message not yet covered by a summary has waited since it
 * was archived (0 when none), over live non-temp sessions: the time the summaries are behind. Not
 * since its `sent_at`, which is the client's: an import of last year's history read as a year of
 * lag. One index probe per session with unsummarised messages: sampled, never computed per scrape.
 */
export async function oldestUnsummarisedAgeSeconds(q: Queryable): Promise<number> {
  const r = await q.query<{ age: number | null }>(
    `SELECT extract(epoch FROM now() - min(first_at)) AS age FROM (
       SELECT (SELECT m.archived_at FROM messages m
               WHERE m.tenant_id = s.tenant_id AND m.session_id = s.id
                 AND m.seq > COALESCE(su.cursor_seq, 0)
               ORDER BY m.seq LIMIT 1) AS first_at
       FROM sessions s
       LEFT JOIN summaries su ON su.tenant_id = s.tenant_id AND su.session_id = s.id
       WHERE s.deleted_at IS NULL AND s.id NOT LIKE 'temp-%'
         AND s.next_seq - 1 > COALESCE(su.cursor_seq, 0)
     ) x`,
  );
  return Math.max(0, Number(r.rows[0]?.age ?? 0));
}
