/**
 * Embedded-mode query latency: the search-like and context-like statements of mnemos, as direct
 * SQL against the embedded Db (PGlite + pgvector), on a generated archive. Optionally the same on
 * native Postgres for a ratio.
 *
 *   node --import tsx bench/embedded.ts [--messages 20000] [--runs 200] [--dim 384] [--compare-pg]
 *
 * Corpus: one big session (half the messages) and sessions of 500; each message is a few words of
 * one of 40 topics plus common words, so the lexical local embedder yields clustered vectors
 * (FACTS: never benchmark on uniform random vectors). Each query is printed with its plan's top
 * node and p50/p95 over `--runs` runs, as planned by default and inside a transaction with
 * `SET LOCAL enable_seqscan = off`.
 */
import { randomBytes } from 'node:crypto';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { parseArgs } from 'node:util';
import { openPgliteDb } from '../db/embedded.js';
import { migrate } from '../db/migrate.js';
import { makePgDb } from '../db/pool.js';
import type { Db, Queryable } from '../db/pool.js';
import { insertArchiveBatch } from '../db/queries/messages.js';
import type { ArchiveInsertRow } from '../db/queries/messages.js';
import { localEmbed } from '../services/llm/local-embedder.js';
import { ftsDocument } from '../services/text/fts-text.js';

const { values: args } = parseArgs({
  options: {
    messages: { type: 'string', default: '20000' },
    runs: { type: 'string', default: '200' },
    dim: { type: 'string', default: '384' },
    'compare-pg': { type: 'boolean', default: false },
    'pg-admin-url': { type: 'string', default: 'postgres://postgres@127.0.0.1:5432/postgres' },
  },
});
const TOTAL = Number(args.messages);
const RUNS = Number(args.runs);
const DIM = Number(args.dim);
const TENANT = 't_bench';
const BIG = 'big';
const SMALL = 'small-0';

// Deterministic PRNG (mulberry32) so every run loads the same corpus.
let seed = 0x5eed;
const rand = () => {
  seed = (seed + 0x6d2b79f5) | 0;
  let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
  t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
};
const pick = <T>(xs: readonly T[]): T => xs[Math.floor(rand() * xs.length)]!;
const syllables = [
  'ka',
  'lo',
  'mi',
  'ra',
  'ten',
  'vo',
  'sup',
  'dri',
  'bel',
  'zor',
  'qua',
  'nex',
  'pol',
  'gri',
];
const word = () => Array.from({ length: 2 + Math.floor(rand() * 2) }, () => pick(syllables)).join('');
const COMMON = ['deploy', 'please', 'check', 'the', 'config', 'error', 'thanks', 'server', 'update', 'test'];
const TOPICS = Array.from({ length: 40 }, () => Array.from({ length: 12 }, word));
const CORPUS_SEED = seed;

function messageText(i: number): string {
  const topic = pick(TOPICS);
  const words = Array.from({ length: 8 + Math.floor(rand() * 20) }, () =>
    rand() < 0.6 ? pick(topic) : pick(COMMON),
  );
  if (i % 997 === 0) words.push('zeppelin'); // a rare word: ~20 hits in 20k
  return words.join(' ');
}

function sessionsPlan(total: number): Array<{ id: string; count: number }> {
  const plan = [{ id: BIG, count: Math.floor(total / 2) }];
  let left = total - plan[0]!.count;
  for (let k = 0; left > 0; k++) {
    const n = Math.min(500, left);
    plan.push({ id: `small-${k}`, count: n });
    left -= n;
  }
  return plan;
}

async function load(db: Db): Promise<number> {
  const started = Date.now();
  await db.query(`INSERT INTO tenants (id, name) VALUES ($1, $2) ON CONFLICT DO NOTHING`, [TENANT, 'bench']);
  let i = 0;
  for (const s of sessionsPlan(TOTAL)) {
    await db.query(`INSERT INTO sessions (tenant_id, id) VALUES ($1, $2)`, [TENANT, s.id]);
    for (let from = 1; from <= s.count; from += 500) {
      const rows: ArchiveInsertRow[] = [];
      const texts: string[] = [];
      for (let seq = from; seq < Math.min(from + 500, s.count + 1); seq++, i++) {
        const text = messageText(i);
        const fts = ftsDocument(text);
        texts.push(text);
        rows.push({
          seq,
          id: `m${seq}`,
          role: seq % 2 ? 'user' : 'assistant',
          content: text,
          parts: null,
          name: null,
          tool_call_id: null,
          tool_calls: null,
          metadata: null,
          sent_at_ns: String(BigInt(Date.now()) * 1_000_000n + BigInt(seq)),
          sent_at_given: false,
          bytes: Buffer.byteLength(text) + 40,
          fingerprint: 'x',
          fts_en: fts.en,
          fts_cjk: fts.cjk,
        });
      }
      await db.transaction(async (tx) => {
        await insertArchiveBatch(tx, TENANT, s.id, rows);
        await tx.query(
          `INSERT INTO message_vectors (tenant_id, session_id, seq, embedding)
           SELECT $1, $2, x.seq, x.v::vector FROM unnest($3::bigint[], $4::text[]) AS x(seq, v)`,
          [TENANT, s.id, rows.map((r) => r.seq), texts.map((t) => `[${localEmbed(t, DIM).join(',')}]`)],
        );
      });
    }
  }
  await db.query('ANALYZE');
  return (Date.now() - started) / 1000;
}

interface Case {
  name: string;
  sql: string;
  params: () => unknown[];
}

const probeVector = `[${localEmbed(`${TOPICS[3]!.slice(0, 6).join(' ')} deploy`, DIM).join(',')}]`;
const cases = (session: string): Case[] => [
  {
    name: `FTS rare word (${session})`,
    sql: `SELECT seq, ts_rank(search_tsv, q) AS score FROM messages, websearch_to_tsquery('english', $3) q
          WHERE tenant_id = $1 AND session_id = $2 AND search_tsv @@ q ORDER BY score DESC, seq DESC LIMIT 8`,
    params: () => [TENANT, session, 'zeppelin'],
  },
  {
    name: `FTS common word (${session})`,
    sql: `SELECT seq, ts_rank(search_tsv, q) AS score FROM messages, websearch_to_tsquery('english', $3) q
          WHERE tenant_id = $1 AND session_id = $2 AND search_tsv @@ q ORDER BY score DESC, seq DESC LIMIT 8`,
    params: () => [TENANT, session, 'deploy config'],
  },
  {
    name: `k-NN top 8 (${session})`,
    sql: `SELECT seq, embedding <=> $3::vector AS d FROM message_vectors
          WHERE tenant_id = $1 AND session_id = $2 ORDER BY d LIMIT 8`,
    params: () => [TENANT, session, probeVector],
  },
  {
    name: `last-16 window (${session})`,
    sql: `SELECT seq, role, content FROM messages WHERE tenant_id = $1 AND session_id = $2
          ORDER BY seq DESC LIMIT 16`,
    params: () => [TENANT, session],
  },
];

const pct = (xs: number[], p: number) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]!;
};

async function measure(
  db: Db,
  c: Case,
  noSeqscan: boolean,
): Promise<{ p50: number; p95: number; plan: string }> {
  const run = (q: Queryable, sql: string) => q.query<Record<string, string>>(sql, c.params());
  const inTx = <T>(fn: (q: Queryable) => Promise<T>) =>
    noSeqscan
      ? db.transaction(async (tx) => {
          await tx.query('SET LOCAL enable_seqscan = off');
          return fn(tx);
        })
      : fn(db);
  const explain = await inTx((q) => run(q, `EXPLAIN ${c.sql}`));
  const lines = explain.rows.map((r) => Object.values(r)[0]!);
  const plan = lines
    .filter((l) => /Scan/.test(l))
    .map((l) =>
      l
        .trim()
        .replace(/\s+\(cost.*$/, '')
        .replace(/^->\s*/, ''),
    );
  for (let i = 0; i < 5; i++) await inTx((q) => run(q, c.sql));
  const times: number[] = [];
  for (let i = 0; i < RUNS; i++) {
    const t = performance.now();
    await inTx((q) => run(q, c.sql));
    times.push(performance.now() - t);
  }
  return { p50: pct(times, 50), p95: pct(times, 95), plan: plan.join(' / ') };
}

async function report(label: string, db: Db): Promise<void> {
  const loadS = await load(db);
  process.stdout.write(
    `\n## ${label}: ${TOTAL} messages (${DIM}-d vectors) loaded in ${loadS.toFixed(1)} s (${Math.round(TOTAL / loadS)} rows/s incl. vectors)\n\n`,
  );
  process.stdout.write(
    '| query | planner default p50 / p95 ms | plan | enable_seqscan=off p50 / p95 ms | plan |\n|---|---|---|---|---|\n',
  );
  for (const c of [...cases(BIG), ...cases(SMALL)]) {
    const a = await measure(db, c, false);
    const b = await measure(db, c, true);
    process.stdout.write(
      `| ${c.name} | ${a.p50.toFixed(2)} / ${a.p95.toFixed(2)} | ${a.plan} | ${b.p50.toFixed(2)} / ${b.p95.toFixed(2)} | ${b.plan} |\n`,
    );
  }
}

const dir = await mkdtemp(path.join(tmpdir(), 'mnemos-bench-embedded-'));
try {
  const t = Date.now();
  const db = await openPgliteDb(dir);
  await migrate(db);
  process.stdout.write(
    `PGlite open + migrate: ${((Date.now() - t) / 1000).toFixed(1)} s; ${RUNS} runs per query\n`,
  );
  try {
    await report('embedded (PGlite 0.5.14, PostgreSQL 18)', db);
  } finally {
    await db.close();
  }
  if (args['compare-pg']) {
    const name = `mnemos_bench_${randomBytes(4).toString('hex')}`;
    const admin = makePgDb({ connectionString: args['pg-admin-url'], max: 1 });
    await admin.query(`CREATE DATABASE "${name}"`);
    const u = new URL(args['pg-admin-url']);
    u.pathname = `/${name}`;
    const pg = makePgDb({ connectionString: u.toString(), max: 2 });
    try {
      await migrate(pg);
      seed = CORPUS_SEED;
      await report('native Postgres', pg);
    } finally {
      await pg.close();
      await admin.query(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
      await admin.close();
    }
  }
} finally {
  await rm(dir, { recursive: true, force: true });
}
