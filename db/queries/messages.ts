import type { Queryable } from '../pool.js';
import { archivedSetSql, recordArchived } from './sessions.js';
import { FTS_EN_SAFE } from '../../services/text/fts-text.js';

export interface ArchiveInsertRow {
  seq: number;
  id: string;
  role: string;
  content: string | null;
  parts: unknown[] | null;
  name: string | null;
  tool_call_id: string | null;
  tool_calls: unknown[] | null;
  metadata: Record<string, unknown> | null;
  sent_at_ns: string;
  sent_at_given: boolean;
  bytes: number;
  fingerprint: string;
  /** The English full-text input; null when it is `content` itself. */
  fts_en: string | null;
  /** The CJK bigrams; null when there are none. */
  fts_cjk: string | null;
}

/**
 * The stored tsvector of a row `x` of insertArchiveBatch's input (see there). An English input of
 * more than FTS_EN_SAFE bytes goes through `mnemos_archive_tsvector` (migration 011), which indexes
 * the first FTS_EN_SAFE characters instead when the whole would exceed Postgres's 1 MB of lexemes;
 * `octet_length` is known without reading the text, and bytes bound characters.
 */
export const ARCHIVE_TSVECTOR_SQL = `CASE
         WHEN octet_length(coalesce(x.fts_en, x.content)) > ${FTS_EN_SAFE}
           THEN mnemos_archive_tsvector(coalesce(x.fts_en, x.content), x.fts_cjk)
         WHEN x.fts_cjk IS NULL THEN to_tsvector('english', coalesce(x.fts_en, x.content))
         ELSE to_tsvector('english', coalesce(x.fts_en, x.content)) || x.fts_cjk::tsvector END`;

/** insertArchiveBatch's statement without its RETURNING: $1 tenant, $2 session, $3 the rows. */
const INSERT_ARCHIVE_SQL = `INSERT INTO messages (tenant_id, session_id, seq, id, role, content, parts, name, tool_call_id,
       tool_calls, metadata, sent_at_ns, sent_at_given, bytes, fingerprint, search_tsv)
     SELECT $1, $2, x.seq, x.id, x.role, x.content, x.parts, x.name, x.tool_call_id, x.tool_calls,
       x.metadata, x.sent_at_ns, x.sent_at_given, x.bytes, x.fingerprint,
       ${ARCHIVE_TSVECTOR_SQL}
     FROM jsonb_to_recordset($3::jsonb) AS x(seq bigint, id text, role text, content text, parts jsonb,
       name text, tool_call_id text, tool_calls jsonb, metadata jsonb, sent_at_ns bigint,
       sent_at_given boolean, bytes integer, fingerprint text, fts_en text, fts_cjk text)
     ORDER BY x.seq
     ON CONFLICT DO NOTHING`;

/**
 * Archives a batch in one statement. `on conflict do nothing` makes a replayed drain a no-op
 * (the primary key on seq and the unique client id are the last guard of exactly-once). The
 * tsvector is `to_tsvector('english', fts_en) || fts_cjk::tsvector` (fts-text.ts). Sending the
 * content once where it is the English input (fts_en null) and leaving out an empty CJK half give
 * the same tsvector for ~6 % less Postgres CPU per row (bench corpus, 40,000 rows compared: none
 * differed).
 */
export async function insertArchiveBatch(
  q: Queryable,
  tenantId: string,
  sessionId: string,
  rows: ArchiveInsertRow[],
): Promise<Array<{ seq: string; bytes: number; sent_at_ns: string }>> {
  const r = await q.query<{ seq: string; bytes: number; sent_at_ns: string }>(
    `${INSERT_ARCHIVE_SQL}
     RETURNING seq, bytes, sent_at_ns`,
    [tenantId, sessionId, JSON.stringify(rows)],
  );
  return r.rows;
}

/**
 * A drain's batch in one statement: insertArchiveBatch's insert, and recordArchived's update of
 * the session row from what the insert returned (a data-modifying CTE; the update does not read
 * `messages`, so it needs nothing of the insert but its RETURNING). Two statements were two
 * round trips with the session's row lock held. A batch without rows to insert (replays and
 * cleared entries only) updates the row alone, and never waits for the `messages` table.
 */
export async function archiveBatch(
  q: Queryable,
  a: { tenantId: string; sessionId: string; nextSeq: number; rows: ArchiveInsertRow[] },
): Promise<{ archived: number; hot_bytes: string }> {
  if (a.rows.length === 0) {
    const counters = await recordArchived(q, { ...a, count: 0, bytes: 0, lastSentNs: null });
    return { archived: 0, hot_bytes: counters.hot_bytes };
  }
  const r = await q.query<{ archived: number; hot_bytes: string }>(
    `WITH ins AS (${INSERT_ARCHIVE_SQL}
       RETURNING bytes, sent_at_ns),
     n AS (SELECT count(*)::int AS count, coalesce(sum(bytes), 0)::bigint AS bytes,
             max(sent_at_ns) AS last_ns FROM ins)
     UPDATE sessions SET
       ${archivedSetSql('$4::bigint', 'n.count', 'n.bytes', 'n.last_ns')}
     FROM n
     WHERE tenant_id = $1 AND id = $2
     RETURNING n.count AS archived, hot_bytes`,
    [a.tenantId, a.sessionId, JSON.stringify(a.rows), a.nextSeq],
  );
  return r.rows[0]!;
}

export interface StoredMessageRow {
  seq: string;
  id: string;
  role: string;
  content: string | null;
  parts: unknown[] | null;
  name: string | null;
  tool_call_id: string | null;
  tool_calls: unknown[] | null;
  metadata: Record<string, unknown> | null;
  sent_at_ns: string;
  fingerprint: string;
}

const MSG_COLS =
  'seq, id, role, content, parts, name, tool_call_id, tool_calls, metadata, sent_at_ns, fingerprint';

/** The session row as an accept reads it (acceptLookup); all 0/false for a session not known. */
export interface AcceptSessionState {
  /** The highest seq the archive has numbered (`next_seq - 1`). */
  archivedTop: number;
  /**
   * The session's generation, which Redis must hold before anything is accepted: behind it (a
   * reset or delete whose Redis step has not run yet, or that Redis lost), its state still holds
   * the cleared history's ids and lacks the delete's mark.
   */
  generation: number;
  clearedThrough: number;
  deleted: boolean;
}

const ACCEPT_SESSION_COLS = `s.next_seq, s.generation, s.cleared_through_seq,
  s.deleted_at IS NOT NULL AS deleted`;

type AcceptSessionRow = {
  next_seq: string;
  generation: number;
  cleared_through_seq: string;
  deleted: boolean;
};

/** What an accept knows without a session row (one not yet created, or Postgres down). */
export const NO_SESSION_STATE: AcceptSessionState = {
  archivedTop: 0,
  generation: 0,
  clearedThrough: 0,
  deleted: false,
};

const acceptState = (row: AcceptSessionRow | undefined): AcceptSessionState =>
  row
    ? {
        archivedTop: Number(row.next_seq) - 1,
        generation: Number(row.generation),
        clearedThrough: Number(row.cleared_through_seq),
        deleted: row.deleted,
      }
    : NO_SESSION_STATE;

/**
 * What an accept reads from Postgres, in one statement: the archived messages with these client
 * ids, and the session's row (its counter, generation, clear and delete), which Redis's state
 * must not be behind. Without ids it reads the session row only: an accept of messages without
 * ids never waits for the `messages` table (a migration or a maintenance task may hold it).
 */
export async function acceptLookup(
  q: Queryable,
  tenantId: string,
  sessionId: string,
  ids: string[],
): Promise<{ rows: StoredMessageRow[]; session: AcceptSessionState }> {
  if (ids.length === 0) {
    const r = await q.query<AcceptSessionRow>(
      `SELECT ${ACCEPT_SESSION_COLS} FROM sessions s WHERE s.tenant_id = $1 AND s.id = $2`,
      [tenantId, sessionId],
    );
    return { rows: [], session: acceptState(r.rows[0]) };
  }
  const r = await q.query<StoredMessageRow & AcceptSessionRow & { seq: string | null }>(
    `SELECT ${ACCEPT_SESSION_COLS}, ${MSG_COLS.split(', ')
      .map((c) => `m.${c}`)
      .join(', ')}
       FROM sessions s
       LEFT JOIN messages m
         ON m.tenant_id = s.tenant_id AND m.session_id = s.id AND m.id = ANY($3::text[])
      WHERE s.tenant_id = $1 AND s.id = $2`,
    [tenantId, sessionId, ids],
  );
  return { rows: r.rows.filter((row) => row.seq !== null), session: acceptState(r.rows[0]) };
}

/** A page of the archive in seq order; both bounds exclusive. */
export async function pageMessages(
  q: Queryable,
  a: {
    tenantId: string;
    sessionId: string;
    afterSeq: number | null;
    beforeSeq: number | null;
    limit: number;
    desc: boolean;
  },
): Promise<StoredMessageRow[]> {
  const r = await q.query<StoredMessageRow>(
    `SELECT ${MSG_COLS} FROM messages
     WHERE tenant_id = $1 AND session_id = $2
       AND ($3::bigint IS NULL OR seq > $3) AND ($4::bigint IS NULL OR seq < $4)
     ORDER BY seq ${a.desc ? 'DESC' : 'ASC'} LIMIT $5`,
    [a.tenantId, a.sessionId, a.afterSeq, a.beforeSeq, a.limit],
  );
  return r.rows;
}

/**
 * The most a page of messages (the listing, the agent tools) or a context window carries, in the
 * messages' stored `bytes`, which is about their JSON's length: at least one message, then as
 * many as fit. 500 messages of 1 MiB of control characters (6 MiB each as JSON) were one 3 GB
 * string that Node cannot make (a 500; a context window of 95 of them, aggregated in SQL, was a
 * row the driver could not read, and the process died).
 */
export const PAGE_MAX_BYTES = 32 * 1024 * 1024;

/**
 * pageMessagesWithin's page as SQL (`p`: the rows within the limit, `w`: those within the bytes, with
 * `fetched` the count of `p`); $1 tenant, $2 session, $3 after, $4 before, $5 limit, $6 bytes.
 */
const pageWithinCtes = (dir: 'ASC' | 'DESC') => `p AS (
       SELECT ${MSG_COLS}, sum(bytes) OVER (ORDER BY seq ${dir}) - bytes AS bytes_before FROM messages
       WHERE tenant_id = $1 AND session_id = $2
         AND ($3::bigint IS NULL OR seq > $3) AND ($4::bigint IS NULL OR seq < $4)
       ORDER BY seq ${dir} LIMIT $5),
     w AS (SELECT ${MSG_COLS}, (SELECT count(*) FROM p)::int AS fetched FROM p WHERE bytes_before < $6)`;

/**
 * pageMessages under `maxBytes` (PAGE_MAX_BYTES by default): `cut` says that messages within the
 * page's limit were left out for their size (the caller then offers the next page).
 */
export async function pageMessagesWithin(
  q: Queryable,
  a: Parameters<typeof pageMessages>[1] & { maxBytes?: number },
): Promise<{ rows: StoredMessageRow[]; cut: boolean }> {
  const dir = a.desc ? 'DESC' : 'ASC';
  const r = await q.query<StoredMessageRow & { fetched: number }>(
    `WITH ${pageWithinCtes(dir)} SELECT * FROM w ORDER BY seq ${dir}`,
    [a.tenantId, a.sessionId, a.afterSeq, a.beforeSeq, a.limit, a.maxBytes ?? PAGE_MAX_BYTES],
  );
  const fetched = r.rows[0]?.fetched ?? 0;
  return { rows: r.rows.map(({ fetched: _, ...row }) => row), cut: fetched > r.rows.length };
}

/**
 * The listing's page (pageMessagesWithin) with the live session's generation, read by the same
 * statement, so by one snapshot: a reset or delete commits either before both or after both, and
 * the generation a page carries is the one its rows belong to. Null when the session does not
 * exist or is deleted.
 */
export async function pageSessionMessages(
  q: Queryable,
  a: Parameters<typeof pageMessages>[1],
): Promise<{ generation: number; rows: StoredMessageRow[]; cut: boolean } | null> {
  const dir = a.desc ? 'DESC' : 'ASC';
  // The session's one row joined to the page's rows, or to one row of nulls for an empty page.
  const r = await q.query<
    Omit<StoredMessageRow, 'seq'> & { seq: string | null; generation: number; fetched: number | null }
  >(
    `WITH s AS (SELECT generation FROM sessions WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL),
     ${pageWithinCtes(dir)}
     SELECT s.generation, w.* FROM s LEFT JOIN w ON true ORDER BY w.seq ${dir}`,
    [a.tenantId, a.sessionId, a.afterSeq, a.beforeSeq, a.limit, PAGE_MAX_BYTES],
  );
  const first = r.rows[0];
  if (!first) return null;
  const rows = r.rows
    .filter((row) => row.seq !== null)
    .map(({ generation: _, fetched: __, ...row }) => row as StoredMessageRow);
  return { generation: first.generation, rows, cut: (first.fetched ?? 0) > rows.length };
}

export async function maxArchivedSeq(q: Queryable, tenantId: string, sessionId: string): Promise<number> {
  const r = await q.query<{ m: string | null }>(
    'SELECT max(seq) AS m FROM messages WHERE tenant_id = $1 AND session_id = $2',
    [tenantId, sessionId],
  );
  return Number(r.rows[0]?.m ?? 0);
}

/** The fingerprints of those of `ids` the session's archive holds, by id. */
export async function archivedFingerprints(
  q: Queryable,
  tenantId: string,
  sessionId: string,
  ids: string[],
): Promise<Map<string, string>> {
  const r = await q.query<{ id: string; fingerprint: string }>(
    'SELECT id, fingerprint FROM messages WHERE tenant_id = $1 AND session_id = $2 AND id = ANY($3::text[])',
    [tenantId, sessionId, ids],
  );
  return new Map(r.rows.map((row) => [row.id, row.fingerprint]));
}
