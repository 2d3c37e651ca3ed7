/**
 * Design probe behind the per-session HNSW index of huge sessions (issue #9; the service builds
 * the plain design below: services/recent-index/ann-indexes.ts, docs/recent-index.md). Does a
 * per-session PARTIAL HNSW index make semantic search on one huge session fast, while every
 * other session keeps the exact k-NN over the primary-key btree and inserts elsewhere stay at
 * full speed?
 *
 *   npm run bench -- partial-hnsw [--big 20000] [--small 200] [--rounds 100]
 *     [--build-timeout 240] [--extra 20 | --no-extra] [--no-crossover] [--keep]
 *
 * A scratch database (bench/lib/scratch.ts: created, migrated, dropped at the end, on failure and
 * on SIGINT/SIGTERM) gets one session `big` of `--big` 1536-d vectors, `--small` sessions of 50,
 * a session `big384` of `--big` 384-d vectors (in a table of its own, `message_vectors_384`, as a
 * 384-d deployment would have) and `bigF`, a copy of `big`. All vectors are
 * CLUSTERED (64 centroids, cos ≈ 0.9 within a cluster, as bench/search.ts makes them; FACTS.md:
 * never uniform random). A twin table `message_vectors_ctl` (same columns, storage, primary key
 * and foreign key, never any HNSW index) holds a copy of `big` and the small sessions so that
 * "index present" and "index absent" inserts and VACUUMs can be compared in the same run.
 *
 * Two index designs:
 * - plain: `CREATE INDEX CONCURRENTLY … USING hnsw ((embedding::vector(1536)) vector_cosine_ops)
 *   WHERE tenant_id = '<t>' AND session_id = '<s>'` on `big`. The column is an untyped `vector`,
 *   so HNSW can only index a cast to a fixed dimension, and a query reaches the index only when
 *   it orders by that same expression.
 * - frozen prefix: the same with `AND (seq < X::bigint) IS TRUE` on `bigF`, X one past the last
 *   seq at build time; the query is a UNION ALL of the HNSW branch (`(seq < $4) IS TRUE`) and an
 *   exact branch over the unindexed tail (`seq >= $4`), so new vectors never enter the index.
 *   `IS TRUE` keeps the btree from taking the range and the planner from underestimating it.
 * Queries go through node-postgres unnamed statements (custom plans: the planner sees the
 * parameter values and can prove the index predicate), as mnemos sends them.
 */
import { createHash } from 'node:crypto';
import { performance } from 'node:perf_hooks';
// The build connection is a raw client only to catch pgvector's NOTICE ("hnsw graph no longer
// fits into maintenance_work_mem"), which Db does not expose (a bench, not the service).
import pg from 'pg';
import type { Db } from '../db/pool.js';
import { float4ArrayParam, makePgDb } from '../db/pool.js';
import { makeRandom } from './lib/corpus.js';
import { fmtInt, fmtMs, fmtRatio, markdownTable, note } from './lib/format.js';
import { cleanupOnSignals, cleanupScratch, createScratchDatabase } from './lib/scratch.js';
import { percentile, ratio } from './lib/stats.js';
import { intArg } from './lib/args.js';

const BIG = intArg('big', 20_000);
const SMALL_SESSIONS = intArg('small', 200);
const SMALL_N = 50;
const ROUNDS = intArg('rounds', 100);
const BUILD_TIMEOUT_S = intArg('build-timeout', 240);
const EXTRA = process.argv.includes('--no-extra') ? 0 : intArg('extra', 20);
const CROSSOVER = !process.argv.includes('--no-crossover');
// Leaves the scratch database in place (URL printed); drop it by hand afterwards.
const KEEP = process.argv.includes('--keep');
if (SMALL_SESSIONS < 100 || EXTRA > SMALL_SESSIONS / 4)
  throw new Error('need --small >= 100 and --extra <= small / 4 (phases use disjoint small sessions)');
const DIMS = 1536;
const K = 32;
const TENANT = 't_phnsw';
const BIG_S = 'big';
const BIG_F = 'bigF';
const BIG384 = 'big384';
const CTL = 'message_vectors_ctl';
/** A 384-d deployment has a table of its own dimension: rows never share pages with 1536-d ones. */
const T384 = 'message_vectors_384';
/** Frozen-prefix bound: one past the last seq loaded. */
const X = BIG + 1;
const small = (i: number) => `s${i}`;

// ---- clustered vectors (bench/search.ts's generator, per dimension) ----

function clusteredSource(dims: number, seed: number): () => number[] {
  const rand = makeRandom(seed);
  const gauss = () => Math.sqrt(-2 * Math.log(rand() || 1e-12)) * Math.cos(2 * Math.PI * rand());
  const centroids = Array.from({ length: 64 }, () => {
    const v = Array.from({ length: dims }, gauss);
    const n = Math.hypot(...v);
    return v.map((x) => x / n);
  });
  const sigma = 0.5 / Math.sqrt(dims);
  return () => centroids[Math.floor(rand() * 64)]!.map((x) => x + sigma * gauss());
}
const vec1536 = clusteredSource(DIMS, 0x5ea7c4);
const vec384 = clusteredSource(384, 0x384384);

// ---- SQL ----

async function insertVectors(
  db: Db,
  table: string,
  session: string,
  seqs: number[],
  make: () => number[],
): Promise<number> {
  const vectors = seqs.map(() => make());
  const t0 = performance.now();
  // The production form (db/queries/vectors.ts): one flat binary float4[] cut into rows in SQL.
  await db.query(
    `INSERT INTO ${table} (tenant_id, session_id, seq, embedding)
     SELECT $1, $2, x.seq, ($4::float4[])[((x.i - 1) * $5::int)::int + 1 : (x.i * $5::int)::int]::vector
     FROM unnest($3::bigint[]) WITH ORDINALITY AS x(seq, i)`,
    [TENANT, session, seqs, float4ArrayParam(db, vectors), vectors[0]!.length],
  );
  return performance.now() - t0;
}

const range = (from: number, n: number) => Array.from({ length: n }, (_, i) => from + i);

/** The session's cutoff as production reads it (an InitPlan the planner cannot see through). */
const START_SEQ = `(SELECT start_seq FROM sessions WHERE tenant_id = $1 AND id = $2)`;

/** Today's exact k-NN (db/queries/search.ts semanticCte, without the CTE wrapping). */
const exactSql = (table = 'message_vectors', seqBound = START_SEQ) => `
  SELECT v.seq, v.embedding <=> $3::vector AS d FROM ${table} v
  WHERE v.tenant_id = $1 AND v.session_id = $2 AND v.seq >= ${seqBound}
  ORDER BY v.embedding <=> $3::vector, v.seq DESC LIMIT ${K}`;

/** The index-matching form: ORDER BY the indexed expression (no seq tie-break, see its plan). */
const castSql = (table = 'message_vectors', seqBound = START_SEQ, tieBreak = false) => `
  SELECT v.seq, v.embedding::vector(${DIMS}) <=> $3::vector(${DIMS}) AS d FROM ${table} v
  WHERE v.tenant_id = $1 AND v.session_id = $2 AND v.seq >= ${seqBound}
  ORDER BY v.embedding::vector(${DIMS}) <=> $3::vector(${DIMS})${tieBreak ? ', v.seq DESC' : ''} LIMIT ${K}`;

/** Frozen prefix: HNSW below $4, exact at and above it; `isTrue` false shows the planner trap. */
const frozenSql = (isTrue = true) => `
  SELECT seq, d FROM (
    (SELECT v.seq, v.embedding::vector(${DIMS}) <=> $3::vector(${DIMS}) AS d FROM message_vectors v
      WHERE v.tenant_id = $1 AND v.session_id = $2
        AND ${isTrue ? '(v.seq < $4::bigint) IS TRUE' : 'v.seq < $4::bigint'} AND v.seq >= ${START_SEQ}
      ORDER BY v.embedding::vector(${DIMS}) <=> $3::vector(${DIMS}) LIMIT ${K})
    UNION ALL
    (SELECT v.seq, v.embedding <=> $3::vector AS d FROM message_vectors v
      WHERE v.tenant_id = $1 AND v.session_id = $2 AND v.seq >= $4::bigint AND v.seq >= ${START_SEQ}
      ORDER BY v.embedding <=> $3::vector LIMIT ${K})) u
  ORDER BY d, seq DESC LIMIT ${K}`;

const literal = (v: number[]) => JSON.stringify(v);

interface Hit {
  seq: string;
  d: number;
}

async function timed(db: Db, sql: string, params: unknown[]): Promise<{ ms: number; rows: Hit[] }> {
  const t0 = performance.now();
  const r = await db.query<Hit>(sql, params);
  return { ms: performance.now() - t0, rows: r.rows };
}

async function explain(db: Db, sql: string, params: unknown[], analyze = true): Promise<string> {
  const r = await db.query<{ 'QUERY PLAN': string }>(
    `EXPLAIN (${analyze ? 'ANALYZE, BUFFERS, ' : ''}COSTS, SUMMARY) ${sql}`,
    params,
  );
  // Vector literals run to thousands of characters: elide them.
  return r.rows
    .map((x) => x['QUERY PLAN'])
    .join('\n')
    .replace(/'\[[^\]']*\]'/g, "'[…]'");
}

const indexName = (tenant: string, session: string) =>
  `mv_hnsw_${createHash('sha256').update(`${tenant}\0${session}`).digest('hex').slice(0, 16)}`;

/** The DDL, with tenant and session quoted by Postgres itself (%L), never by string pasting. */
async function indexDdl(db: Db, session: string, opts: { concurrently: boolean; below?: number }) {
  const r = await db.query<{ ddl: string }>(
    `SELECT format('CREATE INDEX ${opts.concurrently ? 'CONCURRENTLY ' : ''}%I ON message_vectors USING hnsw ((embedding::vector(%s)) vector_cosine_ops) WHERE tenant_id = %L AND session_id = %L'
             || CASE WHEN $5::bigint IS NULL THEN '' ELSE format(' AND (seq < %s::bigint) IS TRUE', $5::bigint) END,
           $1::text, $2::int, $3::text, $4::text) AS ddl`,
    [indexName(TENANT, session), DIMS, TENANT, session, opts.below ?? null],
  );
  return r.rows[0]!.ddl;
}

// ---- stats ----

const sorted = (xs: number[]) => [...xs].sort((a, b) => a - b);
const p50 = (xs: number[]) => percentile(sorted(xs), 50);
const p95 = (xs: number[]) => percentile(sorted(xs), 95);
const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / Math.max(1, xs.length);
const recall = (got: Hit[], truth: Hit[]) => {
  const t = new Set(truth.map((h) => h.seq));
  return got.filter((h) => t.has(h.seq)).length / Math.max(1, truth.length);
};
/** Rotates the call order every round, so no variant always runs first (or right after another). */
const rotate = <T>(xs: T[], round: number) => xs.map((_, i) => xs[(i + round) % xs.length]!);

interface Variant {
  label: string;
  db: Db;
  sql: string;
  session: string;
  /** Parameters after ($1 tenant, $2 session, $3 query vector). */
  extra: unknown[];
  truthOf?: string;
  ms: number[];
  recall: number[];
  rows: number[];
}

const variant = (
  label: string,
  db: Db,
  sql: string,
  session: string,
  opts: { truthOf?: string; extra?: unknown[] } = {},
): Variant => ({
  label,
  db,
  sql,
  session,
  extra: opts.extra ?? [],
  truthOf: opts.truthOf,
  ms: [],
  recall: [],
  rows: [],
});

/**
 * `rounds` rounds; each draws one fresh query vector and runs every variant once in a rotating
 * order. A variant with `truthOf` is scored (recall@K) against that variant's rows of the round.
 */
async function runRounds(variants: Variant[], rounds: number) {
  for (let r = 0; r < rounds; r++) {
    const q1536 = literal(vec1536());
    const q384 = literal(vec384());
    const got = new Map<string, Hit[]>();
    for (const v of rotate(variants, r)) {
      const q = v.session === BIG384 ? q384 : q1536;
      const t = await timed(v.db, v.sql, [TENANT, v.session, q, ...v.extra]);
      v.ms.push(t.ms);
      v.rows.push(t.rows.length);
      got.set(v.label, t.rows);
    }
    for (const v of variants) if (v.truthOf) v.recall.push(recall(got.get(v.label)!, got.get(v.truthOf)!));
  }
}

function latencyTable(variants: Variant[], base: Variant): string {
  return markdownTable(
    [
      'variant',
      'p50',
      'p95',
      `p50 / ${base.label}`,
      `p95 / ${base.label}`,
      'rows/query',
      `recall@${K}`,
      'queries < 0.5',
      'n',
    ],
    variants.map((v) => [
      v.label,
      fmtMs(p50(v.ms)),
      fmtMs(p95(v.ms)),
      fmtRatio(ratio(p50(v.ms), p50(base.ms))),
      fmtRatio(ratio(p95(v.ms), p95(base.ms))),
      mean(v.rows).toFixed(1),
      v.recall.length
        ? `${mean(v.recall).toFixed(3)} (min ${Math.min(...v.recall).toFixed(2)}) vs ${v.truthOf}`
        : '-',
      v.recall.length ? String(v.recall.filter((x) => x < 0.5).length) : '-',
      String(v.ms.length),
    ]),
  );
}

// ---- output ----

const say = (...lines: string[]) => process.stdout.write(`${lines.join('\n')}\n`);
const planBlock = (title: string, plan: string) => say(title, '```', plan, '```', '');
const secs = (ms: number) => `${(ms / 1000).toFixed(1)} s`;

// ---- inserts ----

interface InsertTarget {
  label: string;
  table: string;
  session: (round: number) => string;
  seqs: (round: number) => number[];
  /** Label of the target this one is compared with (itself: it is a base). */
  base: string;
  ms: number[];
}

/** One 50-row batch into each target per round, in rotating order. */
async function insertRounds(db: Db, targets: InsertTarget[], rounds: number): Promise<void> {
  for (let r = 0; r < rounds; r++) {
    for (const t of rotate(targets, r))
      t.ms.push(await insertVectors(db, t.table, t.session(r), t.seqs(r), vec1536));
  }
}

const insertRate = (t: InsertTarget) => (t.ms.length * 50 * 1000) / t.ms.reduce((a, b) => a + b, 0);

function insertTable(targets: InsertTarget[]): string {
  return markdownTable(
    ['target', 'rows', 'rows/s', 'batch p50', 'batch p95', 'rows/s ratio'],
    targets.map((t) => {
      const base = targets.find((b) => b.label === t.base)!;
      return [
        t.label,
        String(t.ms.length * 50),
        fmtInt(insertRate(t)),
        fmtMs(p50(t.ms)),
        fmtMs(p95(t.ms)),
        base === t ? 'base' : `${fmtRatio(ratio(insertRate(t), insertRate(base)))} vs ${base.label}`,
      ];
    }),
  );
}

// ---- phases ----

async function load(db: Db): Promise<void> {
  const t0 = performance.now();
  await db.query(`INSERT INTO tenants (id, name) VALUES ($1, $1)`, [TENANT]);
  const sessions = [BIG_S, BIG_F, BIG384, ...range(0, SMALL_SESSIONS).map(small)];
  await db.query(
    `INSERT INTO sessions (tenant_id, id, start_seq) SELECT $1, s, 1 FROM unnest($2::text[]) AS s`,
    [TENANT, sessions],
  );
  for (const t of [CTL, T384]) {
    await db.query(
      `CREATE TABLE ${t} (LIKE message_vectors INCLUDING ALL,
         CONSTRAINT ${t}_session_fk FOREIGN KEY (tenant_id, session_id)
           REFERENCES sessions (tenant_id, id) ON DELETE CASCADE)`,
    );
  }
  for (let from = 1; from <= BIG; from += 500) {
    const n = Math.min(500, BIG - from + 1);
    await insertVectors(db, 'message_vectors', BIG_S, range(from, n), vec1536);
    await insertVectors(db, T384, BIG384, range(from, n), vec384);
  }
  for (let i = 0; i < SMALL_SESSIONS; i++) {
    await insertVectors(db, 'message_vectors', small(i), range(1, SMALL_N), vec1536);
  }
  await db.query(
    `INSERT INTO message_vectors SELECT tenant_id, $1, seq, embedding FROM message_vectors
      WHERE tenant_id = $2 AND session_id = $3 ORDER BY seq`,
    [BIG_F, TENANT, BIG_S],
  );
  await db.query(
    `INSERT INTO ${CTL} SELECT * FROM message_vectors WHERE session_id <> $1 ORDER BY session_id, seq`,
    [BIG_F],
  );
  for (const t of ['message_vectors', CTL, T384, 'sessions']) await db.query(`VACUUM ANALYZE ${t}`);
  const sizes = await db.query<{ a: string; b: string; c: string; sb: string }>(
    `SELECT pg_size_pretty(pg_total_relation_size('message_vectors')) AS a,
            pg_size_pretty(pg_total_relation_size('${CTL}')) AS b,
            pg_size_pretty(pg_total_relation_size('${T384}')) AS c, current_setting('shared_buffers') AS sb`,
  );
  note(`loaded in ${secs(performance.now() - t0)}`);
  say(
    `Load: ${fmtInt(BIG)} × ${DIMS}-d vectors in session \`${BIG_S}\` and in its copy \`${BIG_F}\`, ` +
      `${fmtInt(BIG)} × 384-d in \`${BIG384}\` (table ${T384}, ${sizes.rows[0]!.c}), ${SMALL_SESSIONS} sessions × ${SMALL_N} × ${DIMS}-d; clustered; ` +
      `${secs(performance.now() - t0)}. message_vectors ${sizes.rows[0]!.a}, twin ${CTL} (big + small sessions) ` +
      `${sizes.rows[0]!.b}; shared_buffers ${sizes.rows[0]!.sb} (smaller than the table: exact scans read ` +
      `through the OS cache and evict each other).`,
    '',
  );
}

interface Build {
  ms: number;
  ok: boolean;
  error?: string;
  notices: string[];
  mwm: string;
  workers: string;
}

async function buildIndex(url: string, session: string, ddl: string, mwm: string | null): Promise<Build> {
  const c = new pg.Client({ connectionString: url, application_name: 'mnemos-bench' });
  const notices: string[] = [];
  c.on('notice', (n) => notices.push(n.message ?? String(n)));
  await c.connect();
  try {
    if (mwm) await c.query(`SET maintenance_work_mem = '${mwm}'`);
    await c.query(`SET statement_timeout = '${BUILD_TIMEOUT_S}s'`);
    const shown = (
      await c.query<{ m: string; w: string }>(
        `SELECT current_setting('maintenance_work_mem') AS m, current_setting('max_parallel_maintenance_workers') AS w`,
      )
    ).rows[0]!;
    const t0 = performance.now();
    try {
      await c.query(ddl);
      return { ms: performance.now() - t0, ok: true, notices, mwm: shown.m, workers: shown.w };
    } catch (err) {
      // A cancelled CONCURRENTLY build leaves an INVALID index behind.
      await c.query(`SET statement_timeout = 0`);
      await c.query(`DROP INDEX IF EXISTS ${indexName(TENANT, session)}`);
      const error = (err as Error).message;
      return { ms: performance.now() - t0, ok: false, error, notices, mwm: shown.m, workers: shown.w };
    }
  } finally {
    await c.end();
  }
}

async function main() {
  cleanupOnSignals();
  const scratch = await createScratchDatabase('phnsw');
  const withOpts = (opts: string | null) => {
    const u = new URL(scratch.url);
    if (opts) u.searchParams.set('options', opts);
    return makePgDb({ connectionString: u.toString(), max: 1, applicationName: 'mnemos-bench' });
  };
  // One connection per setting, so no SET round trip is timed with the queries.
  const db = withOpts(null);
  const ef40 = withOpts('-c hnsw.ef_search=40');
  const ef100 = withOpts('-c hnsw.ef_search=100');
  const ef40i = withOpts('-c hnsw.ef_search=40 -c hnsw.iterative_scan=relaxed_order');
  const ef100i = withOpts('-c hnsw.ef_search=100 -c hnsw.iterative_scan=relaxed_order');
  const pools = [db, ef40, ef100, ef40i, ef100i];
  const t00 = performance.now();
  try {
    say(`## Partial HNSW per session: design probe (bench/partial-hnsw.ts)`, '');
    note('loading');
    await load(db);
    for (const [p, want] of [
      [ef40, '40/off'],
      [ef100, '100/off'],
      [ef40i, '40/relaxed_order'],
      [ef100i, '100/relaxed_order'],
    ] as const) {
      // The placeholder set at connection start must have reached pgvector once it is loaded.
      const s = (
        await p.query<{ e: string; i: string }>(
          `SELECT '[1]'::vector <=> '[1]'::vector AS x, current_setting('hnsw.ef_search') AS e,
                  current_setting('hnsw.iterative_scan') AS i`,
        )
      ).rows[0]!;
      if (`${s.e}/${s.i}` !== want) throw new Error(`connection settings ${s.e}/${s.i}, wanted ${want}`);
    }

    // -- 0. Calibration: the twin inserts like message_vectors while neither has an HNSW index.
    note('insert calibration (no HNSW index anywhere)');
    const CAL = 1_000_001;
    const calib: InsertTarget[] = [
      {
        label: 'mv big',
        table: 'message_vectors',
        session: () => BIG_S,
        seqs: (r) => range(CAL + r * 50, 50),
        base: 'twin big',
        ms: [],
      },
      {
        label: 'twin big',
        table: CTL,
        session: () => BIG_S,
        seqs: (r) => range(CAL + r * 50, 50),
        base: 'twin big',
        ms: [],
      },
      {
        label: 'mv small',
        table: 'message_vectors',
        session: (r) => small(r),
        seqs: () => range(CAL, 50),
        base: 'twin small',
        ms: [],
      },
      {
        label: 'twin small',
        table: CTL,
        session: (r) => small(r),
        seqs: () => range(CAL, 50),
        base: 'twin small',
        ms: [],
      },
    ];
    await insertRounds(db, calib, 6);
    for (const t of ['message_vectors', CTL]) {
      await db.query(`DELETE FROM ${t} WHERE seq >= $1`, [CAL]);
      await db.query(`VACUUM ANALYZE ${t}`);
    }
    say(
      '### 0. Insert calibration, before any HNSW index (50-row batches, interleaved)',
      '',
      insertTable(calib),
      '',
    );

    // -- 2. Builds: default maintenance_work_mem, then raised (the one kept); then the frozen one.
    note(`building the partial index, default maintenance_work_mem (timeout ${BUILD_TIMEOUT_S} s)`);
    const plainDdl = await indexDdl(db, BIG_S, { concurrently: true });
    const bDefault = await buildIndex(scratch.url, BIG_S, plainDdl, null);
    if (bDefault.ok) await db.query(`DROP INDEX ${indexName(TENANT, BIG_S)}`);
    note(`default build: ${secs(bDefault.ms)} ok=${bDefault.ok}`);
    note('building the partial index, maintenance_work_mem = 1GB');
    const bRaised = await buildIndex(scratch.url, BIG_S, plainDdl, '1GB');
    note(`raised build: ${secs(bRaised.ms)} ok=${bRaised.ok}`);
    if (!bRaised.ok) throw new Error(`index build failed: ${bRaised.error}`);
    const frozenDdl = await indexDdl(db, BIG_F, { concurrently: true, below: X });
    const bFrozen = await buildIndex(scratch.url, BIG_F, frozenDdl, '1GB');
    note(`frozen-prefix build: ${secs(bFrozen.ms)} ok=${bFrozen.ok}`);
    if (!bFrozen.ok) throw new Error(`index build failed: ${bFrozen.error}`);
    await db.query(`ANALYZE message_vectors`);
    const idx = (
      await db.query<{ size: string; def: string }>(
        `SELECT pg_size_pretty(pg_relation_size(indexrelid)) AS size, pg_get_indexdef(indexrelid) AS def
           FROM pg_index WHERE indexrelid = ANY ($1::regclass[]) ORDER BY indexrelid`,
        [[indexName(TENANT, BIG_S), indexName(TENANT, BIG_F)]],
      )
    ).rows;
    const fmtBuild = (b: Build) => (b.ok ? secs(b.ms) : `NOT finished in ${secs(b.ms)} (${b.error})`);
    say(
      `### 2. Building the partial index over ${fmtInt(BIG)} vectors (CREATE INDEX CONCURRENTLY, m 16, ef_construction 64)`,
      '',
      markdownTable(
        ['index', 'maintenance_work_mem', 'max_parallel_maintenance_workers', 'build', 'pgvector notices'],
        [
          ['plain', bDefault],
          ['plain', bRaised],
          ['frozen prefix', bFrozen],
        ].map(([name, b]) => {
          const x = b as Build;
          return [name as string, x.mwm, x.workers, fmtBuild(x), x.notices.join(' / ') || '-'];
        }),
      ),
      '',
      `Raised / default build time: ${bDefault.ok ? fmtRatio(ratio(bRaised.ms, bDefault.ms)) : 'n/a (default did not finish)'}.`,
      ...idx.map((i) => `- ${i.size}: \`${i.def}\``),
      '',
    );

    // -- Plans: is the index used with $1/$2 parameters (custom plans)?
    const qv = literal(vec1536());
    const bigParams = [TENANT, BIG_S, qv];
    planBlock(
      "Plan: today's exact form on the big session (index present, expression does not match)",
      await explain(db, exactSql(), bigParams),
    );
    planBlock(
      'Plan: cast form, ef_search 40, parameters $1/$2 (node-postgres unnamed statement)',
      await explain(ef40, castSql(), bigParams),
    );
    planBlock('Plan: cast form, ef_search 100', await explain(ef100, castSql(), bigParams));
    planBlock(
      'Plan: cast form with the `, seq DESC` tie-break of today, ef_search 40',
      await explain(ef40, castSql('message_vectors', START_SEQ, true), bigParams),
    );
    planBlock(
      'Plan: cast form on a small session (no index for it)',
      await explain(ef40, castSql(), [TENANT, small(7), qv]),
    );
    planBlock(
      `Plan: frozen prefix on ${BIG_F}, (seq < $4) IS TRUE, $4 = ${X}, ef_search 40`,
      await explain(ef40, frozenSql(), [TENANT, BIG_F, qv, X]),
    );
    planBlock(
      `Plan: frozen prefix written as a plain seq < $4 (the btree takes the range)`,
      await explain(ef40, frozenSql(false), [TENANT, BIG_F, qv, X]),
    );
    // A prepared statement with a generic plan cannot prove the predicate.
    const gen = withOpts('-c hnsw.ef_search=40');
    try {
      await gen.query(`PREPARE knn(text, text, vector) AS ${castSql()}`);
      const exec = `EXECUTE knn('${TENANT}', '${BIG_S}', '${qv}')`;
      await gen.query(`SET plan_cache_mode = force_generic_plan`);
      planBlock(
        'Plan: PREPAREd statement, plan_cache_mode = force_generic_plan',
        await explain(gen, exec, [], false),
      );
      await gen.query(`SET plan_cache_mode = auto`);
      for (let i = 0; i < 6; i++) await gen.query(exec);
      planBlock(
        'Plan: PREPAREd statement, plan_cache_mode = auto (default), 7th execution',
        await explain(gen, exec, [], false),
      );
    } finally {
      await gen.close();
    }

    // -- 1, 3, 5. Latency, interleaved call by call.
    note(`query rounds: ${ROUNDS}`);
    const E = variant('exact (today)', db, exactSql(), BIG_S);
    const knn: Variant[] = [
      E,
      variant('HNSW ef 40', ef40, castSql(), BIG_S, { truthOf: E.label }),
      variant('HNSW ef 100', ef100, castSql(), BIG_S, { truthOf: E.label }),
      variant('HNSW ef 40 + relaxed', ef40i, castSql(), BIG_S, { truthOf: E.label }),
      variant('frozen prefix ef 40 (bigF)', ef40, frozenSql(), BIG_F, { truthOf: E.label, extra: [X] }),
      variant('exact, cast form, twin (no index)', db, castSql(CTL), BIG_S, { truthOf: E.label }),
      variant('exact 384-d, same size', db, exactSql(T384), BIG384),
      variant('exact small session (today)', db, exactSql(), small(3)),
      variant('cast form small session', ef40, castSql(), small(3)),
    ];
    await runRounds(knn, ROUNDS);
    say(
      `### 1, 3, 5. k-NN latency, k = ${K}, filter seq >= sessions.start_seq as production; ${ROUNDS} rounds, ` +
        `every variant once per round in rotating order, one fresh clustered query per round ` +
        `(bigF holds the same vectors as big, so exact on big is its truth)`,
      '',
      latencyTable(knn, E),
      '',
    );

    // More rounds for the recall tail only (an HNSW search can miss a whole cluster).
    const RR = ROUNDS * 2;
    note(`recall rounds: ${RR}`);
    const Er = variant('exact (today)', db, exactSql(), BIG_S);
    const rec = [
      Er,
      variant('HNSW ef 40', ef40, castSql(), BIG_S, { truthOf: Er.label }),
      variant('HNSW ef 100', ef100, castSql(), BIG_S, { truthOf: Er.label }),
      variant('frozen prefix ef 40 (bigF)', ef40, frozenSql(), BIG_F, { truthOf: Er.label, extra: [X] }),
      variant('frozen prefix ef 100 (bigF)', ef100, frozenSql(), BIG_F, { truthOf: Er.label, extra: [X] }),
    ];
    await runRounds(rec, RR);
    say(
      `### 3c. Recall tail: ${RR} more rounds, two HNSW graphs (big, bigF) over the same vectors`,
      '',
      latencyTable(rec, Er),
      '',
    );

    note('isolated blocks');
    const iso384 = [variant('exact 384-d alone', db, exactSql(T384), BIG384)];
    await runRounds(iso384, 60);
    const iso1536 = [variant('exact 1536-d alone', db, exactSql(), BIG_S)];
    await runRounds(iso1536, 30);
    say(
      '### 5b. Exact k-NN, each session alone (no other variant between calls: its pages stay cached)',
      '',
      latencyTable([...iso1536, ...iso384], iso1536[0]!),
      '',
    );

    // -- 3b. A selective seq filter: half of the session below the bound.
    const HALF = Math.floor(BIG / 2) + 1;
    const RF = Math.max(30, Math.floor(ROUNDS / 3));
    note(`selective-filter rounds: ${RF}`);
    const halfSql = (f: typeof exactSql) => f('message_vectors', '$4::bigint');
    const Eh = variant('exact, seq >= half', db, halfSql(exactSql), BIG_S, { extra: [HALF] });
    const half: Variant[] = [
      Eh,
      ...(
        [
          ['HNSW ef 40', ef40],
          ['HNSW ef 40 + relaxed', ef40i],
          ['HNSW ef 100', ef100],
          ['HNSW ef 100 + relaxed', ef100i],
        ] as const
      ).map(([l, p]) => variant(l, p, halfSql(castSql), BIG_S, { truthOf: Eh.label, extra: [HALF] })),
    ];
    await runRounds(half, RF);
    say(
      `### 3b. Selective filter: seq >= ${HALF} (half the session passes), ${RF} rounds`,
      '',
      latencyTable(half, Eh),
      '',
    );
    planBlock(
      'Plan: selective filter, ef 40 + relaxed_order',
      await explain(ef40i, halfSql(castSql), [...bigParams, HALF]),
    );

    // -- 4. Inserts with the indexes present.
    note('insert rounds with the partial indexes present');
    const ins: InsertTarget[] = [
      {
        label: 'big, plain partial index',
        table: 'message_vectors',
        session: () => BIG_S,
        seqs: (r) => range(BIG + 1 + r * 50, 50),
        base: 'big, twin (no index)',
        ms: [],
      },
      {
        label: 'bigF, frozen prefix (new rows above X)',
        table: 'message_vectors',
        session: () => BIG_F,
        seqs: (r) => range(BIG + 1 + r * 50, 50),
        base: 'big, twin (no index)',
        ms: [],
      },
      {
        label: 'big, twin (no index)',
        table: CTL,
        session: () => BIG_S,
        seqs: (r) => range(BIG + 1 + r * 50, 50),
        base: 'big, twin (no index)',
        ms: [],
      },
      {
        label: 'small, table has both indexes',
        table: 'message_vectors',
        session: (r) => small(r),
        seqs: () => range(SMALL_N + 1, 50),
        base: 'small, twin',
        ms: [],
      },
      {
        label: 'small, twin',
        table: CTL,
        session: (r) => small(r),
        seqs: () => range(SMALL_N + 1, 50),
        base: 'small, twin',
        ms: [],
      },
    ];
    await insertRounds(db, ins, 10);
    let dimsError = 'no error (!)';
    try {
      await insertVectors(db, 'message_vectors', BIG_S, [9_000_000], vec384);
    } catch (err) {
      dimsError = (err as Error).message;
    }
    say(
      '### 4. Inserting 500 vectors per target (10 × 50-row batches, interleaved) with the indexes present',
      '',
      insertTable(ins),
      '',
      `A 384-d vector inserted into the indexed session: ${dimsError}.`,
      '',
    );
    note('queries after the inserts');
    const Ea = variant('exact big', db, exactSql(), BIG_S);
    const EFa = variant('exact bigF', db, exactSql(), BIG_F);
    const afterIns = [
      Ea,
      variant('HNSW ef 40 big', ef40, castSql(), BIG_S, { truthOf: Ea.label }),
      EFa,
      variant('frozen prefix ef 40 bigF', ef40, frozenSql(), BIG_F, { truthOf: EFa.label, extra: [X] }),
    ];
    const RA = Math.max(20, Math.floor(ROUNDS / 4));
    await runRounds(afterIns, RA);
    say(
      `### 4b. After the inserts (${fmtInt(BIG + 500)} rows per big session; bigF's 500 new rows are its exact tail), ${RA} rounds`,
      '',
      latencyTable(afterIns, Ea),
      '',
    );

    // -- 6. Deletes: unrelated sessions first, then compaction of a quarter of the big session.
    note('vacuum after deletes in unrelated sessions');
    const from = Math.floor(SMALL_SESSIONS / 2);
    const count = Math.floor(SMALL_SESSIONS / 5);
    const unrelated = range(from, count).map(small);
    const vacU: string[] = [];
    for (const t of ['message_vectors', CTL]) {
      await db.query(`DELETE FROM ${t} WHERE tenant_id = $1 AND session_id = ANY ($2::text[])`, [
        TENANT,
        unrelated,
      ]);
      const t0 = performance.now();
      // INDEX_CLEANUP ON: what autovacuum does once dead rows pass its 2 % bypass threshold.
      await db.query(`VACUUM (INDEX_CLEANUP ON) ${t}`);
      vacU.push(`${t} ${secs(performance.now() - t0)}`);
    }
    note('compaction simulation');
    const CUT = Math.floor(BIG / 4) + 1;
    await db.query(`UPDATE sessions SET start_seq = $3 WHERE tenant_id = $1 AND id = $2`, [
      TENANT,
      BIG_S,
      CUT,
    ]);
    const delMs: number[] = [];
    for (const t of ['message_vectors', CTL]) {
      const t0 = performance.now();
      await db.query(`DELETE FROM ${t} WHERE tenant_id = $1 AND session_id = $2 AND seq < $3`, [
        TENANT,
        BIG_S,
        CUT,
      ]);
      delMs.push(performance.now() - t0);
    }
    const RC = Math.max(20, Math.floor(ROUNDS / 4));
    const mk = () => {
      const Ec = variant('exact (today)', db, exactSql(), BIG_S);
      return [
        Ec,
        variant('HNSW ef 40', ef40, castSql(), BIG_S, { truthOf: Ec.label }),
        variant('HNSW ef 40 + relaxed', ef40i, castSql(), BIG_S, { truthOf: Ec.label }),
        variant('HNSW ef 100', ef100, castSql(), BIG_S, { truthOf: Ec.label }),
      ];
    };
    const before = mk();
    await runRounds(before, RC);
    const vac: string[] = [];
    for (const t of ['message_vectors', CTL]) {
      const t0 = performance.now();
      await db.query(`VACUUM ${t}`);
      vac.push(`${t} ${secs(performance.now() - t0)}`);
    }
    const after = mk();
    await runRounds(after, RC);
    say(
      `### 6. Deletes and VACUUM`,
      '',
      `Unrelated deletes: all vectors of ${count} small sessions (${fmtInt(count * SMALL_N)} rows, none in an HNSW index), ` +
        `then VACUUM (INDEX_CLEANUP ON): ${vacU.join(' vs ')}.`,
      '',
      `Compaction of the big session: seq < ${CUT} deleted (${fmtInt(CUT - 1)} rows; DELETE ${fmtMs(delMs[0]!)} ` +
        `with the index vs ${fmtMs(delMs[1]!)} on the twin), start_seq moved to ${CUT}. Before VACUUM (${RC} rounds):`,
      '',
      latencyTable(before, before[0]!),
      '',
      `VACUUM: ${vac.join(' vs ')}. After VACUUM (${RC} rounds):`,
      '',
      latencyTable(after, after[0]!),
      '',
    );

    // -- 7. Many partial indexes on one table: planning and insert cost for everyone.
    if (EXTRA > 0) {
      note(`many-indexes phase: ${EXTRA} extra partial indexes on small sessions`);
      let blockNo = 0;
      const block = async (label: string) => {
        const q: Variant[] = [
          variant('exact small (today)', db, exactSql(), small(SMALL_SESSIONS - 20)),
          variant('HNSW ef 40 big', ef40, castSql(), BIG_S),
        ];
        await runRounds(q, 100);
        const plan = await explain(db, exactSql(), [TENANT, small(SMALL_SESSIONS - 20), qv], false);
        const planning = Number(/Planning Time: ([\d.]+)/.exec(plan)?.[1]);
        // Fresh seqs per block, in sessions that never get an index of their own.
        const base = 1000 + 1000 * blockNo++;
        const t: InsertTarget = {
          label,
          table: 'message_vectors',
          session: (r) => small(SMALL_SESSIONS - 1 - r),
          seqs: () => range(base, 50),
          base: label,
          ms: [],
        };
        await insertRounds(db, [t], 10);
        return { label, q, planning, t };
      };
      const blocks = [await block('2 partial indexes')];
      const t0 = performance.now();
      for (let i = 0; i < EXTRA; i++) await db.query(await indexDdl(db, small(i), { concurrently: false }));
      const buildEach = (performance.now() - t0) / EXTRA;
      blocks.push(await block(`${EXTRA + 2} partial indexes`));
      for (let i = 0; i < EXTRA; i++) await db.query(`DROP INDEX ${indexName(TENANT, small(i))}`);
      blocks.push(await block('2 partial indexes again'));
      const [a, b, a2] = blocks as [(typeof blocks)[0], (typeof blocks)[0], (typeof blocks)[0]];
      say(
        `### 7. ${EXTRA} more partial indexes (${SMALL_N}-vector sessions, plain CREATE INDEX, ${fmtMs(buildEach)} each: ` +
          `every build reads the whole table): blocks A / B / A again, 100 query rounds and 500 inserted rows each`,
        '',
        markdownTable(
          [
            'block',
            'exact small p50',
            'p95',
            'HNSW big p50',
            'p95',
            'planning (EXPLAIN, small)',
            'insert small rows/s',
          ],
          blocks.map((x) => [
            x.label,
            fmtMs(p50(x.q[0]!.ms)),
            fmtMs(p95(x.q[0]!.ms)),
            fmtMs(p50(x.q[1]!.ms)),
            fmtMs(p95(x.q[1]!.ms)),
            fmtMs(x.planning),
            fmtInt(insertRate(x.t)),
          ]),
        ),
        '',
        `B / mean(A, A again): exact small p50 ${fmtRatio(ratio(p50(b.q[0]!.ms), (p50(a.q[0]!.ms) + p50(a2.q[0]!.ms)) / 2))}, ` +
          `planning ${fmtRatio(ratio(b.planning, (a.planning + a2.planning) / 2))}, ` +
          `insert rows/s ${fmtRatio(ratio(insertRate(b.t), (insertRate(a.t) + insertRate(a2.t)) / 2))}.`,
        '',
      );
    }

    // -- 8. From which session size does the planner take the partial index, and is it then faster?
    if (CROSSOVER) {
      const sizes = [1000, 2000, 3000, 4000, 6000, 8000, 12000].filter((n) => n <= BIG);
      note(`crossover: sessions of ${sizes.join(', ')} vectors, each with its partial index`);
      const cs = (n: number) => `c${n}`;
      await db.query(
        `INSERT INTO sessions (tenant_id, id, start_seq) SELECT $1, s, 1 FROM unnest($2::text[]) AS s`,
        [TENANT, sizes.map(cs)],
      );
      await db.query(`SET maintenance_work_mem = '1GB'`);
      for (const n of sizes) {
        // The first n vectors of bigF (untouched by compaction), seq kept.
        await db.query(
          `INSERT INTO message_vectors SELECT tenant_id, $1, seq, embedding FROM message_vectors
            WHERE tenant_id = $2 AND session_id = $3 AND seq <= $4 ORDER BY seq`,
          [cs(n), TENANT, BIG_F, n],
        );
        await db.query(await indexDdl(db, cs(n), { concurrently: false }));
      }
      await db.query(`RESET maintenance_work_mem`);
      await db.query(`VACUUM ANALYZE message_vectors`);
      const rows: string[][] = [];
      for (const n of sizes) {
        const chosen = async (p: Db) => {
          const plan = await explain(p, castSql(), [TENANT, cs(n), qv], false);
          return plan.includes('mv_hnsw_') ? 'HNSW' : 'btree + sort';
        };
        const Ex = variant('exact', db, exactSql(), cs(n));
        const v40 = variant('cast ef 40', ef40, castSql(), cs(n), { truthOf: Ex.label });
        const v100 = variant('cast ef 100', ef100, castSql(), cs(n), { truthOf: Ex.label });
        await runRounds([Ex, v40, v100], 15);
        rows.push([
          fmtInt(n),
          `${fmtMs(p50(Ex.ms))} / ${fmtMs(p95(Ex.ms))}`,
          await chosen(ef40),
          `${fmtMs(p50(v40.ms))} / ${fmtMs(p95(v40.ms))}`,
          fmtRatio(ratio(p95(v40.ms), p95(Ex.ms))),
          mean(v40.recall).toFixed(3),
          await chosen(ef100),
          `${fmtMs(p50(v100.ms))} / ${fmtMs(p95(v100.ms))}`,
          fmtRatio(ratio(p95(v100.ms), p95(Ex.ms))),
        ]);
      }
      say(
        '### 8. Planner crossover: sessions of n vectors, each with its own plain partial index; ' +
          'the cast form gets whatever plan the planner picks (15 interleaved rounds per size)',
        '',
        markdownTable(
          [
            'n',
            'exact p50 / p95',
            'ef 40 plan',
            'ef 40 p50 / p95',
            'p95 vs exact',
            'recall',
            'ef 100 plan',
            'ef 100 p50 / p95',
            'p95 vs exact',
          ],
          rows,
        ),
        '',
      );
    }

    // Index use, counted by Postgres (a backend flushes its counters when it ends).
    for (const p of pools.splice(0)) await p.close();
    await new Promise((r) => setTimeout(r, 1200));
    const stat = makePgDb({ connectionString: scratch.url, max: 1, applicationName: 'mnemos-bench' });
    try {
      const s = await stat.query<{ i: string; n: string }>(
        `SELECT indexrelname AS i, idx_scan::text AS n FROM pg_stat_user_indexes
          WHERE relname = 'message_vectors' ORDER BY 1`,
      );
      say(`idx_scan on message_vectors: ${s.rows.map((r) => `${r.i} ${r.n}`).join(', ')}.`, '');
    } finally {
      await stat.close();
    }
    say(`Total run time ${secs(performance.now() - t00)}.`);
  } finally {
    for (const p of pools) await p.close().catch(() => undefined);
    if (KEEP) note(`kept ${scratch.url}`);
    else for (const line of await cleanupScratch()) note(`cleanup: ${line}`);
  }
}

await main();
