import type { Queryable } from '../pool.js';
import type { StoredMessageRow } from './messages.js';
import type { FtsLeaf } from '../../services/search/parse-query.js';

/**
 * Search queries over the archive (tier 3: `messages.search_tsv`, GIN `messages_fts`) and the
 * recent index (tier 2: `message_vectors`, exact k-NN over the primary-key btree). Every query is
 * scoped by tenant and session.
 */

/** Builds `$n` placeholders while collecting their values. */
function paramList(initial: unknown[]) {
  const values = [...initial];
  return {
    values,
    add(v: unknown): string {
      values.push(v);
      return `$${values.length}`;
    },
  };
}
type Params = ReturnType<typeof paramList>;

function leafSql(p: Params, leaf: FtsLeaf): string {
  switch (leaf.kind) {
    case 'english-words':
      return `plainto_tsquery('english', ${p.add(leaf.text)})`;
    case 'english-phrase':
      return `phraseto_tsquery('english', ${p.add(leaf.text)})`;
    case 'cjk-phrase':
      return `phraseto_tsquery('simple', ${p.add(leaf.text)})`;
    case 'cjk-prefix':
      return `to_tsquery('simple', ${p.add(leaf.text)})`;
  }
}

/** AND of groups, each an OR of terms, each an AND of leaves. Null when nothing is indexable. */
function tsquerySql(p: Params, groups: FtsLeaf[][][]): string | null {
  const parts = groups
    .map((terms) =>
      terms
        .filter((leaves) => leaves.length > 0)
        .map((leaves) => `(${leaves.map((l) => leafSql(p, l)).join(' && ')})`),
    )
    .filter((alternatives) => alternatives.length > 0)
    .map((alternatives) => `(${alternatives.join(' || ')})`);
  return parts.length === 0 ? null : parts.join(' && ');
}

function substringSql(p: Params, col: string, groups: string[][]): string | null {
  const parts = groups
    .filter((alternatives) => alternatives.length > 0)
    .map((alternatives) => `(${alternatives.map((pat) => `${col} ILIKE ${p.add(pat)}`).join(' OR ')})`);
  return parts.length === 0 ? null : parts.join(' AND ');
}

export interface SearchFilters {
  tenantId: string;
  sessionId: string;
  /** Only messages sent at or after this (unix ns); null = all time. */
  sinceNs: string | null;
  /** Leave out the context window of this many messages (exclude_window); null = keep it. */
  windowSize: number | null;
  /** Excluded terms: a message matching any of them by full text or by substring is dropped. */
  excludeFts: FtsLeaf[][];
  excludeLike: string[];
}

const MAX_SEQ = '9223372036854775807';

/**
 * Up to this many archived messages, a session's full-text match reads the session's rows and
 * tests each tsvector instead of using the GIN index. The GIN index is table-wide: for a common
 * word it returns every match of every session (45k entries at 220k messages, 9–15 ms, growing
 * with the table), while testing 200 rows takes about 0.3 ms (bench/search.ts, docs/search.md).
 * Past the threshold, the planner chooses.
 */
export const SESSION_SCAN_MAX_MESSAGES = 2000;

/**
 * CTE `st`: the session's cutoff (`start_seq`) and, when `windowSize` is given, the first seq of
 * its context window (`window_from`), drawn as the context endpoint draws it
 * (db/queries/context.ts): the last `windowSize` messages of the hot history; when that starts
 * with a tool result, extended back to the nearest earlier non-tool message if it is the
 * assistant message with tool_calls the results answer. No row when the tenant has no such live
 * session, so every query built on it finds nothing for a foreign or missing session.
 */
function stateCte(p: Params, windowSize: number | null): string {
  // Without a window to find, a plain lookup (the window subqueries cost planning time).
  if (windowSize === null) {
    return `st AS (
      SELECT start_seq, NULL::bigint AS window_from, message_count <= ${SESSION_SCAN_MAX_MESSAGES} AS small
      FROM sessions WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL)`;
  }
  const size = p.add(windowSize);
  return `st AS (
    SELECT s.start_seq,
      CASE WHEN head.role = 'tool' AND prev.role = 'assistant' AND prev.tool_calls IS NOT NULL
        THEN prev.seq ELSE head.seq END AS window_from,
      s.message_count <= ${SESSION_SCAN_MAX_MESSAGES} AS small
    FROM sessions s
    LEFT JOIN LATERAL (
      SELECT seq, role FROM (
        SELECT m.seq, m.role FROM messages m
        WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq >= s.start_seq
        ORDER BY m.seq DESC LIMIT ${size}::int) last_n
      ORDER BY seq LIMIT 1) head ON true
    LEFT JOIN LATERAL (
      SELECT x.seq, x.role, x.tool_calls FROM messages x
      WHERE head.role = 'tool' AND x.tenant_id = $1 AND x.session_id = $2 AND x.seq < head.seq
        AND x.seq >= s.start_seq AND x.role <> 'tool'
      ORDER BY x.seq DESC LIMIT 1) prev ON true
    WHERE s.tenant_id = $1 AND s.id = $2 AND s.deleted_at IS NULL)`;
}

/** Shared WHERE clauses (time range on `m`, window, exclusions on `m`); `seqCol` is the seq to bound. */
function filterSql(p: Params, f: SearchFilters, seqCol = 'm.seq'): string {
  const out: string[] = [];
  if (f.sinceNs !== null) out.push(`m.sent_at_ns >= ${p.add(f.sinceNs)}::bigint`);
  // An empty hot history has no window, so nothing is left out.
  if (f.windowSize !== null) out.push(`${seqCol} < coalesce((SELECT window_from FROM st), ${MAX_SEQ})`);
  const excl = tsquerySql(p, [f.excludeFts]);
  if (excl) out.push(`NOT (m.search_tsv @@ (${excl}))`);
  if (f.excludeLike.length > 0)
    out.push(`NOT (coalesce(m.content, '') ILIKE ANY (${p.add(f.excludeLike)}::text[]))`);
  return out.map((c) => ` AND ${c}`).join('');
}

/**
 * The seqs shown around a hit (2 archived messages before it, 1 after, whatever the cutoff),
 * fetched with the candidates to save a round trip. `c.seq` is the candidate.
 */
const AROUND = `ARRAY(
  (SELECT n.seq FROM messages n WHERE n.tenant_id = $1 AND n.session_id = $2 AND n.seq < c.seq
   ORDER BY n.seq DESC LIMIT 2)
  UNION ALL
  (SELECT n.seq FROM messages n WHERE n.tenant_id = $1 AND n.session_id = $2 AND n.seq > c.seq
   ORDER BY n.seq ASC LIMIT 1))`;

export interface KeywordCandidate {
  seq: number;
  /** ts_rank_cd normalised to 0..1 (0 when only the substring matched). */
  rank: number;
  byFts: boolean;
  bySubstring: boolean;
  /** Neighbour seqs for the context (unordered). */
  around: number[];
}

/**
 * Full text over the session's whole archive plus a substring match over its recent part
 * (seq >= start_seq), each limited to `k`, merged by seq. The tsquery is inlined (not in a CTE)
 * so that the planner sees its constant value and can estimate its selectivity. The full-text
 * part has two branches of which only one runs (one-time filters on `st.small`): for a small
 * session `coalesce(search_tsv, …)`, which the GIN index cannot serve, so the session's rows are
 * read through its btree and tested; for a big one the indexable form (see
 * SESSION_SCAN_MAX_MESSAGES).
 */
export async function keywordCandidates(
  q: Queryable,
  a: SearchFilters & { fts: FtsLeaf[][][]; like: string[][]; k: number },
): Promise<KeywordCandidate[]> {
  const p = paramList([a.tenantId, a.sessionId, a.k]);
  const st = stateCte(p, a.windowSize);
  const tsq = tsquerySql(p, a.fts);
  const like = substringSql(p, `coalesce(m.content, '')`, a.like);
  if (!tsq && !like) return [];
  const filters = filterSql(p, a);
  const branch = (small: boolean) =>
    `SELECT m.seq, ts_rank_cd(m.search_tsv, ${tsq}, 32) AS rank FROM messages m
     WHERE m.tenant_id = $1 AND m.session_id = $2 AND ${small ? '' : 'NOT '}(SELECT small FROM st)
       AND ${small ? `coalesce(m.search_tsv, ''::tsvector)` : 'm.search_tsv'} @@ (${tsq})${filters}`;
  const fts = tsq
    ? `(${branch(true)}) UNION ALL (${branch(false)}) ORDER BY rank DESC, seq DESC LIMIT $3`
    : `SELECT NULL::bigint AS seq, NULL::real AS rank WHERE false`;
  const sub = like
    ? `SELECT m.seq FROM messages m
       WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq >= (SELECT start_seq FROM st)
         AND ${like}${filters}
       ORDER BY m.seq DESC LIMIT $3`
    : `SELECT NULL::bigint AS seq WHERE false`;
  const r = await q.query<{
    seq: string;
    rank: number | null;
    by_fts: boolean;
    by_substring: boolean;
    around: string[];
  }>(
    `WITH ${st}, fts AS (${fts}), sub AS (${sub}),
     cand AS (
       SELECT seq, f.rank, f.seq IS NOT NULL AS by_fts, s.seq IS NOT NULL AS by_substring
       FROM fts f FULL JOIN sub s USING (seq))
     SELECT c.seq, c.rank, c.by_fts, c.by_substring, ${AROUND} AS around FROM cand c`,
    p.values,
  );
  return r.rows.map((row) => ({
    seq: Number(row.seq),
    rank: row.rank ?? 0,
    byFts: row.by_fts,
    bySubstring: row.by_substring,
    around: row.around.map(Number),
  }));
}

export interface SemanticCandidate {
  seq: number;
  /** 1 - cosine distance. */
  score: number;
  around: number[];
}

/**
 * Exact k-NN over the session's recent vectors. The session's rows are found through the primary
 * key (tenant_id, session_id, seq) and sorted by distance: no ANN index, so no recall loss and no
 * planner trap (FACTS.md). The archive row is joined only when a filter needs it.
 */
export async function semanticCandidates(
  q: Queryable,
  a: SearchFilters & { embedding: number[]; k: number },
): Promise<SemanticCandidate[]> {
  const p = paramList([a.tenantId, a.sessionId, JSON.stringify(a.embedding), a.k]);
  const st = stateCte(p, a.windowSize);
  const needsArchive = a.sinceNs !== null || a.excludeFts.length > 0 || a.excludeLike.length > 0;
  // Without the join, the window bound is the only filter left, and it applies to v.seq.
  const where = filterSql(p, a, 'v.seq');
  const join = needsArchive
    ? `JOIN messages m ON m.tenant_id = v.tenant_id AND m.session_id = v.session_id AND m.seq = v.seq`
    : '';
  const r = await q.query<{ seq: string; score: number; around: string[] }>(
    `WITH ${st}, c AS (
       SELECT v.seq, 1 - (v.embedding <=> $3::vector) AS score
       FROM message_vectors v ${join}
       WHERE v.tenant_id = $1 AND v.session_id = $2 AND v.seq >= (SELECT start_seq FROM st)${where}
       ORDER BY v.embedding <=> $3::vector, v.seq DESC LIMIT $4)
     SELECT c.seq, c.score, ${AROUND} AS around FROM c`,
    p.values,
  );
  return r.rows.map((row) => ({
    seq: Number(row.seq),
    score: Number(row.score),
    around: row.around.map(Number),
  }));
}

const MSG_COLS =
  'seq, id, role, content, parts, name, tool_call_id, tool_calls, metadata, sent_at_ns, fingerprint';

/** Archived messages by seq (any order; missing seqs are simply absent). */
export async function messagesBySeqs(
  q: Queryable,
  tenantId: string,
  sessionId: string,
  seqs: number[],
): Promise<StoredMessageRow[]> {
  if (seqs.length === 0) return [];
  const r = await q.query<StoredMessageRow>(
    `SELECT ${MSG_COLS} FROM messages WHERE tenant_id = $1 AND session_id = $2 AND seq = ANY($3::bigint[])`,
    [tenantId, sessionId, seqs],
  );
  return r.rows;
}
