import { Histogram } from 'prom-client';
import type { Registry } from 'prom-client';
import { z } from 'zod';
import { pgCode } from '../../db/pool.js';
import { keywordCandidates, messagesBySeqs, semanticCandidates } from '../../db/queries/search.js';
import type { SearchFilters } from '../../db/queries/search.js';
import { getSession } from '../../db/queries/sessions.js';
import type { CoreDeps } from '../deps.js';
import { notFound } from '../errors.js';
import { hasBadChars } from '../messages/message-input.js';
import { toStoredMessage } from '../routes/session-routes.js';
import type { StoredMessage } from '../routes/session-routes.js';
import { nowNs } from '../time.js';
import { ftsLeaves, likePattern, parseSearchQuery, usableSubstring } from './parse-query.js';
import type { ParsedQuery } from './parse-query.js';
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
      }),
    match: z.enum(['keyword', 'semantic', 'hybrid']).default('hybrid'),
    limit: z.number().int().min(1).max(MAX_LIMIT).default(8),
    time_range: z.enum(['1d', '7d', '1m', '1y', 'all']).default('all'),
    exclude_window: z.boolean().default(false),
  })
  .strict();

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

export type SearchDeps = Pick<CoreDeps, 'db' | 'config' | 'llm' | 'logger' | 'metrics'>;

const DURATION_METRIC = 'mnemos_search_duration_seconds';

/** The search latency histogram, created on the process registry the first time it is asked for. */
export function searchDuration(registry: Registry): Histogram<'match'> {
  const existing = registry.getSingleMetric(DURATION_METRIC);
  if (existing) return existing as Histogram<'match'>;
  return new Histogram({
    name: DURATION_METRIC,
    help: 'Search latency by match mode (query embedding included)',
    labelNames: ['match'] as const,
    buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5],
    registers: [registry],
  });
}

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
  const end = searchDuration(deps.metrics.registry).startTimer({ match: params.match });
  try {
    return await run(deps, tenantId, sessionId, params);
  } finally {
    end();
  }
}

async function run(
  deps: SearchDeps,
  tenantId: string,
  sessionId: string,
  params: SearchParams,
): Promise<{ hits: SearchHit[] }> {
  const parsed = parseSearchQuery(params.query);
  const days = params.time_range === 'all' ? null : TIME_RANGE_DAYS[params.time_range];
  const filters: SearchFilters = {
    tenantId,
    sessionId,
    sinceNs: days === null ? null : (nowNs() - BigInt(days) * DAY_NS).toString(),
    windowSize: params.exclude_window ? deps.config.maxHistoryMessages : null,
    excludeFts: parsed.exclude.map(ftsLeaves).filter((leaves) => leaves.length > 0),
    excludeLike: parsed.exclude
      .map((t) => t.text)
      .filter(usableSubstring)
      .map(likePattern),
  };
  const k = params.limit * CANDIDATES_PER_HIT;
  const neighbours = new Map<number, number[]>();
  // The candidate queries are scoped by tenant and session themselves (they find nothing for a
  // session the tenant does not have), so the 404 check runs beside them, saving a round trip;
  // only a billed query embedding waits for it.
  const sessionCheck = getSession(deps.db, tenantId, sessionId).then((s) => {
    if (!s) throw notFound('session');
  });
  const [, keyword, semantic] = await Promise.all([
    sessionCheck,
    params.match === 'semantic' ? [] : keywordList(deps, filters, parsed, k, neighbours),
    params.match === 'keyword'
      ? []
      : (deps.config.embedding.local ? Promise.resolve() : sessionCheck).then(() =>
          semanticList(deps, filters, parsed, k, neighbours),
        ),
  ]);
  const ranked =
    params.match === 'keyword'
      ? keyword
      : params.match === 'semantic'
        ? semantic
        : fuseRrf([keyword, semantic]);
  return { hits: await expand(deps, tenantId, sessionId, ranked, neighbours, params.limit) };
}

async function keywordList(
  deps: SearchDeps,
  filters: SearchFilters,
  parsed: ParsedQuery,
  k: number,
  neighbours: Map<number, number[]>,
): Promise<Candidate[]> {
  const rows = await keywordCandidates(deps.db, {
    ...filters,
    fts: parsed.groups.map((terms) => terms.map(ftsLeaves)),
    like: parsed.groups.map((terms) =>
      terms
        .map((t) => t.text)
        .filter(usableSubstring)
        .map(likePattern),
    ),
    k,
  });
  for (const r of rows) neighbours.set(r.seq, r.around);
  return rankKeyword(rows);
}

async function semanticList(
  deps: SearchDeps,
  filters: SearchFilters,
  parsed: ParsedQuery,
  k: number,
  neighbours: Map<number, number[]>,
): Promise<Candidate[]> {
  if (parsed.embedText.trim() === '') return [];
  const embedding = await embedQuery(deps, filters.tenantId, filters.sessionId, parsed.embedText);
  if (!embedding) return [];
  try {
    const rows = await semanticCandidates(deps.db, { ...filters, embedding, k });
    for (const r of rows) neighbours.set(r.seq, r.around);
    return rankSemantic(rows);
  } catch (err) {
    // 22000 (data_exception) is pgvector's "different vector dimensions": the index was built by
    // another embedder and awaits `mnemos reembed`. Keyword search still answers.
    if (pgCode(err) !== '22000') throw err;
    deps.logger.warn(
      { code: '22000' },
      'search: query and index dimensions differ; semantic results skipped',
    );
    return [];
  }
}

async function expand(
  deps: SearchDeps,
  tenantId: string,
  sessionId: string,
  ranked: Candidate[],
  neighbours: Map<number, number[]>,
  limit: number,
): Promise<SearchHit[]> {
  if (ranked.length === 0) return [];
  for (const list of neighbours.values()) list.sort((a, b) => a - b);
  const chosen = selectHits(ranked, neighbours, limit);
  const rows = await messagesBySeqs(
    deps.db,
    tenantId,
    sessionId,
    chosen.flatMap((c) => [c.hit.seq, ...c.context]),
  );
  const bySeq = new Map(rows.map((r) => [Number(r.seq), toStoredMessage(r)]));
  const hits: SearchHit[] = [];
  for (const { hit, context } of chosen) {
    const m = bySeq.get(hit.seq);
    // Gone since it was ranked (reset or delete in between): leave it out rather than fail.
    if (!m) continue;
    hits.push({
      seq: m.seq,
      id: m.id,
      role: m.role,
      content: m.content,
      sent_at: m.sent_at,
      score: hit.score,
      source: hit.archive && hit.recent ? 'both' : hit.archive ? 'archive' : 'recent',
      context: context.flatMap((s) => bySeq.get(s) ?? []),
    });
  }
  return hits;
}
