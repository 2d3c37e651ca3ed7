/**
 * Which index serves the recent index's k-NN? Per-session exact k-NN over the primary-key btree
 * (what mnemos ships: filter tenant + session, ORDER BY embedding <=> q LIMIT k) against an HNSW
 * index over a typed copy of the same vectors, at 384 and 1536 dimensions.
 *
 *   node --import tsx bench/vector-index.ts [--sessions 200] [--messages 100] [--big 5000] [--queries 300]
 *
 * Vectors are CLUSTERED (FACTS.md: uniform random vectors give meaningless recall and insert
 * rates): 64 shared topic centroids, each session talks about 5 of them, each message is one of
 * its session's topics plus noise (cosine to the centroid ≈ 0.8), each query likewise. One extra
 * long session (`--big` messages, ~4 MiB of hot history) shows the exact scan's worst case.
 * The corpus is generated inside Postgres (seeded; formatting 40M floats in JavaScript took
 * longer than everything else), and the insert rates are measured the way the embed worker
 * writes: text literals sent as parameters, `::vector` casts, 500-row bulk INSERTs and 20-row
 * per-session batches, with and without HNSW present. Also: HNSW build time; query p50/p95;
 * recall@10 against the exact results; the plans. Own scratch database, dropped at the end;
 * every timed phase is bounded.
 */
import { makePgDb } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import { createTestDatabase, dropTestDatabase } from '../test/support/harness.js';
import { intArg } from './lib/args.js';

const SESSIONS = intArg('sessions', 200);
const PER_SESSION = intArg('messages', 100);
const BIG_SESSION = intArg('big', 5000);
const QUERIES = intArg('queries', 300);
const K = 10;
const TOPICS = 64;
const TOPICS_PER_SESSION = 5;
const SAMPLE_ROWS = 5000;
const FRESH_ROWS = 600;
const FRESH_BATCH = 20;
const PHASE_BUDGET_MS = 8_000;
const TENANT = 'bench-tenant';

interface Row {
  session: string;
  seq: string;
  vec: string;
}

const pct = (sorted: number[], p: number) =>
  sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
const fmt = (x: number) => x.toFixed(x < 10 ? 2 : 0);

/**
 * Seeded corpus in `bench_corpus` (session, seq, embedding): topic centroid + uniform noise of
 * unit variance scaled so cos ≈ 0.8, L2-normalised. Sessions s0…s(N-1) and `big`.
 */
async function generateCorpus(db: Db, dims: number): Promise<void> {
  const sigma = (0.75 * Math.sqrt(3)) / Math.sqrt(dims);
  await db.transaction(async (tx) => {
    await tx.query('SELECT setseed(0.42)');
    await tx.query('DROP TABLE IF EXISTS bench_topics, bench_session_topics, bench_corpus');
    await tx.query(
      `CREATE TABLE bench_topics AS
       SELECT t AS id, l2_normalize(ARRAY(SELECT random() * 2 - 1 + 0 * t FROM generate_series(1, $1))::vector) AS v
       FROM generate_series(0, $2 - 1) AS t`,
      [dims, TOPICS],
    );
    await tx.query(
      `CREATE TABLE bench_session_topics AS
       SELECT s.name, slot, floor(random() * $1)::int AS topic
       FROM (SELECT 's' || i AS name FROM generate_series(0, $2 - 1) AS i UNION ALL SELECT 'big') AS s,
            generate_series(0, $3 - 1) AS slot`,
      [TOPICS, SESSIONS, TOPICS_PER_SESSION],
    );
    // One row per message: its session's topic for a random slot, plus noise.
    await tx.query(
      `CREATE TABLE bench_corpus AS
       SELECT m.session, m.seq,
         l2_normalize(t.v + ARRAY(SELECT (random() * 2 - 1) * $1 + 0 * m.seq FROM generate_series(1, $2))::vector) AS embedding
       FROM (SELECT 's' || i AS session, j AS seq, floor(random() * $3)::int AS slot
             FROM generate_series(0, $4 - 1) AS i, generate_series(1, $5) AS j
             UNION ALL
             SELECT 'big', j, floor(random() * $3)::int FROM generate_series(1, $6) AS j) AS m
       JOIN bench_session_topics st ON st.name = m.session AND st.slot = m.slot
       JOIN bench_topics t ON t.id = st.topic`,
      [sigma, dims, TOPICS_PER_SESSION, SESSIONS, PER_SESSION, BIG_SESSION],
    );
  });
}

/** Query vectors (or new messages) drawn like the corpus, as text literals for parameters. */
async function drawVectors(db: Db, dims: number, n: number, sessions: 'any' | 'big'): Promise<Row[]> {
  const sigma = (0.75 * Math.sqrt(3)) / Math.sqrt(dims);
  const r = await db.query<Row>(
    `SELECT st.name AS session, (1000000 + g)::text AS seq,
       l2_normalize(t.v + ARRAY(SELECT (random() * 2 - 1) * $1 + 0 * g FROM generate_series(1, $2))::vector)::text AS vec
     FROM generate_series(1, $3) AS g
     CROSS JOIN LATERAL (
       SELECT name, topic FROM bench_session_topics
       WHERE ($4 = 'big') = (name = 'big') AND g = g
       ORDER BY random() LIMIT 1) AS st
     JOIN bench_topics t ON t.id = st.topic`,
    [sigma, dims, n, sessions],
  );
  return r.rows;
}

async function insertRows(db: Db, table: string, rows: Row[]): Promise<void> {
  await db.query(
    `INSERT INTO ${table} (tenant_id, session_id, seq, embedding)
     SELECT $1, x.s, x.seq, x.e::vector FROM unnest($2::text[], $3::bigint[], $4::text[]) AS x(s, seq, e)`,
    [TENANT, rows.map((r) => r.session), rows.map((r) => r.seq), rows.map((r) => r.vec)],
  );
}

/** Rows per second inserting `rows` in chunks, stopping at the phase budget. */
async function insertRate(
  db: Db,
  table: string,
  rows: Row[],
  chunk: number,
): Promise<{ rate: number; n: number }> {
  const started = performance.now();
  let n = 0;
  for (let i = 0; i < rows.length; i += chunk) {
    await insertRows(db, table, rows.slice(i, i + chunk));
    n += Math.min(chunk, rows.length - i);
    if (performance.now() - started > PHASE_BUDGET_MS) break;
  }
  return { rate: (n * 1000) / (performance.now() - started), n };
}

const knnSql = (table: string, forceHnsw: boolean) =>
  forceHnsw
    ? // Expressions defeat the btree, so the planner must use HNSW (or scan everything).
      `SELECT seq FROM ${table} WHERE tenant_id || '' = $1 AND session_id || '' = $2
       ORDER BY embedding <=> $3::vector LIMIT ${K}`
    : `SELECT seq FROM ${table} WHERE tenant_id = $1 AND session_id = $2 ORDER BY embedding <=> $3::vector LIMIT ${K}`;

async function queryRun(
  db: Db,
  sql: string,
  queries: Row[],
  settings: string[],
): Promise<{ p50: number; p95: number; results: string[][] }> {
  const times: number[] = [];
  const results: string[][] = [];
  const started = performance.now();
  for (const q of queries) {
    const t0 = performance.now();
    // One round trip when there is nothing to SET (a transaction would add BEGIN and COMMIT).
    const r =
      settings.length === 0
        ? await db.query<{ seq: string }>(sql, [TENANT, q.session, q.vec])
        : await db.transaction(async (tx) => {
            for (const s of settings) await tx.query(s);
            return tx.query<{ seq: string }>(sql, [TENANT, q.session, q.vec]);
          });
    times.push(performance.now() - t0);
    results.push(r.rows.map((x) => x.seq));
    if (performance.now() - started > PHASE_BUDGET_MS) break;
  }
  times.sort((a, b) => a - b);
  return { p50: pct(times, 50), p95: pct(times, 95), results };
}

async function explain(db: Db, sql: string, q: Row, settings: string[]): Promise<string> {
  return db.transaction(async (tx) => {
    for (const s of settings) await tx.query(s);
    const r = await tx.query<{ 'QUERY PLAN': string }>(
      `EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) ${sql}`,
      [TENANT, q.session, q.vec],
    );
    // The query vector's literal would fill the screen.
    return r.rows.map((x) => x['QUERY PLAN'].replace(/'\[[^\]]*\]'::vector/g, '$q::vector')).join('\n');
  });
}

/** Share of the exact top-k found (results compared up to the shorter of the two runs). */
function recall(exact: string[][], got: string[][]): number {
  let hit = 0;
  let total = 0;
  got.forEach((g, i) => {
    const truth = new Set(exact[i] ?? []);
    total += truth.size;
    hit += g.filter((s) => truth.has(s)).length;
  });
  return total === 0 ? Number.NaN : hit / total;
}

async function benchDims(db: Db, dims: number): Promise<void> {
  const t0 = performance.now();
  await generateCorpus(db, dims);
  const sample = await db.query<Row>(
    `SELECT session, (seq + 500000)::text AS seq, embedding::text AS vec FROM bench_corpus ORDER BY session, seq LIMIT $1`,
    [SAMPLE_ROWS],
  );
  const fresh = await drawVectors(db, dims, FRESH_ROWS, 'any');
  // Group the new rows into per-session batches as the embed worker writes them.
  fresh.sort((a, b) => a.session.localeCompare(b.session));
  const queries = await drawVectors(db, dims, QUERIES, 'any');
  const bigQueries = await drawVectors(db, dims, Math.min(QUERIES, 100), 'big');
  const genMs = performance.now() - t0;

  const btree = `bench_btree_${dims}`;
  const hnsw = `bench_hnsw_${dims}`;
  // The shipped shape: untyped vector, primary-key btree only. HNSW needs a typed column.
  await db.query(`CREATE TABLE ${btree} (tenant_id text, session_id text, seq bigint, embedding vector NOT NULL,
    PRIMARY KEY (tenant_id, session_id, seq))`);
  await db.query(`CREATE TABLE ${hnsw} (tenant_id text, session_id text, seq bigint, embedding vector(${dims}) NOT NULL,
    PRIMARY KEY (tenant_id, session_id, seq))`);
  const total = await db.query<{ n: number }>('SELECT count(*)::int AS n FROM bench_corpus');
  for (const t of [btree, hnsw]) {
    await db.query(`INSERT INTO ${t} SELECT $1, session, seq, embedding FROM bench_corpus`, [TENANT]);
  }

  // Bulk rate: 500-row INSERTs of text literals (sample rows under fresh seqs; removed after).
  const bulk = await insertRate(db, btree, sample.rows, 500);
  await db.query(`DELETE FROM ${btree} WHERE seq >= 500000`);
  await db.query(`VACUUM ANALYZE ${btree}`);

  const buildStart = performance.now();
  await db.transaction(async (tx) => {
    await tx.query(`SET LOCAL maintenance_work_mem = '512MB'`);
    await tx.query(`CREATE INDEX ${hnsw}_idx ON ${hnsw} USING hnsw (embedding vector_cosine_ops)`);
  });
  const buildMs = performance.now() - buildStart;
  await db.query(`ANALYZE ${hnsw}`);

  await queryRun(db, knnSql(btree, false), queries.slice(0, 20), []); // warm-up
  const exact = await queryRun(db, knnSql(btree, false), queries, []);
  const planned = await queryRun(db, knnSql(hnsw, false), queries, []);
  const forced = await queryRun(db, knnSql(hnsw, true), queries, ['SET LOCAL enable_seqscan = off']);
  const iterative = ['SET LOCAL enable_seqscan = off', "SET LOCAL hnsw.iterative_scan = 'relaxed_order'"];
  const forcedIter = await queryRun(db, knnSql(hnsw, true), queries, iterative);
  const bigExact = await queryRun(db, knnSql(btree, false), bigQueries, []);
  const bigIter = await queryRun(db, knnSql(hnsw, true), bigQueries, iterative);

  // New per-session batches with and without HNSW present (after the queries: they add rows).
  const freshBtree = await insertRate(db, btree, fresh, FRESH_BATCH);
  const freshHnsw = await insertRate(db, hnsw, fresh, FRESH_BATCH);

  const q0 = queries[0]!;
  const r = (a: { results: string[][] }, b: { results: string[][] }) =>
    recall(a.results, b.results).toFixed(3);
  console.log(
    `\n## ${dims} dimensions: ${SESSIONS} sessions × ${PER_SESSION} messages + one of ${BIG_SESSION} ` +
      `(${total.rows[0]?.n} rows; generated in ${fmt(genMs / 1000)} s)\n`,
  );
  console.log('| measure | btree only (shipped) | with HNSW |');
  console.log('|---|---|---|');
  console.log(
    `| bulk insert, 500-row INSERTs | ${fmt(bulk.rate)} rows/s (${bulk.n} rows) | built after the load |`,
  );
  console.log(`| HNSW build (m=16, ef_construction=64, 512MB) | – | ${fmt(buildMs / 1000)} s |`);
  console.log(
    `| insert of new 20-row session batches | ${fmt(freshBtree.rate)} rows/s (${freshBtree.n} rows) | ` +
      `${fmt(freshHnsw.rate)} rows/s (${freshHnsw.n} rows) |`,
  );
  console.log(
    `| per-session k-NN (k=${K}), as planned | p50 ${fmt(exact.p50)} ms, p95 ${fmt(exact.p95)} ms, recall 1 | ` +
      `p50 ${fmt(planned.p50)} ms, p95 ${fmt(planned.p95)} ms, recall ${r(exact, planned)} (planner keeps the btree) |`,
  );
  console.log(
    `| per-session k-NN forced through HNSW (ef_search=40) | – | p50 ${fmt(forced.p50)} ms, ` +
      `p95 ${fmt(forced.p95)} ms, recall ${r(exact, forced)} |`,
  );
  console.log(
    `| same, hnsw.iterative_scan=relaxed_order | – | p50 ${fmt(forcedIter.p50)} ms, p95 ${fmt(forcedIter.p95)} ms, ` +
      `recall ${r(exact, forcedIter)} |`,
  );
  console.log(
    `| k-NN in the ${BIG_SESSION}-message session | p50 ${fmt(bigExact.p50)} ms, p95 ${fmt(bigExact.p95)} ms, recall 1 | ` +
      `iterative HNSW: p50 ${fmt(bigIter.p50)} ms, p95 ${fmt(bigIter.p95)} ms, recall ${r(bigExact, bigIter)} |`,
  );
  console.log(
    `\nPlan, shipped query (btree only):\n\`\`\`\n${await explain(db, knnSql(btree, false), q0, [])}\n\`\`\``,
  );
  console.log(
    `Plan, same query with HNSW present:\n\`\`\`\n${await explain(db, knnSql(hnsw, false), q0, [])}\n\`\`\``,
  );
  console.log(
    `Plan, HNSW forced:\n\`\`\`\n${await explain(db, knnSql(hnsw, true), q0, ['SET LOCAL enable_seqscan = off'])}\n\`\`\``,
  );
  await db.query(`DROP TABLE ${btree}, ${hnsw}, bench_topics, bench_session_topics, bench_corpus`);
}

const url = await createTestDatabase();
const db = makePgDb({ connectionString: url, max: 2, applicationName: 'mnemos-bench-vector-index' });
const started = performance.now();
try {
  const v = await db.query<{ extversion: string; server: string }>(
    `SELECT extversion, current_setting('server_version') AS server FROM pg_extension WHERE extname = 'vector'`,
  );
  console.log(
    `# recent index: btree exact k-NN vs HNSW (Postgres ${v.rows[0]?.server}, pgvector ${v.rows[0]?.extversion})`,
  );
  for (const dims of [384, 1536]) await benchDims(db, dims);
  console.log(`\ntotal ${((performance.now() - started) / 1000).toFixed(0)} s`);
} finally {
  await db.close();
  await dropTestDatabase(url);
}
