/**
 * Search latency: `searchSession` (services/search/search-session.ts) in keyword, semantic and
 * hybrid mode, each against the single plain SQL statement it is built on, in the same process
 * and run, interleaved call by call. The corpus is loaded straight into a scratch database
 * (created and dropped here): `--sessions` sessions sharing `--messages` archived messages (mixed
 * English/Chinese agent chatter), the last `--hot` of each in the recent index, plus one big
 * session of `--big` messages that are all hot and all embedded. Vectors are clustered
 * (FACTS.md: never uniform random), `--dims` dimensions.
 *
 *   node --import tsx bench/search.ts [--messages 200000] [--sessions 1000] [--big 20000]
 *     [--hot 50] [--dims 1536] [--iterations 200] [--big-iterations 30] [--keep] [--no-ann]
 *     [--no-search-indexes] [--per-query-runs 10]
 *     [--no-langgraph] [--langgraph-sessions 100] [--langgraph-seconds 60] [--no-langgraph-fill]
 *
 * `--keep` leaves the scratch database in place for inspection (its URL is printed; the next
 * bench run drops it once it is an hour old).
 *
 * Then a peer baseline (skip it with `--no-langgraph`): LangGraph's `PostgresStore` (from the
 * isolated bench/peers project) in its own schema of the scratch database, holding the recent,
 * vector-indexed messages of up to `--langgraph-sessions` typical sessions, put through its API
 * (whole sessions; loading stops after `--langgraph-seconds`, its puts are slow) with exactly the
 * vectors loaded for mnemos, searched semantically interleaved call by call with `searchSession`
 * on the same sessions and queries. Then (unless `--no-langgraph-fill`) the rest of mnemos's
 * recent index is copied into LangGraph's tables by SQL and the same searches run again: its
 * search cost depends on the size of the whole store, not of the session.
 *
 * Query embedding is not part of the semantic timings in substance: the bench runs with the
 * local embedder, whose cost is measured and printed separately (microseconds).
 */
import { performance } from 'node:perf_hooks';
import type { Db, Queryable } from '../db/pool.js';
import { makePgDb } from '../db/pool.js';
import { insertArchiveBatch } from '../db/queries/messages.js';
import { leafQuerySql, semanticCandidates } from '../db/queries/search.js';
import type { ArchiveInsertRow } from '../db/queries/messages.js';
import { loadConfig } from '../services/config.js';
import { maintainAnnIndexes } from '../services/recent-index/ann-indexes.js';
import { maintainSessionIndexes } from '../services/search/session-indexes.js';
import { initVectorIndex } from '../db/queries/vectors.js';
import { LOCAL_EMBEDDING_MODEL, localEmbed } from '../services/llm/local-embedder.js';
import { makeLogger } from '../services/logger.js';
import { makeMetrics } from '../services/metrics.js';
import { ftsLeaves, parseSearchQuery } from '../services/search/parse-query.js';
import type { FtsLeaf } from '../services/search/parse-query.js';
import { embedQuery } from '../services/search/query-embedding.js';
import { searchSession } from '../services/search/search-session.js';
import type { SearchDeps, SearchMatch } from '../services/search/search-session.js';
import { ftsDocument } from '../services/text/fts-text.js';
import { makeCorpus, makeRandom } from './lib/corpus.js';
import { fmtInt, fmtMs, fmtRatio, markdownTable, note } from './lib/format.js';
import { ensurePeers, peerVersion, requirePeer } from './lib/peers.js';
import {
  cleanupOnSignals,
  cleanupScratch,
  createScratchDatabase,
  dropStaleScratchDatabases,
  onCleanup,
} from './lib/scratch.js';
import { ratio, summarize } from './lib/stats.js';
import { intArg } from './lib/args.js';

const MESSAGES = intArg('messages', 200_000);
const SESSIONS = intArg('sessions', 1000);
const BIG = intArg('big', 20_000);
const HOT = intArg('hot', 50);
const DIMS = intArg('dims', 1536);
const ITERATIONS = intArg('iterations', 200);
// Exact k-NN over the big session takes about half a second per call at 1536 dimensions.
const BIG_ITERATIONS = intArg('big-iterations', 30);
const KEEP = process.argv.includes('--keep');
// Without the per-session HNSW index the service builds for huge sessions (ANN_MIN_VECTORS).
const ANN = !process.argv.includes('--no-ann');
// Without the per-session full-text and trigram indexes of huge sessions (SEARCH_INDEX_MIN_MESSAGES).
const SEARCH_INDEXES = !process.argv.includes('--no-search-indexes');
const LANGGRAPH = !process.argv.includes('--no-langgraph');
const LG_SESSIONS = Math.min(intArg('langgraph-sessions', 100), SESSIONS);
const LG_SECONDS = intArg('langgraph-seconds', 60);
const LG_FILL = !process.argv.includes('--no-langgraph-fill');
const LG_WARM_UP = Math.min(20, Math.ceil(ITERATIONS / 4));
const LG_SCHEMA = 'lg_store';
const LIMIT = 8;
const K = LIMIT * 4;
const PER_QUERY_RUNS = intArg('per-query-runs', 10);
const TENANT = 't_bench_search';
const BIG_SESSION = 'big-session';
const CLUSTERS = 64;

const rand = makeRandom(0x5ea7c4);
const gauss = () => Math.sqrt(-2 * Math.log(rand() || 1e-12)) * Math.cos(2 * Math.PI * rand());
const unit = (v: number[]) => {
  const n = Math.hypot(...v);
  return v.map((x) => x / n);
};
// Text embeddings share a common direction: a query scores above 0 with every stored text, as
// the service's similarity floor (> 0) expects of a model embedder. searchSession embeds its query
// with the local embedder, whose vectors know nothing of random centroids (half of those scores
// would be negative and dropped, less work than a model embedder's search does), so the common
// direction is that of the bench's own queries: their embedded vectors, summed.
let centroidCache: number[][] | null = null;
function centroids(): number[][] {
  if (centroidCache) return centroidCache;
  const queries = KEYWORD_QUERIES.map((q) => localEmbed(parseSearchQuery(q).embedText, DIMS));
  const common = unit(
    queries.reduce((sum, v) => sum.map((x, i) => x + v[i]!), new Array<number>(DIMS).fill(0)),
  );
  centroidCache = Array.from({ length: CLUSTERS }, () =>
    unit(Array.from({ length: DIMS }, gauss)).map((x, i) => x + 0.8 * common[i]!),
  ).map(unit);
  return centroidCache;
}
/**
 * A point of a random cluster: centroid plus noise of half its norm (cos ≈ 0.9 within a cluster,
 * ≈ 0.4 across clusters; with the bench queries median ≈ 0.17, none below 0 in 20,000 samples).
 */
function clusteredVector(): number[] {
  const c = centroids()[Math.floor(rand() * CLUSTERS)]!;
  const sigma = 0.5 / Math.sqrt(DIMS);
  return c.map((x) => x + sigma * gauss());
}
const literal = (v: number[]) => `[${v.map((x) => x.toFixed(5)).join(',')}]`;

const corpus = makeCorpus();
const DAY_MS = 86_400_000;
const now = Date.now();

/**
 * Issue #9's big session holds "4 MiB of short messages": its messages are the corpus's cut to
 * at most SHORT_CHARS characters at a word boundary (~200 UTF-8 bytes on average).
 */
const SHORT_CHARS = 200;
function shortened(text: string): string {
  if (text.length <= SHORT_CHARS) return text;
  const cut = text.lastIndexOf(' ', SHORT_CHARS);
  return text.slice(0, cut > SHORT_CHARS / 2 ? cut : SHORT_CHARS);
}

function rows(sessionIndex: number, count: number, fromSeq: number, short = false): ArchiveInsertRow[] {
  const out: ArchiveInsertRow[] = [];
  for (let i = 0; i < count; i++) {
    const seq = fromSeq + i;
    const full = corpus.message(sessionIndex, seq);
    const m = short ? { ...full, content: shortened(full.content) } : full;
    const fts = ftsDocument(m.content);
    // Spread over the last 400 days, oldest first, so time ranges select a realistic share.
    const sentMs = now - 400 * DAY_MS + Math.floor(((seq - 1) / count) * 400 * DAY_MS);
    out.push({
      seq,
      id: `m${seq}`,
      role: m.role,
      content: m.content,
      parts: null,
      name: null,
      tool_call_id: null,
      tool_calls: null,
      metadata: null,
      sent_at_ns: `${sentMs}000000`,
      sent_at_given: true,
      bytes: Buffer.byteLength(JSON.stringify(m), 'utf8'),
      fingerprint: 'bench',
      fts_en: fts.en,
      fts_cjk: fts.cjk,
    });
  }
  return out;
}

async function insertVectors(db: Db, sessionId: string, seqs: number[]): Promise<void> {
  for (let i = 0; i < seqs.length; i += 500) {
    const part = seqs.slice(i, i + 500);
    await db.query(
      `INSERT INTO message_vectors (tenant_id, session_id, seq, embedding)
       SELECT $1, $2, x.seq, x.v::vector FROM unnest($3::bigint[], $4::text[]) AS x(seq, v)`,
      [TENANT, sessionId, part, part.map(() => literal(clusteredVector()))],
    );
  }
}

async function loadSession(
  db: Db,
  sessionId: string,
  sessionIndex: number,
  count: number,
  hot: number,
  short = false,
) {
  const startSeq = count - hot + 1;
  await db.query(
    `INSERT INTO sessions (tenant_id, id, next_seq, message_count, start_seq) VALUES ($1, $2, $3, $4, $5)`,
    [TENANT, sessionId, count + 1, count, startSeq],
  );
  for (let from = 1; from <= count; from += 1000) {
    await insertArchiveBatch(
      db,
      TENANT,
      sessionId,
      rows(sessionIndex, Math.min(1000, count - from + 1), from, short),
    );
  }
  await insertVectors(
    db,
    sessionId,
    Array.from({ length: hot }, (_, i) => startSeq + i),
  );
}

async function load(db: Db): Promise<{ seconds: number; rows: number; vectors: number; perSession: number }> {
  const t0 = performance.now();
  await db.query(`INSERT INTO tenants (id, name) VALUES ($1, $1)`, [TENANT]);
  const perSession = Math.max(HOT, Math.floor(MESSAGES / SESSIONS));
  let next = 0;
  let done = 0;
  const worker = async () => {
    for (let i = next++; i < SESSIONS; i = next++) {
      await loadSession(db, `s${i}`, i, perSession, HOT);
      if (++done % 100 === 0) note(`loaded ${done}/${SESSIONS} sessions`);
    }
  };
  await Promise.all([worker(), worker()]);
  note(`loading the big session (${BIG} short messages, all embedded)`);
  await loadSession(db, BIG_SESSION, SESSIONS, BIG, BIG, true);
  // As autovacuum would have by then: statistics, and a visibility map for index-only scans.
  await db.query('VACUUM ANALYZE messages');
  await db.query('VACUUM ANALYZE message_vectors');
  await db.query('VACUUM ANALYZE sessions');
  return {
    seconds: (performance.now() - t0) / 1000,
    rows: perSession * SESSIONS + BIG,
    perSession,
    vectors: HOT * SESSIONS + BIG,
  };
}

const KEYWORD_QUERIES = [
  'connection pool',
  '"connection pool"',
  'deployment or migration',
  'timezone -server',
  'spreadsheet',
  '資料庫',
  '繁體中文',
  'certificate 錯誤',
  'regress',
  'the',
];

/**
 * The tsquery searchSession builds for a query (same leaves, same && / || composition as
 * db/queries/search.ts), as text, so the keyword baseline runs the very same full-text match;
 * excluded terms become `!!` (NOT) clauses of it, as a plain full-text statement would exclude them.
 */
async function tsqueryText(db: Db, query: string): Promise<string> {
  const params: string[] = [];
  const leaf = (l: FtsLeaf) => {
    params.push(l.text);
    return leafQuerySql(l.kind, `$${params.length}`);
  };
  const parsed = parseSearchQuery(query);
  const groups = parsed.groups
    .map((terms) => terms.map(ftsLeaves).filter((ls) => ls.length > 0))
    .filter((terms) => terms.length > 0)
    .map((terms) => `(${terms.map((ls) => `(${ls.map(leaf).join(' && ')})`).join(' || ')})`);
  if (groups.length === 0) return '';
  for (const ls of parsed.exclude.map(ftsLeaves).filter((x) => x.length > 0)) {
    groups.push(`!!(${ls.map(leaf).join(' && ')})`);
  }
  const r = await db.query<{ q: string }>(`SELECT (${groups.join(' && ')})::text AS q`, params);
  return r.rows[0]?.q ?? '';
}

/**
 * The baselines run on the connections searchSession's statements run on (QueryOptions.search):
 * on the main pool's, another backend than ours, they and ours alternated between two backends
 * and our keyword search measured 0.25 ms more at p50 (1.68 against 1.40 ms), none of it work
 * of ours (probe of 2026-12-01 16:50 UTC, 100,000 messages, 300 searches).
 */
const ON_SEARCH = { search: true };
const BASELINE_KEYWORD = `SELECT seq, ts_rank_cd(search_tsv, $3::tsquery, 32) AS rank
  FROM messages
  WHERE tenant_id = $1 AND session_id = $2 AND search_tsv @@ $3::tsquery
  ORDER BY rank DESC LIMIT ${K}`;
const BASELINE_SEMANTIC = `SELECT seq, 1 - (embedding <=> $3::vector) AS score
  FROM message_vectors WHERE tenant_id = $1 AND session_id = $2
  ORDER BY embedding <=> $3::vector LIMIT ${K}`;
const BASELINE_HYBRID = `WITH k AS (
    SELECT seq, row_number() OVER () AS r FROM (${BASELINE_KEYWORD}) x),
  s AS (
    SELECT seq, row_number() OVER () AS r FROM (
      SELECT seq FROM message_vectors WHERE tenant_id = $1 AND session_id = $2
      ORDER BY embedding <=> $4::vector LIMIT ${K}) y)
  SELECT seq, coalesce(1.0 / (60 + k.r), 0) + coalesce(1.0 / (60 + s.r), 0) AS score
  FROM k FULL JOIN s USING (seq) ORDER BY score DESC LIMIT ${LIMIT}`;

const noFilters = (sessionId: string) => ({
  tenantId: TENANT,
  sessionId,
  sinceNs: null,
  window: null,
  excludeFts: [],
  excludeLike: [],
  excludeWords: [],
});

interface Case {
  match: SearchMatch;
  target: 'typical' | 'big';
}

/** Runs both, alternating which goes first from one iteration to the next so caching favours neither. */
async function pair(i: number, ours: () => Promise<void>, base: () => Promise<void>): Promise<void> {
  if (i % 2 === 0) {
    await ours();
    await base();
  } else {
    await base();
    await ours();
  }
}

async function measure(deps: SearchDeps, c: Case, tsqueries: Map<string, string>) {
  const ours: number[] = [];
  const base: number[] = [];
  let hitsTotal = 0;
  const session = () => (c.target === 'big' ? BIG_SESSION : `s${Math.floor(rand() * SESSIONS)}`);
  const iterations = c.target === 'big' ? BIG_ITERATIONS : ITERATIONS;
  for (let i = -Math.min(20, Math.ceil(iterations / 4)); i < iterations; i++) {
    const sid = session();
    const query = KEYWORD_QUERIES[Math.floor(rand() * KEYWORD_QUERIES.length)]!;
    const tsq = tsqueries.get(query)!;
    const vector = literal(localEmbed(query, DIMS));
    const runOurs = async () => {
      const t = performance.now();
      const r = await searchSession(deps, TENANT, sid, {
        query,
        match: c.match,
        limit: LIMIT,
        time_range: 'all',
        exclude_window: false,
      });
      if (i >= 0) {
        ours.push(performance.now() - t);
        hitsTotal += r.hits.length;
      }
    };
    const runBase = async () => {
      const t = performance.now();
      if (c.match === 'keyword') await deps.db.query(BASELINE_KEYWORD, [TENANT, sid, tsq], ON_SEARCH);
      else if (c.match === 'semantic')
        await deps.db.query(BASELINE_SEMANTIC, [TENANT, sid, vector], ON_SEARCH);
      else await deps.db.query(BASELINE_HYBRID, [TENANT, sid, tsq, vector], ON_SEARCH);
      if (i >= 0) base.push(performance.now() - t);
    };
    await pair(i, runOurs, runBase);
  }
  return {
    ours: summarize(ours),
    base: summarize(base),
    p95: { ours: p95(ours), base: p95(base) },
    hitsPerQuery: hitsTotal / iterations,
    iterations,
  };
}

/**
 * Keyword search on the big session, query by query (the mix's p50 falls on whichever query the
 * draw puts in the middle): `runs` interleaved pairs each, after one unmeasured pair.
 */
async function measurePerQuery(deps: SearchDeps, tsqueries: Map<string, string>, runs: number) {
  const rows: string[][] = [];
  for (const query of KEYWORD_QUERIES) {
    const ours: number[] = [];
    const base: number[] = [];
    for (let i = -1; i < runs; i++) {
      const runOurs = async () => {
        const t = performance.now();
        await searchSession(deps, TENANT, BIG_SESSION, {
          query,
          match: 'keyword',
          limit: LIMIT,
          time_range: 'all',
          exclude_window: false,
        });
        if (i >= 0) ours.push(performance.now() - t);
      };
      const runBase = async () => {
        const t = performance.now();
        await deps.db.query(BASELINE_KEYWORD, [TENANT, BIG_SESSION, tsqueries.get(query)], ON_SEARCH);
        if (i >= 0) base.push(performance.now() - t);
      };
      await pair(i, runOurs, runBase);
    }
    const o = summarize(ours).p50;
    const b = summarize(base).p50;
    // A | ends a table cell even inside a code span.
    const cell = (text: string) => `\`${text.replaceAll('|', '\\|')}\``;
    rows.push([
      cell(query),
      cell(tsqueries.get(query) || '(empty)'),
      fmtMs(o),
      fmtMs(b),
      fmtRatio(ratio(o, b)),
    ]);
  }
  return rows;
}

function p95(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.ceil(0.95 * s.length) - 1)]!;
}

/** The plan of the statement `run` sends (run against a Queryable that only records it). */
async function explainCall(db: Db, run: (q: Queryable) => Promise<unknown>): Promise<string> {
  let sent: { text: string; params: unknown[] } | null = null;
  await run({
    query: (text, params) => {
      sent = { text, params: params ?? [] };
      return Promise.resolve({ rows: [], rowCount: 0 });
    },
  });
  const call = sent as { text: string; params: unknown[] } | null;
  return call ? explain(db, call.text, call.params) : '(no statement)';
}

async function explain(db: Queryable, sql: string, params: unknown[]): Promise<string> {
  const r = await db.query<{ 'QUERY PLAN': string }>(
    `EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) ${sql}`,
    params,
  );
  return r.rows.map((x) => x['QUERY PLAN'].replace(/'\[[^\]]*\]'::vector/g, '$vector')).join('\n');
}

// ---------------------------------------------------------------------------------------------
// Peer baseline: LangGraph's PostgresStore semantic search on the same vectors.

interface LgItem {
  key: string;
  namespace: string[];
  value: Record<string, unknown>;
  score?: number;
}
interface LgEmbeddings {
  embedDocuments(texts: string[]): Promise<number[][]>;
  embedQuery(text: string): Promise<number[]>;
}
interface LgStore {
  setup(): Promise<void>;
  batch(ops: Array<{ namespace: string[]; key: string; value: Record<string, unknown> }>): Promise<unknown[]>;
  search(prefix: string[], options: { query?: string; limit?: number }): Promise<LgItem[]>;
  stop(): Promise<void>;
}
type LgStoreClass = new (config: {
  connectionOptions: { connectionString: string; max: number; application_name: string };
  schema?: string;
  ensureTables?: boolean;
  index?: { dims: number; embed: LgEmbeddings; fields?: string[] };
}) => LgStore;

function loadLangGraph(): { PostgresStore: LgStoreClass; version: string } | { error: string } {
  const installError = ensurePeers();
  if (installError) return { error: installError };
  try {
    const { PostgresStore } = requirePeer<{ PostgresStore: LgStoreClass }>(
      '@langchain/langgraph-checkpoint-postgres/store',
    );
    const version = [
      '@langchain/langgraph-checkpoint-postgres',
      '@langchain/langgraph-checkpoint',
      '@langchain/core',
    ]
      .map((name) => `${name} ${peerVersion(name)}`)
      .join(', ');
    return { PostgresStore, version };
  } catch (err) {
    return {
      error: `cannot load @langchain/langgraph-checkpoint-postgres from bench/peers: ${(err as Error).message}`,
    };
  }
}

// LangGraph rejects "_" in namespace labels (a LIKE wildcard), and its search takes a namespace
// *prefix* (`namespace_path LIKE 'a:b%'`), so session s1 would also match s10…s19: fixed-width
// labels keep each search to one session.
const LG_TENANT = TENANT.replaceAll('_', '-');
const lgSession = (i: number) => `s${String(i).padStart(6, '0')}`;

/** A document's vector, queued by the loader in put order and handed out by `embedDocuments`. */
interface PendingVector {
  text: string;
  vector: string;
}

/** The statements `run` sends through `store` (patched pool.connect; null when its internals differ). */
async function captureLgStatements(
  store: LgStore,
  run: () => Promise<unknown>,
): Promise<Array<{ text: string; params: unknown[] }> | null> {
  type Client = {
    query: (text: string, params?: unknown[]) => Promise<unknown>;
    release: (e?: unknown) => void;
  };
  const pool = (store as unknown as { core?: { pool?: { connect?: () => Promise<Client> } } }).core?.pool;
  if (!pool || typeof pool.connect !== 'function') return null;
  const connect = pool.connect;
  const sent: Array<{ text: string; params: unknown[] }> = [];
  pool.connect = async () => {
    const client = await connect.call(pool);
    const { query, release } = client;
    client.query = (text, params) => {
      sent.push({ text, params: params ?? [] });
      return query.call(client, text, params);
    };
    client.release = (e) => {
      client.query = query;
      client.release = release;
      release.call(client, e);
    };
    return client;
  };
  try {
    await run();
  } finally {
    pool.connect = connect;
  }
  return sent;
}

interface LgRun {
  ours: number[];
  theirs: number[];
  oursHits: number;
  theirHits: number;
  /** LangGraph hits that searchSession also returned. */
  agree: number;
  /** Calls where both ranked the same message first. */
  sameTop: number;
}

/** searchSession (semantic) and store.search on the same session and query, call by call. */
async function measureLangGraph(
  deps: SearchDeps,
  store: LgStore,
  sessions: number[],
  lrand: () => number,
): Promise<LgRun> {
  const run: LgRun = { ours: [], theirs: [], oursHits: 0, theirHits: 0, agree: 0, sameTop: 0 };
  for (let i = -LG_WARM_UP; i < ITERATIONS; i++) {
    const idx = sessions[Math.floor(lrand() * sessions.length)]!;
    const query = KEYWORD_QUERIES[Math.floor(lrand() * KEYWORD_QUERIES.length)]!;
    let mine: number[] = [];
    let peer: number[] = [];
    const runOurs = async () => {
      const t = performance.now();
      const r = await searchSession(deps, TENANT, `s${idx}`, {
        query,
        match: 'semantic',
        limit: LIMIT,
        time_range: 'all',
        exclude_window: false,
      });
      if (i >= 0) run.ours.push(performance.now() - t);
      mine = r.hits.map((h) => h.seq);
    };
    const runTheirs = async () => {
      const t = performance.now();
      const r = await store.search([LG_TENANT, lgSession(idx)], { query, limit: LIMIT });
      if (i >= 0) run.theirs.push(performance.now() - t);
      peer = r.map((x) => Number(x.value.seq));
    };
    await pair(i, runOurs, runTheirs);
    if (i >= 0) {
      run.oursHits += mine.length;
      run.theirHits += peer.length;
      run.agree += peer.filter((seq) => mine.includes(seq)).length;
      if (peer.length > 0 && peer[0] === mine[0]) run.sameTop++;
    }
  }
  return run;
}

/** LangGraph's search statement for one session, as the store sends it, explained (ANALYZE). */
async function explainLangGraph(db: Db, store: LgStore, idx: number, noSeqScan = false): Promise<string> {
  const sent = await captureLgStatements(store, () =>
    store.search([LG_TENANT, lgSession(idx)], { query: 'connection pool', limit: LIMIT }),
  );
  const statement = sent?.find((x) => x.text.includes('store_vectors'));
  if (!statement) return '(statement not captured: PostgresStore internals differ from 1.0.x)';
  return db.transaction(async (tx) => {
    if (noSeqScan) await tx.query('SET LOCAL enable_seqscan = off');
    return explain(tx, statement.text, statement.params);
  });
}

async function phaseLangGraph(db: Db, url: string, deps: SearchDeps, perSession: number): Promise<string[]> {
  const head = `## LangGraph PostgresStore semantic search on the same vectors (peer baseline)`;
  if (!LANGGRAPH) return [head, '', 'Skipped with --no-langgraph.'];
  const lg = loadLangGraph();
  if ('error' in lg) {
    note(`LangGraph unavailable: ${lg.error}; phase skipped`);
    return [head, '', `NOT MEASURED: ${lg.error}.`];
  }
  const stores: LgStore[] = [];
  const stopStores = () => Promise.all(stores.splice(0).map((s) => s.stop().catch(() => undefined)));
  // Its pools must be gone before cleanupScratch drops the database (also on SIGINT).
  onCleanup(async () => {
    await stopStores();
  });
  try {
    // Documents get the vectors read back from mnemos's message_vectors (queued by the loader in
    // put order, text checked); a query gets exactly the vector searchSession embeds (same
    // embedder, same input preparation). No model anywhere.
    const embed = (queue: PendingVector[] | null): LgEmbeddings => ({
      embedDocuments: (texts) => {
        if (!queue) return Promise.reject(new Error('the search store does not embed documents'));
        return Promise.resolve(
          texts.map((text) => {
            const next = queue.shift();
            if (!next || next.text !== text)
              throw new Error(`embed: unexpected document text ${JSON.stringify(text.slice(0, 40))}`);
            return JSON.parse(next.vector) as number[];
          }),
        );
      },
      embedQuery: async (text) => {
        const v = await embedQuery(deps, TENANT, 'bench', parseSearchQuery(text).embedText);
        if (!v) throw new Error('query embedding failed');
        return v;
      },
    });
    const makeStore = (queue: PendingVector[] | null) => {
      const store = new lg.PostgresStore({
        connectionOptions: { connectionString: url, max: 1, application_name: 'mnemos-bench-langgraph' },
        schema: LG_SCHEMA,
        ensureTables: false,
        index: { dims: DIMS, embed: embed(queue), fields: ['content'] },
      });
      stores.push(store);
      return store;
    };
    const sizes = async () =>
      (
        await db.query<{ name: string; size: string }>(
          `SELECT c.relname AS name, pg_size_pretty(pg_total_relation_size(c.oid)) AS size
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = $1 AND c.relname IN ('store', 'store_vectors') ORDER BY 1`,
          [LG_SCHEMA],
        )
      ).rows
        .map((r) => `${r.name} ${r.size}`)
        .join(', ');

    // 1. Through the API: LangGraph's own tables and HNSW index (PostgresStore.setup(): m=16,
    //    ef_construction=200, cosine), then one store.batch of puts per session by two loaders,
    //    bounded by count and time.
    const loaderQueues: PendingVector[][] = [[], []];
    const loaders = loaderQueues.map((q) => makeStore(q));
    await loaders[0]!.setup();
    const stride = SESSIONS / LG_SESSIONS;
    const planned = Array.from({ length: LG_SESSIONS }, (_, i) => Math.floor(i * stride));
    note(
      `LangGraph: loading up to ${planned.length} sessions × ${HOT} items by put, at most ${LG_SECONDS} s`,
    );
    const loaded: number[] = [];
    let items = 0;
    let next = 0;
    const t0 = performance.now();
    const deadline = t0 + LG_SECONDS * 1000;
    const worker = async (store: LgStore, queue: PendingVector[]) => {
      for (let i = next++; i < planned.length && performance.now() < deadline; i = next++) {
        const idx = planned[i]!;
        const r = await db.query<{ seq: string; role: string; content: string; v: string }>(
          `SELECT m.seq, m.role, m.content, v.embedding::text AS v
             FROM message_vectors v JOIN messages m USING (tenant_id, session_id, seq)
            WHERE v.tenant_id = $1 AND v.session_id = $2 ORDER BY seq`,
          [TENANT, `s${idx}`],
        );
        for (const row of r.rows) queue.push({ text: row.content.trim(), vector: row.v });
        await store.batch(
          r.rows.map((row) => ({
            namespace: [LG_TENANT, lgSession(idx)],
            key: `m${row.seq}`,
            value: { seq: Number(row.seq), role: row.role, content: row.content },
          })),
        );
        loaded.push(idx);
        items += r.rows.length;
      }
    };
    await Promise.all(loaders.map((s, i) => worker(s, loaderQueues[i]!)));
    const loadMs = performance.now() - t0;
    const stoppedBy = loaded.length < planned.length ? `the ${LG_SECONDS} s bound` : 'count';
    note(`LangGraph: loaded ${loaded.length} sessions (${items} items) in ${(loadMs / 1000).toFixed(1)} s`);
    if (loaded.length === 0) return [head, '', 'NOT MEASURED: no session could be loaded in time.'];
    await db.query(`VACUUM ANALYZE ${LG_SCHEMA}.store`);
    await db.query(`VACUUM ANALYZE ${LG_SCHEMA}.store_vectors`);

    // Own PRNG: the rest of the bench keeps its sequence.
    const lrand = makeRandom(0x1a96a9);
    note(`LangGraph: measuring semantic search on ${loaded.length} sessions (${items} items in the store)`);
    let store = makeStore(null);
    const runs: Array<{ label: string; items: number; run: LgRun; sizes: string; plan: string }> = [];
    runs.push({
      label: `put-loaded: ${loaded.length} sessions`,
      items,
      run: await measureLangGraph(deps, store, loaded, lrand),
      sizes: await sizes(),
      plan: await explainLangGraph(db, store, loaded[0]!),
    });
    const planNoSeq = await explainLangGraph(db, store, loaded[0]!, true);
    // Does its search ever touch the HNSW index? Its scan counter, read after the pools end (a
    // backend flushes its counters on exit).
    await stopStores();
    await new Promise((r) => setTimeout(r, 1000));
    const scans = (
      await db.query<{ index: string; idx_scan: string }>(
        `SELECT indexrelname AS index, idx_scan::text AS idx_scan FROM pg_stat_user_indexes
          WHERE schemaname = $1 ORDER BY relname, indexrelname`,
        [LG_SCHEMA],
      )
    ).rows;
    const hnsw = scans.find((r) => r.index.includes('hnsw'));
    const hnswSize = hnsw
      ? (
          await db.query<{ s: string }>(`SELECT pg_size_pretty(pg_relation_size($1::regclass)) AS s`, [
            `${LG_SCHEMA}.${hnsw.index}`,
          ])
        ).rows[0]?.s
      : undefined;

    // 2. The same vectors as mnemos holds: every recent, vector-indexed message of every session
    //    (big one included), the rest added by SQL in LangGraph's own row format (puts at ~100/s
    //    would take minutes). The HNSW index is dropped first: inserting into it runs at
    //    hundreds of rows/s (FACTS.md) and, as counted above, its search never reads it.
    let fill = '';
    if (LG_FILL) {
      note('LangGraph: adding the other sessions by SQL (HNSW index dropped)');
      const f0 = performance.now();
      if (hnsw) await db.query(`DROP INDEX ${LG_SCHEMA}.${hnsw.index}`);
      const ns = `$1 || ':' || CASE WHEN v.session_id = $2 THEN v.session_id
                    ELSE 's' || lpad(substr(v.session_id, 2), 6, '0') END`;
      const from = `FROM message_vectors v JOIN messages m USING (tenant_id, session_id, seq)
                    WHERE v.tenant_id = $3 AND NOT (v.session_id = ANY ($4::text[]))`;
      const params = [LG_TENANT, BIG_SESSION, TENANT, loaded.map((i) => `s${i}`)];
      const added = await db.query(
        `INSERT INTO ${LG_SCHEMA}.store (namespace_path, key, value)
         SELECT ${ns}, 'm' || v.seq, jsonb_build_object('seq', v.seq, 'role', m.role, 'content', m.content) ${from}`,
        params,
      );
      await db.query(
        `INSERT INTO ${LG_SCHEMA}.store_vectors (namespace_path, key, field_path, text_content, embedding)
         SELECT ${ns}, 'm' || v.seq, 'content', btrim(m.content), v.embedding ${from}`,
        params,
      );
      await db.query(`VACUUM ANALYZE ${LG_SCHEMA}.store`);
      await db.query(`VACUUM ANALYZE ${LG_SCHEMA}.store_vectors`);
      const total = items + (added.rowCount ?? 0);
      fill = `Then ${fmtInt(added.rowCount ?? 0)} more items added by SQL (${((performance.now() - f0) / 1000).toFixed(0)} s, HNSW index dropped first), so LangGraph's store mirrors mnemos's whole recent index.`;
      note(`LangGraph: measuring again with ${total} items in the store`);
      store = makeStore(null);
      runs.push({
        label: `mirror: all ${SESSIONS + 1} sessions`,
        items: total,
        run: await measureLangGraph(deps, store, loaded, lrand),
        sizes: await sizes(),
        plan: await explainLangGraph(db, store, loaded[0]!),
      });
    }

    const verdict = (r: LgRun) => {
      const x = ratio(p95(r.ours), p95(r.theirs));
      return `${fmtRatio(x)} (${x <= 0.5 ? 'met' : 'NOT met'})`;
    };
    return [
      head,
      '',
      `${lg.version}, in schema ${LG_SCHEMA} of the same scratch database. Loaded by put ` +
        `${loaded.length} of ${planned.length} planned typical sessions (stopped by ${stoppedBy}): ` +
        `${fmtInt(items)} items, the ${HOT} recent, vector-indexed messages of each with their ${DIMS}-d ` +
        `vectors read back from message_vectors, in ${(loadMs / 1000).toFixed(1)} s = ` +
        `${fmtInt((items * 1000) / loadMs)} puts/s (2 loaders, one store.batch of ${HOT} puts per ` +
        `session, HNSW index present). ${fill} Searches run on the put-loaded sessions only: ` +
        `store.search([${LG_TENANT}, s000123], { query, limit: ${LIMIT} }) vs searchSession(match ` +
        `semantic, limit ${LIMIT}; sessions of ${fmtInt(perSession)} messages), same session and ` +
        `query per call, order alternating, concurrency 1, warm-up ${LG_WARM_UP}; both embed the ` +
        `query with the same local embedder.`,
      '',
      markdownTable(
        [
          'LangGraph store',
          'items',
          'searchSession p50',
          'p95',
          'LangGraph p50',
          'p95',
          'ratio p50',
          'ratio p95',
          'runs',
          'hits/query',
          'same hits',
          'same #1',
        ],
        runs.map(({ label, items: n, run: r }) => [
          label,
          fmtInt(n),
          fmtMs(summarize(r.ours).p50),
          fmtMs(p95(r.ours)),
          fmtMs(summarize(r.theirs).p50),
          fmtMs(p95(r.theirs)),
          fmtRatio(ratio(summarize(r.ours).p50, summarize(r.theirs).p50)),
          fmtRatio(ratio(p95(r.ours), p95(r.theirs))),
          String(r.ours.length),
          `${(r.oursHits / r.ours.length).toFixed(1)} / ${(r.theirHits / r.theirs.length).toFixed(1)}`,
          `${((100 * r.agree) / Math.max(1, r.theirHits)).toFixed(0)} %`,
          `${((100 * r.sameTop) / r.theirs.length).toFixed(0)} %`,
        ]),
      ),
      '',
      `Target mnemos p95 ≤ 0.50× LangGraph p95: ${runs.map((r) => `${r.label}: ${verdict(r.run)}`).join('; ')}. ` +
        `"same hits": share of LangGraph's hits that searchSession also returned (searchSession ` +
        `skips a hit already shown as a neighbour of a better one, and takes the next); "same #1": ` +
        `calls where both ranked the same message first (they differ on \`timezone -server\`: ` +
        `searchSession applies the exclusion to semantic hits too, LangGraph has no such syntax).`,
      '',
      `HNSW: ${hnsw ? `${hnsw.index} (${hnswSize}) idx_scan = ${hnsw.idx_scan} after ${LG_WARM_UP + ITERATIONS + 2} searches on the put-loaded store` : 'no HNSW index found'}. ` +
        `Index scans there (loading included): ${scans.map((r) => `${r.index} ${r.idx_scan}`).join(', ')}.`,
      '',
      ...runs.flatMap((r) => [
        `Plan of LangGraph's search statement (as sent, one session), ${r.label} (${r.sizes}):`,
        '```',
        r.plan,
        '```',
      ]),
      'Put-loaded store, the same with enable_seqscan = off:',
      '```',
      planNoSeq,
      '```',
    ];
  } finally {
    await stopStores();
  }
}

async function main() {
  cleanupOnSignals();
  await dropStaleScratchDatabases();
  const scratch = await createScratchDatabase('search');
  const db = makePgDb({ connectionString: scratch.url, max: 4, applicationName: 'mnemos-bench' });
  try {
    note(
      `loading ${fmtInt(MESSAGES)} messages over ${SESSIONS} sessions (+${BIG} in one), ${DIMS}-d vectors`,
    );
    const loaded = await load(db);
    const config = loadConfig({
      DATABASE_URL: scratch.url,
      EMBEDDING_DIMENSIONS: String(DIMS),
      LOG_LEVEL: 'silent',
    });
    const deps: SearchDeps = {
      db,
      config,
      llm: null,
      logger: makeLogger('silent'),
      metrics: makeMetrics(),
      // The loaded vectors are clusters standing for a model's (see clusteredVector).
      syntheticVectors: true,
    };
    // What the service's ann-indexes maintenance task does for sessions of ANN_MIN_VECTORS or more.
    let annNote = 'Per-session HNSW indexes: off (--no-ann).';
    if (ANN) {
      // The service records its embedder at start-up (ensureVectorIndex); the task reads it.
      await initVectorIndex(db, LOCAL_EMBEDDING_MODEL, DIMS);
      const t = performance.now();
      const ann = await maintainAnnIndexes(deps, { maxBuilds: 10 });
      const sizes = await db.query<{ size: string }>(
        `SELECT coalesce(pg_size_pretty(sum(pg_relation_size(to_regclass(index_name)))), '0') AS size
         FROM vector_ann_indexes`,
      );
      annNote =
        `Per-session HNSW indexes (ANN_MIN_VECTORS ${fmtInt(config.annMinVectors)}): ${ann.built.length} built ` +
        `in ${((performance.now() - t) / 1000).toFixed(1)} s (${sizes.rows[0]?.size}), as the ann-indexes ` +
        `maintenance task builds them; the baselines stay exact.`;
      note(annNote);
    }
    // What the search-indexes maintenance task does for sessions of SEARCH_INDEX_MIN_MESSAGES or more.
    let searchIndexNote = 'Per-session full-text and trigram indexes: off (--no-search-indexes).';
    if (SEARCH_INDEXES) {
      const t = performance.now();
      const built = await maintainSessionIndexes(deps, { maxBuilds: 10 });
      const sizes = await db.query<{ kind: string; size: string }>(
        `SELECT kind, pg_size_pretty(sum(pg_relation_size(to_regclass(index_name)))) AS size
         FROM session_search_indexes GROUP BY kind ORDER BY kind`,
      );
      searchIndexNote =
        `Per-session search indexes (SEARCH_INDEX_MIN_MESSAGES ${fmtInt(config.searchIndexMinMessages)}): ` +
        `${built.built.length} built in ${((performance.now() - t) / 1000).toFixed(1)} s ` +
        `(${sizes.rows.map((r) => `${r.kind} ${r.size}`).join(', ') || 'none'})` +
        `${built.trigramsUnavailable ? ', pg_trgm unavailable' : ''}, as the search-indexes ` +
        `maintenance task builds them; the baselines run on the same database.`;
      note(searchIndexNote);
    }

    const embedSamples: number[] = [];
    for (let i = 0; i < 200; i++) {
      const t = performance.now();
      localEmbed(KEYWORD_QUERIES[i % KEYWORD_QUERIES.length]!, DIMS);
      embedSamples.push(performance.now() - t);
    }

    const tsqueries = new Map<string, string>();
    for (const q of KEYWORD_QUERIES) tsqueries.set(q, await tsqueryText(db, q));

    const out: string[][] = [];
    for (const target of ['typical', 'big'] as const) {
      for (const match of ['keyword', 'semantic', 'hybrid'] as const) {
        note(`measuring ${match} on the ${target} session(s)`);
        const m = await measure(deps, { match, target }, tsqueries);
        out.push([
          target === 'big'
            ? `big (${fmtInt(BIG)} short, hot)`
            : `typical (${fmtInt(loaded.perSession)} msgs)`,
          match,
          fmtMs(m.ours.p50),
          fmtMs(m.p95.ours),
          fmtMs(m.base.p50),
          fmtMs(m.p95.base),
          fmtRatio(ratio(m.ours.p50, m.base.p50)),
          fmtRatio(ratio(m.p95.ours, m.p95.base)),
          String(m.iterations),
          m.hitsPerQuery.toFixed(1),
        ]);
      }
    }

    note('measuring keyword on the big session, query by query');
    const perQuery = await measurePerQuery(deps, tsqueries, PER_QUERY_RUNS);

    const sizes = await db.query<{ name: string; size: string }>(
      `SELECT name, pg_size_pretty(size) AS size FROM (VALUES
         ('messages (table + TOAST + indexes)', pg_total_relation_size('messages')),
         ('messages heap', pg_relation_size('messages')),
         ('messages_fts (GIN)', pg_relation_size('messages_fts')),
         ('messages_pkey', pg_relation_size('messages_pkey')),
         ('messages_sent_at', pg_relation_size('messages_sent_at')),
         ('messages_client_id', pg_relation_size('messages_client_id')),
         ('message_vectors (table + TOAST + indexes)', pg_total_relation_size('message_vectors')),
         ('message_vectors_pkey', pg_relation_size('message_vectors_pkey'))) AS t(name, size)`,
    );
    const mwm = await db.query<{ maintenance_work_mem: string }>('SHOW maintenance_work_mem');
    const bigText = await db.query<{ size: string; mean: number }>(
      `SELECT pg_size_pretty(sum(octet_length(content))) AS size, avg(octet_length(content))::int AS mean
       FROM messages WHERE tenant_id = $1 AND session_id = $2`,
      [TENANT, BIG_SESSION],
    );
    const bigVector = literal(clusteredVector());

    const lines = [
      `## search bench: ${fmtInt(loaded.rows)} archived messages in ${SESSIONS + 1} sessions, ` +
        `${fmtInt(loaded.vectors)} ${DIMS}-d vectors`,
      '',
      `Load: ${loaded.seconds.toFixed(0)} s (${fmtInt(loaded.rows / loaded.seconds)} messages/s incl. vectors). ` +
        `Runs per row after a warm-up of a quarter (at most 20), concurrency 1, limit ${LIMIT} ` +
        `(${K} candidates per matcher). Local query embedding (${DIMS}-d): p50 ` +
        `${fmtMs(summarize(embedSamples).p50)}.`,
      '',
      `Big session: ${fmtInt(BIG)} messages, ${bigText.rows[0]?.size} of text (${bigText.rows[0]?.mean} bytes on average), all in the recent index.`,
      '',
      annNote,
      '',
      searchIndexNote,
      '',
      markdownTable(
        [
          'session',
          'match',
          'searchSession p50',
          'p95',
          'baseline SQL p50',
          'p95',
          'ratio p50',
          'ratio p95',
          'runs',
          'hits/query',
        ],
        out,
      ),
      '',
      `Keyword search on the big session, query by query (p50 of ${PER_QUERY_RUNS} interleaved runs each; ` +
        'the baseline is the plain full-text statement with the same tsquery, exclusions included):',
      '',
      markdownTable(['query', 'tsquery', 'searchSession p50', 'baseline SQL p50', 'ratio'], perQuery),
      '',
      markdownTable(
        ['relation', 'size'],
        sizes.rows.map((r) => [r.name, r.size]),
      ),
      '',
      `maintenance_work_mem: ${mwm.rows[0]?.maintenance_work_mem}`,
      '',
      'Plan of the semantic baseline on the big session:',
      '```',
      await explain(db, BASELINE_SEMANTIC, [TENANT, BIG_SESSION, bigVector]),
      '```',
      'Plan of the semantic baseline on a typical session:',
      '```',
      await explain(db, BASELINE_SEMANTIC, [TENANT, 's7', bigVector]),
      '```',
      "Plan of searchSession's semantic statement (k-NN + neighbours) on the big session:",
      '```',
      await explainCall(db, (q) =>
        semanticCandidates(q, { ...noFilters(BIG_SESSION), embedding: clusteredVector(), k: K }),
      ),
      '```',
      "Plan of searchSession's semantic statement on a typical session:",
      '```',
      await explainCall(db, (q) =>
        semanticCandidates(q, { ...noFilters('s7'), embedding: clusteredVector(), k: K }),
      ),
      '```',
      'Plan of the keyword baseline (common words) on a typical session:',
      '```',
      await explain(db, BASELINE_KEYWORD, [TENANT, 's7', tsqueries.get('connection pool')]),
      '```',
    ];
    process.stdout.write(`${lines.join('\n')}\n`);

    let peer: string[];
    try {
      peer = await phaseLangGraph(db, scratch.url, deps, loaded.perSession);
    } catch (err) {
      // The mnemos figures above stand; say the peer run failed and exit non-zero.
      process.exitCode = 1;
      peer = [
        '## LangGraph PostgresStore (peer baseline)',
        '',
        `FAILED: ${(err as Error).stack ?? String(err)}`,
      ];
    }
    process.stdout.write(`\n${peer.join('\n')}\n`);
  } finally {
    await db.close().catch(() => undefined);
    if (KEEP) note(`kept ${scratch.url}`);
    else for (const line of await cleanupScratch()) note(`cleanup: ${line}`);
  }
}

await main();
