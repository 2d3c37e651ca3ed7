import assert from 'node:assert/strict';
import { randomBytes, randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { QueueEvents } from 'bullmq';
import { annIndexName, buildAnnIndex } from '../db/queries/ann-indexes.js';
import { SESSION_SCAN_MAX_MESSAGES, searchCandidates } from '../db/queries/search.js';
import { buildSessionIndex, sessionIndexName } from '../db/queries/session-indexes.js';
import { makePgDb } from '../db/pool.js';
import { localEmbed } from '../services/llm/local-embedder.js';
import {
  MAX_LEAF_TOKENS,
  MAX_LEAVES_PER_TERM,
  ftsLeaves,
  parseSearchQuery,
} from '../services/search/parse-query.js';
import { RRF_K, fuseRrf, selectHits } from '../services/search/rank-hits.js';
import type { Db, QueryOptions } from '../db/pool.js';
import { searchSession } from '../services/search/search-session.js';
import { QUERY_EMBED_DEADLINE_MS } from '../services/search/query-embedding.js';
import { maintainAnnIndexes } from '../services/recent-index/ann-indexes.js';
import { maintainSessionIndexes } from '../services/search/session-indexes.js';
import { refreshTableStatistics } from '../services/search/table-statistics.js';
import { exclusively, maintenanceLockKeys } from '../workers/maintenance-lock.js';
import {
  FTS_CJK_PASS,
  FTS_ARGS_PASS,
  FTS_FOLD_PASS,
  FTS_COMPOUND_PASS,
  FTS_FORMAT_PASS,
  FTS_LONG_PASS,
  backfillCjkTsvectors,
  backfillCompoundTsvectors,
  backfillFormatTsvectors,
  backfillFoldedTsvectors,
  backfillLongTsvectors,
  backfillToolCallTsvectors,
} from '../services/search/fts-backfill.js';
import type { SearchHit, SearchParams } from '../services/search/search-session.js';
import { startFakeOpenAI } from './support/fake-openai.js';
import type { FakeOpenAI } from './support/fake-openai.js';
import {
  ADMIN_TOKEN,
  api,
  createTestDatabase,
  dropTestDatabase,
  eventually,
  holdOldSnapshot,
  holdTransaction,
  indexBuildWaiting,
  startTestService,
} from './support/harness.js';
import type { Api, Res, TestService } from './support/harness.js';

const sid = (what: string) => `search-${what}-${randomBytes(3).toString('hex')}`;

type Msg = Record<string, unknown>;
const user = (content: string, extra: Msg = {}): Msg => ({ role: 'user', content, ...extra });
const assistant = (content: string): Msg => ({ role: 'assistant', content });
// System messages are not embedded (EMBED_ROLES default user,assistant) and match no query here:
// they keep targets apart so that one target's context never swallows another.
const filler = (): Msg => ({ role: 'system', content: 'padding message' });

/** Posts and waits until archived; returns the seqs in order. */
async function archive(api: Api, session: string, messages: Msg[]): Promise<number[]> {
  const r = await api.post(`/v1/sessions/${session}/messages?wait=true`, { messages });
  assert.equal(r.status, 201, r.text);
  return (r.body.messages as Array<{ seq: number }>).map((m) => m.seq);
}

/** Each target followed by three fillers; returns the targets' seqs. */
async function archiveSpaced<T extends Msg[]>(
  api: Api,
  session: string,
  targets: [...T],
): Promise<{ [K in keyof T]: number }> {
  const messages = targets.flatMap((t) => [t, filler(), filler(), filler()]);
  const seqs = await archive(api, session, messages);
  return targets.map((_, i) => seqs[i * 4]!) as { [K in keyof T]: number };
}

/** A hit as the API returns it (JSON of searchSession's SearchHit). */
type Hit = SearchHit;

/**
 * Every search in this file goes through here: never a 5xx, and every 200 obeys invariant 5 (no
 * seq twice across hits and contexts), with contexts ascending and without their own hit.
 */
type SearchBody = { hits: Hit[]; error?: { code: string; message: string } };

async function search(api: Api, session: string, body: Record<string, unknown>): Promise<Res<SearchBody>> {
  const r = await api.post<SearchBody>(`/v1/sessions/${session}/search`, body);
  assert.ok(r.status < 500, `search ${JSON.stringify(body).slice(0, 80)} answered ${r.status}: ${r.text}`);
  if (r.status === 200) {
    const seen = new Set<number>();
    for (const h of r.body.hits) {
      for (const s of [h.seq, ...h.context.map((c) => c.seq)]) {
        assert.ok(!seen.has(s), `seq ${s} appears twice in ${JSON.stringify(r.body.hits.map((x) => x.seq))}`);
        seen.add(s);
      }
      const ctx = h.context.map((c) => c.seq);
      assert.deepEqual(
        ctx,
        [...ctx].sort((a, b) => a - b),
        'context in seq order',
      );
      assert.ok(
        ['archive', 'recent', 'both'].includes(h.source),
        "['archive', 'recent', 'both'].includes(h.source)",
      );
      assert.equal(typeof h.score, 'number');
    }
  }
  return r;
}

async function hitSeqs(api: Api, session: string, body: Record<string, unknown>): Promise<number[]> {
  const r = await search(api, session, body);
  assert.equal(r.status, 200, r.text);
  return r.body.hits.map((h) => h.seq);
}

const sorted = (xs: number[]) => [...xs].sort((a, b) => a - b);

/**
 * A Db that records the statements sent and lets `tamper` alter the result of the candidate
 * statement (the one whose row carries `kw` and `sem`), to make its prefetch incomplete.
 */
function recordingDb(db: Db, tamper: (row: Record<string, unknown>) => void = () => undefined) {
  const sent: string[] = [];
  const calls: Array<{ text: string; params?: unknown[] }> = [];
  const wrapped: Db = {
    ...db,
    async query<R>(text: string, params?: unknown[], opts?: QueryOptions) {
      // Not a search's statement: the process's list of sessions with indexes of their own, read
      // at most every 30 s (services/search/indexed-sessions.ts; here once per wrapper).
      if (!text.includes('session_search_indexes')) {
        sent.push(text);
        calls.push({ text, params });
      }
      const r = await db.query<R>(text, params, opts);
      const row = r.rows[0] as Record<string, unknown> | undefined;
      if (row && 'kw' in row && 'sem' in row) tamper(row);
      return r;
    },
  };
  return { db: wrapped, sent, calls };
}

const params = (p: Partial<SearchParams> & { query: string }): SearchParams => ({
  match: 'hybrid',
  limit: 8,
  time_range: 'all',
  exclude_window: false,
  ...p,
});

/**
 * Vectors for the session's hot messages of the embedded roles. With an extension owning the
 * embed queue (the real pipeline), waits for it; otherwise writes them as the embed job would,
 * with the local embedder.
 */
async function ensureVectors(svc: TestService, tenantId: string, session: string): Promise<void> {
  const missing = async () =>
    (
      await svc.deps.db.query<{ seq: string; content: string }>(
        `SELECT m.seq, m.content FROM messages m JOIN sessions s ON s.tenant_id = m.tenant_id AND s.id = m.session_id
         WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq >= s.start_seq AND m.role = ANY($3::text[])
           AND m.content ~ '[^[:space:]]'
           AND NOT EXISTS (SELECT 1 FROM message_vectors v
                           WHERE v.tenant_id = m.tenant_id AND v.session_id = m.session_id AND v.seq = m.seq)
           AND NOT EXISTS (SELECT 1 FROM message_vector_skips k
                           WHERE k.tenant_id = m.tenant_id AND k.session_id = m.session_id AND k.seq = m.seq)`,
        [tenantId, session, svc.config.embedRoles],
      )
    ).rows;
  if (svc.extensions.some((e) => e.processors?.embed)) {
    await eventually(async () => (await missing()).length === 0, 20_000, 'the embed job');
    return;
  }
  for (const row of await missing()) {
    await svc.deps.db.query(
      `INSERT INTO message_vectors (tenant_id, session_id, seq, embedding) VALUES ($1, $2, $3, $4::vector)
       ON CONFLICT DO NOTHING`,
      [tenantId, session, row.seq, JSON.stringify(localEmbed(row.content, svc.config.embedding.dimensions))],
    );
  }
}

/**
 * Moves the cutoff past `beyondSeq`: waits for the compaction job when an extension owns the
 * compact queue; otherwise does what compaction does (cutoff forward, vectors below it gone).
 */
async function ensureCompacted(svc: TestService, api: Api, tenantId: string, session: string, cutTo: number) {
  if (svc.extensions.some((e) => e.processors?.compact)) {
    return eventually(
      async () => {
        const s = await api.get(`/v1/sessions/${session}`);
        return s.body.start_seq > 1 ? (s.body.start_seq as number) : null;
      },
      20_000,
      'compaction',
    );
  }
  await svc.deps.db.query('UPDATE sessions SET start_seq = $3 WHERE tenant_id = $1 AND id = $2', [
    tenantId,
    session,
    cutTo,
  ]);
  await svc.deps.db.query(
    'DELETE FROM message_vectors WHERE tenant_id = $1 AND session_id = $2 AND seq < $3',
    [tenantId, session, cutTo],
  );
  return cutTo;
}

void describe('query parsing and ranking (pure)', () => {
  void test('a term reaches its tsquery as at most 8 leaves of at most 32 words or bigrams', () => {
    const words = (leaf: { text: string }) => leaf.text.match(/[\p{L}\p{N}]+/gu) ?? [];
    const [cjk] = ftsLeaves({ text: '記憶系統'.repeat(2_500), phrase: false });
    assert.equal(cjk!.kind, 'cjk-phrase');
    assert.equal(words(cjk!).length, MAX_LEAF_TOKENS);
    assert.equal(words(cjk!).slice(0, 3).join(' '), '記憶 憶系 系統');
    const hyphens = ftsLeaves({
      text: Array.from({ length: 3_000 }, (_, i) => `w${i}`).join('-'),
      phrase: true,
    });
    assert.deepEqual(
      hyphens.map((l) => [l.kind, words(l).length]),
      [['english-phrase', MAX_LEAF_TOKENS]],
    );
    assert.ok(
      hyphens[0]!.text.endsWith(`w${MAX_LEAF_TOKENS - 1}`),
      'hyphens[0]!.text.endsWith(`w${MAX_LEAF_TOKENS - 1}`)',
    );
    const runs = ftsLeaves({ text: 'x記'.repeat(5_000), phrase: false });
    assert.equal(runs.length, MAX_LEAVES_PER_TERM);
    // A phrase's CJK runs are one chain of runs, cut as one leaf.
    const chain = ftsLeaves({ text: '記憶系 '.repeat(100), phrase: true });
    assert.deepEqual(
      chain.map((l) => [l.kind, l.text.match(/'[^']+'/g)?.length]),
      [['cjk-phrase', MAX_LEAF_TOKENS]],
    );
    assert.ok(chain[0]!.text.startsWith("'記憶' <-> '憶系' <2> '記憶'"), chain[0]!.text);
    // Short terms are untouched.
    assert.deepEqual(ftsLeaves({ text: 'pool記憶', phrase: false }), [
      { kind: 'english-words', text: 'pool ' },
      { kind: 'cjk-phrase', text: "'記憶'" },
    ]);
  });

  void test('web-search syntax: words AND, or binds tighter, phrases, exclusions, junk ignored', () => {
    const p = parseSearchQuery('deploy db or database -"hot fix" -legacy "unclosed phrase');
    assert.deepEqual(
      p.groups.map((g) => g.map((t) => `${t.phrase ? 'P:' : ''}${t.text}`)),
      [['deploy'], ['db', 'database'], ['P:unclosed phrase']],
    );
    assert.deepEqual(
      p.exclude.map((t) => t.text),
      ['hot fix', 'legacy'],
    );
    assert.equal(p.embedText, 'deploy db database unclosed phrase');
    assert.deepEqual(parseSearchQuery('or or - -').groups, []);
    // Two dashes make a word (a command-line flag), not an exclusion.
    assert.deepEqual(
      parseSearchQuery('--"dry run"').groups.map((g) => g.map((t) => `${t.phrase ? 'P:' : ''}${t.text}`)),
      [['P:dry run']],
    );
    const flags = parseSearchQuery('migrate --dry-run -v --');
    assert.deepEqual(
      flags.groups.map((g) => g.map((t) => t.text)),
      [['migrate'], ['--dry-run']],
    );
    assert.deepEqual(
      flags.exclude.map((t) => t.text),
      ['v'],
    );
    assert.deepEqual(
      parseSearchQuery('a or -b or c').groups.map((g) => g.map((t) => t.text)),
      [['a'], ['c']],
    );
  });

  void test('reciprocal-rank fusion sums 1/(60+rank) and favours agreement', () => {
    const c = (seq: number) => ({ seq, score: 0, archive: true, recent: false });
    const fused = fuseRrf([
      [c(1), c(2), c(3)],
      [
        { ...c(2), archive: false, recent: true },
        { ...c(4), archive: false, recent: true },
      ],
    ]);
    assert.deepEqual(
      fused.map((f) => f.seq),
      [2, 1, 4, 3],
    );
    assert.equal(fused[0]!.score, 1 / (RRF_K + 2) + 1 / (RRF_K + 1));
    assert.deepEqual([fused[0]!.archive, fused[0]!.recent], [true, true]);
  });

  void test('selectHits drops hits already shown and trims contexts', () => {
    const c = (seq: number) => ({ seq, score: 1, archive: true, recent: false });
    const neighbours = new Map([
      [5, [3, 4, 6]],
      [4, [2, 3, 5]],
      [8, [6, 7, 9]],
    ]);
    const out = selectHits([c(5), c(4), c(8)], neighbours, 8);
    assert.deepEqual(
      out.map((o) => [o.hit.seq, o.context]),
      [
        [5, [3, 4, 6]],
        [8, [7, 9]],
      ],
    );
  });
});

void describe('POST /v1/sessions/{sid}/search', () => {
  let svc: TestService;
  let api: Api;
  let tenantId: string;

  before(async () => {
    svc = await startTestService({ env: { MAX_HISTORY_MESSAGES: '4' } });
    ({ api, tenantId } = await svc.newTenant());
  });
  after(async () => {
    await svc?.stop();
  });
  void test('a response of huge messages past 32 MiB shows each cut, with a marker', async () => {
    // 1 MiB of a control character is 6 MiB as JSON (\u0001): 128 such rows in one search were
    // a 768 MB string the driver could not make, and the process died. Tool calls' arguments
    // (bounded only by the 8 MiB body) did the same.
    const s = `huge-${randomBytes(3).toString('hex')}`;
    for (let i = 0; i < 7; i++)
      await archive(api, s, [user(`word${i} ${'\u0001'.repeat(1024 * 1024 - 16)}`)]);
    const call = {
      id: 'c1',
      type: 'function',
      function: { name: 'f', arguments: 'b'.repeat(3 * 1024 * 1024) },
    };
    await archive(api, s, [{ role: 'assistant', content: 'calling', tool_calls: [call] }]);
    const r = await search(api, s, { query: 'word0 or word3 or word6', match: 'keyword', limit: 3 });
    assert.equal(r.status, 200);
    const shown = r.body.hits.flatMap((h) => [h, ...h.context]);
    assert.equal(shown.length, 8, 'every message shown once: 3 hits and their neighbours');
    for (const m of shown.filter((x) => x.seq !== 8)) {
      const text = String(m.content);
      assert.ok(text.length < 70_000, `seq ${m.seq}: ${text.length} characters`);
      assert.match(text, /…\[cut: the search response passed 32 MiB\]$/);
    }
    // #8 is the context after the hit #7.
    const after = shown.find((m) => m.seq === 8) as unknown as {
      content: string;
      tool_calls: (typeof call)[];
    };
    assert.equal(after.content, 'calling', 'short content stays whole');
    const args = after.tool_calls[0]!.function.arguments;
    assert.equal(args, `${'b'.repeat(65_536)} …[cut]`);
    // Below the bound nothing changes.
    const one = await search(api, s, { query: 'word6', match: 'keyword', limit: 1 });
    assert.equal(String(one.body.hits[0]!.content).length, 1024 * 1024 - 16 + 'word6 '.length);
  });

  /** The cutoff moved to `seq` (as compaction would) without waiting for one. */
  const moveCutoff = (session: string, seq: number) =>
    svc.deps.db.query('UPDATE sessions SET start_seq = $3 WHERE tenant_id = $1 AND id = $2', [
      tenantId,
      session,
      seq,
    ]);

  /**
   * Runs `fn` with the backfill pass `name` set back to its start and the service's own scheduled
   * maintenance paused, so that only `fn` moves the pass; `deps` logs nothing.
   */
  const withPassRestarted = async (
    name: string,
    fn: (deps: { db: Db; logger: never }) => Promise<void>,
  ): Promise<void> => {
    await svc.deps.queues.maintenance.pause();
    try {
      await svc.deps.db.query(`UPDATE maintenance_state SET state = '{}', done_at = NULL WHERE name = $1`, [
        name,
      ]);
      await fn({ db: svc.deps.db, logger: { info: () => undefined } as never });
    } finally {
      await svc.deps.queues.maintenance.resume();
    }
  };
  /** Runs a full-text backfill pass from its start to its end, three rows a batch, two batches a run. */
  const runPass = (
    name: string,
    backfill: (
      deps: { db: Db; logger: never },
      opts: { batch: number; maxBatches: number },
    ) => Promise<{ done: boolean }>,
  ) =>
    withPassRestarted(name, async (deps) => {
      for (let done = false; !done;) ({ done } = await backfill(deps, { batch: 3, maxBatches: 2 }));
    });
  /** What rows archived before a pass existed hold: their content indexed as Postgres's parser reads it. */
  const indexedAsWritten = (s: string, seqs: Array<number | undefined>) =>
    svc.deps.db.query(
      `UPDATE messages SET search_tsv = to_tsvector('english', content)
       WHERE tenant_id = $1 AND session_id = $2 AND seq = ANY($3::bigint[])`,
      [tenantId, s, seqs],
    );
  /** The seqs of the hits full text found, in rank order (not those of the substring match alone). */
  const fullTextHits = async (s: string, query: string) =>
    (await search(api, s, { query, match: 'keyword' })).body.hits
      .filter((h) => h.source !== 'recent')
      .map((h) => h.seq);

  void test('keyword: English stemming finds "compaction" for "compacting"', async () => {
    const s = sid('stem');
    const [a, , c] = await archiveSpaced(api, s, [
      user('We talked about compaction of the hot history yesterday.'),
      user('Completely unrelated: the weather is nice.'),
      user('The compacted archive stays searchable.'),
    ]);
    const r = await search(api, s, { query: 'compacting', match: 'keyword' });
    assert.equal(r.status, 200);
    assert.deepEqual(sorted(r.body.hits.map((h) => h.seq)), [a, c]);
    // Full text found it; the literal "compacting" is nowhere, so the substring matcher did not.
    assert.ok(
      r.body.hits.every((h) => h.source === 'archive'),
      "r.body.hits.every((h) => h.source === 'archive')",
    );
    assert.match(String(r.body.hits.find((h) => h.seq === a)?.content), /compaction/);
  });

  void test('keyword: the text parts of a message are separate words to full text', async () => {
    const s = sid('parts');
    const [parts] = await archiveSpaced(api, s, [
      {
        role: 'user',
        content: [
          { type: 'text', text: 'alpha' },
          { type: 'text', text: 'beta' },
        ],
      },
    ]);

    const r = await search(api, s, { query: 'beta', match: 'keyword' });

    // Full text found the word (joined without a break, the parts were one word "alphabeta").
    assert.deepEqual(
      r.body.hits.map((h) => [h.seq, h.source]),
      [[parts, 'both']],
    );
  });

  void test('keyword: phrases, unclosed quotes, exclusions and or', async () => {
    const s = sid('syntax');
    const archived = await archiveSpaced(api, s, [
      user('the hot history grows quickly'),
      user('history is hot today'),
      user('database migration with postgres'),
      user('database migration with mysql'),
      user('redis cache layer'),
      user('kafka event stream'),
      user('redis and kafka together'),
      user('ran npm run migrate --dry-run first'),
      user('the job ended with exit code -1'),
      user('the job ended with exit code 0'),
    ]);
    const [minusOne, zero] = [archived[8]!, archived[9]!];
    const [hot, rev, pg, my, redis, kafka, both, dry] = archived;
    // A command-line flag is a term, not an exclusion; a quoted term may start with one dash.
    assert.deepEqual(await hitSeqs(api, s, { query: 'exit code "-1"', match: 'keyword' }), [minusOne]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'exit code -1', match: 'keyword' }), [zero]);
    assert.deepEqual(await hitSeqs(api, s, { query: '--dry-run', match: 'keyword' }), [dry]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'database --dry-run', match: 'keyword' }), []);
    assert.deepEqual(await hitSeqs(api, s, { query: '"hot history"', match: 'keyword' }), [hot]);
    assert.deepEqual(await hitSeqs(api, s, { query: '"hot history', match: 'keyword' }), [hot]);
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'hot history', match: 'keyword' })), [hot, rev]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'database -postgres', match: 'keyword' }), [my]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'database -"with postgres"', match: 'keyword' }), [my]);
    assert.deepEqual(await hitSeqs(api, s, { query: '-postgres', match: 'keyword' }), []);
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'redis or kafka', match: 'keyword' })), [
      redis,
      kafka,
      both,
    ]);
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'redis OR kafka', match: 'keyword' })), [
      redis,
      kafka,
      both,
    ]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'redis kafka', match: 'keyword' }), [both]);
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'redis or', match: 'keyword' })), [redis, both]);
    // Exclusions apply to every matcher, semantic included.
    await ensureVectors(svc, tenantId, s);
    const sem = await hitSeqs(api, s, { query: 'database -postgres', match: 'semantic', limit: 32 });
    assert.ok(sem.includes(my) && !sem.includes(pg), JSON.stringify(sem));
  });

  void test('an excluded term drops a message only when all its parts match', async () => {
    const s = sid('exclude-parts');
    const [both, db, err] = await archiveSpaced(api, s, [
      user('the db 錯誤 again'),
      user('the db is fine'),
      user('又一個錯誤'),
    ]);
    await ensureVectors(svc, tenantId, s);
    // `db錯誤` is an English and a CJK part: only the first message has both.
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'db or 錯誤 -db錯誤', match: 'keyword' })), [
      db,
      err,
    ]);
    for (const match of ['semantic', 'hybrid'] as const) {
      const got = await hitSeqs(api, s, { query: 'db or 錯誤 -db錯誤', match, limit: 32 });
      assert.ok(!got.includes(both) && got.includes(db) && got.includes(err), `${match}: ${got.join()}`);
    }
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'db or 錯誤', match: 'keyword' })), [
      both,
      db,
      err,
    ]);
  });

  void test('an excluded phrase with stop words leaves out only the messages that hold it', async () => {
    const s = sid('exclude-stop');
    const [failed, green, disk, possessive, list, cjkOf, cjk] = await archiveSpaced(api, s, [
      user('the build failed with an error in step 3'),
      user('no error this time, build is green'),
      user('error: disk full on build host'),
      user("the user's key expired"),
      user('user list refreshed'),
      user('記憶 of the error'),
      user('記憶 error again'),
    ]);
    await ensureVectors(svc, tenantId, s);
    // Full text drops `no` from the phrase: its tsquery alone would exclude every "error".
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'error -"no error"', match: 'keyword' })), [
      failed,
      disk,
      cjkOf,
      cjk,
    ]);
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: "user -user's", match: 'keyword' })), [list]);
    // A stop word beside CJK text: full text would test the CJK alone, and drop every 記憶.
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'error -"記憶 of"', match: 'keyword' })), [
      failed,
      green,
      disk,
      cjk,
    ]);
    for (const match of ['semantic', 'hybrid'] as const) {
      const got = await hitSeqs(api, s, { query: 'error build -"no error"', match, limit: 32 });
      assert.ok(
        got.includes(failed) && got.includes(disk) && !got.includes(green),
        `${match}: ${got.join()}`,
      );
      const users = await hitSeqs(api, s, { query: "user -user's", match, limit: 32 });
      assert.ok(users.includes(list) && !users.includes(possessive), `${match}: ${users.join()}`);
    }
  });

  void test('keyword: CJK queries of 2, 3 and 4 characters match inside longer text', async () => {
    const s = sid('cjk');
    const [sys, weather, mem, log, ja] = await archiveSpaced(api, s, [
      user('我們討論了記憶系統的設計'),
      user('今天天氣很好'),
      user('記憶體不足的錯誤'),
      user('系統記錄在這裡'),
      user('検索エンジンの設計について'),
    ]);
    const kw = (query: string) => hitSeqs(api, s, { query, match: 'keyword' }).then(sorted);
    assert.deepEqual(await kw('記憶'), [sys, mem]);
    assert.deepEqual(await kw('記憶系'), [sys]);
    assert.deepEqual(await kw('記憶系統'), [sys]);
    assert.deepEqual(await kw('憶系統的'), [sys]);
    assert.deepEqual(await kw('系統記'), [log]);
    assert.deepEqual(await kw('天氣'), [weather]);
    assert.deepEqual(await kw('検索エンジン'), [ja]);
    assert.deepEqual(await kw('系記'), []);
    // One character: a prefix match on the bigrams.
    assert.deepEqual(await kw('憶'), [sys, mem]);
    // Both tiers: full text and the substring matcher over the (uncompacted) recent part.
    const r = await search(api, s, { query: '記憶系統', match: 'keyword' });
    assert.equal(r.body.hits[0]?.source, 'both');
    assert.deepEqual(await kw('"記憶系統的設計"'), [sys]);
    assert.deepEqual(await kw('記憶 -記憶體'), [sys]);
  });

  void test('keyword over the archive alone: no phrase across two CJK runs, katakana words with ー', async () => {
    const s = sid('cjkruns');
    const [tokyo, taipei, db] = await archiveSpaced(api, s, [
      user('他去了東京。京都很美'),
      user('我喜歡台北，北京也不錯'),
      user('データベースのサーバーでエラーが発生しました'),
      filler(),
    ]);
    // Below the cutoff only full text answers (the substring matcher reads the recent part).
    await moveCutoff(s, db! + 1);
    const kw = async (query: string) => {
      const r = await search(api, s, { query, match: 'keyword' });
      assert.ok(
        r.body.hits.every((h) => h.source === 'archive'),
        "r.body.hits.every((h) => h.source === 'archive')",
      );
      return sorted(r.body.hits.map((h) => h.seq));
    };
    assert.deepEqual(await kw('東京'), [tokyo]);
    assert.deepEqual(await kw('京都'), [tokyo]);
    assert.deepEqual(await kw('東京都'), [], 'the bigrams of 東京 and 京都 are two runs apart');
    assert.deepEqual(await kw('"台北京"'), []);
    assert.deepEqual(await kw('北京'), [taipei]);
    for (const word of ['サーバー', 'ベース', 'データベース', 'エラー'])
      assert.deepEqual(await kw(word), [db], word);
  });

  void test('keyword: a quoted phrase of several CJK or Korean runs matches them in order and adjacent, before and after compaction', async () => {
    const s = sid('cjkphrase');
    const [ko, ja, trip, paper, mixed, en] = await archiveSpaced(api, s, [
      user('메모리를 정리했습니다 그리고 시스템은 빠릅니다'),
      user('タイムズ紙はニューヨークで読んだ。東京は晴れ、大阪は雨'),
      user('出張先は東京、大阪、名古屋の順です'),
      user('ニューヨーク・タイムズの記事'),
      user('deploy 東京 server 大阪 tomorrow'),
      user('the system memory was fine'),
    ]);
    const expectations: Array<[string, number[]]> = [
      ['"메모리를 정리했습니다"', [ko!]],
      ['"정리했습니다 메모리를"', []],
      ['"메모리를 시스템은"', []],
      ['"메모리 정리했습니다"', []],
      ['"ニューヨーク・タイムズ"', [paper!]],
      // Runs are followed across whatever separated them in the message: a space, `、`, English
      // words (full text keeps those apart from the CJK runs).
      ['"東京、大阪"', sorted([trip!, mixed!])],
      ['"東京 大阪"', sorted([trip!, mixed!])],
      ['"大阪 東京"', []],
      ['"東京 名古屋"', []],
      ['"東京 server 大阪"', [mixed!]],
      ['"大阪 server 東京"', []],
      ['"memory system"', []],
      ['"system memory"', [en!]],
      ['東京 大阪', sorted([ja!, trip!, mixed!])],
    ];
    const kw = (query: string) => hitSeqs(api, s, { query, match: 'keyword' }).then(sorted);
    for (const [query, want] of expectations) assert.deepEqual(await kw(query), want, query);
    // Below the cutoff only full text answers: the same hits.
    await moveCutoff(s, en! + 4);
    for (const [query, want] of expectations) assert.deepEqual(await kw(query), want, `${query} (compacted)`);
  });

  void test('keyword: query syntax typed full-width, with a minus sign or typographic quotes', async () => {
    const s = sid('fwsyntax');
    const [sysmem, memory, osaka, times, mail] = await archiveSpaced(api, s, [
      user('the system memory was fine'),
      user('memory alone'),
      user('タイムズ紙はニューヨークで読んだ。東京は晴れ、大阪は雨'),
      user('タイムズ紙だけ'),
      user('send the e-mail now'),
    ]);
    const expectations: Array<[string, number[]]> = [
      ['タイムズ －大阪', [times!]],
      ['memory −system', [memory!]],
      ['memory ﹣system', [memory!]],
      ['＂memory system＂', []],
      ['＂system memory＂', [sysmem!]],
      ['“memory system”', []],
      ['“system memory”', [sysmem!]],
      ['„system memory“', [sysmem!]],
      ['„memory system“', []],
      ['nothinghere ＯＲ memory', sorted([sysmem!, memory!])],
      ['nothinghere ｏｒ 大阪', [osaka!]],
      // A dash inside a word is no exclusion, however it is typed.
      ['e-mail', [mail!]],
      ['e－mail', [mail!]],
    ];
    for (const [query, want] of expectations)
      assert.deepEqual(sorted(await hitSeqs(api, s, { query, match: 'keyword' })), want, query);
  });

  void test('keyword: a query word with a zero-width no-break space inside is one word, as the index reads it', async () => {
    const s = sid('bom');
    const [wide] = await archiveSpaced(api, s, [
      user('a wide\ufeffspread outage'),
      user('wide roads spread out'),
    ]);
    const kw = (query: string) => hitSeqs(api, s, { query, match: 'keyword' });
    for (const query of ['wide\ufeffspread', 'widespread']) assert.deepEqual(await kw(query), [wide], query);
    await moveCutoff(s, wide! + 8);
    for (const query of ['wide\ufeffspread', 'widespread'])
      assert.deepEqual(await kw(query), [wide], `${query} (compacted)`);
  });

  void test('keyword: a one-character run of a quoted CJK or Korean phrase is that run, except as its last', async () => {
    const s = sid('cjkone');
    // Neither `이번` nor `京東` ends or is the phrase's one-character run.
    const [i, , eopsi, tokyo, , kyo, osaka, osakaFu, dai] = await archiveSpaced(api, s, [
      user('이 문제는 어렵다'),
      user('이번 문제는 어렵다'),
      user('없이 문제는 쉽다'),
      user('東京 大阪に行く'),
      user('京東 大阪に行く'),
      user('京 大阪に行く'),
      user('東京 大阪 名古屋'),
      user('東京 大阪府 名古屋'),
      user('東京 大 名古屋'),
    ]);
    // [query, recent, compacted]: a message run that only ends with the first run's character is
    // found by the substring match, in the recent part only.
    const expectations: Array<[string, number[], number[]]> = [
      ['"이 문제는"', sorted([i!, eopsi!]), [i!]],
      ['"京 大阪"', sorted([tokyo!, kyo!, osaka!, osakaFu!]), [kyo!]],
      ['"東京 大 名古屋"', [dai!], [dai!]],
      // The last run begins a run of the message.
      ['"東京 大"', sorted([tokyo!, osaka!, osakaFu!, dai!]), sorted([tokyo!, osaka!, osakaFu!, dai!])],
    ];
    const kw = (query: string) => hitSeqs(api, s, { query, match: 'keyword' }).then(sorted);
    for (const [query, want] of expectations) assert.deepEqual(await kw(query), want, query);
    await moveCutoff(s, dai! + 4);
    for (const [query, , want] of expectations)
      assert.deepEqual(await kw(query), want, `${query} (compacted)`);
  });

  void test('keyword: a typographic closing quote after a letter or digit (an inch mark) opens no phrase', async () => {
    const s = sid('inch');
    const [curved, flat, ascii, plain] = await archiveSpaced(api, s, [
      user('a 27” monitor that is curved'),
      user('a 27” monitor, flat panel'),
      user('the 27" monitor is curved too'),
      user('monitor curved 27'),
    ]);
    const all = sorted([curved!, flat!, ascii!, plain!]);
    const expectations: Array<[string, number[]]> = [
      ['27” monitor -curved', [flat!]],
      // A digit outside the BMP (two UTF-16 units) is a digit too.
      ['𝟐𝟕” monitor -curved', [flat!]],
      ['monitor -curved 27”', [flat!]],
      ['27” monitor', all],
      // `“` opens, and `”` still closes: the phrase `27`.
      ['“27” monitor', all],
      ['“monitor curved” 27', [plain!]],
      // An ASCII `"` after a digit opens a phrase, as it always did.
      ['27" monitor -curved', [plain!]],
    ];
    const kw = (query: string) => hitSeqs(api, s, { query, match: 'keyword' }).then(sorted);
    for (const [query, want] of expectations) assert.deepEqual(await kw(query), want, query);
    await moveCutoff(s, plain! + 4);
    for (const [query, want] of expectations) assert.deepEqual(await kw(query), want, `${query} (compacted)`);
  });

  void test('keyword: a query fragment with a soft hyphen, word joiner or U+FEFF inside matches recent messages as typed', async () => {
    const s = sid('cfsub');
    const [wide, soft, joiner] = await archiveSpaced(api, s, [
      user('a wide\ufeffspread outage'),
      user('soft\u00adware engineering'),
      user('a word\u2060joiner here'),
    ]);
    const expectations: Array<[string, number[]]> = [
      ['wide\ufeffspr', [wide!]],
      ['soft\u00adwa', [soft!]],
      ['word\u2060join', [joiner!]],
      ['"soft\u00adware eng"', [soft!]],
      // One at a term's end holds no word of it.
      ['\ufeffsoft\u00adwa\u2060', [soft!]],
    ];
    for (const [query, want] of expectations)
      assert.deepEqual(await hitSeqs(api, s, { query, match: 'keyword' }), want, query);
  });

  void test('the backfill re-derives the tsvector of CJK rows archived before the gap and ー, and only theirs', async () => {
    const s = sid('backfill');
    const text = 'データベースのサーバーでエラーが発生しました';
    const [old, english] = await archiveSpaced(api, s, [
      user(text),
      user('plain English server note'),
      filler(),
    ]);
    await moveCutoff(s, english! + 2);
    // What rows archived before 2026-12-01 hold, in effect: a tsvector today's queries miss.
    const stale = `to_tsvector('english', 'stale')`;
    await svc.deps.db.query(
      `UPDATE messages SET search_tsv = ${stale} WHERE tenant_id = $1 AND session_id = $2 AND seq IN ($3, $4)`,
      [tenantId, s, old, english],
    );
    assert.deepEqual(await hitSeqs(api, s, { query: 'サーバー', match: 'keyword' }), []);
    await withPassRestarted(FTS_CJK_PASS, async (deps) => {
      // A byte budget smaller than any message: one message per batch (never none).
      const first = await backfillCjkTsvectors(deps, { batch: 3, maxBatches: 2, maxBytes: 1 });
      assert.deepEqual([first.scanned, first.done], [2, false]);
      let runs = 0;
      for (let done = false; !done; runs++) {
        ({ done } = await backfillCjkTsvectors(deps, { batch: 3, maxBatches: 2 }));
      }
      assert.ok(runs > 1, 'it resumed where it stopped');
      assert.deepEqual(await hitSeqs(api, s, { query: 'サーバー', match: 'keyword' }), [old]);
      const tsv = await svc.deps.db.query<{ seq: string; stale: boolean }>(
        `SELECT seq, search_tsv = ${stale} AS stale FROM messages
         WHERE tenant_id = $1 AND session_id = $2 AND seq IN ($3, $4) ORDER BY seq`,
        [tenantId, s, old, english],
      );
      assert.deepEqual(
        tsv.rows.map((r) => r.stale),
        [false, true],
        'a row without CJK text is left as it is',
      );
      const again = await backfillCjkTsvectors(deps);
      assert.deepEqual(again, { scanned: 0, updated: 0, done: true }, 'once through, it is done');
    });
  });

  void test('full text covers a long message whole, and a megabyte of distinct tokens up to where it fits', async () => {
    const s = sid('long');
    const long = `lorem ipsum ${'dolor sit amet consectetur '.repeat(3000)}zebrafinish`;
    assert.ok(long.length > 70_000, 'long.length > 70_000');
    // 27,000 UUIDs: a hyphenated token is indexed whole and in parts, ~2 MB of lexemes, over
    // Postgres's 1 MB per tsvector: the first 65,536 characters are indexed (and it is archived).
    const uuids = Array.from({ length: 27_000 }, () => randomUUID()).join(' ');
    const tokens = `startmarker ${uuids} endmarker`;
    // CJK beside a long English text: its bigrams used to land after the English positions, all
    // at Postgres's last position, 16,383, where no phrase of bigrams matches.
    const mixed = `開頭標記測試 ${'quux corge grault garply waldo '.repeat(4000)} endmarkerkiwi 終點標記`;
    const [whole, capped, both] = await archiveSpaced(api, s, [user(long), user(tokens), user(mixed)]);
    await moveCutoff(s, both! + 4);
    const kw = async (query: string) => {
      const r = await search(api, s, { query, match: 'keyword' });
      assert.ok(
        r.body.hits.every((h) => h.source === 'archive'),
        "r.body.hits.every((h) => h.source === 'archive')",
      );
      return r.body.hits.map((h) => h.seq);
    };
    assert.deepEqual(await kw('zebrafinish'), [whole], 'a word after the first 65,536 characters');
    assert.deepEqual(await kw('lorem'), [whole]);
    assert.deepEqual(await kw('startmarker'), [capped]);
    assert.deepEqual(await kw('endmarker'), [], 'past the part that fits');
    assert.deepEqual(await kw('endmarkerkiwi'), [both]);
    assert.deepEqual(await kw('開頭標記'), [both]);
    assert.deepEqual(await kw('終點標記'), [both]);
  });

  void test('the backfill indexes long rows archived before whole-text indexing, and only theirs', async () => {
    const s = sid('backfill-long');
    const long = `lorem ipsum ${'dolor sit amet consectetur '.repeat(3000)}zebrafinish`;
    const [old, short] = await archiveSpaced(api, s, [user(long), user('a short note')]);
    await moveCutoff(s, short! + 4);
    // What rows archived before 2026-12-01 hold: the first 65,536 characters only.
    await svc.deps.db.query(
      `UPDATE messages SET search_tsv = to_tsvector('english', left(content, 65536))
       WHERE tenant_id = $1 AND session_id = $2 AND seq = $3`,
      [tenantId, s, old],
    );
    const stale = `to_tsvector('english', 'stale')`;
    await svc.deps.db.query(
      `UPDATE messages SET search_tsv = ${stale} WHERE tenant_id = $1 AND session_id = $2 AND seq = $3`,
      [tenantId, s, short],
    );
    assert.deepEqual(await hitSeqs(api, s, { query: 'zebrafinish', match: 'keyword' }), []);
    await withPassRestarted(FTS_LONG_PASS, async (deps) => {
      for (let done = false; !done;) {
        ({ done } = await backfillLongTsvectors(deps, { batch: 3, maxBatches: 2 }));
      }
      assert.deepEqual(await hitSeqs(api, s, { query: 'zebrafinish', match: 'keyword' }), [old]);
      const tsv = await svc.deps.db.query<{ stale: boolean }>(
        `SELECT search_tsv = ${stale} AS stale FROM messages WHERE tenant_id = $1 AND session_id = $2 AND seq = $3`,
        [tenantId, s, short],
      );
      assert.equal(tsv.rows[0]!.stale, true, 'a short row is left as it is');
    });
  });

  void test('keyword: compatibility forms and final sigma match either way; old rows are re-derived', async () => {
    const s = sid('fold');
    const [wide, kana, decomposed, greek, plain, symbols] = await archive(api, s, [
      user('ＧＰＵ　ｓｅｒｖｅｒ　ｅｒｒｏｒ from a full-width keyboard'),
      user('ｻｰﾊﾞｰ が落ちた'),
      // Tiếng Việt as NFD: each accent a combining mark (a macOS file name, a clipboard).
      user('Tie\u0302\u0301ng Vie\u0323\u0302t'),
      user('Η ΟΔΟΣ είναι μεγάλη'),
      user('plain gpu server note'),
      // Symbols whose compatibility form is letters or digits: they must not glue to the word.
      user('the Acme™ rocket covers 100 km² in 1½ hours'),
    ]);
    const kw = async (query: string) => sorted(await hitSeqs(api, s, { query, match: 'keyword' }));
    const byFullText = (query: string) => fullTextHits(s, query);
    assert.deepEqual(await byFullText('Acme'), [symbols!]);
    assert.deepEqual(await byFullText('km'), [symbols!]);
    assert.deepEqual(await byFullText('11'), []);
    assert.deepEqual(await kw('GPU server'), [wide!, plain!]);
    assert.deepEqual(await kw('ＧＰＵ'), [wide!, plain!]);
    assert.deepEqual(await kw('サーバー'), [kana!]);
    assert.deepEqual(await kw('ｻｰﾊﾞｰ'), [kana!]);
    assert.deepEqual(await kw('Ti\u1ebfng'), [decomposed!], 'an NFC query finds the NFD text');
    assert.deepEqual(await kw('οδος'), [greek!], 'final sigma');
    assert.deepEqual(await kw('ΟΔΟΣ'), [greek!]);
    // What rows archived before 2026-12-02 hold: the text indexed as written.
    await indexedAsWritten(s, [wide, decomposed, greek]);
    assert.deepEqual(await kw('GPU server'), [plain!]);
    await runPass(FTS_FOLD_PASS, backfillFoldedTsvectors);
    assert.deepEqual(await kw('GPU server'), [wide!, plain!]);
    assert.deepEqual(await kw('Ti\u1ebfng'), [decomposed!]);
    assert.deepEqual(await kw('οδος'), [greek!]);
  });

  void test('keyword: invisible format characters are dropped inside a word or break it, the same in every mode; old rows are re-derived', async () => {
    const s = sid('format');
    const [shy, zwnj, zwsp, plain] = await archive(api, s, [
      // A soft hyphen and a word joiner only say where a line may or may not break.
      user('the soft\u00adware ships with the re\u2060build'),
      // Persian writes "I want" with a zero-width non-joiner between its two parts.
      user('\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 a new deploy'),
      user('zero\u200bwidth separated tokens'),
      user('plain software note'),
    ]);
    const byFullText = async (query: string) => sorted(await fullTextHits(s, query));
    const expectations: Array<[string, number[]]> = [
      ['software', sorted([shy!, plain!])],
      ['rebuild', [shy!]],
      ['ware', []],
      ['\u062e\u0648\u0627\u0647\u0645', [zwnj!]],
      ['width', [zwsp!]],
      // A query is read the same way: a soft hyphen typed into it changes nothing.
      ['soft\u00adware', sorted([shy!, plain!])],
    ];
    for (const [query, want] of expectations) assert.deepEqual(await byFullText(query), want, query);
    // What rows archived before 2026-12-03 hold on Postgres 15: a word break at each one.
    await indexedAsWritten(s, [shy, zwnj]);
    assert.deepEqual(await byFullText('software'), [plain!]);
    await runPass(FTS_FORMAT_PASS, backfillFormatTsvectors);
    for (const [query, want] of expectations)
      assert.deepEqual(await byFullText(query), want, `${query} (re-derived)`);
  });

  void test('keyword: the words of dotted names, paths, URLs and addresses are found by full text; old rows are re-derived', async () => {
    const s = sid('compound');
    const [npe, path, mail, plain] = await archiveSpaced(api, s, [
      user('threw java.lang.NullPointerException at com.acme.InvoiceService.load(InvoiceService.java:42)'),
      user('the worker runs /app/worker/tasks.py from https://example.com/deploy/notes'),
      user('ask ops-team@example.org, e.g. before 3.5 ships'),
      user('a plain message about tasks and services'),
    ]);
    const byFullText = async (query: string) => sorted(await fullTextHits(s, query));
    const expectations: Array<[string, number[]]> = [
      ['NullPointerException', [npe!]],
      ['InvoiceService', [npe!]],
      ['java.lang.NullPointerException', [npe!]],
      ['tasks.py', [path!]],
      ['tasks', sorted([path!, plain!])],
      ['example', sorted([path!, mail!])],
      ['ops-team', [mail!]],
      ['deploy notes', [path!]],
      // The text's own phrases keep their positions, and none runs on into the parts.
      ['"threw java.lang.NullPointerException"', [npe!]],
      ['"ships ops-team"', []],
    ];
    for (const [query, want] of expectations) assert.deepEqual(await byFullText(query), want, query);
    // What rows archived before 2026-12-02 hold: each compound one token.
    await indexedAsWritten(s, [npe, path, mail]);
    assert.deepEqual(await byFullText('NullPointerException'), []);
    assert.deepEqual(await byFullText('tasks'), [plain!]);
    await runPass(FTS_COMPOUND_PASS, backfillCompoundTsvectors);
    for (const [query, want] of expectations)
      assert.deepEqual(await byFullText(query), want, `${query} (re-derived)`);
  });

  void test('keyword: words inside tool-call arguments are found (JSON escapes decoded); old rows are re-derived', async () => {
    const s = sid('args');
    // As Python's json.dumps sends them: non-ASCII as \u escapes, newlines and tabs escaped.
    const args = JSON.stringify({ script: 'cd /srv\nrestart nginx\tquickly', note: '記憶系統' }).replace(
      /[\u0080-\uffff]/g,
      (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`,
    );
    assert.match(args, /\\u8a18/);
    const call = { id: 'call_1', type: 'function', function: { name: 'shell', arguments: args } };
    const [seq] = await archive(api, s, [
      { role: 'assistant', content: null, tool_calls: [call] },
      { role: 'tool', tool_call_id: 'call_1', content: 'ok' },
    ]);
    for (const query of ['restart', 'quickly', '記憶', 'nginx', 'shell', 'script']) {
      assert.deepEqual(await hitSeqs(api, s, { query, match: 'keyword' }), [seq], query);
    }
    // What rows archived before 2026-12-02 hold: the raw JSON indexed.
    await svc.deps.db.query(
      `UPDATE messages SET search_tsv = to_tsvector('english', 'shell ' || (tool_calls->0->'function'->>'arguments'))
       WHERE tenant_id = $1 AND session_id = $2 AND seq = $3`,
      [tenantId, s, seq],
    );
    assert.deepEqual(await hitSeqs(api, s, { query: 'restart', match: 'keyword' }), []);
    await runPass(FTS_ARGS_PASS, backfillToolCallTsvectors);
    assert.deepEqual(await hitSeqs(api, s, { query: 'restart', match: 'keyword' }), [seq]);
    assert.deepEqual(await hitSeqs(api, s, { query: '記憶系統', match: 'keyword' }), [seq]);
    // Escapes that decode to what the archive row cannot carry (NUL, a lone surrogate): the body's
    // check sees only their six characters. They blocked the session's drain for good.
    const odd = {
      id: 'call_2',
      type: 'function',
      function: { name: 'sh', arguments: '{"cmd":"printf a\\u0000b","\\ud800k":"\\udc00 pelican"}' },
    };
    const [withOdd, after] = await archive(api, s, [
      { role: 'assistant', content: null, tool_calls: [odd] },
      { role: 'tool', tool_call_id: 'call_2', content: 'done' },
    ]);
    assert.ok(withOdd && after, 'withOdd && after');
    assert.deepEqual(await hitSeqs(api, s, { query: 'pelican', match: 'keyword' }), [withOdd]);

    // Values as the model wrote them: an id past 2^53, a decimal's trailing zero, both values of a
    // key given twice (JSON.parse rounded the first two and kept only the last of the third).
    const ids = {
      id: 'call_3',
      type: 'function',
      function: {
        name: 'refund',
        arguments: '{"order_id": 1234567890123456789, "ratio": 1.10, "cmd": "zebrafish", "cmd": "giraffe"}',
      },
    };
    const [withIds] = await archive(api, s, [
      { role: 'assistant', content: null, tool_calls: [ids] },
      { role: 'tool', tool_call_id: 'call_3', content: 'refunded' },
    ]);
    for (const query of ['1234567890123456789', '1.10', 'zebrafish', 'giraffe']) {
      assert.deepEqual(await hitSeqs(api, s, { query, match: 'keyword' }), [withIds], query);
    }
    assert.deepEqual(await hitSeqs(api, s, { query: '1234567890123456800', match: 'keyword' }), []);
    // Rows the v4 pass derived (through JSON.parse) are derived again by the v6 pass.
    await svc.deps.db.query(
      `UPDATE messages SET search_tsv = to_tsvector('english', 'refund order_id 1234567890123456800 ratio 1.1 cmd giraffe')
       WHERE tenant_id = $1 AND session_id = $2 AND seq = $3`,
      [tenantId, s, withIds],
    );
    assert.deepEqual(await hitSeqs(api, s, { query: '1234567890123456789', match: 'keyword' }), []);
    await runPass(FTS_ARGS_PASS, backfillToolCallTsvectors);
    for (const query of ['1234567890123456789', '1.10', 'zebrafish']) {
      assert.deepEqual(await hitSeqs(api, s, { query, match: 'keyword' }), [withIds], query);
    }
  });

  void test('keyword: mixed CJK and English queries', async () => {
    const s = sid('mixed');
    const [both] = await archiveSpaced(api, s, [
      user('記憶系統 uses compaction nightly'),
      user('compaction only in English'),
      user('記憶系統 only in Chinese'),
    ]);
    assert.deepEqual(await hitSeqs(api, s, { query: '記憶系統 compacting', match: 'keyword' }), [both]);
    assert.deepEqual(await hitSeqs(api, s, { query: '記憶系統compaction', match: 'keyword' }), [both]);
    assert.deepEqual(await hitSeqs(api, s, { query: '"記憶系統 uses compaction"', match: 'keyword' }), [
      both,
    ]);
  });

  void test('keyword: substring over the recent part finds partial words and ids, wildcards literal', async () => {
    const s = sid('substr');
    const [compaction, order, percent, under, , school] = await archiveSpaced(api, s, [
      user('the compaction job ran'),
      user('order req#A1B2C3D4 shipped'),
      user('upload is 100% done'),
      user('variable a_b is set'),
      user('nothing to see axb here 1000 done'),
      user('rendez-vous devant l’ÉCOLE à 8h'),
    ]);
    const r = await search(api, s, { query: 'compa', match: 'keyword' });
    assert.deepEqual(
      r.body.hits.map((h) => [h.seq, h.source]),
      [[compaction, 'recent']],
    );
    assert.deepEqual(await hitSeqs(api, s, { query: 'B2C3', match: 'keyword' }), [order]);
    assert.deepEqual(await hitSeqs(api, s, { query: '0%', match: 'keyword' }), [percent]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'a_b', match: 'keyword' }), [under]);
    // Letters match in any case, accented ones too; patterns without letters match exactly.
    assert.deepEqual(await hitSeqs(api, s, { query: 'b2c3', match: 'keyword' }), [order]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'écol', match: 'keyword' }), [school]);
    assert.deepEqual(await hitSeqs(api, s, { query: '0% do', match: 'keyword' }), [percent]);
    // Only stop words: no full-text hits, but the substring still applies.
    const stop = await search(api, s, { query: 'the', match: 'keyword' });
    assert.deepEqual(
      stop.body.hits.map((h) => h.seq),
      [compaction],
    );
  });

  void test('keyword: substring terms are at most 64 characters, and 256 together', async () => {
    const s = sid('substrcap');
    // Each a long word with the term inside it: full text cannot find it, only the substring can.
    const inside = (c: string, n: number) => user(`see k${c.repeat(n)}k here`);
    const [at64, , ...alternatives] = await archiveSpaced(api, s, [
      inside('q', 64),
      inside('w', 65),
      ...['a', 'b', 'c', 'd', 'e'].map((c) => inside(c, 60)),
    ]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'q'.repeat(64), match: 'keyword' }), [at64]);
    // Postgres matches `%term%` at up to the text's length times the term's: longer terms are
    // left to full text, which does not see inside a word.
    assert.deepEqual(await hitSeqs(api, s, { query: 'w'.repeat(65), match: 'keyword' }), []);
    assert.equal((await search(api, s, { query: `-${'q'.repeat(65)}`, match: 'keyword' })).status, 200);
    // Five alternatives of 60: the first four fit in 256 code points, the fifth is left out.
    const five = ['a', 'b', 'c', 'd', 'e'].map((c) => c.repeat(60)).join(' or ');
    assert.deepEqual(
      (await hitSeqs(api, s, { query: five, match: 'keyword', limit: 32 })).sort((x, y) => x - y),
      alternatives.slice(0, 4),
    );
  });

  void test('keyword: a word of one character or over 64 stays in the AND, never widening the substring match', async () => {
    const s = sid('andword');
    const steps = Array.from({ length: 30 }, (_, i) => [
      user(`step ${i + 1} of the install guide`),
      assistant('done'),
    ]).flat();
    const long = 'x'.repeat(70);
    const seqs = await archive(api, s, [
      ...steps,
      user(`error ${long} in build`),
      ...Array.from({ length: 12 }, (_, i) => user(`error in build ${i}`)),
    ]);
    const step2 = seqs[2]!;
    // Every recent "step" matched the substring half without the 2, and the newest of them, each
    // with the substring bonus, pushed the one message with both out of the hits.
    assert.deepEqual(await hitSeqs(api, s, { query: 'step 2', match: 'keyword' }), [step2]);
    assert.deepEqual((await hitSeqs(api, s, { query: 'step 2', match: 'hybrid' }))[0], step2);
    assert.deepEqual(await hitSeqs(api, s, { query: 'STEP 2 install', match: 'keyword' }), [step2]);
    // A stop letter constrains neither half, as in full text.
    assert.equal((await hitSeqs(api, s, { query: 'a step 2', match: 'keyword' }))[0], step2);
    assert.deepEqual(await hitSeqs(api, s, { query: `error ${long}`, match: 'keyword', limit: 2 }), [
      seqs[60]!,
    ]);
  });

  void test('keyword: a stop letter (a, i, s, t) constrains neither half; another single letter is a whole word', async () => {
    const s = sid('stopletter');
    const [deploy] = await archiveSpaced(api, s, [user('deploy the service now'), user('rollback done')]);

    for (const query of ['a deploy', 'deploy t', 'I deploy', 'deploy S']) {
      const r = await search(api, s, { query, match: 'keyword' });
      // Found by both halves: the substring match does not look for the letter as a word either.
      assert.deepEqual(
        r.body.hits.map((h) => [h.seq, h.source]),
        [[deploy, 'both']],
        query,
      );
    }
    assert.deepEqual(await hitSeqs(api, s, { query: 'deploy x', match: 'keyword' }), []);
    // Excluded, a single ASCII character is no substring either: `-a` leaves out nothing, `-x` the
    // word x, never every message with an a or an x inside a word.
    const [split, box, xray] = await archiveSpaced(api, s, [
      user('banana split'),
      user('banana box'),
      user('banana x ray'),
    ]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'banana -a', match: 'keyword' }).then(sorted), [
      split,
      box,
      xray,
    ]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'banana -x', match: 'keyword' }).then(sorted), [
      split,
      box,
    ]);
  });

  const LONG_TERMS = ['a', 'b', 'c', 'd'].map((c) => c.repeat(64)).join(' ');

  void test('keyword: full-text matches rank above substring-only ones; -2 leaves out what 2 finds; a CJK character past the budget stays in the AND', async () => {
    const s = sid('tier');
    const seqs = await archive(api, s, [
      user('step 3 of the install guide'),
      ...Array.from({ length: 40 }, (_, i) => user(`step ${300 + i} of the filler guide`)),
      user('step 2.0 migration notes'),
      user('plain migration notes'),
      ...[' 錯誤', '', '', ''].map((tail) => user(`${LONG_TERMS}${tail}`)),
      user(`${LONG_TERMS} 🚀 here`),
    ]);
    const [step3] = seqs;
    // The phrase is inside "step 300" … "step 339" too; the newest of them took the substring
    // bonus (0.1) above the phrase's full-text rank (~0.09), and the one exact match was dropped.
    const phrase = await search(api, s, { query: '"step 3"', match: 'keyword', limit: 3 });
    assert.equal(phrase.body.hits[0]!.seq, step3);
    assert.ok(
      phrase.body.hits[0]!.score > phrase.body.hits[1]!.score,
      'phrase.body.hits[0]!.score > phrase.body.hits[1]!.score',
    );
    assert.equal((await hitSeqs(api, s, { query: '"step 3"', match: 'keyword', limit: 1 }))[0], step3);
    assert.equal((await hitSeqs(api, s, { query: '"step 3"', match: 'hybrid', limit: 1 }))[0], step3);
    // Full text reads `2.0` as a token of its own; `2` finds it as a word, so `-2` leaves it out.
    assert.deepEqual(await hitSeqs(api, s, { query: 'migration 2', match: 'keyword' }), [seqs[41]]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'migration -2', match: 'keyword' }), [seqs[42]]);
    // Four terms of 64 fill the substring budget: 錯 is left to full text, and the AND keeps it
    // (the substring match ANDed the four alone, and the three messages without 錯 were hits).
    assert.deepEqual(await hitSeqs(api, s, { query: `${LONG_TERMS} 錯`, match: 'keyword' }), [seqs[43]]);
    // A symbol only the substring match can test is taken before long words (shortest first):
    // past the budget it was left out of both halves, and every message with the words was a hit.
    assert.deepEqual(await hitSeqs(api, s, { query: `${LONG_TERMS} 🚀`, match: 'keyword' }), [seqs[47]]);
    const without = await hitSeqs(api, s, { query: `${LONG_TERMS} -🚀`, match: 'keyword', limit: 32 });
    assert.ok(without.includes(seqs[43]!) && !without.includes(seqs[47]!), String(without));
  });

  void test('keyword: of two full-text matches, the one holding the query verbatim ranks first', async () => {
    const s = sid('verbatim');
    // Full text stems both to `run`; only the older one holds `running` itself.
    const [older, newer] = await archiveSpaced(api, s, [user('running the job'), user('runs the job')]);

    const r = await search(api, s, { query: 'running', match: 'keyword' });

    assert.deepEqual(
      r.body.hits.map((h) => [h.seq, h.source]),
      [
        [older, 'both'],
        [newer, 'archive'],
      ],
    );
    // 1.19: FULL_TEXT_TIER (1), its rank (0.09) and the substring bonus (0.1); the other 1.09.
    assert.ok(r.body.hits[0]!.score >= 1.1, String(r.body.hits[0]!.score));
    assert.ok(r.body.hits[1]!.score < 1.1, String(r.body.hits[1]!.score));
  });

  void test('keyword: an exclusion is honoured past the substring budget and past 64 terms, or nothing is returned', async () => {
    const s = sid('exclbudget');
    // 37 words of 7 letters: 259 code points, past the substring budget of 256.
    const words = Array.from({ length: 37 }, (_, i) => `w${String(i).padStart(2, '0')}xqzv`);
    const [withBecause, without] = await archive(api, s, [
      user(`${words.join(' ')} because`),
      user(`${words.join(' ')} plain`),
    ]);
    // `because` is a stop word: full text cannot exclude it, so its substring test goes first.
    assert.deepEqual(await hitSeqs(api, s, { query: `${words.join(' ')} -because`, match: 'keyword' }), [
      without,
    ]);
    assert.deepEqual(await hitSeqs(api, s, { query: `${words.join(' ')} -plain`, match: 'keyword' }), [
      withBecause,
    ]);
    // Enough short exclusions still fill the budget before `because`, which full text cannot test
    // either (its tsquery is empty): no hits rather than hits that may hold it.
    const fillers = Array.from({ length: 43 }, (_, i) => `-zq${String(i).padStart(2, '0')}vk`).join(' ');
    assert.deepEqual(
      await hitSeqs(api, s, { query: `${words[0]} ${fillers} -because`, match: 'keyword' }),
      [],
    );
    assert.deepEqual(await hitSeqs(api, s, { query: `${words[0]} -zq00vk -because`, match: 'keyword' }), [
      without,
    ]);
    // An exclusion past the 64 terms a query is read for is not tested: no hits rather than hits
    // that may hold it, in every mode.
    const many = Array.from({ length: 64 }, (_, i) => words[i % 37]).join(' ');
    for (const match of ['keyword', 'semantic', 'hybrid'])
      assert.deepEqual(await hitSeqs(api, s, { query: `${many} -plain`, match }), [], match);
  });

  void test('keyword: a query reaches full text with at most 256 words and bigrams', async () => {
    const s = sid('ftscap');
    // Ten different 31-character CJK phrases (30 bigrams each), each inside a message of its own.
    const phrase = (k: number) =>
      Array.from({ length: 31 }, (_, i) => String.fromCodePoint(0x4e00 + k * 64 + i)).join('');
    const seqs = await archiveSpaced(
      api,
      s,
      Array.from({ length: 10 }, (_, k) => user(`see ${phrase(k)} here`)),
    );
    const query = Array.from({ length: 10 }, (_, k) => phrase(k)).join(' or ');
    // 8 × 30 bigrams fit in 256; the ninth and tenth alternatives are left out (so is their
    // substring: 8 × 31 code points fill that budget too).
    assert.deepEqual(
      (await hitSeqs(api, s, { query, match: 'keyword', limit: 32 })).sort((x, y) => x - y),
      seqs.slice(0, 8),
    );
    // The same of quoted phrases of 30 two-character runs (30 bigrams each, across the gaps
    // between runs; too long for the substring match).
    const runs = (k: number, n: number) =>
      Array.from({ length: n }, (_, i) =>
        String.fromCodePoint(0x6000 + k * 128 + 2 * i, 0x6001 + k * 128 + 2 * i),
      ).join(' ');
    const spaced = await archiveSpaced(
      api,
      s,
      Array.from({ length: 11 }, (_, k) => user(`see ${runs(k, k === 10 ? 40 : 30)} here`)),
    );
    const phrases = Array.from({ length: 10 }, (_, k) => `"${runs(k, 30)}"`).join(' or ');
    assert.deepEqual(
      (await hitSeqs(api, s, { query: phrases, match: 'keyword', limit: 32 })).sort((x, y) => x - y),
      spaced.slice(0, 8),
    );
    // A phrase of 40 runs reaches full text as its first 32.
    assert.deepEqual(await hitSeqs(api, s, { query: `"${runs(10, 40)}"`, match: 'keyword' }), [spaced[10]]);
  });

  void test('with a trigram index of its own, the substring match reads past the newest 500 rows only when needed', async () => {
    const s = sid('deep');
    const n = 700;
    // Substrings inside longer words: full text cannot find them, only the substring match can.
    const text = (i: number) => {
      const marks = [
        i % 10 === 0 ? `abcxqzydef${i}` : '',
        i === 5 || i === 15 ? 'prevwkjpost' : '',
        i === 100 || i === 650 ? 'preplmopost' : '',
      ];
      return `note ${i} ${marks.join(' ')}`.trim();
    };
    const seqs = await archive(
      api,
      s,
      Array.from({ length: n }, (_, i) => user(text(i))),
    );
    const expected = {
      // 70 matches, 50 of them among the newest 500 rows: the newest 8 (ties go to the newest).
      xqzy: [690, 680, 670, 660, 650, 640, 630, 620].map((i) => seqs[i]),
      // None among the newest 500 rows: found in the older part.
      vwkj: [seqs[15], seqs[5]],
      // One of each: both.
      plmo: [seqs[650], seqs[100]],
    };
    for (const [query, seqsWanted] of Object.entries(expected))
      assert.deepEqual(await hitSeqs(api, s, { query, match: 'keyword', limit: 8 }), seqsWanted, query);

    // The same with the session's own trigram index, searched through a fresh process-level view
    // of which sessions have one (the API process re-reads it every 30 s).
    await svc.deps.db.query('CREATE EXTENSION IF NOT EXISTS pg_trgm');
    await buildSessionIndex(svc.deps.db, { tenantId, sessionId: s, kind: 'trgm', messages: n });
    const db = makePgDb({ connectionString: svc.config.databaseUrl!, max: 1 });
    try {
      const texts: string[] = [];
      const recording = {
        ...db,
        query: (text: string, values?: unknown[], o?: QueryOptions) => {
          texts.push(text);
          return db.query(text, values, o);
        },
      } as Db;
      for (const [query, seqsWanted] of Object.entries(expected)) {
        const r = await searchSession(
          { ...svc.deps, db: recording },
          tenantId,
          s,
          params({ query, match: 'keyword', limit: 8 }),
        );
        assert.deepEqual(
          r.hits.map((h) => h.seq),
          seqsWanted,
          `${query}, own index`,
        );
      }
      assert.ok(
        texts.some((t) => t.includes('newest AS')),
        'the newest rows were read first',
      );
    } finally {
      await db.close();
    }
  });

  void test('a session past the scan threshold is searched through the GIN index, same results', async () => {
    const s = sid('big');
    const n = SESSION_SCAN_MAX_MESSAGES + 10;
    const text = (i: number) =>
      i === 99
        ? 'a zebra crossing'
        : i === 1499
          ? '我們的記憶系統'
          : i === n - 3
            ? 'zebra again'
            : `routine note ${i}`;
    const all = Array.from({ length: n }, (_, i) => (i % 2 ? assistant(text(i)) : user(text(i))));
    const seqs: number[] = [];
    for (let i = 0; i < n; i += 1000) seqs.push(...(await archive(api, s, all.slice(i, i + 1000))));
    const count = (await api.get(`/v1/sessions/${s}`)).body.message_count as number;
    assert.ok(count > SESSION_SCAN_MAX_MESSAGES, `${count} messages`);
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'zebras', match: 'keyword' })), [
      seqs[99],
      seqs[n - 3],
    ]);
    assert.deepEqual(await hitSeqs(api, s, { query: '記憶系統', match: 'keyword' }), [seqs[1499]]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'zebra -again', match: 'keyword' }), [seqs[99]]);
  });

  void test('expansion: 2 before and 1 after, clipped at session start and end', async () => {
    const s = sid('edges');
    const seqs = await archive(api, s, [
      user('apple at the start'),
      ...Array.from({ length: 8 }, (_, i) => (i % 2 ? user(`filler ${i}`) : assistant(`filler ${i}`))),
      user('apple at the end'),
    ]);
    const r = await search(api, s, { query: 'apple', match: 'keyword' });
    // Equal ranks: newer first.
    assert.deepEqual(
      r.body.hits.map((h) => [h.seq, h.context.map((c) => c.seq)]),
      [
        [seqs[9], [seqs[7], seqs[8]]],
        [seqs[0], [seqs[1]]],
      ],
    );
    const ctx = r.body.hits[0]!.context[0]!;
    assert.deepEqual(Object.keys(ctx).sort(), ['content', 'id', 'role', 'sent_at', 'sent_at_ns', 'seq']);
  });

  void test('expansion with adjacent hits: nothing shown twice, lower hits absorbed', async () => {
    const s = sid('adjacent');
    const text = ['x', 'x', 'x', 'banana', 'banana banana', 'x', 'x', 'banana', 'x', 'x'];
    const seqs = await archive(
      api,
      s,
      text.map((t, i) => (t === 'x' ? assistant(`plain ${i}`) : user(t))),
    );
    const r = await search(api, s, { query: 'banana', match: 'keyword' });
    const at = (i: number) => seqs[i]!;
    assert.deepEqual(
      r.body.hits.map((h) => [h.seq, h.context.map((c) => c.seq)]),
      [
        [at(4), [at(2), at(3), at(5)]],
        [at(7), [at(6), at(8)]],
      ],
    );
  });

  void test('fills up to limit after dropping hits shown in contexts', async () => {
    const s = sid('fill');
    const seqs = await archive(
      api,
      s,
      Array.from({ length: 12 }, (_, i) => user(`cherry ${i}`)),
    );
    const got = await hitSeqs(api, s, { query: 'cherry', match: 'keyword', limit: 3 });
    assert.deepEqual(got, [seqs[11], seqs[8], seqs[5]]);
    assert.equal((await hitSeqs(api, s, { query: 'cherry', match: 'hybrid', limit: 3 })).length, 3);
  });

  void test('exclude_window leaves out the current context window (extended to its tool call)', async () => {
    const s = sid('window');
    const seqs = await archive(api, s, [
      user('grape one'),
      assistant('grape two'),
      user('grape three'),
      {
        role: 'assistant',
        content: null,
        tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'grape_lookup', arguments: '{}' } }],
      },
      { role: 'tool', tool_call_id: 'call_1', content: 'grape tool result' },
      assistant('grape six'),
      user('grape seven'),
      assistant('grape eight'),
    ]);
    // MAX_HISTORY_MESSAGES=4: the window is seqs[4..7], extended back to the call at seqs[3].
    const windowFrom = seqs[3]!;
    const all = await hitSeqs(api, s, { query: 'grape', match: 'keyword' });
    assert.equal(all[0], seqs[7]);
    for (const match of ['keyword', 'semantic', 'hybrid']) {
      if (match !== 'keyword') await ensureVectors(svc, tenantId, s);
      const got = await hitSeqs(api, s, { query: 'grape', match, exclude_window: true, limit: 32 });
      assert.ok(got.length > 0, match);
      assert.ok(
        got.every((q) => q < windowFrom),
        `${match}: ${JSON.stringify(got)} must be before ${windowFrom}`,
      );
    }
  });

  void test('exclude_window leaves out the first message of the window too, however the window is given', async () => {
    const s = sid('window-edge');
    // Every target holds the word, the fillers do not: with MAX_HISTORY_MESSAGES=4 the window is the
    // last target and its three fillers, so the first message of the window is a real match and
    // only the window's bound keeps it out.
    const [first, second, last] = await archiveSpaced(api, s, [
      user('quince jam one'),
      assistant('quince jam two'),
      user('quince jam three'),
    ]);
    await ensureVectors(svc, tenantId, s);
    for (const match of ['keyword', 'semantic', 'hybrid']) {
      const q = (body: Record<string, unknown>) =>
        hitSeqs(api, s, { query: 'quince jam', match, limit: 32, ...body }).then(sorted);
      assert.deepEqual(await q({}), [first, second, last], match);
      assert.deepEqual(await q({ exclude_window: true }), [first, second], `${match}: default window`);
      // An agent whose context starts elsewhere names the window's first seq itself.
      assert.deepEqual(
        await q({ exclude_window: true, window_from_seq: second }),
        [first],
        `${match}: window_from_seq`,
      );
    }
  });

  void test('time_range filters on sent_at relative to now', async () => {
    const s = sid('time');
    // One message inside each range but not the one below it: 1d, 7d, 1m (30 days), 1y (365 days).
    const daysAgo = (days: number) => new Date(Date.now() - days * 86_400_000).toISOString();
    const [d200, d20, d3, now] = await archiveSpaced(api, s, [
      user('kiwi harvest report', { sent_at: daysAgo(200) }),
      user('kiwi harvest review', { sent_at: daysAgo(20) }),
      user('kiwi harvest notes', { sent_at: daysAgo(3) }),
      user('kiwi harvest update'),
    ]);
    await ensureVectors(svc, tenantId, s);
    for (const match of ['keyword', 'semantic', 'hybrid']) {
      const q = (time_range: string) =>
        hitSeqs(api, s, { query: 'kiwi harvest', match, time_range }).then(sorted);
      assert.deepEqual(await q('1d'), [now], `${match} 1d`);
      assert.deepEqual(await q('7d'), [d3, now], `${match} 7d`);
      assert.deepEqual(await q('1m'), [d20, d3, now], `${match} 1m`);
      assert.deepEqual(await q('1y'), [d200, d20, d3, now], `${match} 1y`);
      assert.deepEqual(await q('all'), [d200, d20, d3, now], `${match} all`);
    }
  });

  void test('time_range boundaries: 1d, 7d, 1m and 1y are 1, 7, 30 and 365 days', async () => {
    const s = sid('timeedge');
    // A tenth of a day (2.4 hours) inside and outside each range.
    const daysAgo = (days: number) => new Date(Date.now() - days * 86_400_000).toISOString();
    const ages = [0.9, 1.1, 6.9, 7.1, 29.9, 30.1, 364.9, 365.1];
    const seqs = await archiveSpaced(
      api,
      s,
      ages.map((age) => user('plum harvest log', { sent_at: daysAgo(age) })),
    );
    const within = (days: number) => seqs.filter((_, i) => ages[i]! < days);
    await ensureVectors(svc, tenantId, s);
    for (const match of ['keyword', 'semantic', 'hybrid']) {
      for (const [time_range, days] of [
        ['1d', 1],
        ['7d', 7],
        ['1m', 30],
        ['1y', 365],
      ] as const) {
        const got = await hitSeqs(api, s, { query: 'plum harvest', match, time_range, limit: 32 });
        assert.deepEqual(sorted(got), within(days), `${match} ${time_range}`);
      }
    }
  });

  void test('hybrid: reciprocal-rank fusion of the keyword and semantic orders', async () => {
    const s = sid('hybrid');
    const [exact, wordy, solar, panels] = await archiveSpaced(api, s, [
      user('solar panel'),
      user(
        'solar panel solar panel installation guide with solar panel pricing and solar panel cleaning ' +
          'plus roof mounting wiring inverter battery warranty permits cost',
      ),
      user('solar'),
      user('panel panel panel discussion'),
    ]);
    await ensureVectors(svc, tenantId, s);
    const body = { query: 'solar panel', limit: 32 };
    const kw = (await search(api, s, { ...body, match: 'keyword' })).body.hits;
    const sem = (await search(api, s, { ...body, match: 'semantic' })).body.hits;
    const hy = (await search(api, s, { ...body, match: 'hybrid' })).body.hits;
    // The constructed case: keyword ranks the wordy message first; semantic ranks the exact one
    // first and the one-word "solar" above the wordy one (which keyword search does not find).
    assert.deepEqual(
      kw.map((h) => h.seq),
      [wordy, exact],
    );
    assert.deepEqual(
      sem.slice(0, 3).map((h) => h.seq),
      [exact, solar, wordy],
    );
    assert.deepEqual(sorted(sem.map((h) => h.seq)), sorted([exact, wordy, solar, panels]));
    const expected = new Map<number, number>();
    for (const list of [kw, sem]) {
      list.forEach((h, i) => expected.set(h.seq, (expected.get(h.seq) ?? 0) + 1 / (RRF_K + i + 1)));
    }
    const order = [...expected.entries()].sort((a, b) => b[1] - a[1] || b[0] - a[0]);
    assert.deepEqual(
      hy.map((h) => h.seq),
      order.map(([seq]) => seq),
    );
    hy.forEach((h) =>
      assert.ok(
        Math.abs(h.score - expected.get(h.seq)!) < 1e-12,
        'Math.abs(h.score - expected.get(h.seq)!) < 1e-12',
      ),
    );
    // Found by the archive's full text and the recent vectors.
    assert.equal(hy.find((h) => h.seq === exact)?.source, 'both');
    assert.equal(hy.find((h) => h.seq === solar)?.source, 'recent');
    // Agreement wins: first in neither list alone... first in the fused one; and the wordy
    // message (1st + 3rd) beats "solar" (2nd in one list only).
    assert.deepEqual(
      hy.slice(0, 3).map((h) => h.seq),
      [exact, wordy, solar],
    );
  });

  void test('semantic and hybrid leave out messages that share nothing with the query (score 0)', async () => {
    const s = sid('floor');
    const [notes] = await archive(api, s, [
      user('pgvector index notes'),
      assistant('ok thanks'),
      user('lunch order'),
    ]);
    await ensureVectors(svc, tenantId, s);
    for (const match of ['semantic', 'hybrid']) {
      const none = await search(api, s, { query: 'zebra', match });
      assert.equal(none.status, 200);
      assert.deepEqual(none.body.hits, [], `${match}: nothing shares a word with "zebra"`);
      const one = await search(api, s, { query: 'pgvector', match, limit: 3 });
      assert.deepEqual(
        one.body.hits.map((h: SearchHit) => h.seq),
        [notes],
        `${match}: only the message that shares a word`,
      );
    }
  });

  void test('local embedder: a message whose vector collides with the query but shares no word is no semantic hit', async () => {
    // With the local embedder's 384 buckets, `lot` has the bucket and sign of `kubectl`: "lot"
    // scores 1.0 against the query "kubectl", above the message that has the word.
    const s = sid('collide');
    const [real, aLot, lot, thanks] = await archiveSpaced(api, s, [
      user('kubectl rollout restart of the gateway deployment, then check the logs'),
      user('a lot'),
      user('lot'),
      user('Thanks, that helps a lot.'),
    ]);
    await ensureVectors(svc, tenantId, s);
    const colliding = (await search(api, s, { query: 'lot', match: 'semantic' })).body.hits.map((h) => h.seq);
    assert.deepEqual(sorted(colliding), sorted([aLot, lot, thanks]), 'the word itself is found');
    for (const match of ['semantic', 'hybrid'] as const) {
      for (const limit of [1, 8]) {
        const hits = (await search(api, s, { query: 'kubectl', match, limit })).body.hits;
        assert.deepEqual(
          hits.map((h) => h.seq),
          [real],
          `${match}, limit ${limit}: only the message with the word`,
        );
      }
    }
    // Collisions that fill every candidate of the k-NN (4 per hit) do not hide the real match: the
    // search asks for more candidates.
    const many = sid('collide-many');
    const [older] = await archive(api, many, [
      user('kubectl rollout restart of the gateway deployment, then check the logs'),
      ...Array.from({ length: 20 }, () => user('a lot')),
    ]);
    await ensureVectors(svc, tenantId, many);
    for (const limit of [1, 2, 4]) {
      const hits = (await search(api, many, { query: 'kubectl', match: 'semantic', limit })).body.hits;
      assert.deepEqual(
        hits.map((h) => h.seq),
        [older],
        `limit ${limit}`,
      );
    }
    // A tool call's arguments are not embedded: keyword finds it, and the collision no longer ties
    // with it in hybrid (first in each list, the newer one won).
    const t = sid('collide-call');
    const [call, , thanks2] = await archive(api, t, [
      {
        role: 'assistant',
        content: null,
        tool_calls: [
          {
            id: 'k1',
            type: 'function',
            function: { name: 'run_shell', arguments: JSON.stringify({ cmd: 'kubectl rollout restart' }) },
          },
        ],
      },
      { role: 'tool', tool_call_id: 'k1', content: 'restarted' },
      user('Thanks, that helps a lot.'),
    ]);
    await ensureVectors(svc, tenantId, t);
    const before = await search(api, t, { query: 'helps', match: 'semantic' });
    assert.deepEqual(
      before.body.hits.map((h) => h.seq),
      [thanks2],
    );
    for (const limit of [1, 8]) {
      const hy = (await search(api, t, { query: 'kubectl', limit })).body.hits;
      assert.deepEqual(
        hy.map((h) => h.seq),
        [call],
        `hybrid, limit ${limit}`,
      );
    }
  });

  void test('a query of emoji or punctuation: no semantic list, and a symbol term is ANDed in full text too', async () => {
    const s = sid('symbols');
    const [thumb, plain, rocket] = await archive(api, s, [
      user('👍'),
      user('please deploy the database'),
      user('deploy 🚀 now'),
      filler(),
    ]);
    await ensureVectors(svc, tenantId, s);
    // "🎉" and "👍" have no word in common: with the local embedder both have the one vector of
    // featureless texts, which scored 1.
    for (const query of ['🎉', '???']) {
      for (const match of ['semantic', 'hybrid']) {
        const r = await search(api, s, { query, match });
        assert.equal(r.status, 200);
        assert.deepEqual(r.body.hits, [], `${match} ${query}`);
      }
    }
    const thumbs = await search(api, s, { query: '👍', match: 'hybrid' });
    assert.deepEqual(
      thumbs.body.hits.map((h: SearchHit) => h.seq),
      [thumb],
      'the substring matcher still finds it',
    );
    // Below the cutoff only full text answers: it must not drop the 🚀 of `deploy 🚀`.
    await moveCutoff(s, rocket! + 1);
    assert.deepEqual(await hitSeqs(api, s, { query: 'deploy 🚀', match: 'keyword' }), [rocket]);
    assert.deepEqual(await hitSeqs(api, s, { query: 'database 🚀', match: 'keyword' }), []);
    assert.deepEqual(await hitSeqs(api, s, { query: 'database', match: 'keyword' }), [plain]);
  });

  void test('malformed queries never give a 5xx; NUL, lone surrogates, blank and too long give 400', async () => {
    const s = sid('malformed');
    await archive(api, s, [user('some text to search, with "quotes" and 100% of things'), assistant('ok')]);
    // The limit goes in the body: in the query string it was silently ignored.
    const misplaced = await api.post(`/v1/sessions/${s}/search?limit=3`, { query: 'text' });
    assert.equal(misplaced.status, 400);
    assert.equal(misplaced.body.error.details.problems[0].path, 'limit');
    await ensureVectors(svc, tenantId, s);
    const fine = [
      '"unclosed',
      '&|!',
      "'",
      '\\',
      '😀',
      '😀 emoji 記憶',
      'x'.repeat(10_000),
      '😀'.repeat(10_000),
      'the and of a',
      '-',
      '- -',
      '--x',
      '-"',
      '""',
      '"',
      'or or',
      'OR',
      '-or',
      'a:*',
      '!!',
      '<->',
      '(foo',
      'foo) & !bar',
      "'; DROP TABLE messages; --",
      '%',
      '_',
      '\\%',
      Array.from({ length: 2000 }, (_, i) => (i % 2 ? 'the' : `w${i}`)).join(' '),
      '記'.repeat(3000),
    ];
    for (const query of fine) {
      for (const match of ['keyword', 'semantic', 'hybrid']) {
        const r = await search(api, s, { query, match });
        assert.equal(r.status, 200, `${match} ${JSON.stringify(query.slice(0, 40))}: ${r.text}`);
      }
    }
    const bad: Array<[string, string]> = [
      ['a\u0000b', 'invalid_characters'],
      ['\ud800', 'invalid_characters'],
      ['   ', 'validation_failed'],
      ['x'.repeat(10_001), 'validation_failed'],
      ['😀'.repeat(10_001), 'validation_failed'],
    ];
    for (const [query, code] of bad) {
      const r = await search(api, s, { query });
      assert.equal(r.status, 400, JSON.stringify(query.slice(0, 20)));
      assert.equal(r.body.error?.code, code);
    }
    const invalid: Array<Record<string, unknown>> = [
      {},
      { query: 5 },
      { query: 'x', limit: 0 },
      { query: 'x', limit: 33 },
      { query: 'x', limit: 1.5 },
      { query: 'x', match: 'fuzzy' },
      { query: 'x', time_range: '2d' },
      { query: 'x', exclude_window: 'yes' },
      { query: 'x', extra: 1 },
    ];
    for (const body of invalid) {
      const r = await search(api, s, body);
      assert.equal(r.status, 400, JSON.stringify(body));
      assert.equal(r.body.error?.code, 'validation_failed');
    }
    const path = await api.post(`/v1/sessions/${encodeURIComponent('bad id!')}/search`, { query: 'x' });
    assert.equal(path.status, 400);
  });

  void test('tenants never see each other: 404 for a foreign session, same id never mixes', async () => {
    const s = sid('tenancy');
    const onlyA = sid('only-a');
    const b = await svc.newTenant();
    await archive(api, s, [user('secret plans of tenant a')]);
    await archive(api, onlyA, [user('secret plans of tenant a, again')]);
    await archive(b.api, s, [user('public notes of tenant b')]);
    await ensureVectors(svc, tenantId, s);
    await ensureVectors(svc, b.tenantId, s);
    for (const match of ['keyword', 'semantic', 'hybrid']) {
      const foreign = await search(b.api, onlyA, { query: 'secret', match });
      assert.equal(foreign.status, 404);
      assert.equal(foreign.body.error?.code, 'not_found');
      const fromB = await search(b.api, s, { query: 'secret or plans or public', match, limit: 32 });
      assert.equal(fromB.status, 200);
      const contents = fromB.body.hits.flatMap((h) => [h.content, ...h.context.map((c) => c.content)]);
      assert.deepEqual(contents, ['public notes of tenant b'], match);
      const fromA = await search(api, s, { query: 'public notes', match: 'keyword' });
      assert.deepEqual(fromA.body.hits, []);
    }
    const unknown = await search(api, sid('never-written'), { query: 'x' });
    assert.equal(unknown.status, 404);
    assert.equal(unknown.body.error?.code, 'not_found');
  });

  void test('one statement per search: session check, candidates, neighbours and rows together', async () => {
    const s = sid('one-trip');
    await archive(api, s, [user('lemon one'), assistant('lemon two'), user('plain'), user('lemon four')]);
    await ensureVectors(svc, tenantId, s);
    for (const match of ['keyword', 'semantic', 'hybrid'] as const) {
      const rec = recordingDb(svc.deps.db);
      const r = await searchSession(
        { ...svc.deps, db: rec.db },
        tenantId,
        s,
        params({ query: 'lemon', match }),
      );
      assert.ok(r.hits.length > 0, match);
      assert.equal(rec.sent.length, 1, `${match}: ${rec.sent.length} statements`);
      const missing = recordingDb(svc.deps.db);
      await assert.rejects(
        searchSession(
          { ...svc.deps, db: missing.db },
          tenantId,
          sid('never'),
          params({ query: 'lemon', match }),
        ),
        (err: { status?: number }) => err.status === 404,
      );
      assert.equal(missing.sent.length, 1, match);
    }
  });

  void test('an incomplete prefetch is completed by one more statement, with the same response', async () => {
    const s = sid('prefetch');
    // Runs of adjacent matches, so that hits absorb each other and the walk skips candidates.
    const text = ['melon', 'melon melon', 'x', 'melon', 'x', 'x', 'melon pie', 'melon', 'x', 'melon'];
    await archive(
      api,
      s,
      [...text, ...text].map((t, i) => (t === 'x' ? assistant(`plain ${i}`) : user(`${t} ${i}`))),
    );
    await ensureVectors(svc, tenantId, s);
    const tampers: Array<[string, (row: Record<string, unknown>) => void]> = [
      ['no neighbours', (row) => (row.around = null)],
      ['no rows', (row) => (row.rows = null)],
      [
        'half of each',
        (row) => {
          row.around = (row.around as unknown[] | null)?.filter((_, i) => i % 2 === 0) ?? null;
          row.rows = (row.rows as unknown[] | null)?.filter((_, i) => i % 2 === 1) ?? null;
        },
      ],
    ];
    for (const match of ['keyword', 'semantic', 'hybrid'] as const) {
      for (const limit of [1, 3, 32]) {
        for (const exclude_window of [false, true]) {
          const p = params({ query: 'melon', match, limit, exclude_window });
          const whole = recordingDb(svc.deps.db);
          const expected = await searchSession({ ...svc.deps, db: whole.db }, tenantId, s, p);
          assert.equal(whole.sent.length, 1);
          assert.ok(expected.hits.length > 0, match);
          for (const [what, tamper] of tampers) {
            const rec = recordingDb(svc.deps.db, tamper);
            const got = await searchSession({ ...svc.deps, db: rec.db }, tenantId, s, p);
            assert.deepEqual(got, expected, `${match} limit ${limit} ${what}`);
            assert.equal(rec.sent.length, 2, `${match} limit ${limit} ${what}: the fallback ran`);
          }
        }
      }
    }
  });

  void test('a zero vector stored before they were refused (NaN cosine score) is no semantic hit, whatever the query', async () => {
    const s = sid('nan');
    const seqs = await archiveSpaced(api, s, [user('quince jam'), user('quince tart'), user('lemon curd')]);
    await ensureVectors(svc, tenantId, s);
    const zero = `[${Array.from({ length: svc.config.embedding.dimensions }, () => 0).join(',')}]`;
    await svc.deps.db.query(
      `UPDATE message_vectors SET embedding = $4::vector WHERE tenant_id = $1 AND session_id = $2 AND seq = $3`,
      [tenantId, s, seqs[1], zero],
    );
    for (const limit of [1, 2, 8]) {
      // A query that shares nothing with any message: no hit at all (the zero vector matched it
      // with "score": null).
      assert.deepEqual(await hitSeqs(api, s, { query: 'walnut', match: 'semantic', limit }), []);
      for (const match of ['semantic', 'hybrid'] as const) {
        const r = await search(api, s, { query: 'quince', match, limit });
        assert.equal(r.status, 200);
        // `search` checks that each score is a number: JSON has no NaN, it wrote null.
        for (const h of r.body.hits) assert.ok(Number.isFinite(h.score), `${match} ${h.seq}: ${h.score}`);
        const want = match === 'semantic' ? [seqs[0]] : [seqs[0], seqs[1]];
        assert.deepEqual(sorted(r.body.hits.map((h) => h.seq)), want.slice(0, limit), `${match} ${limit}`);
        // The statement's own walk picks what searchSession picks: no second statement.
        const p = params({ query: 'quince', match, limit });
        const rec = recordingDb(svc.deps.db);
        await searchSession({ ...svc.deps, db: rec.db }, tenantId, s, p);
        assert.equal(rec.sent.length, 1, `${match} ${limit}`);
      }
    }
  });

  void test('the duration histogram and the OpenAPI entry exist', async () => {
    const metrics = await fetch(`${svc.base}/metrics`).then((r) => r.text());
    assert.match(metrics, /mnemos_search_duration_seconds_count\{match="keyword"\} [1-9]/);
    assert.match(metrics, /mnemos_search_duration_seconds_count\{match="hybrid"\} [1-9]/);
    const doc = (await api.get('/openapi.json')).body;
    assert.ok(doc.paths['/v1/sessions/{sid}/search']?.post, "doc.paths['/v1/sessions/{sid}/search']?.post");
  });
});

void describe('huge sessions: their own full-text and trigram indexes', () => {
  // A service of its own: the maintenance pass looks at every session of the database.
  let svc: TestService;
  let api: Api;
  let tenantId: string;

  before(async () => {
    svc = await startTestService();
    ({ api, tenantId } = await svc.newTenant());
  });
  after(async () => {
    await svc?.stop();
  });

  void test('same results, the planner uses them, a capped number, dropped on shrink and delete', async () => {
    const s = sid('huge');
    const small = sid('small');
    const n = SESSION_SCAN_MAX_MESSAGES + 10;
    const text = (i: number) =>
      ({
        99: 'a zebra crossing',
        700: 'the xylophonist played',
        1499: '我們的記憶系統',
        [n - 3]: 'zebra again',
      })[i] ?? `routine note ${i}`;
    const all = Array.from({ length: n }, (_, i) => (i % 2 ? assistant(text(i)) : user(text(i))));
    for (let i = 0; i < n; i += 1000) await archive(api, s, all.slice(i, i + 1000));
    await archive(api, small, all.slice(95, 105));
    // Full text (stems, CJK bigrams, exclusion) and substring-only matches (a word's inside, 2 CJK chars).
    const queries = ['zebras', '記憶系統', 'zebra -again', 'ylophon', '記憶', 'routine note 1999'];
    const results = async () => {
      const out: unknown[] = [];
      for (const query of queries) {
        const r = await search(api, s, { query, match: 'keyword' });
        assert.equal(r.status, 200, r.text);
        out.push(r.body.hits.map((h) => [h.seq, h.source, h.context.map((c) => c.seq)]));
      }
      return out;
    };
    const before = await results();
    assert.equal((before[3] as unknown[]).length, 1, 'the substring match finds "ylophon"');

    const names = (sessionId: string) => [
      sessionIndexName(tenantId, sessionId, 'fts'),
      sessionIndexName(tenantId, sessionId, 'trgm'),
    ];
    const indexDefs = async (sessionId: string) =>
      (
        await svc.deps.db.query<{ indexdef: string }>(
          'SELECT indexdef FROM pg_indexes WHERE indexname = ANY ($1::text[]) ORDER BY indexname',
          [names(sessionId)],
        )
      ).rows.map((r) => r.indexdef);
    const pass = (minMessages: number, maxSessions: number) =>
      maintainSessionIndexes(svc.deps, { minMessages, maxSessions, maxBuilds: 4 });

    const built = await pass(2000, 4);
    assert.deepEqual(built, { built: names(s), dropped: [] });
    const defs = await indexDefs(s);
    assert.match(defs[0]!, /USING gin \(search_tsv\) WHERE .*session_id = 'search-huge-/);
    assert.match(defs[1]!, /USING gin \(COALESCE\(content, ''::text\) gin_trgm_ops\) WHERE/);
    assert.deepEqual(await results(), before, 'the indexes change no result');

    // The keyword statement can use both: with statistics (as autovacuum keeps them), the planner
    // takes them for a rare term of this session.
    await svc.deps.db.query('ANALYZE messages');
    const rec = recordingDb(svc.deps.db);
    await searchSession(
      { ...svc.deps, db: rec.db },
      tenantId,
      s,
      params({ query: 'xylophonist', match: 'keyword' }),
    );
    const [sent] = rec.calls;
    const plan = (
      await svc.deps.db.query<{ 'QUERY PLAN': string }>(`EXPLAIN ${sent!.text}`, sent!.params)
    ).rows
      .map((r) => r['QUERY PLAN'])
      .join('\n');
    for (const name of names(s)) assert.match(plan, new RegExp(`Bitmap Index Scan on ${name}`));

    // A second pass changes nothing; the cap holds; small sessions lose theirs when the threshold is back.
    assert.deepEqual(await pass(2000, 4), { built: [], dropped: [] });
    assert.deepEqual(await pass(5, 1), { built: [], dropped: [] }, 'one session per kind at most');
    assert.deepEqual((await pass(5, 2)).built, names(small));
    assert.deepEqual(await pass(2000, 4), { built: [], dropped: names(small) });
    assert.deepEqual(await indexDefs(small), []);

    // Deleting the session drops its indexes, right after the answer.
    assert.equal((await api.del(`/v1/sessions/${s}`)).status, 204);
    // (The index first, then its record: both are waited for.)
    const recorded = async () =>
      (await svc.deps.db.query('SELECT 1 FROM session_search_indexes WHERE session_id = $1', [s])).rowCount;
    await eventually(
      async () => {
        try {
          return (await indexDefs(s)).length === 0 && (await recorded()) === 0;
        } catch (err) {
          // pg_indexes read while the index is being dropped concurrently: "cache lookup failed
          // for attribute 1 of relation …" (XX000, a catalog race of the read, not of the drop).
          if ((err as { code?: string }).code === 'XX000') return false;
          throw err;
        }
      },
      20_000,
      'the indexes dropped and forgotten',
    );
  });

  void test('a filtered k-NN gives the same candidates joined before or after sorting', async () => {
    const s = sid('filtered');
    const words = ['habitat', 'migration', 'weather', 'lunch', 'burrow', 'diet'];
    const texts = Array.from(
      { length: 60 },
      (_, i) => `quokka ${words[i % 6]} ${words[(i * 7) % 6]} note ${i}`,
    );
    const seqs = await archive(
      api,
      s,
      texts.map((t) => user(t)),
    );
    await ensureVectors(svc, tenantId, s);
    const content = new Map(seqs.map((seq, i) => [seq, texts[i]!]));
    const parsed = parseSearchQuery('quokka habitat -habitat -lunch');
    const base = {
      tenantId,
      sessionId: s,
      sinceNs: null,
      window: null,
      excludeFts: [] as Array<Array<{ kind: 'english-words'; text: string }>>,
      excludeLike: [] as string[],
      excludeWords: [] as string[],
      keyword: null,
      embedding: localEmbed(parsed.embedText, svc.config.embedding.dimensions),
      k: 8,
      limit: 2,
      match: 'semantic' as const,
    };
    const variants = [
      { excludeFts: [[{ kind: 'english-words' as const, text: 'habitat' }]], excludeLike: ['%lunch%'] },
      { sinceNs: '0' },
      { sinceNs: '0', window: { size: 20 }, excludeLike: ['%habitat%'] },
    ];
    for (const v of variants) {
      const run = async (ann: boolean) =>
        (await searchCandidates(svc.deps.db, { ...base, ...v, ownIndexes: { ann, search: false } })).semantic;
      const [after, before] = [await run(false), await run(true)];
      // Ties may come in either order: the scores, and what is left out, must agree.
      assert.deepEqual(
        after.map((c) => c.score).sort(),
        before.map((c) => c.score).sort(),
        JSON.stringify(v),
      );
      assert.equal(after.length, 8, JSON.stringify(v));
      for (const c of after) {
        const text = content.get(c.seq)!;
        if (v.excludeFts) assert.ok(!text.includes('habitat') && !text.includes('lunch'), text);
        if (v.excludeLike?.[0] === '%habitat%') assert.ok(!text.includes('habitat'), text);
        if (v.window) assert.ok(c.seq < seqs[seqs.length - 20]!, `${c.seq} is in the window`);
      }
    }
  });

  void test('a session with its own HNSW index finds the few vectors that share a rare word with the query', async () => {
    // With the lexical local embedder almost every vector is at distance 1 from a one-word query:
    // the graph walk used to return k of those, and the score filter after it left 0–2 hits.
    const s = sid('rare');
    const d = svc.config.embedding.dimensions;
    const query = localEmbed('zyzzyva', d);
    const dim = query.findIndex((x) => x !== 0);
    // Filler words that share no dimension with the query: every other message scores exactly 0.
    const vocabulary: string[] = [];
    for (let i = 0; vocabulary.length < 2000; i++) {
      if (localEmbed(`w${i}`, d)[dim] === 0) vocabulary.push(`w${i}`);
    }
    const words = (i: number) =>
      Array.from({ length: 8 }, (_, j) => vocabulary[(i * 131 + j * 977) % vocabulary.length]).join(' ');
    const texts = Array.from({ length: 3000 }, (_, i) =>
      i % 300 === 150 ? `zyzzyva ${words(i)}` : words(i),
    );
    for (let b = 0; b < texts.length; b += 1000) {
      await archive(
        api,
        s,
        texts.slice(b, b + 1000).map((t) => user(t)),
      );
    }
    await ensureVectors(svc, tenantId, s);
    await buildAnnIndex(svc.deps.db, {
      tenantId,
      sessionId: s,
      dimensions: svc.config.embedding.dimensions,
      vectors: texts.length,
    });
    const rare = texts.map((t, i) => (t.startsWith('zyzzyva') ? i + 1 : 0)).filter((seq) => seq > 0);
    assert.equal(rare.length, 10);
    const args = {
      tenantId,
      sessionId: s,
      sinceNs: null,
      window: null,
      excludeFts: [],
      excludeLike: [],
      excludeWords: [],
      keyword: null,
      embedding: query,
      k: 32,
      limit: 8,
      match: 'semantic' as const,
    };
    for (const ann of [false, true]) {
      const found = (await searchCandidates(svc.deps.db, { ...args, ownIndexes: { ann, search: false } }))
        .semantic;
      const seqs = new Set(found.map((c) => c.seq));
      assert.deepEqual(
        rare.filter((seq) => !seqs.has(seq)),
        [],
        `messages with the word missed (${ann ? 'HNSW' : 'exact'})`,
      );
      assert.ok(
        found.every((c) => c.score > 0),
        'only positive scores',
      );
    }
    const hits = (await searchSession(svc.deps, tenantId, s, params({ query: 'zyzzyva', match: 'semantic' })))
      .hits;
    assert.equal(hits.length, 8);
    for (const h of hits) assert.match(String(h.content), /^zyzzyva /);
  });

  void test('messages without a word or CJK character are not in the semantic index (local embedder)', async () => {
    const d = svc.config.embedding.dimensions;
    // A word whose one feature lands where the local embedder puts every featureless text: such
    // messages used to come first, with a score of 1, for this word.
    let word = '';
    for (let i = 0; !word; i++) if (localEmbed(`win${i}`, d)[0] === 1) word = `win${i}`;
    const s = sid('featureless');
    const seqs = await archive(api, s, [
      user(`did we ${word} the contract with the customer?`),
      assistant('👍'),
      user('...'),
      assistant('🎉🎉'),
      user('?!'),
      assistant('the weather is fine'),
    ]);
    await ensureVectors(svc, tenantId, s);
    const vectors = await svc.deps.db.query<{ seq: string }>(
      'SELECT seq FROM message_vectors WHERE tenant_id = $1 AND session_id = $2 ORDER BY seq',
      [tenantId, s],
    );
    assert.deepEqual(
      vectors.rows.map((r) => Number(r.seq)),
      [seqs[0], seqs[5]],
    );
    const hits = (await searchSession(svc.deps, tenantId, s, params({ query: word, match: 'semantic' })))
      .hits;
    assert.deepEqual(
      hits.map((h) => h.seq),
      [seqs[0]],
    );
  });

  void test('equal semantic scores go to the newer message, whatever the limit', async () => {
    const s = sid('ties');
    const seqs = await archive(
      api,
      s,
      Array.from({ length: 12 }, () => user('the same words again')),
    );
    await ensureVectors(svc, tenantId, s);
    for (const limit of [1, 2, 3]) {
      const hits = (
        await searchSession(svc.deps, tenantId, s, params({ query: 'same words', match: 'semantic', limit }))
      ).hits;
      assert.equal(hits[0]!.seq, seqs[11], `limit ${limit}`);
    }
  });

  void test('semantic search runs as a prepared statement, except for sessions with an HNSW index of their own', async () => {
    const plain = sid('plain');
    const ann = sid('ann');
    const fts = sid('fts');
    const texts = ['quokka migration plan', 'weather report', 'quokka habitat notes', 'lunch order'];
    for (const s of [plain, ann, fts])
      await archive(
        api,
        s,
        texts.map((t, i) => (i % 2 ? assistant(t) : user(t))),
      );
    for (const s of [plain, ann, fts]) await ensureVectors(svc, tenantId, s);
    await buildAnnIndex(svc.deps.db, {
      tenantId,
      sessionId: ann,
      dimensions: svc.config.embedding.dimensions,
      vectors: 4,
    });
    await buildSessionIndex(svc.deps.db, { tenantId, sessionId: fts, kind: 'fts', messages: 4 });
    // One connection for named statements, so that pg_prepared_statements (per connection) shows
    // what ran on it; the probe below is itself named, to run on that connection.
    const db = makePgDb({ connectionString: svc.config.databaseUrl!, max: 1 });
    try {
      const body = params({ query: 'quokka', match: 'semantic', limit: 3 });
      const hits = async (s: string, prepared: boolean) =>
        (
          await searchSession(
            { ...svc.deps, db, config: { ...svc.deps.config, pgPreparedStatements: prepared } },
            tenantId,
            s,
            body,
          )
        ).hits;
      const plans = async () =>
        (
          await db.query<{ generic_plans: string; custom_plans: string }>(
            `SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name LIKE 'mnemos_search_%'`,
            [],
            { name: 'test_prepared_statements' },
          )
        ).rows.map((r) => ({ generic: Number(r.generic_plans), custom: Number(r.custom_plans) }));
      const statements = async () => (await plans()).map((p) => p.generic + p.custom).sort((a, b) => b - a);
      const unprepared = await hits(plain, false);
      assert.match(String(unprepared[0]?.content), /quokka/);
      for (let i = 0; i < 8; i++) assert.deepEqual(await hits(plain, true), unprepared);
      // Planned once without the values and reused, from the first run on.
      assert.deepEqual(await plans(), [{ generic: 8, custom: 0 }]);
      assert.match(String((await hits(ann, true))[0]?.content), /quokka/);
      assert.deepEqual(
        await statements(),
        [8],
        'a session with its own HNSW index is planned with its values',
      );
      // Full-text and trigram indexes serve keyword matching only: the same prepared statement.
      assert.deepEqual(await hits(fts, true), await hits(fts, false));
      assert.deepEqual(await statements(), [9]);
      // Excluded terms are array parameters: one more statement serves any number and kind of them,
      // with the results of the unprepared search. [query, a word no hit may contain]; `the` is a
      // stop word, excluded by substring only.
      // [query, a word no hit may contain, whether any hit is left]: with both quokka messages
      // excluded, nothing left shares a word with the query (score 0, no match).
      const excluding = [
        ['quokka -habitat', 'habitat', true],
        ['quokka -"habitat notes" -lunch', 'lunch', true],
        ['quokka -habitat -天氣 -plan', 'plan', false],
        ['quokka -the', 'weather', true],
        ['quokka -天 -lunch', 'lunch', true],
      ] as const;
      for (const [query, gone, anyLeft] of excluding) {
        const body = params({ query, match: 'semantic', limit: 3 });
        const got = await searchSession({ ...svc.deps, db }, tenantId, plain, body);
        const want = await searchSession(
          { ...svc.deps, db, config: { ...svc.deps.config, pgPreparedStatements: false } },
          tenantId,
          plain,
          body,
        );
        assert.deepEqual(got, want, query);
        assert.equal(got.hits.length > 0, anyLeft, query);
        assert.ok(
          got.hits.every((h) => !String(h.content).includes(gone)),
          query,
        );
      }
      assert.deepEqual(
        await statements(),
        [9, excluding.length],
        'searches with exclusions share one statement',
      );
    } finally {
      await db.close();
    }
  });
});

void describe('a huge session deleted while its own index is built', () => {
  // A service of its own: the maintenance pass looks at every session of the database.
  let svc: TestService;
  before(async () => {
    svc = await startTestService();
  });
  after(async () => {
    await svc?.stop();
  });
  // The tests' passes hold the worker's locks on their tables, as a worker's pass does, so that
  // the drop pass a delete asks the service's own worker for waits for them. Unlocked, its DROP
  // INDEX CONCURRENTLY waited for a build's table lock while the build waited out the drop's
  // snapshot: Postgres broke that deadlock by failing one of the two, once the tests' build (CI).
  const asWorker = async <T extends object>(
    kind: 'search-indexes' | 'search-indexes-gone' | 'ann-indexes',
    pass: () => Promise<T>,
  ): Promise<T> => {
    const keys = maintenanceLockKeys(svc.config.prefix, kind);
    const r = await exclusively(svc.deps.redis, keys, pass, { waitMs: 120_000 });
    assert.ok(!('skipped' in r), `the ${kind} pass got its locks`);
    return r as T;
  };

  void test('the index built meanwhile is dropped when the build finishes, not left to the next pass', async () => {
    // Setup: a session over the threshold, and a transaction holding an old snapshot open, which
    // every CREATE INDEX CONCURRENTLY of the database waits out.
    const { api, tenantId } = await svc.newTenant();
    const s = sid('deleted-while-built');
    await archive(
      api,
      s,
      Array.from({ length: 30 }, (_, i) => user(`note ${i} about the zebra crossing`)),
    );
    const snapshot = await holdOldSnapshot(svc.config.databaseUrl!);
    try {
      const name = sessionIndexName(tenantId, s, 'fts');
      const pass = asWorker('search-indexes', () =>
        maintainSessionIndexes(svc.deps, { minMessages: 20, maxSessions: 4, maxBuilds: 1 }),
      );
      await indexBuildWaiting(svc.deps.db, name);

      // Action: the session is deleted while the build waits; then the build finishes.
      assert.equal((await api.del(`/v1/sessions/${s}`)).status, 204);
      await snapshot.release();
      const done = await pass;

      // Assert: no index of the deleted session exists or is recorded.
      assert.ok(done.dropped.includes(name), JSON.stringify(done));
      const left = await svc.deps.db.query('SELECT 1 FROM pg_class WHERE relname = $1', [name]);
      assert.equal(left.rowCount, 0, 'the index is gone');
      const recorded = await svc.deps.db.query(
        'SELECT 1 FROM session_search_indexes WHERE tenant_id = $1 AND session_id = $2',
        [tenantId, s],
      );
      assert.equal(recorded.rowCount, 0);
    } finally {
      await snapshot.release();
    }
  });

  void test('a worker that dies during an index pass leaves nothing a later pass misses: the index of a session deleted since goes, a live one is built', async () => {
    // Setup: two sessions over both thresholds (full text and HNSW). The registries are locked,
    // so that a pass stops at its first write of them; the "worker" is a pool of its own.
    const { api, tenantId } = await svc.newTenant();
    const [doomed, kept] = [sid('died-deleted'), sid('died-live')];
    // The doomed session is the larger, so that each pass takes it first.
    for (const [s, n] of [
      [doomed, 36],
      [kept, 30],
    ] as const) {
      await archive(
        api,
        s,
        Array.from({ length: n }, (_, i) => user(`note ${i} about the zebra crossing`)),
      );
      await ensureVectors(svc, tenantId, s);
    }
    const dims = svc.config.embedding.dimensions;
    const namesOf = (s: string) => [sessionIndexName(tenantId, s, 'fts'), annIndexName(tenantId, s, dims)];
    const worker = makePgDb({ connectionString: svc.config.databaseUrl!, max: 2 });
    const locked = await holdTransaction(svc.config.databaseUrl!, [
      'LOCK TABLE session_search_indexes, vector_ann_indexes IN EXCLUSIVE MODE',
    ]);
    try {
      const workerDeps = { ...svc.deps, db: worker };
      const passes = Promise.allSettled([
        maintainSessionIndexes(workerDeps, { minMessages: 20, maxSessions: 4, maxBuilds: 1 }),
        maintainAnnIndexes(workerDeps, { minVectors: 20, maxBuilds: 1 }),
      ]);
      const stuck = `SELECT pid FROM pg_stat_activity
        WHERE datname = current_database() AND wait_event_type = 'Lock'
          AND query ~ '^\\s*INSERT INTO (session_search_indexes|vector_ann_indexes)'`;
      await eventually(
        async () => (await svc.deps.db.query(stuck)).rowCount === 2,
        60_000,
        'both passes stopped at their registry writes',
      );

      // Action: the worker dies there (its connections end; nothing it was running commits), and
      // the first session is deleted.
      await svc.deps.db.query(`SELECT pg_terminate_backend(pid) FROM (${stuck}) x`);
      const settled = await passes;
      assert.ok(
        settled.every((p) => p.status === 'rejected'),
        'the dying passes ended with their connections',
      );
      await locked.release();
      assert.equal((await api.del(`/v1/sessions/${doomed}`)).status, 204);
      for (let i = 0; i < 2; i++) {
        await asWorker('search-indexes', () =>
          maintainSessionIndexes(svc.deps, { minMessages: 20, maxSessions: 4, maxBuilds: 1 }),
        );
        await asWorker('ann-indexes', () => maintainAnnIndexes(svc.deps, { minVectors: 20, maxBuilds: 1 }));
      }

      // Assert: no index of the deleted session is left (before, one built by the dead worker
      // but never recorded stayed for good), and the live session's are built and recorded.
      const valid = async (names: string[]) =>
        (
          await svc.deps.db.query<{ relname: string }>(
            `SELECT c.relname FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid
             WHERE c.relname = ANY($1::text[]) AND i.indisvalid ORDER BY 1`,
            [names],
          )
        ).rows.map((r) => r.relname);
      const left = await svc.deps.db.query('SELECT relname FROM pg_class WHERE relname = ANY($1::text[])', [
        namesOf(doomed),
      ]);
      assert.deepEqual(left.rows, [], 'the deleted session has no index');
      assert.deepEqual(await valid(namesOf(kept)), namesOf(kept).sort(), 'the live session has both');
      const recorded = await svc.deps.db.query<{ index_name: string }>(
        `SELECT index_name FROM session_search_indexes WHERE tenant_id = $1
         UNION ALL SELECT index_name FROM vector_ann_indexes WHERE tenant_id = $1 ORDER BY 1`,
        [tenantId],
      );
      const keptTrgm = sessionIndexName(tenantId, kept, 'trgm');
      assert.deepEqual(
        recorded.rows.map((r) => r.index_name).filter((n) => n !== keptTrgm),
        namesOf(kept).sort(),
      );
    } finally {
      await locked.release();
      await worker.close();
    }
  });

  void test('a build still waiting for its table lock when its session is deleted is not forgotten: its index goes once built', async () => {
    // Setup: a session over the threshold, and its build by another process ("a worker killed
    // meanwhile": its backend goes on) waiting for the table's lock, held as a manual VACUUM does,
    // so its index is not in the catalog yet.
    const { api, tenantId } = await svc.newTenant();
    const s = sid('waits-for-lock');
    const messages = await archive(
      api,
      s,
      Array.from({ length: 30 }, (_, i) => user(`note ${i} about the zebra crossing`)),
    );
    const name = sessionIndexName(tenantId, s, 'fts');
    const orphan = makePgDb({ connectionString: svc.config.databaseUrl!, max: 1 });
    const holding = await holdTransaction(svc.config.databaseUrl!, [
      'LOCK TABLE messages IN SHARE UPDATE EXCLUSIVE MODE',
    ]);
    try {
      const build = buildSessionIndex(orphan, {
        tenantId,
        sessionId: s,
        kind: 'fts',
        messages: messages.length,
      });
      const waiting = `SELECT 1 FROM pg_stat_activity WHERE datname = current_database()
        AND wait_event_type = 'Lock' AND query LIKE 'CREATE INDEX CONCURRENTLY%' AND strpos(query, $1) > 0`;
      await eventually(
        async () => (await svc.deps.db.query(waiting, [name])).rowCount === 1,
        20_000,
        'the build to wait for the lock',
      );

      // Action: the session is deleted, and a pass runs while the build still waits.
      assert.equal((await api.del(`/v1/sessions/${s}`)).status, 204);
      await asWorker('search-indexes-gone', () =>
        maintainSessionIndexes(svc.deps, { minMessages: 20, maxSessions: 4, maxBuilds: 1, goneOnly: true }),
      );
      await holding.release();
      await build;
    } finally {
      await holding.release();
      await orphan.close();
    }
    await asWorker('search-indexes-gone', () =>
      maintainSessionIndexes(svc.deps, { minMessages: 20, maxSessions: 4, maxBuilds: 1, goneOnly: true }),
    );

    // Assert: once built, the index goes (before, the first pass forgot the record of an index
    // not yet in the catalog, and the build then left one no pass would drop).
    const left = await svc.deps.db.query('SELECT 1 FROM pg_class WHERE relname = $1', [name]);
    assert.equal(left.rowCount, 0, 'the index is gone');
    const recorded = await svc.deps.db.query('SELECT 1 FROM session_search_indexes WHERE index_name = $1', [
      name,
    ]);
    assert.equal(recorded.rowCount, 0);
  });

  void test("a delete and a tenant erasure answer while another session's index builds wait; their indexes go once the builds end", async () => {
    // Setup: session A, and tenant C's session, with their own search and HNSW indexes; session B
    // over the thresholds since, whose builds wait out an old snapshot (a long report, a pg_dump).
    const { api: user1, tenantId } = await svc.newTenant();
    const erased = await svc.newTenant();
    const [a, b, c] = [sid('indexed'), sid('building'), sid('erased')];
    const notes = (n: number) =>
      Array.from({ length: n }, (_, i) => user(`note ${i} about the zebra crossing`));
    await archive(user1, a, notes(30));
    await ensureVectors(svc, tenantId, a);
    await archive(erased.api, c, notes(30));
    await ensureVectors(svc, erased.tenantId, c);
    const search = (maxBuilds: number) =>
      asWorker('search-indexes', () =>
        maintainSessionIndexes(svc.deps, { minMessages: 20, maxSessions: 4, maxBuilds }),
      );
    const ann = (maxBuilds: number) =>
      asWorker('ann-indexes', () => maintainAnnIndexes(svc.deps, { minVectors: 20, maxBuilds }));
    const indexesOf = (tenant: string, session: string) => [
      sessionIndexName(tenant, session, 'fts'),
      sessionIndexName(tenant, session, 'trgm'),
      annIndexName(tenant, session, svc.config.embedding.dimensions),
    ];
    const doomed = [...indexesOf(tenantId, a), ...indexesOf(erased.tenantId, c)].sort();
    assert.equal((await search(2)).built.length, 4);
    assert.equal((await ann(2)).built.length, 2);
    await archive(user1, b, notes(30));
    await ensureVectors(svc, tenantId, b);
    const present = async () =>
      (
        await svc.deps.db.query<{ relname: string }>(
          'SELECT relname FROM pg_class WHERE relname = ANY($1::text[]) ORDER BY relname',
          [doomed],
        )
      ).rows.map((r) => r.relname);
    assert.deepEqual(await present(), doomed);
    const snapshot = await holdOldSnapshot(svc.config.databaseUrl!);
    let passes: Promise<unknown> | undefined;
    try {
      passes = Promise.all([search(1), ann(1)]);
      await indexBuildWaiting(svc.deps.db, sessionIndexName(tenantId, b, 'fts'));
      await indexBuildWaiting(svc.deps.db, annIndexName(tenantId, b, svc.config.embedding.dimensions));

      // Action: A is deleted and tenant C erased while both builds wait. Dropping their indexes
      // waits for the builds (both tables'), so the answers must not: they came once the builds
      // had ended (68 s and 140 s in a tester's runs). The snapshot is released only after 20 s
      // without an answer.
      const within20s = <T>(p: Promise<T>) =>
        Promise.race([p, new Promise<null>((r) => setTimeout(r, 20_000, null))]);
      const deleted = await within20s(user1.del(`/v1/sessions/${a}`));
      assert.equal(deleted?.status, 204, 'the delete answered while the builds still waited');
      const gone = await within20s(api(svc.base, ADMIN_TOKEN).del(`/v1/admin/tenants/${erased.tenantId}`));
      assert.equal(gone?.status, 204, 'the erasure answered while the builds still waited');
      // The API process's connections are not held by drops waiting meanwhile.
      assert.equal((await user1.get(`/v1/sessions/${b}`)).status, 200);
    } finally {
      await snapshot.release();
    }
    await passes;

    // Assert: once the builds have ended, the indexes are gone and unrecorded.
    const recorded = async () =>
      (
        await svc.deps.db.query(
          `SELECT index_name FROM session_search_indexes WHERE index_name = ANY($1::text[])
           UNION ALL SELECT index_name FROM vector_ann_indexes WHERE index_name = ANY($1::text[])`,
          [doomed],
        )
      ).rowCount;
    // (A pass drops an index, then forgets it: both are waited for.)
    await eventually(
      async () => (await present()).length === 0 && (await recorded()) === 0,
      30_000,
      'the indexes dropped and forgotten',
    );
  });
});

void describe('table-locking maintenance passes', () => {
  let svc: TestService;
  let events: QueueEvents;
  before(async () => {
    svc = await startTestService({ env: { SEARCH_INDEX_MIN_MESSAGES: '20' } });
    events = new QueueEvents('maintenance', {
      connection: { url: svc.config.redisUrl },
      prefix: svc.config.prefix,
    });
    await events.waitUntilReady();
  });
  after(async () => {
    await events?.close();
    await svc?.stop();
  });

  void test('run one at a time: a pass that finds another running (its build waiting on an old snapshot) is skipped', async () => {
    const { api, tenantId } = await svc.newTenant();
    const s = sid('one-at-a-time');
    await archive(
      api,
      s,
      Array.from({ length: 30 }, (_, i) => user(`note ${i} about the zebra crossing`)),
    );
    // Kept once complete: waitUntilFinished reads the job after subscribing, and a skipped pass can
    // end (and be removed) before that read ("Missing key for job", a CI failure).
    const run = (kind: string) =>
      svc.deps.queues.maintenance.add(kind, { v: 1, kind }, { removeOnComplete: false });
    const snapshot = await holdOldSnapshot(svc.config.databaseUrl!);
    let first: Promise<unknown> | undefined;
    try {
      first = (await run('search-indexes')).waitUntilFinished(events, 60_000);
      await indexBuildWaiting(svc.deps.db, sessionIndexName(tenantId, s, 'fts'));
      // Before, a second pass built the same index at once (or deadlocked with the first), and
      // ANALYZE queued behind the build.
      for (const kind of ['search-indexes', 'table-statistics']) {
        const result = await (await run(kind)).waitUntilFinished(events, 30_000);
        assert.deepEqual(result, { skipped: 'another maintenance task on the same tables is running' }, kind);
      }
    } finally {
      await snapshot.release();
    }
    const done = (await first) as { built: string[] };
    assert.ok(done.built.includes(sessionIndexName(tenantId, s, 'fts')), JSON.stringify(done));
    // Released: the next pass runs.
    const next = await (await run('table-statistics')).waitUntilFinished(events, 30_000);
    assert.ok(!(next && typeof next === 'object' && 'skipped' in next), JSON.stringify(next));
  });
});

void describe('search across compaction and with an LLM embedder', () => {
  let fake: FakeOpenAI;
  let svc: TestService;
  let api: Api;
  let tenantId: string;

  before(async () => {
    fake = await startFakeOpenAI();
    svc = await startTestService({
      env: { OPENAI_BASE_URL: fake.url, EMBEDDING_DIMENSIONS: '384', MAX_HISTORY_BYTES: '1024' },
    });
    ({ api, tenantId } = await svc.newTenant());
  });
  after(async () => {
    await svc?.stop();
    await fake?.close().catch(() => undefined);
  });

  void test('results stay correct and unique before and after the first compaction', async () => {
    const s = sid('compaction');
    const target = (n: number) => user(`note ${n} about compaction`);
    // About 330 bytes: below MAX_HISTORY_BYTES, nothing compacted yet.
    const first = await archiveSpaced(api, s, [target(1), target(2)]);
    await ensureVectors(svc, tenantId, s);
    let r = await search(api, s, { query: 'compaction', match: 'keyword' });
    assert.deepEqual(
      r.body.hits.map((h) => [h.seq, h.source]),
      [
        [first[1], 'both'],
        [first[0], 'both'],
      ],
    );
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'compa', match: 'keyword' })), first);
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'compaction', match: 'semantic' })), first);

    const rest = await archiveSpaced(
      api,
      s,
      [3, 4, 5, 6, 7, 8].map((n) => target(n)),
    );
    const targets = [...first, ...rest];
    const cutoff = await ensureCompacted(svc, api, tenantId, s, rest[2]!);
    assert.ok(cutoff > first[1]!, `cutoff ${cutoff}`);
    await ensureVectors(svc, tenantId, s);
    const hot = targets.filter((q) => q >= cutoff);
    const cold = targets.filter((q) => q < cutoff);
    assert.ok(hot.length > 0 && cold.length > 0, 'hot.length > 0 && cold.length > 0');

    r = await search(api, s, { query: 'compaction', match: 'keyword', limit: 32 });
    assert.deepEqual(sorted(r.body.hits.map((h) => h.seq)), targets);
    for (const h of r.body.hits) assert.equal(h.source, h.seq >= cutoff ? 'both' : 'archive', `seq ${h.seq}`);
    // The substring matcher and the vectors only cover the recent part.
    assert.deepEqual(sorted(await hitSeqs(api, s, { query: 'compa', match: 'keyword', limit: 32 })), hot);
    assert.deepEqual(
      sorted(await hitSeqs(api, s, { query: 'compaction', match: 'semantic', limit: 32 })),
      hot,
    );
    const hy = await search(api, s, { query: 'compaction', match: 'hybrid', limit: 32 });
    assert.deepEqual(sorted(hy.body.hits.map((h) => h.seq)), targets);
    for (const h of hy.body.hits) assert.equal(h.source, h.seq >= cutoff ? 'both' : 'archive');
  });

  void test('a query embedding past its deadline is aborted: no retry after the answer, no usage recorded late', async () => {
    const s = sid('slow');
    await archiveSpaced(api, s, [user('grey whale song')]);
    await ensureVectors(svc, tenantId, s);
    const usage = async () =>
      Number(
        (
          await svc.deps.db.query<{ n: string }>(
            `SELECT coalesce(sum(calls), 0)::bigint AS n FROM llm_usage
             WHERE tenant_id = $1 AND session_id = $2 AND purpose = 'embedding'`,
            [tenantId, s],
          )
        ).rows[0]!.n,
      );
    const usedBefore = await usage();
    const sentBefore = fake.embeddingRequests().length;
    // Slower than the search's deadline (5 s), within the LLM client's own timeout (60 s).
    fake.onEmbeddings(() => ({ delayMs: QUERY_EMBED_DEADLINE_MS + 1500 }));
    try {
      const started = Date.now();
      const r = await search(api, s, { query: 'whale', match: 'semantic' });
      assert.equal(r.status, 200);
      assert.deepEqual(r.body.hits, []);
      assert.ok(Date.now() - started >= QUERY_EMBED_DEADLINE_MS - 50, 'answered at the deadline');
      // Past the moment the endpoint would have answered.
      await new Promise((resolve) => setTimeout(resolve, 3000));
      assert.equal(fake.embeddingRequests().length - sentBefore, 1, 'one request, not retried');
      assert.equal(await usage(), usedBefore, 'no usage recorded after the answer: the call was aborted');
    } finally {
      fake.onEmbeddings(null);
    }
  });

  void test('the query is embedded by the LLM endpoint; if that fails, semantic is empty and hybrid is keyword', async () => {
    const s = sid('llm');
    const [exact, other] = await archiveSpaced(api, s, [user('blue whale migration'), user('red fox den')]);
    await ensureVectors(svc, tenantId, s);
    const before = fake.embeddingRequests().length;
    const sem = await search(api, s, { query: 'blue whale', match: 'semantic' });
    assert.equal(sem.status, 200);
    assert.equal(sem.body.hits[0]?.seq, exact);
    // "red fox den" shares nothing with the query: no match, however near it ranks.
    assert.ok(!sem.body.hits.some((h) => h.seq === other), '!sem.body.hits.some((h) => h.seq === other)');
    assert.ok(fake.embeddingRequests().length > before, 'the query went to the embeddings endpoint');

    const keyword = await hitSeqs(api, s, { query: 'whale', match: 'keyword' });
    // A zero query vector (its cosine distance to everything is NaN) is a failed query embedding.
    const zero = { index: 0, embedding: new Array<number>(384).fill(0) };
    fake.queueEmbeddings({ status: 200, body: { data: [zero] } }, { status: 200, body: { data: [zero] } });
    assert.deepEqual(await hitSeqs(api, s, { query: 'whale', match: 'semantic' }), []);
    assert.deepEqual(await hitSeqs(api, s, { query: 'whale', match: 'hybrid' }), keyword);
    await fake.close();
    const down = await search(api, s, { query: 'whale', match: 'semantic' });
    assert.equal(down.status, 200);
    assert.deepEqual(down.body.hits, []);
    const hybrid = await search(api, s, { query: 'whale', match: 'hybrid' });
    assert.equal(hybrid.status, 200);
    assert.deepEqual(
      hybrid.body.hits.map((h) => h.seq),
      keyword,
    );
    assert.deepEqual(keyword, [exact]);
  });
});

void test('planner statistics: tables Postgres never analyzed are analyzed once by the maintenance task', async () => {
  const url = await createTestDatabase();
  const db = makePgDb({ connectionString: url, max: 1 });
  const quiet = { info: () => undefined } as never;
  try {
    const analyzedAt = async () =>
      (
        await db.query<{ relname: string; at: Date | null }>(
          `SELECT relname, coalesce(last_analyze, last_autoanalyze) AS at FROM pg_stat_user_tables
           WHERE relname IN ('messages', 'message_vectors', 'sessions') ORDER BY relname`,
        )
      ).rows.map((r) => [r.relname, r.at !== null]);
    // A new database has no statistics (autovacuum is off on our machines; where it is on, it
    // would take a minute to get there).
    assert.deepEqual(await analyzedAt(), [
      ['message_vectors', false],
      ['messages', false],
      ['sessions', false],
    ]);
    const first = await refreshTableStatistics({ db, logger: quiet });
    assert.deepEqual(first.analyzed, ['message_vectors', 'messages', 'sessions']);
    assert.deepEqual(await analyzedAt(), [
      ['message_vectors', true],
      ['messages', true],
      ['sessions', true],
    ]);
    assert.deepEqual(
      (await refreshTableStatistics({ db, logger: quiet })).analyzed,
      [],
      'nothing changed since',
    );
  } finally {
    await db.close();
    await dropTestDatabase(url);
  }
});

void describe('search time limit', () => {
  void test('a search that finds every search connection busy for 5 s is a 503 search_busy, not "postgres is unavailable"', async () => {
    // PG_POOL_SIZE 1: one search connection. A lock on the archive holds the first search on it.
    // API only: a job of a worker in the same process (an embed, the fts-backfill pass) waiting on
    // the lock held the one connection left for the rest, and the second search answered 503
    // unavailable (every time under load). A worker of its own archives the message and stops first.
    const svc = await startTestService({ mode: 'api', env: { PG_POOL_SIZE: '1' } });
    const { Client } = (await import('pg')).default;
    const locker = new Client({ connectionString: svc.config.databaseUrl });
    await locker.connect();
    const watcher = makePgDb({ connectionString: svc.config.databaseUrl!, max: 1 });
    try {
      const { api } = await svc.newTenant();
      const worker = await startTestService({
        mode: 'worker',
        databaseUrl: svc.config.databaseUrl!,
        prefix: svc.config.prefix,
      });
      try {
        await archive(api, 'busy', [user('a note about locks')]);
      } finally {
        await worker.stop();
      }
      await locker.query('BEGIN');
      await locker.query('LOCK TABLE messages IN ACCESS EXCLUSIVE MODE');
      const first = api.post<SearchBody>('/v1/sessions/busy/search', { query: 'locks', match: 'keyword' });
      // The second goes once the first waits on the lock (after a fixed 300 ms, a first search not
      // yet there under load left the search connection to the second).
      await eventually(
        async () =>
          (
            await watcher.query(
              `SELECT 1 FROM pg_stat_activity WHERE datname = current_database()
                 AND wait_event_type = 'Lock' AND query LIKE 'WITH st AS%'`,
            )
          ).rowCount === 1,
        10_000,
        'the first search waiting on the lock',
      );
      const second = await api.post<SearchBody>('/v1/sessions/busy/search', {
        query: 'note',
        match: 'keyword',
      });
      assert.equal(second.status, 503, JSON.stringify(second.body));
      assert.equal(second.body.error!.code, 'search_busy');
      assert.equal(second.headers.get('retry-after'), '1');
      await locker.query('COMMIT');
      // The first one was only waiting: it answers once the lock goes.
      assert.equal((await first).status, 200);
    } finally {
      await locker.query('COMMIT').catch(() => undefined);
      await locker.end();
      await watcher.close();
      await svc.stop();
    }
  });

  void test('a search past SEARCH_TIMEOUT_MS is a 503 search_timeout; the next one and the rest of the API go on', async () => {
    // PG_POOL_SIZE 4: one search connection, so the next search runs on the very connection whose
    // statement was cancelled. A lock on the archive holds the first search past the limit on any
    // machine, and the limit leaves an ordinary search room on a loaded one (a search slowed by its
    // own cost, a substring tested against megabytes, needed a limit of 50 ms, which the next
    // search on a loaded machine passed too).
    const svc = await startTestService({ env: { SEARCH_TIMEOUT_MS: '1000', PG_POOL_SIZE: '4' } });
    const { Client } = (await import('pg')).default;
    const locker = new Client({ connectionString: svc.config.databaseUrl });
    await locker.connect();
    try {
      const { api } = await svc.newTenant();
      await archive(api, 'slow', [user('a short note about timeouts')]);
      await locker.query('BEGIN');
      await locker.query('LOCK TABLE messages IN ACCESS EXCLUSIVE MODE');
      const started = Date.now();
      // (Not through search(): a 503 is the answer here.)
      const slow = await api.post<SearchBody>('/v1/sessions/slow/search', {
        query: 'timeouts',
        match: 'keyword',
      });
      assert.equal(slow.status, 503, JSON.stringify(slow.body).slice(0, 300));
      assert.equal(slow.body.error!.code, 'search_timeout');
      assert.equal(slow.headers.get('retry-after'), '1');
      assert.ok(Date.now() - started >= 1000, `answered after ${Date.now() - started} ms`);
      await locker.query('COMMIT');
      // The cancelled statement left its connection usable, and the other routes never needed it.
      assert.deepEqual(await hitSeqs(api, 'slow', { query: 'timeouts', match: 'keyword' }), [1]);
      assert.equal((await api.get('/v1/sessions/slow')).body.message_count, 1);
    } finally {
      await locker.query('COMMIT').catch(() => undefined);
      await locker.end();
      await svc.stop();
    }
  });
});
