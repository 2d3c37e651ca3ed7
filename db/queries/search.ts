import { createHash } from 'node:crypto';
import { vectorParam } from '../pool.js';
import type { Queryable } from '../pool.js';
import type { StoredMessageRow } from './messages.js';
import type { FtsLeaf } from '../../services/search/parse-query.js';
import type { OwnIndexes } from '../../services/search/indexed-sessions.js';
import { FULL_TEXT_TIER, RRF_K, SUBSTRING_BONUS } from '../../services/search/rank-hits.js';

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

/** Per leaf kind, its tsquery from the SQL expression of its text. */
const LEAF_QUERY: Record<FtsLeaf['kind'], (text: string) => string> = {
  'english-words': (text) => `plainto_tsquery('english', ${text})`,
  'english-phrase': (text) => `phraseto_tsquery('english', ${text})`,
  // tsquery text built by parse-query.ts, as the archive's CJK lexemes are tsvector text.
  'cjk-phrase': (text) => `(${text})::tsquery`,
  'cjk-prefix': (text) => `(${text})::tsquery`,
};

/** The tsquery of a leaf of kind `kind` whose text is the SQL expression `text`. */
export const leafQuerySql = (kind: FtsLeaf['kind'], text: string): string => LEAF_QUERY[kind](text);

const leafSql = (p: Params, leaf: FtsLeaf): string => leafQuerySql(leaf.kind, p.add(leaf.text));

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

/** Whether case folding can change what `text` matches: some character has another case. */
function hasCase(text: string): boolean {
  return text.toLowerCase() !== text || text.toUpperCase() !== text;
}

/**
 * The operator of a substring test: a LIKE pattern (`%…%`) with LIKE or ILIKE, a whole-word regular
 * expression (`\m…\M`, parse-query.ts wordRegex) with `~` or, for a letter, `~*`.
 */
const likeOp = (pat: string): LikeTest['op'] =>
  pat.startsWith('%') ? (hasCase(pat) ? 'ILIKE' : 'LIKE') : hasCase(pat.slice(2, -2)) ? '~*' : '~';

/**
 * The order in which a row's text is tested: Postgres tests the clauses of an AND or an OR as
 * written (they cost the same to the planner) and stops at the first that decides. LIKE compares
 * bytes; ILIKE first lowercases the row's whole text, about ten times the work. So LIKE goes first,
 * and among patterns of one operator the longer, usually the rarer (an AND stops at its first
 * miss). Rechecking the 1,742 rows a trigram index gave for `certificate 錯誤` on the bench's
 * 20,000-message session: 7.4–12 ms with the ILIKE first, 3.3–3.7 ms with the LIKE first.
 */
type LikeTest = { pat: string; op: 'LIKE' | 'ILIKE' | '~' | '~*' };
const testCost = (t: LikeTest) => (t.op === 'LIKE' ? 0 : 1);
const orderedPatterns = (alternatives: LikeTest[]): LikeTest[] =>
  [...alternatives].sort((a, b) => testCost(a) - testCost(b) || b.pat.length - a.pat.length);
/** Groups (ORs, each ordered as above): those of LIKE tests only first, then the longer patterns. */
const byCheapFirst = (a: LikeTest[], b: LikeTest[]) =>
  Math.max(...a.map(testCost)) - Math.max(...b.map(testCost)) ||
  Math.min(...b.map((t) => t.pat.length)) - Math.min(...a.map((t) => t.pat.length));

/**
 * AND of groups, each an OR of LIKE patterns, as a function of the column to match: the patterns
 * become parameters once, however many expressions use them; null when there is no pattern. A
 * pattern without cased characters (CJK, digits, punctuation) is matched with LIKE: ILIKE would
 * give the same rows, but in a UTF-8 database it lowercases every row's text first, which made a
 * 2-character CJK substring over a 20,000-message session cost ~2.5 µs per row (EXPLAIN ANALYZE
 * on the bench corpus).
 */
function substringSql(p: Params, groups: string[][]): ((col: string) => string) | null {
  const terms = groups
    .filter((alternatives) => alternatives.length > 0)
    .map((alternatives) => orderedPatterns(alternatives.map((pat) => ({ pat, op: likeOp(pat) }))))
    .sort(byCheapFirst)
    .map((alternatives) => alternatives.map(({ op, pat }) => ({ op, param: p.add(pat) })));
  if (terms.length === 0) return null;
  return (col) =>
    terms.map((alts) => `(${alts.map((t) => `${col} ${t.op} ${t.param}`).join(' OR ')})`).join(' AND ');
}

export interface SearchFilters {
  tenantId: string;
  sessionId: string;
  /** Only messages sent at or after this (unix ns); null = all time. */
  sinceNs: string | null;
  /**
   * The context window to leave out (exclude_window): the last `size` messages, drawn as the
   * context endpoint draws them, or every message from `fromSeq` on (the `window.from_seq` the
   * agent's context answer gave); null = keep it.
   */
  window: { size: number } | { fromSeq: number } | null;
  /** Excluded terms: a message matching any of them by full text or by substring is dropped. */
  excludeFts: FtsLeaf[][];
  excludeLike: string[];
  /** Excluded terms of one letter or digit, as whole-word regular expressions (wordRegex). */
  excludeWords: string[];
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
 * The substring match first reads this many of the newest rows (keywordCtes): enough to find the
 * newest 32 matches of a pattern in 1 row of 16 (~1 ms for the whole window when it is rarer).
 */
const SUBSTRING_SCAN_ROWS = 500;

/**
 * CTE `st`: the session's cutoff (`start_seq`) and, when a window is given, the first seq of its
 * context window (`window_from`): the caller's `fromSeq`, or drawn as the context endpoint draws
 * it (db/queries/context.ts): the last `size` messages of the hot history; when that starts
 * with a tool result, extended back to the nearest earlier non-tool message if it is the
 * assistant message with tool_calls the results answer. No row when the tenant has no such live
 * session, so every query built on it finds nothing for a foreign or missing session.
 */
function stateCte(p: Params, window: SearchFilters['window']): string {
  // Without a window to find, a plain lookup (the window subqueries cost planning time).
  if (window === null || 'fromSeq' in window) {
    const from = window === null ? 'NULL' : p.add(window.fromSeq);
    return `st AS (
      SELECT start_seq, ${from}::bigint AS window_from, message_count <= ${SESSION_SCAN_MAX_MESSAGES} AS small,
        greatest(start_seq, next_seq - ${SUBSTRING_SCAN_ROWS}) AS scan_from
      FROM sessions WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL)`;
  }
  const size = p.add(window.size);
  return `st AS (
    SELECT s.start_seq,
      CASE WHEN head.role = 'tool' AND prev.role = 'assistant' AND prev.tool_calls IS NOT NULL
        THEN prev.seq ELSE head.seq END AS window_from,
      s.message_count <= ${SESSION_SCAN_MAX_MESSAGES} AS small,
      greatest(s.start_seq, s.next_seq - ${SUBSTRING_SCAN_ROWS}) AS scan_from
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

const hasExclusions = (f: SearchFilters) =>
  f.excludeFts.length > 0 || f.excludeLike.length > 0 || f.excludeWords.length > 0;

/**
 * CTE `ex`, present when there are excluded terms: `fts`, one tsquery per excluded term (the AND
 * of its leaves, each built as `leafQuerySql` builds it), and `likes`, the substring patterns. The
 * terms travel as three parallel arrays, so the statement's text is the same whatever the number
 * and kind of excluded terms, and a semantic search with exclusions can be prepared once
 * (services/search/search-session.ts). A leaf without a lexeme (stop words only) is left out, as
 * `&&` and `||` leave out an empty tsquery; a term with no other leaf excludes nothing.
 */
function exclusionCte(p: Params, f: SearchFilters): string {
  const kinds: string[] = [];
  const texts: string[] = [];
  const terms: number[] = [];
  f.excludeFts.forEach((leaves, term) => {
    for (const leaf of leaves) {
      kinds.push(leaf.kind);
      texts.push(leaf.text);
      terms.push(term);
    }
  });
  const leaf = `CASE l.kind ${Object.entries(LEAF_QUERY)
    .map(([kind, query]) => `WHEN '${kind}' THEN ${query('l.text')}`)
    .join(' ')} END`;
  return `ex AS (
    SELECT coalesce(array_agg(t.q), '{}') AS fts, ${p.add(f.excludeLike)}::text[] AS likes,
      ${p.add(f.excludeWords)}::text[] AS words
    FROM (
      SELECT string_agg('(' || l.q::text || ')', ' & ')::tsquery AS q
      FROM (SELECT l.term, ${leaf} AS q
            FROM unnest(${p.add(kinds)}::text[], ${p.add(texts)}::text[], ${p.add(terms)}::int[])
              AS l(kind, text, term)) l
      WHERE numnode(l.q) > 0
      GROUP BY l.term) t)`;
}

/** Shared WHERE clauses (time range on `m`, window, exclusions on `m`); `seqCol` is the seq to bound. */
function filterSql(p: Params, f: SearchFilters, seqCol = 'm.seq'): string {
  const out: string[] = [];
  if (f.sinceNs !== null) out.push(`m.sent_at_ns >= ${p.add(f.sinceNs)}::bigint`);
  // An empty hot history has no window, so nothing is left out.
  if (f.window !== null) out.push(`${seqCol} < coalesce((SELECT window_from FROM st), ${MAX_SEQ})`);
  if (hasExclusions(f)) {
    out.push(`NOT (m.search_tsv @@ ANY ((SELECT fts FROM ex)::tsquery[]))`);
    out.push(`NOT (coalesce(m.content, '') ILIKE ANY ((SELECT likes FROM ex)::text[]))`);
    out.push(`NOT (coalesce(m.content, '') ~* ANY ((SELECT words FROM ex)::text[]))`);
  }
  return out.map((c) => ` AND ${c}`).join('');
}

/**
 * The last step of a search statement: `selectHits` in SQL (migration 009's `mnemos_search_walk`)
 * over `order`, an SQL array of candidate seqs in rank order. It returns `around`, the hits with
 * their neighbours, and `rows`, the archived rows of what it shows (hits and contexts), leaving out
 * `have`, an SQL array of the rows the caller already holds. A function, so that its plan is made
 * once per connection; planning it inside each keyword or hybrid statement cost 0.23–0.46 ms.
 */
const walkCall = (order: string, limit: string, have = `'{}'::bigint[]`) =>
  `mnemos_search_walk($1, $2, ${order}, ${limit}::int, ${have})`;

/** A row of the walk's `rows`, in the column order of migration 009. */
type JsonRow = [
  number,
  string,
  string,
  string | null,
  unknown[] | null,
  string | null,
  string | null,
  unknown[] | null,
  Record<string, unknown> | null,
  string,
  string,
];

interface WalkResult {
  around: Array<[number, number[]]> | null;
  rows: JsonRow[] | null;
}

function readWalk(r: WalkResult): { around: Map<number, number[]>; rows: StoredMessageRow[] } {
  return {
    around: new Map(r.around ?? []),
    rows: (r.rows ?? []).map(
      ([seq, id, role, content, parts, name, toolCallId, toolCalls, metadata, sentAtNs, fingerprint]) => ({
        seq: String(seq),
        id,
        role,
        content,
        parts,
        name,
        tool_call_id: toolCallId,
        tool_calls: toolCalls,
        metadata,
        sent_at_ns: sentAtNs,
        fingerprint,
      }),
    ),
  };
}

type KeywordJson = Array<[number, number | null, boolean, boolean]>;
/** A NaN score would come as the JSON string "NaN" (semanticCte leaves NaN out). */
type SemanticJson = Array<[number, number | string]>;

const EMPTY_KC = `kc AS (SELECT NULL::bigint AS seq, NULL::real AS rank, false AS by_fts, false AS by_substring WHERE false)`;
/** Semantic candidates must score above this (cosine similarity). */
export const MIN_SEMANTIC_SCORE = 0;

const EMPTY_SC = `sc AS (SELECT NULL::bigint AS seq, NULL::float8 AS score WHERE false)`;

export interface KeywordCandidate {
  seq: number;
  /** ts_rank_cd normalised to 0..1 (0 when only the substring matched). */
  rank: number;
  byFts: boolean;
  bySubstring: boolean;
}

export interface SemanticCandidate {
  seq: number;
  /** 1 - cosine distance. */
  score: number;
}

export interface SearchArgs extends SearchFilters {
  /**
   * The keyword matchers (full text, substring); null for no keyword list. `blind`: the groups
   * (ORs of LIKE patterns) of terms full text cannot see (no letter or digit: emoji, symbols),
   * which its matches must contain too, since the words are ANDed.
   */
  keyword: { fts: FtsLeaf[][][]; like: string[][]; blind?: string[][] } | null;
  /** The query embedding; null for no semantic list. */
  embedding: number[] | null;
  /** Candidates per list. */
  k: number;
  /** Hits wanted: where the statement's own walk stops. */
  limit: number;
  /** Which order the walk follows: each mode's ranking in rank-hits.ts. */
  match: 'keyword' | 'semantic' | 'hybrid';
  /**
   * The kinds of index the session may have of its own (services/search/indexed-sessions.ts; none
   * when left out). With `search` indexes its substring match looks at the newest rows first
   * (keywordCtes); with an `ann` index its filtered k-NN joins below the ordered scan (semanticCte).
   */
  ownIndexes?: OwnIndexes;
}

export interface SearchPrefetch {
  /** False when the tenant has no such live session (nothing else is then returned). */
  found: boolean;
  keyword: KeywordCandidate[];
  semantic: SemanticCandidate[];
  /** Neighbour seqs (unordered) of the hits of the statement's walk. */
  around: Map<number, number[]>;
  /** Archived rows of those hits and of their neighbours. */
  rows: StoredMessageRow[];
}

/**
 * The keyword list: full text over the session's whole archive plus a substring match over its
 * recent part (seq >= start_seq), each limited to `k`, merged by seq. The tsquery is inlined (not
 * in a CTE) so that the planner sees its constant value and can estimate its selectivity. The
 * full-text part has two branches of which only one runs (one-time filters on `st.small`): for a
 * small session `coalesce(search_tsv, …)`, which the GIN index cannot serve, so the session's rows
 * are read through its btree and tested; for a big one the indexable form (see
 * SESSION_SCAN_MAX_MESSAGES). CTEs `fts`, `sub`, `kc`; null when no term is usable.
 */
function keywordCtes(
  p: Params,
  a: SearchFilters,
  m: NonNullable<SearchArgs['keyword']>,
  k: () => string,
  ownSearchIndexes: boolean,
) {
  const tsq = tsquerySql(p, m.fts);
  const likeOn = substringSql(p, m.like);
  const like = likeOn?.(`coalesce(m.content, '')`);
  if (!tsq && !like) return null;
  const filters = filterSql(p, a);
  const blindOn = tsq && m.blind ? substringSql(p, m.blind) : null;
  const blind = blindOn ? ` AND ${blindOn(`coalesce(m.content, '')`)}` : '';
  const branch = (small: boolean) =>
    `SELECT m.seq, ts_rank_cd(m.search_tsv, ${tsq}, 32) AS rank FROM messages m
     WHERE m.tenant_id = $1 AND m.session_id = $2 AND ${small ? '' : 'NOT '}(SELECT small FROM st)
       AND ${small ? `coalesce(m.search_tsv, ''::tsvector)` : 'm.search_tsv'} @@ (${tsq})${blind}${filters}`;
  const fts = tsq
    ? `(${branch(true)}) UNION ALL (${branch(false)}) ORDER BY rank DESC, seq DESC LIMIT ${k()}`
    : `SELECT NULL::bigint AS seq, NULL::real AS rank WHERE false`;
  // The substring list is the newest k matches of the recent part. One scan backwards through the
  // primary key finds them and stops at k, unless the session has a trigram index of its own: the
  // planner then reads them through it, and its bitmap returns every match of the session, each
  // rechecked, before the newest k can be picked (1,519 rows for a common phrase: 10 ms). So such
  // a session's newest SUBSTRING_SCAN_ROWS rows are read backwards first; only if fewer than k
  // match there does the whole recent part run through the index (one-time filters). The newest
  // rows are matched on `(m.content || '')`: the same rows as the index's `coalesce(m.content,
  // '')` for a non-empty pattern, but an expression the index cannot serve and without statistics
  // (on `m.content` itself the planner tested the patterns against its histogram: +3 ms of
  // planning). A two-sided seq range for the older rows was estimated at 0.5 % of the rows and
  // scanned backwards through the key instead of the index.
  const whole = (extra: string) =>
    `SELECT m.seq FROM messages m
     WHERE m.tenant_id = $1 AND m.session_id = $2${extra} AND m.seq >= (SELECT start_seq FROM st)
       AND ${like}${filters}
     ORDER BY m.seq DESC LIMIT ${k()}`;
  const sub = !likeOn
    ? `sub AS (SELECT NULL::bigint AS seq WHERE false)`
    : !ownSearchIndexes
      ? `sub AS (${whole('')})`
      : `newest AS (
           SELECT m.seq FROM messages m
           WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq >= (SELECT scan_from FROM st)
             AND ${likeOn(`(m.content || '')`)}${filters}
           ORDER BY m.seq DESC LIMIT ${k()}),
         newest_done AS (
           SELECT (SELECT count(*) FROM newest) >= ${k()} OR scan_from <= start_seq AS done FROM st),
         sub AS (
           SELECT seq FROM newest WHERE (SELECT done FROM newest_done)
           UNION ALL
           (${whole(' AND NOT (SELECT done FROM newest_done)')}))`;
  return `fts AS (${fts}), ${sub},
    kc AS (
      SELECT seq, f.rank, f.seq IS NOT NULL AS by_fts, s.seq IS NOT NULL AS by_substring
      FROM fts f FULL JOIN sub s USING (seq))`;
}

/**
 * The semantic list: k-NN over the session's recent vectors. Usually exact: the session's rows
 * are found through the primary key (tenant_id, session_id, seq) and sorted by distance. A huge
 * session may have its own partial HNSW index (services/recent-index/ann-indexes.ts), which the
 * planner takes only if the ORDER BY is that index's expression, `embedding::vector(D)`, and
 * nothing else: so the distance is computed on the cast (free for the exact path), and only the
 * exact path breaks ties here (newer first). The archive row is joined only when a filter needs
 * it (`time_range`, exclusions). CTE `sc`.
 *
 * With such a filter, the exact path sorts first and joins after (`sortFirst`, for sessions
 * without an HNSW index of their own): the join and its filters then stop once k rows pass,
 * instead of running for every recent vector before the sort (a 20,000-vector session's
 * candidates with `timezone -server`: 148 ms joined before the sort, 68 ms after, 74 ms
 * unfiltered). A subquery with an ORDER BY is not merged into the outer query, which keeps its
 * order. An HNSW index could not serve that inner ORDER BY, which has no LIMIT of its own, so a
 * session that may have one keeps the join below the ordered scan.
 */
function semanticCte(
  q: Queryable,
  p: Params,
  a: SearchFilters,
  embedding: number[],
  k: () => string,
  sortFirst: boolean,
): string {
  const e = p.add(vectorParam(q, embedding));
  const d = embedding.length;
  const distance = `v.embedding::vector(${d}) <=> ${e}::vector(${d})`;
  const recent = `v.tenant_id = $1 AND v.session_id = $2 AND v.seq >= (SELECT start_seq FROM st)`;
  const needsArchive = a.sinceNs !== null || hasExclusions(a);
  // The nearest k, then only those with a positive cosine similarity: a message that shares
  // nothing with the query (score 0 with the lexical local embedder) is no match, however near
  // it ranks. A NaN score (a zero vector's, stored before the LLM client refused them) compares
  // above every number in SQL, so it is left out by name: such a message matched every query
  // with a score the API wrote as null. (In the k-NN's ORDER BY NaN sorts last, so it takes a
  // place only when fewer than k others exist.)
  const positive = (nearest: string) =>
    `sc AS (SELECT seq, score FROM (${nearest}) nearest WHERE score > ${MIN_SEMANTIC_SCORE} AND score <> 'NaN')`;
  if (needsArchive && sortFirst) {
    return positive(`
    SELECT c.seq, 1 - c.distance AS score
    FROM (SELECT v.seq, ${distance} AS distance FROM message_vectors v WHERE ${recent}
          ORDER BY 2, 1 DESC) c
    JOIN messages m ON m.tenant_id = $1 AND m.session_id = $2 AND m.seq = c.seq
    WHERE true${filterSql(p, a, 'c.seq')}
    ORDER BY c.distance, c.seq DESC LIMIT ${k()}`);
  }
  // Without the join, the window bound is the only filter left, and it applies to v.seq.
  const join = needsArchive
    ? `JOIN messages m ON m.tenant_id = v.tenant_id AND m.session_id = v.session_id AND m.seq = v.seq`
    : '';
  // Exact: ties go to the newer message, as everywhere in ranking. Through an HNSW index the
  // ORDER BY must be its expression alone, and the scan is approximate: among vectors that share
  // nothing with the query (all at distance 1 with the lexical local embedder) the graph walk
  // found its k rows before the few real matches, and the filter after the LIMIT then dropped
  // them all (a rare word's search lost a third of its hits). So there the condition is a filter
  // of the scan, which iterative scans (db/pool.ts) continue past until k rows pass it.
  const ann = !sortFirst;
  return positive(`
    SELECT v.seq, 1 - (${distance}) AS score
    FROM message_vectors v ${join}
    WHERE ${recent}${filterSql(p, a, 'v.seq')}${ann ? ` AND ${distance} < ${1 - MIN_SEMANTIC_SCORE}` : ''}
    ORDER BY ${distance}${ann ? '' : ', v.seq DESC'} LIMIT ${k()}`);
}

/**
 * The candidates in the order searchSession ranks them (rank-hits.ts), computed the same way in
 * float8 so that the walk usually picks what `selectHits` picks: the keyword score is the rank as
 * the client reads it (its float4 text) plus the substring bonus; hybrid is reciprocal-rank
 * fusion. Ties: newer first. Should the orders ever differ (a NaN score did, before the semantic
 * list left it out), searchSession notices and fetches what is missing (`walkRows`).
 */
function orderSql(match: SearchArgs['match']): string {
  const kwScore = `CASE WHEN by_fts THEN ${FULL_TEXT_TIER}::float8 + rank::text::float8 ELSE 0 END
    + CASE WHEN by_substring THEN ${SUBSTRING_BONUS}::float8 ELSE 0 END`;
  const source =
    match === 'keyword'
      ? `SELECT seq, ${kwScore} AS score FROM kc`
      : match === 'semantic'
        ? `SELECT seq, score FROM sc`
        : `SELECT seq, coalesce(1::float8 / (${RRF_K} + k.rn), 0) + coalesce(1::float8 / (${RRF_K} + s.rn), 0) AS score
           FROM (SELECT seq, row_number() OVER (ORDER BY ${kwScore} DESC, seq DESC) AS rn FROM kc) k
           FULL JOIN (SELECT seq, row_number() OVER (ORDER BY score DESC, seq DESC) AS rn FROM sc) s
           USING (seq)`;
  return `(SELECT coalesce(array_agg(seq ORDER BY score DESC, seq DESC), '{}') FROM (${source}) o)`;
}

/**
 * Everything a search needs, in one round trip: whether the session exists (for the 404), the
 * keyword and semantic candidates (4 × limit each, ranked again by the caller), and, for the hits
 * that the same ranking and de-duplication pick, their neighbours and the archived rows of hits
 * and neighbours, i.e. the rows of the response itself (at most 4 × limit; no row is fetched
 * that the response would not show, so large messages cost no more than before).
 *
 * `prepared` runs it as a named prepared statement, which Postgres may run on a generic plan after
 * five executions: planning this statement costs almost as much as running it on a typical session
 * (~0.9 ms of ~2 ms in semantic mode). Only where the plan does not depend on the values: not for
 * a session with an HNSW index of its own, whose predicate a generic plan cannot prove, and not
 * with a keyword list, whose plan depends on how common the terms are.
 */
export async function searchCandidates(
  q: Queryable,
  a: SearchArgs,
  opts: { prepared?: boolean } = {},
): Promise<SearchPrefetch> {
  const p = paramList([a.tenantId, a.sessionId]);
  const ctes = [stateCte(p, a.window)];
  if (hasExclusions(a)) ctes.push(exclusionCte(p, a));
  // Added on first use: a parameter that no clause mentions has no type, an error in Postgres.
  let kParam: string | null = null;
  const k = () => (kParam ??= p.add(a.k));
  const kw = a.keyword && keywordCtes(p, a, a.keyword, k, a.ownIndexes?.search ?? false);
  const sem = a.embedding && semanticCte(q, p, a, a.embedding, k, !(a.ownIndexes?.ann ?? false));
  // Only the lists the order reads: an unused CTE still costs parse time.
  if (kw || (a.match === 'hybrid' && sem)) ctes.push(kw ?? EMPTY_KC);
  if (sem || (a.match === 'hybrid' && kw)) ctes.push(sem ?? EMPTY_SC);
  const order = kw || sem ? orderSql(a.match) : `'{}'::bigint[]`;
  const text = `WITH ${ctes.join(',\n')}
     SELECT ${kw ? `(SELECT json_agg(json_build_array(seq, rank, by_fts, by_substring)) FROM kc)` : 'NULL'} AS kw,
       ${sem ? `(SELECT json_agg(json_build_array(seq, score)) FROM sc)` : 'NULL'} AS sem,
       w.around, w.rows
     FROM st, LATERAL ${walkCall(order, p.add(a.limit))} w`;
  const name = opts.prepared
    ? `mnemos_search_${createHash('sha256').update(text).digest('hex').slice(0, 24)}`
    : '';
  const r = await q.query<WalkResult & { kw: KeywordJson | null; sem: SemanticJson | null }>(
    text,
    p.values,
    name ? { name } : undefined,
  );
  const head = r.rows[0];
  if (!head) return { found: false, keyword: [], semantic: [], around: new Map(), rows: [] };
  return {
    found: true,
    keyword: (head.kw ?? []).map(([seq, rank, byFts, bySubstring]) => ({
      seq,
      rank: rank ?? 0,
      byFts,
      bySubstring,
    })),
    semantic: (head.sem ?? []).map(([seq, score]) => ({ seq, score: Number(score) })),
    ...readWalk(head),
  };
}

/**
 * The fallback of `searchCandidates`: the same walk over a given candidate order (the caller's
 * own ranking), returning the walk's neighbours and the rows of what it shows, except the rows
 * the caller already has (`have`).
 */
export async function walkRows(
  q: Queryable,
  a: { tenantId: string; sessionId: string; order: number[]; limit: number; have: number[] },
): Promise<{ around: Map<number, number[]>; rows: StoredMessageRow[] }> {
  const p = paramList([a.tenantId, a.sessionId]);
  const call = walkCall(`${p.add(a.order)}::bigint[]`, p.add(a.limit), `${p.add(a.have)}::bigint[]`);
  const r = await q.query<WalkResult>(`SELECT w.around, w.rows FROM ${call} w`, p.values);
  return readWalk(r.rows[0] ?? { around: null, rows: null });
}

/**
 * The statement searchSession sends in semantic mode (bench/search.ts prints its plan); `limit`
 * defaults to a quarter of `k`, as searchSession asks for 4 candidates per hit.
 */
export function semanticCandidates(
  q: Queryable,
  a: SearchFilters & { embedding: number[]; k: number; limit?: number },
): Promise<SearchPrefetch> {
  return searchCandidates(q, {
    ...a,
    keyword: null,
    match: 'semantic',
    limit: a.limit ?? Math.ceil(a.k / 4),
  });
}
