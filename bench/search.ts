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
 *     [--hot 50] [--dims 1536] [--iterations 200] [--big-iterations 30] [--keep]
 *
 * `--keep` leaves the scratch database in place for inspection (its URL is printed; the next
 * bench run drops it once it is an hour old).
 *
 * Query embedding is not part of the semantic timings in substance: the bench runs with the
 * local embedder, whose cost is measured and printed separately (microseconds).
 */
import { performance } from 'node:perf_hooks';
import type { Db, Queryable } from '../db/pool.js';
import { makePgDb } from '../db/pool.js';
import { insertArchiveBatch } from '../db/queries/messages.js';
import { semanticCandidates } from '../db/queries/search.js';
import type { ArchiveInsertRow } from '../db/queries/messages.js';
import { loadConfig } from '../services/config.js';
import { localEmbed } from '../services/llm/local-embedder.js';
import { makeLogger } from '../services/logger.js';
import { makeMetrics } from '../services/metrics.js';
import { ftsLeaves, parseSearchQuery } from '../services/search/parse-query.js';
import type { FtsLeaf } from '../services/search/parse-query.js';
import { searchSession } from '../services/search/search-session.js';
import type { SearchDeps, SearchMatch } from '../services/search/search-session.js';
import { ftsDocument } from '../services/text/fts-text.js';
import { makeCorpus, makeRandom } from './lib/corpus.js';
import { fmtInt, fmtMs, fmtRatio, markdownTable, note } from './lib/format.js';
import {
  cleanupOnSignals,
  cleanupScratch,
  createScratchDatabase,
  dropStaleScratchDatabases,
} from './lib/scratch.js';
import { ratio, summarize } from './lib/stats.js';

const arg = (name: string, dflt: number) => {
  const i = process.argv.indexOf(`--${name}`);
  const v = i >= 0 ? Number(process.argv[i + 1]) : dflt;
  if (!Number.isInteger(v) || v <= 0) throw new Error(`--${name} must be a positive integer`);
  return v;
};
const MESSAGES = arg('messages', 200_000);
const SESSIONS = arg('sessions', 1000);
const BIG = arg('big', 20_000);
const HOT = arg('hot', 50);
const DIMS = arg('dims', 1536);
const ITERATIONS = arg('iterations', 200);
// Exact k-NN over the big session takes about half a second per call at 1536 dimensions.
const BIG_ITERATIONS = arg('big-iterations', 30);
const KEEP = process.argv.includes('--keep');
const LIMIT = 8;
const K = LIMIT * 4;
const TENANT = 't_bench_search';
const BIG_SESSION = 'big-session';
const CLUSTERS = 64;

const rand = makeRandom(0x5ea7c4);
const gauss = () => Math.sqrt(-2 * Math.log(rand() || 1e-12)) * Math.cos(2 * Math.PI * rand());
const centroids = Array.from({ length: CLUSTERS }, () => {
  const v = Array.from({ length: DIMS }, gauss);
  const n = Math.hypot(...v);
  return v.map((x) => x / n);
});
/** A point of a random cluster: centroid plus noise of half its norm (cos ≈ 0.9 within a cluster). */
function clusteredVector(): number[] {
  const c = centroids[Math.floor(rand() * CLUSTERS)]!;
  const sigma = 0.5 / Math.sqrt(DIMS);
  return c.map((x) => x + sigma * gauss());
}
const literal = (v: number[]) => `[${v.map((x) => x.toFixed(5)).join(',')}]`;

const corpus = makeCorpus();
const DAY_MS = 86_400_000;
const now = Date.now();

function rows(sessionIndex: number, count: number, fromSeq: number): ArchiveInsertRow[] {
  const out: ArchiveInsertRow[] = [];
  for (let i = 0; i < count; i++) {
    const seq = fromSeq + i;
    const m = corpus.message(sessionIndex, seq);
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

async function loadSession(db: Db, sessionId: string, sessionIndex: number, count: number, hot: number) {
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
      rows(sessionIndex, Math.min(1000, count - from + 1), from),
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
  note(`loading the big session (${BIG} messages, all embedded)`);
  await loadSession(db, BIG_SESSION, SESSIONS, BIG, BIG);
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
 * db/queries/search.ts), as text, so the keyword baseline runs the very same full-text match.
 */
async function tsqueryText(db: Db, query: string): Promise<string> {
  const params: string[] = [];
  const leaf = (l: FtsLeaf) => {
    params.push(l.text);
    const fn = {
      'english-words': "plainto_tsquery('english', ",
      'english-phrase': "phraseto_tsquery('english', ",
      'cjk-phrase': "phraseto_tsquery('simple', ",
      'cjk-prefix': "to_tsquery('simple', ",
    }[l.kind];
    return `${fn}$${params.length})`;
  };
  const groups = parseSearchQuery(query)
    .groups.map((terms) => terms.map(ftsLeaves).filter((ls) => ls.length > 0))
    .filter((terms) => terms.length > 0)
    .map((terms) => `(${terms.map((ls) => `(${ls.map(leaf).join(' && ')})`).join(' || ')})`);
  if (groups.length === 0) return '';
  const r = await db.query<{ q: string }>(`SELECT (${groups.join(' && ')})::text AS q`, params);
  return r.rows[0]?.q ?? '';
}

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
  windowSize: null,
  excludeFts: [],
  excludeLike: [],
});

interface Case {
  match: SearchMatch;
  target: 'typical' | 'big';
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
      if (c.match === 'keyword') await deps.db.query(BASELINE_KEYWORD, [TENANT, sid, tsq]);
      else if (c.match === 'semantic') await deps.db.query(BASELINE_SEMANTIC, [TENANT, sid, vector]);
      else await deps.db.query(BASELINE_HYBRID, [TENANT, sid, tsq, vector]);
      if (i >= 0) base.push(performance.now() - t);
    };
    // Alternate which goes first so caching favours neither.
    if (i % 2 === 0) {
      await runOurs();
      await runBase();
    } else {
      await runBase();
      await runOurs();
    }
  }
  return {
    ours: summarize(ours),
    base: summarize(base),
    p95: { ours: p95(ours), base: p95(base) },
    hitsPerQuery: hitsTotal / iterations,
    iterations,
  };
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

async function explain(db: Db, sql: string, params: unknown[]): Promise<string> {
  const r = await db.query<{ 'QUERY PLAN': string }>(
    `EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) ${sql}`,
    params,
  );
  return r.rows.map((x) => x['QUERY PLAN'].replace(/'\[[^\]]*\]'::vector/g, '$vector')).join('\n');
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
    const deps: SearchDeps = { db, config, llm: null, logger: makeLogger('silent'), metrics: makeMetrics() };

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
          target === 'big' ? `big (${fmtInt(BIG)} hot)` : `typical (${fmtInt(loaded.perSession)} msgs)`,
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
  } finally {
    await db.close().catch(() => undefined);
    if (KEEP) note(`kept ${scratch.url}`);
    else for (const line of await cleanupScratch()) note(`cleanup: ${line}`);
  }
}

await main();
