import { Histogram } from 'prom-client';
import type { Registry } from 'prom-client';
import { z } from 'zod';
import { isPoolWaitTimeout, pgCode } from '../../db/pool.js';
import type { Db } from '../../db/pool.js';
import { searchCandidates, walkRows } from '../../db/queries/search.js';
import type { SearchArgs, SearchFilters, SearchPrefetch } from '../../db/queries/search.js';
import { getSession } from '../../db/queries/sessions.js';
import type { CoreDeps } from '../deps.js';
import { AppError, notFound } from '../errors.js';
import { hasBadChars } from '../messages/message-input.js';
import { toStoredMessage } from '../routes/session-routes.js';
import type { StoredMessage } from '../routes/session-routes.js';
import { codePoints } from '../text/code-points.js';
import { nowNs } from '../time.js';
import {
  MAX_SUBSTRING_BUDGET,
  budgetLeaves,
  ftsLeaves,
  likePattern,
  parseSearchQuery,
  usableSubstring,
  wordRegex,
} from './parse-query.js';
import type { FtsLeaf, QueryTerm } from './parse-query.js';
import { hasLocalFeatures, localFeatureSet, sharesLocalFeature } from '../llm/local-embedder.js';
import { prepareEmbedText } from '../recent-index/embedder.js';
import { onlyStopWords, partlyStopWords } from './english-stop-words.js';
import { ownIndexes } from './indexed-sessions.js';
import { embedQuery } from './query-embedding.js';
import { fuseRrf, rankKeyword, rankSemantic, selectHits } from './rank-hits.js';
import type { Candidate } from './rank-hits.js';

export const MAX_QUERY_CHARS = 10_000;
export const MAX_LIMIT = 32;
/** Candidates fetched per matcher, per hit wanted: each kept hit can hide at most 3 others. */
const CANDIDATES_PER_HIT = 4;

const TIME_RANGE_DAYS = { '1d': 1, '7d': 7, '1m': 30, '1y': 365 } as const;
const DAY_NS = 86_400n * 1_000_000_000n;

/** The body of `POST /v1/sessions/{sid}/search`, also the arguments of `searchSession`. */
export const searchBodySchema = z
  .object({
    query: z
      .string()
      .refine((s) => s.trim() !== '', 'must not be blank')
      .refine((s) => !hasBadChars(s), 'NUL characters and lone surrogates are not allowed')
      .refine((s) => s.length <= MAX_QUERY_CHARS || Array.from(s).length <= MAX_QUERY_CHARS, {
        message: `must be at most ${MAX_QUERY_CHARS} characters`,
      })
      // For the OpenAPI document: refinements do not show there, and JSON Schema counts code points.
      .meta({ minLength: 1, maxLength: MAX_QUERY_CHARS }),
    match: z.enum(['keyword', 'semantic', 'hybrid']).default('hybrid'),
    limit: z.number().min(1).max(MAX_LIMIT).int().default(8),
    time_range: z.enum(['1d', '7d', '1m', '1y', 'all']).default('all'),
    exclude_window: z.boolean().default(false),
    // The first seq of the agent's context window (`window.from_seq` of its context answer), for
    // a window other than the default one of MAX_HISTORY_MESSAGES (context's `max_messages`).
    window_from_seq: z.number().int().min(0).max(Number.MAX_SAFE_INTEGER).optional(),
  })
  .strict()
  .refine((b) => b.window_from_seq === undefined || b.exclude_window, {
    message:
      'window_from_seq is the start of the window exclude_window leaves out: send exclude_window: true with it',
    path: ['window_from_seq'],
  });

export type SearchParams = z.output<typeof searchBodySchema>;
export type SearchMatch = SearchParams['match'];

export interface SearchHit {
  seq: number;
  id: string;
  role: string;
  content: unknown;
  sent_at: string;
  score: number;
  source: 'archive' | 'recent' | 'both';
  context: StoredMessage[];
}

/** A hit with the whole message as `GET …/messages` shows it (name, tool calls: the agent tools show them). */
export interface DetailedHit extends SearchHit {
  message: StoredMessage;
}

export type SearchDeps = Pick<CoreDeps, 'db' | 'config' | 'llm' | 'logger' | 'metrics'> & {
  /**
   * Set by bench/search.ts only: its stored vectors stand for a model embedder's (clusters), not
   * the local embedder's, so semantic hits are not tested for a shared word (see `lexical`).
   */
  syntheticVectors?: boolean;
};

const DURATION_METRIC = 'mnemos_search_duration_seconds';

/** The search latency histogram, created on the process registry the first time it is asked for. */
export function searchDuration(registry: Registry): Histogram<'match'> {
  const existing = registry.getSingleMetric(DURATION_METRIC);
  if (existing) return existing as Histogram<'match'>;
  return new Histogram({
    name: DURATION_METRIC,
    help: 'Search latency by match mode (query embedding included)',
    labelNames: ['match'] as const,
    // Up to 10 s: SEARCH_TIMEOUT_MS's default stops a search's statement there.
    buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
    registers: [registry],
  });
}

/**
 * The terms matched as substrings: each usable (at most MAX_SUBSTRING_CHARS), and together at
 * most MAX_SUBSTRING_BUDGET code points: the excluded terms first (a positive term left out only
 * turns the substring list off, see `untestable`; an excluded one left out is tested by full text
 * alone, which skips stop words), then the shortest first: a symbol or an emoji, which only the
 * substring match can test, is never left out for a long word, which full text tests too. Every
 * pattern is tested against every candidate row, at up to the row's length times the pattern's:
 * 64 alternatives of 64 characters each (`a…b or a…c or …`) would cost 64 times the worst single
 * term.
 */
function substringTerms(parsed: ReturnType<typeof parseSearchQuery>): Set<string> {
  const out = new Set<string>();
  let budget = MAX_SUBSTRING_BUDGET;
  const bySize = (terms: QueryTerm[]) =>
    terms
      .filter((t) => usableSubstring(t.text))
      .map((t) => ({ text: t.text, size: codePoints(t.text) }))
      .sort((a, b) => a.size - b.size);
  const usable = [...bySize(parsed.exclude), ...bySize(parsed.groups.flat())];
  for (const term of usable) {
    if (out.has(term.text) || term.size > budget) continue;
    budget -= term.size;
    out.add(term.text);
  }
  return out;
}

/** A single ASCII character: punctuation or a stop letter constrains neither half of keyword search. */
const oneAscii = (text: string) => text.length === 1 && text.charCodeAt(0) < 0x80;

/**
 * Searches one session (SPEC §4 "Search"): keyword, semantic or hybrid candidates, ranked, then
 * expanded with their neighbours so that no message appears twice. Throws 404 for a session the
 * tenant does not have. `params` must have passed `searchBodySchema`.
 */
export async function searchSession(
  deps: SearchDeps,
  tenantId: string,
  sessionId: string,
  params: SearchParams,
): Promise<{ hits: SearchHit[] }> {
  const { hits } = await searchSessionDetailed(deps, tenantId, sessionId, params);
  return { hits: hits.map(({ message: _message, ...hit }) => hit) };
}

const searchDbs = new WeakMap<Db, Db>();

/**
 * `db` with every statement marked as a search's (QueryOptions.search: the search connections).
 * One view per Db, kept: what is cached per Db (indexed-sessions.ts, read at most every 30 s) would
 * otherwise be read again by every search (+0.25 ms per keyword search in the bench).
 */
function searchDb(db: Db): Db {
  let view = searchDbs.get(db);
  if (!view) {
    view = { ...db, query: (text, p, o) => db.query(text, p, { ...o, search: true }) };
    searchDbs.set(db, view);
  }
  return view;
}

/** searchSession, each hit with its whole message. */
export async function searchSessionDetailed(
  deps: SearchDeps,
  tenantId: string,
  sessionId: string,
  params: SearchParams,
): Promise<{ hits: DetailedHit[] }> {
  const end = searchDuration(deps.metrics.registry).startTimer({ match: params.match });
  try {
    // On the search connections: a slow search neither holds the connections that archive
    // messages nor runs longer than SEARCH_TIMEOUT_MS (Postgres cancels it: 57014).
    return await run({ ...deps, db: searchDb(deps.db) }, tenantId, sessionId, params);
  } catch (err) {
    // Every search connection taken (by slow searches) for the pool's 5 s wait: Postgres is up,
    // and saying it is down (the generic answer to a pool timeout) would send operators after an
    // outage.
    if (isPoolWaitTimeout(err) && deps.db.kind === 'postgres') {
      throw new AppError(
        503,
        'search_busy',
        'every search connection stayed busy with other searches: retry',
        { dependency: 'postgres' },
        { 'retry-after': '1' },
      );
    }
    if (pgCode(err) !== '57014') throw err;
    throw new AppError(
      503,
      'search_timeout',
      `the search ran longer than ${deps.config.searchTimeoutMs} ms (SEARCH_TIMEOUT_MS): narrow the query or retry`,
      { limit_ms: deps.config.searchTimeoutMs },
      { 'retry-after': '1' },
    );
  } finally {
    end();
  }
}

async function run(
  deps: SearchDeps,
  tenantId: string,
  sessionId: string,
  params: SearchParams,
): Promise<{ hits: DetailedHit[] }> {
  const parsed = parseSearchQuery(params.query);
  const substrings = substringTerms(parsed);
  // An excluded term whose words are partly stop words is tested by its substring alone where it
  // has one: full text drops the stop words, and `-"no error"` (the tsquery `'error'`) hid every
  // message with "error" in it, `-user's` every "user". Past the substring budget full text still
  // tests the rest of its words, the wider exclusion.
  const excludeLeaves = parsed.exclude.map((t) =>
    substrings.has(t.text) && partlyStopWords(t.text) ? [] : ftsLeaves(t),
  );
  // An excluded term that nothing can test, or one past the query's 64 terms: no message can be
  // shown not to hold it. (Full text cannot test a term of stop words only, `because`: its
  // tsquery is empty.)
  const ftsTestable = (leaves: FtsLeaf[]) =>
    leaves.some(
      (leaf) => leaf.kind === 'cjk-phrase' || leaf.kind === 'cjk-prefix' || !onlyStopWords(leaf.text),
    );
  const unexcludable = parsed.exclude.some(
    (t, i) =>
      !oneAscii(t.text) &&
      !substrings.has(t.text) &&
      wordRegex(t.text) === null &&
      !ftsTestable(excludeLeaves[i]!),
  );
  if (unexcludable || parsed.excludedPastLimit > 0) {
    if (!(await getSession(deps.db, tenantId, sessionId))) throw notFound('session');
    return { hits: [] };
  }
  const days = params.time_range === 'all' ? null : TIME_RANGE_DAYS[params.time_range];
  const filters: SearchFilters = {
    tenantId,
    sessionId,
    sinceNs: days === null ? null : (nowNs() - BigInt(days) * DAY_NS).toString(),
    window: !params.exclude_window
      ? null
      : params.window_from_seq !== undefined
        ? { fromSeq: params.window_from_seq }
        : { size: deps.config.maxHistoryMessages },
    excludeFts: excludeLeaves.filter((leaves) => leaves.length > 0),
    excludeLike: parsed.exclude
      .map((t) => t.text)
      .filter((t) => substrings.has(t))
      .map(likePattern),
    // `-2` leaves out what `2` finds (`step 2.0`, `step-2`, which full text reads as other tokens).
    excludeWords: parsed.exclude.map((t) => wordRegex(t.text)).filter((w): w is string => w !== null),
  };
  // A term's substring test: a LIKE pattern, or for a term of one ASCII letter or digit a
  // whole-word regular expression.
  const patterns = (terms: QueryTerm[]) =>
    terms.flatMap((t) => {
      if (substrings.has(t.text)) return [likePattern(t.text)];
      const word = wordRegex(t.text);
      return word ? [word] : [];
    });
  const like = parsed.groups.map(patterns);
  // The substring match ANDs the groups it can test. A group it cannot test (a term over
  // MAX_SUBSTRING_CHARS, or past the query's budget) would leave the AND a term short: `step
  // <long id>` matched every recent "step", each with the substring bonus, above the one message
  // with both. Full text alone answers such a query; and none answers it when full text cannot
  // see that group either (a symbol past the budget): no keyword hits then, rather than hits
  // without it. (A group of single ASCII characters it cannot test, punctuation or a stop letter,
  // constrains neither half.)
  const untestable = parsed.groups.map(
    (terms, g) => like[g]!.length === 0 && terms.some((t) => !oneAscii(t.text)),
  );
  const leaves = budgetLeaves(parsed.groups.map((terms) => terms.map(ftsLeaves)));
  const unanswerable = untestable.some((u, g) => u && leaves[g]!.every((l) => l.length === 0));
  const keyword =
    params.match === 'semantic' || unanswerable
      ? null
      : {
          fts: leaves,
          like: untestable.some(Boolean) ? [] : like,
          // Groups full text cannot see (`deploy 🚀`: its matches must hold the 🚀 as well).
          blind: like
            .filter((_, g) => leaves[g]!.every((l) => l.length === 0))
            .filter((alternatives) => alternatives.length > 0),
        };
  let embedding: number[] | null = null;
  // With the local embedder a query without a word or CJK character has the one vector that every
  // such text shares: "🎉" would find "👍" with a score of 1. It has no semantic list.
  const featureless = deps.config.embedding.local && !hasLocalFeatures(parsed.embedText);
  if (params.match !== 'keyword' && parsed.embedText.trim() !== '' && !featureless) {
    // A billed query embedding waits for the session check, so that a 404 costs nothing; the
    // local embedder costs microseconds, and the one statement below checks the session itself.
    if (!deps.config.embedding.local && !(await getSession(deps.db, tenantId, sessionId))) {
      throw notFound('session');
    }
    embedding = await embedQuery(deps, tenantId, sessionId, parsed.embedText);
  }
  const lexicalCheck = embedding !== null && deps.config.embedding.local && !deps.syntheticVectors;
  // Collisions dropped can leave fewer hits than `limit` while real matches lay past the k-NN's
  // candidates: 20 short "that works" messages filled every candidate of `compaction` (they
  // collide), and semantic search answered none of the 3 messages about it. Then the search runs
  // again with four times the candidates, as long as the k-NN filled them all.
  for (let k = params.limit * CANDIDATES_PER_HIT; ; k *= CANDIDATES_PER_HIT) {
    const fetched = await candidates(deps, {
      ...filters,
      keyword,
      embedding,
      k,
      limit: params.limit,
      match: params.match,
    });
    // The candidate statement is scoped by the tenant's live session: no head row, no session.
    if (!fetched.found) throw notFound('session');
    const found = await rankAndExpand(
      deps,
      tenantId,
      sessionId,
      params,
      fetched,
      lexicalCheck,
      parsed.embedText,
    );
    const more = found.collided > 0 && found.hits.length < params.limit;
    if (!more || fetched.semantic.length < k || k * CANDIDATES_PER_HIT > MAX_LEXICAL_CANDIDATES) {
      return { hits: found.hits };
    }
  }
}

/** The most candidates a search asks the k-NN for after dropping collisions (see `run`). */
const MAX_LEXICAL_CANDIDATES = 512;

/** Ranks the candidates by `params.match` and picks the hits with their contexts (expand). */
async function rankAndExpand(
  deps: SearchDeps,
  tenantId: string,
  sessionId: string,
  params: SearchParams,
  fetched: SearchPrefetch,
  lexicalCheck: boolean,
  embedText: string,
): Promise<{ hits: DetailedHit[]; collided: number }> {
  const keywordList = rankKeyword(fetched.keyword);
  const semanticList = rankSemantic(fetched.semantic);
  const ranked =
    params.match === 'keyword'
      ? keywordList
      : params.match === 'semantic'
        ? semanticList
        : fuseRrf([keywordList, semanticList]);
  // The local embedder is lexical, and its vectors have a few hundred buckets: a message can score
  // as high as a real match of one word without sharing any with the query (hash collisions, in
  // about one search in four for a word the session never used). What only the vectors found must
  // share a word or CJK bigram with the query.
  const lexical =
    lexicalCheck && semanticList.length > 0
      ? {
          features: localFeatureSet(prepareEmbedText(embedText) ?? ''),
          seqs: new Set(
            params.match === 'semantic'
              ? semanticList.map((c) => c.seq)
              : difference(semanticList, keywordList),
          ),
        }
      : undefined;
  return expand(deps, tenantId, sessionId, ranked, fetched, params.limit, lexical);
}

/**
 * `searchCandidates`, retried without the semantic list when the vectors have another dimension.
 * A semantic search of a session without an HNSW index of its own runs as a prepared statement
 * (its other indexes of its own, full text and trigrams, serve only keyword matching). Its text
 * depends only on which filters are present (`time_range`, `exclude_window`, exclusions), the
 * excluded terms being array parameters, so a connection holds at most eight such statements.
 */
async function candidates(deps: SearchDeps, search: SearchArgs): Promise<SearchPrefetch> {
  const postgres = deps.db.kind === 'postgres';
  const own = postgres ? await ownIndexes(deps.db, search.tenantId, search.sessionId) : undefined;
  const args = { ...search, ownIndexes: own };
  const prepared = args.keyword === null && deps.config.pgPreparedStatements && postgres && !own?.ann;
  try {
    return await searchCandidates(deps.db, args, { prepared });
  } catch (err) {
    // 22000 (data_exception) is pgvector's "different vector dimensions": the index was built by
    // another embedder and awaits `mnemos reembed`. Keyword search still answers.
    if (args.embedding === null || pgCode(err) !== '22000') throw err;
    deps.logger.warn(
      { code: '22000' },
      'search: query and index dimensions differ; semantic results skipped',
    );
    return searchCandidates(deps.db, { ...args, embedding: null });
  }
}

/** Seqs of `list` that `other` does not hold. */
function difference(list: readonly Candidate[], other: readonly Candidate[]): number[] {
  const held = new Set(other.map((c) => c.seq));
  return list.filter((c) => !held.has(c.seq)).map((c) => c.seq);
}

/**
 * Picks the hits and their contexts (`selectHits`) and builds them from the prefetched rows. The
 * candidate statement ran the same selection in SQL, so it normally brought every neighbour list
 * and row needed; if not (the orders differed), one more statement runs the selection over this
 * ranking and brings what is missing. With `lexical`, a hit among its `seqs` whose text shares no
 * feature with the query is a collision of the local embedder: if one is picked, the rows of all
 * such candidates are fetched (one statement), the collisions dropped, and the hits picked again.
 */
async function expand(
  deps: SearchDeps,
  tenantId: string,
  sessionId: string,
  candidates: Candidate[],
  fetched: Pick<SearchPrefetch, 'around' | 'rows'>,
  limit: number,
  lexical?: { features: ReadonlySet<string>; seqs: ReadonlySet<number> },
): Promise<{ hits: DetailedHit[]; collided: number }> {
  let ranked = candidates;
  if (ranked.length === 0) return { hits: [], collided: 0 };
  const neighbours = fetched.around;
  for (const list of neighbours.values()) list.sort((a, b) => a - b);
  const bySeq = new Map(fetched.rows.map((r) => [Number(r.seq), r]));
  // Runs the selection over `order` in SQL and keeps the rows and neighbour lists it brings (a
  // message's neighbours do not depend on the order).
  const walk = async (order: readonly Candidate[], n: number) => {
    const more = await walkRows(deps.db, {
      tenantId,
      sessionId,
      order: order.map((c) => c.seq),
      limit: n,
      have: [...bySeq.keys()],
    });
    for (const [seq, list] of more.around)
      neighbours.set(
        seq,
        list.sort((a, b) => a - b),
      );
    for (const r of more.rows) bySeq.set(Number(r.seq), r);
  };
  const pick = async () => {
    const chosen = selectHits(ranked, neighbours, limit);
    const complete = chosen.every(
      ({ hit, context }) =>
        neighbours.has(hit.seq) && bySeq.has(hit.seq) && context.every((s) => bySeq.has(s)),
    );
    if (complete) return chosen;
    await walk(ranked, limit);
    return selectHits(ranked, neighbours, limit);
  };
  let chosen = await pick();
  let dropped = 0;
  if (lexical) {
    const collided = (c: Candidate) => {
      if (!lexical.seqs.has(c.seq)) return false;
      const row = bySeq.get(c.seq);
      return row !== undefined && !sharesLocalFeature(lexical.features, prepareEmbedText(row.content) ?? '');
    };
    if (chosen.some(({ hit }) => collided(hit))) {
      const unseen = ranked.filter((c) => lexical.seqs.has(c.seq) && !bySeq.has(c.seq));
      if (unseen.length > 0) await walk(unseen, unseen.length);
      const kept = ranked.filter((c) => !collided(c));
      dropped = ranked.length - kept.length;
      ranked = kept;
      chosen = await pick();
    }
  }
  const stored = (seq: number) => {
    const r = bySeq.get(seq);
    return r && toStoredMessage(r);
  };
  const hits: DetailedHit[] = [];
  for (const { hit, context } of chosen) {
    const m = stored(hit.seq);
    // Gone since it was ranked (reset or delete between the two statements): leave it out.
    if (!m) continue;
    hits.push({
      seq: m.seq,
      id: m.id,
      role: m.role,
      content: m.content,
      sent_at: m.sent_at,
      score: hit.score,
      source: hit.archive && hit.recent ? 'both' : hit.archive ? 'archive' : 'recent',
      context: context.flatMap((s) => stored(s) ?? []),
      message: m,
    });
  }
  return { hits, collided: dropped };
}
