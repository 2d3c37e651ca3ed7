import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { after, before, describe, test } from 'node:test';
import { promisify } from 'node:util';
import { Worker } from 'bullmq';
import { Redis } from 'ioredis';
import { pino } from 'pino';
import { vectorParam } from '../db/pool.js';
import { archivingBehind, defineInboxScripts, finishDrain, inboxKeys } from '../services/messages/inbox.js';
import { nearestInSession } from '../db/queries/vectors.js';
import { makeLlmClient } from '../services/llm/llm-client.js';
import { localEmbed } from '../services/llm/local-embedder.js';
import {
  MAX_EMBED_CHARS,
  MAX_EMBED_TOKENS,
  estimateTokens,
  makeEmbedder,
  prepareEmbedText,
} from '../services/recent-index/embedder.js';
import { enqueueEmbed } from '../services/recent-index/jobs.js';
import { sweepMissingVectors } from '../services/recent-index/recent-index-extension.js';
import { annIndexName } from '../db/queries/ann-indexes.js';
import { maintainAnnIndexes } from '../services/recent-index/ann-indexes.js';
import { searchSession } from '../services/search/search-session.js';
import { reembed } from '../services/recent-index/reembed.js';
import { compactSession } from '../workers/compact.js';
import { embedSession } from '../workers/embed.js';
import type { EmbedContext } from '../services/recent-index/embedder.js';
import { REQUESTED, makeQueues } from '../workers/queues.js';
import { startFakeOpenAI } from './support/fake-openai.js';
import type { FakeOpenAI } from './support/fake-openai.js';
import {
  ADMIN_TOKEN,
  REDIS_URL,
  api,
  createTestDatabase,
  deleteRedisPrefix,
  dropTestDatabase,
  eventually,
  heldCall,
  holdOldSnapshot,
  indexBuildWaiting,
  startTestService,
  testPrefix,
} from './support/harness.js';
import type { Api, TestService } from './support/harness.js';

const run = promisify(execFile);

const user = (content: string) => ({ role: 'user', content });
const assistant = (content: string) => ({ role: 'assistant', content });

async function post(api: Api, sid: string, messages: unknown[]): Promise<number[]> {
  const r = await api.post(`/v1/sessions/${sid}/messages?wait=true`, { messages });
  assert.equal(r.status, 201, r.text);
  return r.body.messages.map((m: { seq: number }) => m.seq);
}

async function vectors(svc: TestService, tenantId: string, sid: string): Promise<Map<number, number[]>> {
  const r = await svc.deps.db.query<{ seq: string; e: string }>(
    'SELECT seq, embedding::text AS e FROM message_vectors WHERE tenant_id = $1 AND session_id = $2 ORDER BY seq',
    [tenantId, sid],
  );
  return new Map(r.rows.map((x) => [Number(x.seq), JSON.parse(x.e) as number[]]));
}

async function vectorsFor(
  svc: TestService,
  tenantId: string,
  sid: string,
  seqs: number[],
): Promise<Map<number, number[]>> {
  return eventually(
    async () => {
      const v = await vectors(svc, tenantId, sid);
      return seqs.every((s) => v.has(s)) ? v : null;
    },
    30_000,
    `vectors for seqs ${seqs.join(',')}`,
  );
}

/**
 * An endpoint that refuses every input (`refuseAll` sets it up: an unknown model, a gateway's
 * error for all, a model of another size): a batch of two is sent whole, each input alone and then
 * the canary, and nothing is marked; once `heal` has run, those two messages and a later one get
 * their vectors. With `failedWith`, the embed job must fail with that reason first.
 */
async function refusedEverywhere(
  svc: TestService,
  fake: FakeOpenAI,
  t: { tenantId: string; api: Api },
  sid: string,
  opts: { refuseAll: () => void; heal: () => void; failedWith?: RegExp },
): Promise<void> {
  opts.refuseAll();
  const before = fake.embeddingRequests().length;
  const notes = await post(t.api, sid, [user('first note'), user('second note')]);
  const sent = () => fake.embeddingRequests().slice(before);
  if (opts.failedWith) {
    const failed = await eventually(async () => {
      const jobs = await svc.deps.queues.embed.getFailed();
      return jobs.find((j) => j.data.tenantId === t.tenantId && j.data.sessionId === sid) ?? null;
    });
    assert.match(failed.failedReason, opts.failedWith);
  } else {
    // The batch, each input alone, the canary; then the job fails.
    await eventually(async () => sent().length >= 4);
    await new Promise((r) => setTimeout(r, 500));
  }
  assert.deepEqual(
    sent().map((r) => (r.body as { input: string[] }).input),
    [['first note', 'second note'], ['first note'], ['second note'], ['mnemos embedding probe']],
  );
  const marks = await svc.deps.db.query(
    'SELECT seq FROM message_vector_skips WHERE tenant_id = $1 AND session_id = $2',
    [t.tenantId, sid],
  );
  assert.deepEqual(marks.rows, []);
  opts.heal();
  const [third] = await post(t.api, sid, [user('third note')]);
  await vectorsFor(svc, t.tenantId, sid, [...notes, third!]);
}

function assertClose(actual: number[], expected: number[]): void {
  assert.equal(actual.length, expected.length);
  // pgvector stores float32.
  for (let i = 0; i < actual.length; i++)
    assert.ok(Math.abs(actual[i]! - expected[i]!) < 1e-6, `component ${i}`);
}

void describe('recent index with an OpenAI-compatible embedder (fake server, 1536 dims)', () => {
  let fake: FakeOpenAI;
  let svc: TestService;
  let dbUrl: string;
  const stopped = { svc: false };

  before(async () => {
    fake = await startFakeOpenAI();
    dbUrl = await createTestDatabase();
    svc = await startTestService({ databaseUrl: dbUrl, env: { OPENAI_BASE_URL: fake.url } });
  });
  after(async () => {
    if (!stopped.svc) await svc.stop();
    await fake.close();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(dbUrl);
  });

  void test('an embedder answering 500 for a while only delays vectors; the backlog drains afterwards', async () => {
    const t = await svc.newTenant();
    // Seven failures: more than one job attempt's worth (the LLM client tries 3 times per attempt).
    fake.queueEmbeddings(...Array.from({ length: 7 }, () => ({ status: 500 })));
    const before = fake.embeddingRequests().length;

    const seqs = [
      ...(await post(t.api, 'outage', [user('first question about invoices'), assistant('first answer')])),
      ...(await post(t.api, 'outage', [user('second question about refunds')])),
      ...(await post(t.api, 'outage', [assistant('second answer'), user('third question')])),
    ];
    // The archive and listing do not wait for the embedder.
    const listed = await t.api.get('/v1/sessions/outage/messages');
    assert.equal(listed.status, 200);
    assert.deepEqual(
      listed.body.messages.map((m: { seq: number }) => m.seq),
      seqs,
    );

    const v = await vectorsFor(svc, t.tenantId, 'outage', seqs);
    assert.equal(v.size, 5);
    for (const e of v.values()) assert.equal(e.length, 1536);
    assert.ok(fake.embeddingRequests().length - before >= 8, 'failed requests were retried');
    const usage = await svc.deps.db.query<{ calls: string }>(
      `SELECT sum(calls)::bigint AS calls FROM llm_usage WHERE tenant_id = $1 AND purpose = 'embedding' AND session_id = 'outage'`,
      [t.tenantId],
    );
    assert.ok(Number(usage.rows[0]?.calls) >= 1, 'embedding usage recorded');
  });

  void test('a huge message is truncated before it reaches the embedder', async () => {
    const t = await svc.newTenant();
    const latin = 'lorem ipsum dolor sit amet '.repeat(12_000); // 324k characters
    const cjk = '記憶系統測試資料'.repeat(12_000); // 96k characters, ~288 KB of UTF-8
    const seqs = await post(t.api, 'huge', [user(latin), assistant(cjk)]);
    await vectorsFor(svc, t.tenantId, 'huge', seqs);

    const inputs = fake
      .embeddingRequests()
      .flatMap((r) => ((r.body as { input?: unknown }).input as string[] | undefined) ?? []);
    const sentLatin = inputs.find((i) => i.startsWith('lorem ipsum'));
    const sentCjk = inputs.find((i) => i.startsWith('記憶系統'));
    assert.ok(sentLatin && sentCjk, 'both messages were sent');
    assert.ok(
      sentLatin.length <= MAX_EMBED_CHARS && sentLatin.length > MAX_EMBED_CHARS * 0.8,
      `latin ${sentLatin.length}`,
    );
    assert.ok(estimateTokens(sentLatin) <= MAX_EMBED_TOKENS, 'estimateTokens(sentLatin) <= MAX_EMBED_TOKENS');
    // CJK text costs more tokens per character, so it is cut shorter.
    assert.ok(sentCjk.length < 5000 && estimateTokens(sentCjk) <= MAX_EMBED_TOKENS, `cjk ${sentCjk.length}`);
    assert.ok(
      latin.startsWith(sentLatin) && cjk.startsWith(sentCjk),
      'latin.startsWith(sentLatin) && cjk.startsWith(sentCjk)',
    );
  });

  void test('messages embedded in more than one request each get their own vector: a search for one finds it first', async () => {
    const t = await svc.newTenant();
    // 20 messages of MAX_EMBED_TOKENS estimated tokens each, one word apiece: one embed job's
    // batch, past one request's budget of 120,000 (17 of them fit), so it is sent in two requests.
    const words = ['albatross', 'bobcat', 'caribou', 'dingo', 'echidna', 'ferret', 'gazelle', 'hyena', 'ibex']
      .concat(['jackal', 'koala', 'lemur', 'marmot', 'narwhal', 'ocelot', 'pangolin', 'quokka', 'raccoon'])
      .concat(['sloth', 'tapir']);
    const text = (w: string) => `${w} `.repeat(MAX_EMBED_TOKENS).slice(0, MAX_EMBED_TOKENS * 3);
    const sentBefore = fake.embeddingRequests().length;
    const seqs = await post(
      t.api,
      'split',
      words.map((w) => user(text(w))),
    );
    // One batch, written in one transaction.
    await vectorsFor(svc, t.tenantId, 'split', [seqs[0]!]);
    const requests = fake
      .embeddingRequests()
      .slice(sentBefore)
      .filter((r) =>
        ((r.body as { input?: string[] }).input ?? []).some((i) => words.includes(i.split(' ')[0]!)),
      );
    assert.ok(requests.length >= 2, `sent in ${requests.length} request(s)`);

    const firstHits: Array<number | undefined> = [];
    for (const w of words) {
      const r = await t.api.post('/v1/sessions/split/search', { query: w, match: 'semantic', limit: 1 });
      assert.equal(r.status, 200, r.text);
      firstHits.push(r.body.hits[0]?.seq);
    }
    assert.deepEqual(firstHits, seqs);
  });

  void test('prepareEmbedText passes short text unchanged and cuts long text at a code point', () => {
    assert.equal(prepareEmbedText('  '), null);
    assert.equal(prepareEmbedText(null), null);
    const short = 'short text 記憶 😀';
    assert.equal(prepareEmbedText(short), short);
    const emoji = '😀'.repeat(5_000); // 10,000 UTF-16 units, 1.5 estimated tokens per code point
    const cut = prepareEmbedText(emoji)!;
    assert.equal(cut.length % 2, 0, 'no half surrogate pair at the end');
    assert.equal(Array.from(cut).length, Math.floor(MAX_EMBED_TOKENS / 1.5));
    assert.ok(
      emoji.startsWith(cut) && estimateTokens(cut) <= MAX_EMBED_TOKENS,
      'emoji.startsWith(cut) && estimateTokens(cut) <= MAX_EMBED_TOKENS',
    );
  });

  void test('a message the embedder refuses alone is skipped and does not block the others', async () => {
    const t = await svc.newTenant();
    // The batch is refused, then each input alone: ok, refused, ok.
    fake.queueEmbeddings({ status: 400 }, 'ok', { status: 400 }, 'ok');
    const seqs = await post(t.api, 'poison', [
      user('alpha message'),
      user('poison message'),
      user('gamma message'),
    ]);
    await vectorsFor(svc, t.tenantId, 'poison', [seqs[0]!, seqs[2]!]);
    const skips = await eventually(async () => {
      const r = await svc.deps.db.query<{ seq: string; reason: string }>(
        'SELECT seq, reason FROM message_vector_skips WHERE tenant_id = $1',
        [t.tenantId],
      );
      return r.rows.length > 0 ? r.rows : null;
    });
    assert.deepEqual(skips, [{ seq: String(seqs[1]), reason: 'bad_request 400' }]);

    const sentBefore = fake.embeddingRequests().length;
    const [later] = await post(t.api, 'poison', [user('delta message')]);
    const v = await vectorsFor(svc, t.tenantId, 'poison', [later!]);
    assert.equal(v.has(seqs[1]!), false);
    const resent = fake
      .embeddingRequests()
      .slice(sentBefore)
      .some((r) => JSON.stringify(r.body).includes('poison message'));
    assert.equal(resent, false, 'the skipped message is not sent again');
  });

  /** Skip marks of the tenant's session, once there are at least `n`. */
  async function skipsFor(
    tenantId: string,
    sid: string,
    n: number,
  ): Promise<Array<{ seq: number; reason: string }>> {
    return eventually(
      async () => {
        const r = await svc.deps.db.query<{ seq: string; reason: string }>(
          'SELECT seq, reason FROM message_vector_skips WHERE tenant_id = $1 AND session_id = $2 ORDER BY seq',
          [tenantId, sid],
        );
        return r.rows.length >= n ? r.rows.map((x) => ({ seq: Number(x.seq), reason: x.reason })) : null;
      },
      30_000,
      `${n} skip marks in ${sid}`,
    );
  }

  /** The fake answers a text holding one of `bad`'s words with that vector, every other text normally. */
  function answerBadVectors(bad: Record<string, (dimensions: number) => number[]>): void {
    const badFor = (text: string) => Object.entries(bad).find(([word]) => text.includes(word))?.[1];
    fake.onEmbeddings((body: { input: string[]; dimensions?: number }) => {
      if (!body.input.some((text) => badFor(text))) return undefined;
      const d = body.dimensions ?? 1536;
      const data = body.input.map((text, index) => ({
        object: 'embedding',
        index,
        embedding: badFor(text)?.(d) ?? localEmbed(text, d).map((v) => Math.fround(v)),
      }));
      return { status: 200, body: { object: 'list', data, usage: { prompt_tokens: 1, total_tokens: 1 } } };
    });
  }

  void test('a vector the database cannot hold (beyond float4, or of zero length) is skipped alone; the session goes on', async () => {
    const t = await svc.newTenant();
    answerBadVectors({
      // A valid JSON double that is Infinity as a float4: Postgres refuses the row.
      poisonbig: (d) => localEmbed('big', d).map((v, i) => (i === 0 ? 1e39 : v)),
      // Zero in float4: its cosine distance to anything is NaN.
      poisontiny: (d) => new Array<number>(d).fill(1e-50),
      poisonzero: (d) => new Array<number>(d).fill(0),
      // An empty vector, or one of another dimension, for one input (a re-tester's endpoint).
      poisonempty: () => [],
      poisonshort: (d) => localEmbed('short', d).slice(1),
    });
    try {
      // Alone in its batch: the canary tells the input's fault from the endpoint's.
      const [big] = await post(t.api, 'bad', [user('poisonbig message')]);
      assert.deepEqual(await skipsFor(t.tenantId, 'bad', 1), [{ seq: big, reason: 'bad_vector' }]);

      const seqs = await post(t.api, 'bad', [
        user('kiwi fruit'),
        assistant('poisontiny answer'),
        user('poisonzero question'),
        assistant('mango salad'),
      ]);
      const odd = await post(t.api, 'bad', [user('poisonempty one'), user('poisonshort two')]);
      const [later] = await post(t.api, 'bad', [user('lemon tart')]);
      const v = await vectorsFor(svc, t.tenantId, 'bad', [seqs[0]!, seqs[3]!, later!]);
      assert.deepEqual([...v.keys()], [seqs[0], seqs[3], later]);
      assert.deepEqual(await skipsFor(t.tenantId, 'bad', 5), [
        { seq: big, reason: 'bad_vector' },
        { seq: seqs[1], reason: 'bad_vector' },
        { seq: seqs[2], reason: 'bad_vector' },
        { seq: odd[0], reason: 'bad_vector' },
        { seq: odd[1], reason: 'bad_vector' },
      ]);
    } finally {
      fake.onEmbeddings(null);
    }
  });

  void test('an input refused with an error under HTTP 200, or left out of the answer, is skipped alone; the session goes on', async () => {
    const t = await svc.newTenant();
    // OpenRouter and proxies refuse an input with a 200 whose body is an error; another endpoint
    // leaves the text it cannot embed out of its answer.
    fake.onEmbeddings((body: { input: string[]; dimensions?: number }) => {
      if (body.input.some((text) => text.includes('poisonbody'))) {
        return { status: 200, body: { error: { code: 400, message: 'input rejected' } } };
      }
      if (!body.input.some((text) => text.includes('poisondrop'))) return undefined;
      const data = body.input
        .filter((text) => !text.includes('poisondrop'))
        .map((text, index) => ({
          object: 'embedding',
          index,
          embedding: localEmbed(text, body.dimensions ?? 1536).map((v) => Math.fround(v)),
        }));
      return { status: 200, body: { object: 'list', data, usage: { prompt_tokens: 1, total_tokens: 1 } } };
    });
    try {
      const seqs = await post(t.api, 'dropped', [
        user('kiwi fruit'),
        assistant('poisonbody answer'),
        user('poisondrop question'),
        assistant('mango salad'),
      ]);
      const [later] = await post(t.api, 'dropped', [user('lemon tart')]);
      const v = await vectorsFor(svc, t.tenantId, 'dropped', [seqs[0]!, seqs[3]!, later!]);
      assert.deepEqual([...v.keys()], [seqs[0], seqs[3], later]);
      assert.deepEqual(await skipsFor(t.tenantId, 'dropped', 2), [
        { seq: seqs[1], reason: 'error_body' },
        { seq: seqs[2], reason: 'missing_vectors' },
      ]);

      // Every answer an error under HTTP 200 (a gateway that serves no such model): the canary
      // is refused too and nothing is marked; the messages get their vectors once it is fixed.
      await refusedEverywhere(svc, fake, t, 'gateway', {
        refuseAll: () =>
          fake.onEmbeddings(() => ({
            status: 200,
            body: { error: { code: 400, message: 'no such model' } },
          })),
        heal: () => fake.onEmbeddings(null),
      });
    } finally {
      fake.onEmbeddings(null);
    }
  });

  void test('a whole batch refused input by input is skipped when the endpoint takes other text; a configuration fault marks nothing', async () => {
    const t = await svc.newTenant();
    // Each of these is refused, alone or not (too long for the model, say): 130 in a row, more than
    // a batch (EMBED_BATCH, 128).
    fake.onEmbeddings((body: { input: string[] }) =>
      body.input.some((text) => text.includes('poisonfour')) ? { status: 400 } : undefined,
    );
    try {
      const refused = await post(
        t.api,
        'refused',
        Array.from({ length: 130 }, (_, i) => (i % 2 ? assistant : user)(`long doc ${i} poisonfour`)),
      );
      const [good] = await post(t.api, 'refused', [user('good message oscar')]);
      const v = await vectorsFor(svc, t.tenantId, 'refused', [good!]);
      assert.deepEqual([...v.keys()], [good]);
      const skips = await skipsFor(t.tenantId, 'refused', 130);
      assert.deepEqual(
        skips,
        refused.map((seq) => ({ seq, reason: 'bad_request 400' })),
      );

      // Every call refused, whatever the input (an unknown model, say): the canary is refused too,
      // nothing is marked, and the messages get their vectors once the endpoint takes them.
      await refusedEverywhere(svc, fake, t, 'misconfigured', {
        refuseAll: () => fake.onEmbeddings(() => ({ status: 400 })),
        heal: () => fake.onEmbeddings(null),
      });
    } finally {
      fake.onEmbeddings(null);
    }
  });

  void test('a rebuild under the same model name gives the messages it skipped a new chance', async () => {
    const t = await svc.newTenant();
    fake.onEmbeddings((body: { input: string[] }) =>
      body.input.some((text) => text.includes('flaky')) ? { status: 400 } : undefined,
    );
    let seqs: number[];
    try {
      seqs = await post(t.api, 'again', [user('a flaky message'), user('a steady message')]);
      await vectorsFor(svc, t.tenantId, 'again', [seqs[1]!]);
      assert.deepEqual(await skipsFor(t.tenantId, 'again', 1), [{ seq: seqs[0], reason: 'bad_request 400' }]);
    } finally {
      fake.onEmbeddings(null);
    }
    // The endpoint takes it now (a model with a longer window behind the same name, say).
    const llm = makeLlmClient({ baseURL: fake.url, timeoutMs: 10_000 });
    const result = await reembed(svc.deps.db, svc.config, makeEmbedder(svc.config, llm), { force: true });
    assert.equal(result.status, 'rebuilt');
    assert.equal(result.model, svc.config.embedding.model);
    assert.deepEqual([...(await vectors(svc, t.tenantId, 'again')).keys()], seqs);
    const marks = await svc.deps.db.query('SELECT seq FROM message_vector_skips WHERE tenant_id = $1', [
      t.tenantId,
    ]);
    assert.deepEqual(marks.rows, []);
  });

  void test('start-up refuses another embedder and names `mnemos reembed`; reembed 1536 → 384 fixes it', async () => {
    const t = await svc.newTenant();
    const seqs = await post(t.api, 'move', [
      user('how do I tune the postgres connection pool'),
      assistant('raise max connections in the pool settings'),
      user('and what about banana bread'),
    ]);
    await vectorsFor(svc, t.tenantId, 'move', seqs);
    const countBefore = await svc.deps.db.query<{ n: number }>(
      'SELECT count(*)::int AS n FROM message_vectors',
    );
    const skipsBefore = await svc.deps.db.query<{ n: number }>(
      'SELECT count(*)::int AS n FROM message_vector_skips',
    );
    await svc.stop();
    stopped.svc = true;

    // No LLM configured: the local-hash embedder at 384 dimensions. The missing LLM setting is named
    // first (a reembed would move the index to the lexical embedder for good).
    await assert.rejects(startTestService({ databaseUrl: dbUrl }), (err: Error) => {
      assert.match(err.message, /^no LLM is configured \(OPENAI_API_KEY and OPENAI_BASE_URL are unset\)/);
      assert.match(err.message, /embedder is the built-in lexical local-hash\/384, but/);
      assert.match(
        err.message,
        /built with text-embedding-3-small\/1536: set OPENAI_API_KEY or OPENAI_BASE_URL/,
      );
      assert.match(err.message, /npx mnemos reembed/);
      return true;
    });
    // The same with the model and dimension the index was built with, and still no LLM: before,
    // this said "the configuration says local-hash/1536 … run `npx mnemos reembed`".
    const withoutLlm = { EMBEDDING_MODEL: 'text-embedding-3-small', EMBEDDING_DIMENSIONS: '1536' };
    await assert.rejects(startTestService({ databaseUrl: dbUrl, env: withoutLlm }), (err: Error) => {
      assert.match(err.message, /^no LLM is configured/);
      assert.match(
        err.message,
        /local-hash\/1536 \(EMBEDDING_MODEL=text-embedding-3-small is ignored without them\)/,
      );
      return true;
    });

    const env = {
      PATH: process.env.PATH,
      HOME: process.env.HOME,
      DATABASE_URL: dbUrl,
      REDIS_URL,
      LOG_LEVEL: 'silent',
    };
    const out = await run(process.execPath, ['bin/mnemos.js', 'reembed', '--batch-size', '2'], { env });
    assert.match(
      out.stdout,
      /reembed: done: \d+ vectors .* with local-hash\/384, replacing text-embedding-3-small\/1536/,
    );

    const next = await startTestService({ databaseUrl: dbUrl });
    try {
      const dims = await next.deps.db.query<{ d: number; n: number }>(
        'SELECT vector_dims(embedding) AS d, count(*)::int AS n FROM message_vectors GROUP BY 1',
      );
      // The message the old embedder refused (previous test) is tried again, and the new one takes it.
      assert.deepEqual(dims.rows, [{ d: 384, n: countBefore.rows[0]!.n + skipsBefore.rows[0]!.n }]);
      const skips = await next.deps.db.query('SELECT model FROM message_vector_skips');
      assert.deepEqual(skips.rows, []);
      const index = await next.deps.db.query('SELECT model, dimensions, state FROM vector_index');
      assert.deepEqual(index.rows, [{ model: 'local-hash', dimensions: 384, state: 'ready' }]);
      const v = await vectors(next, t.tenantId, 'move');
      assertClose(v.get(seqs[0]!)!, localEmbed('how do I tune the postgres connection pool', 384));

      // The restarted service embeds new messages with the new model.
      const api = (await next.newTenant()).api;
      const fresh = await api.post('/v1/sessions/after/messages?wait=true', {
        messages: [user('after the move')],
      });
      assert.equal(fresh.status, 201);
      await eventually(async () => {
        const r = await next.deps.db.query<{ d: number }>(
          `SELECT vector_dims(embedding) AS d FROM message_vectors WHERE session_id = 'after'`,
        );
        return r.rows[0]?.d === 384;
      });

      // A second run has nothing to do.
      const again = await run(process.execPath, ['bin/mnemos.js', 'reembed'], { env });
      assert.match(again.stdout, /already built with local-hash\/384; nothing to do/);
      assert.doesNotMatch(again.stdout, /building/, 'nothing is built');
    } finally {
      await next.stop();
      await deleteRedisPrefix(next.config.prefix);
    }
  });
});

void describe('recent index with a model that is not sent `dimensions` (nomic-embed-text, 8 dims)', () => {
  const D = 8;
  let fake: FakeOpenAI;
  let svc: TestService;
  /** The length of the vector the fake answers for a text. */
  let lengthFor: (text: string) => number = () => D;

  before(async () => {
    fake = await startFakeOpenAI();
    // Such a model answers its native size; no `dimensions` reaches it.
    fake.onEmbeddings((body: { input: string[] }) => {
      const data = body.input.map((text, index) => ({
        object: 'embedding',
        index,
        embedding: Array.from({ length: lengthFor(text) }, (_, j) => (j + 1) / 10),
      }));
      return { status: 200, body: { object: 'list', data, usage: { prompt_tokens: 1, total_tokens: 1 } } };
    });
    svc = await startTestService({
      env: {
        OPENAI_BASE_URL: fake.url,
        EMBEDDING_MODEL: 'nomic-embed-text',
        EMBEDDING_DIMENSIONS: String(D),
      },
    });
  });
  after(async () => {
    await svc.stop();
    await fake.close();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(svc.config.databaseUrl!);
  });

  void test('one input answered with a vector of another length is skipped alone; a model of another size fails loudly and marks nothing', async () => {
    const t = await svc.newTenant();
    lengthFor = (text) => (text.includes('poisonshort') ? D - 1 : D);
    const seqs = await post(t.api, 'short', [
      user('kiwi fruit'),
      assistant('poisonshort answer'),
      user('mango salad'),
    ]);
    const [later] = await post(t.api, 'short', [user('lemon tart')]);
    const v = await vectorsFor(svc, t.tenantId, 'short', [seqs[0]!, seqs[2]!, later!]);
    assert.deepEqual([...v.keys()], [seqs[0], seqs[2], later]);
    const skips = await svc.deps.db.query<{ seq: string; reason: string }>(
      'SELECT seq, reason FROM message_vector_skips WHERE tenant_id = $1',
      [t.tenantId],
    );
    assert.deepEqual(skips.rows, [{ seq: String(seqs[1]), reason: 'bad_vector' }]);

    // Every vector of another length (EMBEDDING_DIMENSIONS does not match the model): the canary's
    // too, so the job fails naming both numbers and no message is marked.
    await refusedEverywhere(svc, fake, t, 'resized', {
      refuseAll: () => (lengthFor = () => D - 1),
      heal: () => (lengthFor = () => D),
      failedWith: /embedder nomic-embed-text returned 7 dimensions but EMBEDDING_DIMENSIONS is 8/,
    });
  });
});

void describe('recent index with an endpoint that sends errors under HTTP 200 (8 dims)', () => {
  let fake: FakeOpenAI;
  let svc: TestService;
  const lines: Array<Record<string, unknown>> = [];

  before(async () => {
    fake = await startFakeOpenAI();
    const logger = pino({ level: 'warn' }, { write: (line: string) => void lines.push(JSON.parse(line)) });
    svc = await startTestService({
      logger,
      env: {
        OPENAI_BASE_URL: fake.url,
        EMBEDDING_MODEL: 'text-embedding-3-small',
        EMBEDDING_DIMENSIONS: '8',
      },
    });
  });
  after(async () => {
    await svc.stop();
    await fake.close();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(svc.config.databaseUrl!);
  });

  /** Seq -> vector or skip reason, once every seq has one or the other. */
  async function settled(tenantId: string, sid: string, seqs: number[]): Promise<Map<number, string>> {
    return eventually(
      async () => {
        const r = await svc.deps.db.query<{ seq: string; state: string }>(
          `SELECT seq, 'vector' AS state FROM message_vectors WHERE tenant_id = $1 AND session_id = $2
           UNION ALL
           SELECT seq, reason FROM message_vector_skips WHERE tenant_id = $1 AND session_id = $2`,
          [tenantId, sid],
        );
        const states = new Map(r.rows.map((x) => [Number(x.seq), x.state]));
        return seqs.every((s) => states.has(s)) ? states : null;
      },
      30_000,
      `vectors or skips for seqs ${seqs.join(',')}`,
    );
  }

  void test('an error without a code (a gateway whose upstream timed out) is an outage: retried, no message skipped', async () => {
    const t = await svc.newTenant();
    // Every second request is answered 200 with an error that has no code, the first included.
    let n = 0;
    fake.onEmbeddings(() =>
      n++ % 2 === 0 ? { status: 200, body: { error: { message: 'upstream request timed out' } } } : undefined,
    );
    try {
      for (const sid of ['flaky-a', 'flaky-b', 'flaky-c']) {
        const seqs = await post(t.api, sid, [
          user(`${sid} kiwi fruit`),
          assistant(`${sid} mango salad`),
          user(`${sid} lemon tart`),
          assistant(`${sid} plum jam`),
        ]);
        const states = await settled(t.tenantId, sid, seqs);
        assert.deepEqual(
          seqs.map((s) => states.get(s)),
          seqs.map(() => 'vector'),
          sid,
        );
      }
      assert.ok(n >= 6, `${n} embeddings requests`);
    } finally {
      fake.onEmbeddings(null);
    }
  });

  void test('a message the endpoint refuses is skipped, logged at warn with its seq and reason, and counted', async () => {
    const t = await svc.newTenant();
    const skippedTotal = async () =>
      (await svc.deps.metrics.registry.getSingleMetric('mnemos_embeddings_skipped_total')!.get()).values[0]
        ?.value ?? 0;
    const before = await skippedTotal();
    fake.onEmbeddings((body: { input: string[] }) =>
      body.input.some((text) => text.includes('poisonbody'))
        ? { status: 200, body: { error: { code: 400, message: 'input rejected' } } }
        : undefined,
    );
    try {
      const seqs = await post(t.api, 'refused', [user('kiwi fruit'), assistant('poisonbody answer')]);
      const states = await settled(t.tenantId, 'refused', seqs);
      assert.deepEqual([states.get(seqs[0]!), states.get(seqs[1]!)], ['vector', 'error_body']);
      const warning = await eventually(
        async () => lines.find((l) => l['tenantId'] === t.tenantId && l['sessionId'] === 'refused'),
        5000,
        'a warning naming the skipped message',
      );
      assert.equal(warning['level'], 40);
      assert.equal(warning['msg'], 'embeddings endpoint refused a message: it gets no vector');
      assert.equal(warning['seq'], seqs[1]);
      assert.equal(warning['reason'], 'error_body');
      assert.equal(warning['model'], 'text-embedding-3-small');
      assert.equal((await skippedTotal()) - before, 1);
    } finally {
      fake.onEmbeddings(null);
    }
  });
});

void describe('recent index with the local embedder', () => {
  let svc: TestService;
  before(async () => {
    svc = await startTestService();
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(svc.config.databaseUrl!);
  });

  void test('a query vector travels in binary and arrives as the same float4 values as its text form', async () => {
    const v = [0.1, -2.5, 1e-7, 123456.789, Math.PI, -0, 3.4e38];
    const binary = vectorParam(svc.deps.db, v);
    assert.ok(Buffer.isBuffer(binary), 'node-postgres sends it as a binary parameter');
    const r = await svc.deps.db.query<{ same: boolean; d: number; text: string }>(
      `SELECT $1::vector = $2::vector AS same, vector_dims($1::vector) AS d, $1::vector::text AS text`,
      [binary, `[${v.join(',')}]`],
    );
    assert.deepEqual({ same: r.rows[0]!.same, d: r.rows[0]!.d }, { same: true, d: v.length });
    assert.deepEqual((JSON.parse(r.rows[0]!.text) as number[]).map(Math.fround), v.map(Math.fround));
  });

  void test('writes deterministic vectors for EMBED_ROLES text only, and the nearest one is the lexical neighbour', async () => {
    const t = await svc.newTenant();
    const texts = [
      'how do I configure the postgres connection pool size',
      'Use pgBouncer in transaction mode for short queries.',
      'my sourdough bread recipe needs more hydration',
      'the weather in Taipei is humid today',
    ];
    const seqs = await post(t.api, 'lexical', [
      user(texts[0]!),
      assistant(texts[1]!),
      {
        role: 'assistant',
        content: null,
        tool_calls: [{ id: 'c1', type: 'function', function: { name: 'lookup', arguments: '{}' } }],
      },
      { role: 'tool', tool_call_id: 'c1', content: 'tool output about postgres pools' },
      user(texts[2]!),
      user('   '),
      assistant(texts[3]!),
    ]);
    const embedded = [seqs[0]!, seqs[1]!, seqs[4]!, seqs[6]!];
    const v = await vectorsFor(svc, t.tenantId, 'lexical', embedded);
    assert.deepEqual([...v.keys()], embedded, 'tool, tool-call-only and blank messages get no vector');
    embedded.forEach((seq, i) => assertClose(v.get(seq)!, localEmbed(texts[i]!, 384)));

    const index = await svc.deps.db.query('SELECT model, dimensions, state FROM vector_index');
    assert.deepEqual(index.rows, [{ model: 'local-hash', dimensions: 384, state: 'ready' }]);

    const near = await nearestInSession(svc.deps.db, {
      tenantId: t.tenantId,
      sessionId: 'lexical',
      embedding: localEmbed('postgres pool configuration', 384),
      limit: 2,
    });
    assert.equal(near[0]?.seq, seqs[0]);
    const bread = await nearestInSession(svc.deps.db, {
      tenantId: t.tenantId,
      sessionId: 'lexical',
      embedding: localEmbed('bread hydration', 384),
      limit: 1,
    });
    assert.equal(bread[0]?.seq, seqs[4]);

    // Another tenant's session of the same name sees none of these vectors.
    const other = await svc.newTenant();
    const none = await nearestInSession(svc.deps.db, {
      tenantId: other.tenantId,
      sessionId: 'lexical',
      embedding: localEmbed('postgres', 384),
      limit: 5,
    });
    assert.deepEqual(none, []);
  });

  void test('an embed run that a compaction overtakes embeds the rows now past the cutoff', async () => {
    // The reported race: the run read a page of rows, a compaction committed meanwhile and moved
    // the cutoff past all of them, the write kept none, and the run ended there: the new hot tail
    // had no vector until the embed sweep, minutes later.
    const t = await svc.newTenant();
    const sid = 'overtaken';
    const seqs = await post(
      t.api,
      sid,
      Array.from({ length: 300 }, (_, i) => user(`walrus note ${i}`)),
    );
    await vectorsFor(svc, t.tenantId, sid, seqs);
    await svc.deps.db.query('DELETE FROM message_vectors WHERE tenant_id = $1 AND session_id = $2', [
      t.tenantId,
      sid,
    ]);
    const cutoff = seqs[280]!;
    const local = makeEmbedder(svc.config, null);
    let overtaken = false;
    const embedder = {
      ...local,
      embed: async (texts: string[], ctx: EmbedContext) => {
        if (!overtaken) {
          overtaken = true;
          // What a compaction commits: the cutoff, past this whole first page (256 rows).
          await svc.deps.db.query('UPDATE sessions SET start_seq = $3 WHERE tenant_id = $1 AND id = $2', [
            t.tenantId,
            sid,
            cutoff,
          ]);
        }
        return local.embed(texts, ctx);
      },
    };
    const result = await embedSession(svc.deps, embedder, t.tenantId, sid);
    assert.ok(overtaken, 'the compaction moved the cutoff during the run');
    assert.equal(result.written, 20);
    assert.deepEqual([...(await vectors(svc, t.tenantId, sid)).keys()], seqs.slice(280));
  });

  void test('a delete stops an embed call in flight: its text is not sent again after the 204', async () => {
    // A slow endpoint held the call; the delete was answered, and the call's retries sent the
    // deleted text again seconds later. The run watches the session's generation and aborts.
    const t = await svc.newTenant();
    const sid = 'deleted-mid-call';
    const [seq] = await post(t.api, sid, [user('my password hint is aardvark')]);
    await vectorsFor(svc, t.tenantId, sid, [seq!]);
    await svc.deps.db.query('DELETE FROM message_vectors WHERE tenant_id = $1 AND session_id = $2', [
      t.tenantId,
      sid,
    ]);
    const held = heldCall();
    const embedder = {
      ...makeEmbedder(svc.config, null),
      local: false,
      embed: (_texts: string[], ctx: EmbedContext) => held.call(ctx.signal),
    };
    const run = embedSession(svc.deps, embedder, t.tenantId, sid);
    await eventually(async () => held.state.called, 5000, 'the embed call');
    assert.equal((await t.api.del(`/v1/sessions/${sid}`)).status, 204);
    const result = await run;
    assert.ok(held.state.aborted, 'the call was aborted, not answered');
    assert.equal(result.written, 0);
  });

  void test('the embed sweep re-enqueues quiet sessions that miss vectors, and only those', async () => {
    const t = await svc.newTenant();
    const seqs = await post(t.api, 'swept', [
      user('first note'),
      assistant('second note'),
      user('third note'),
    ]);
    const complete = await post(t.api, 'complete', [user('nothing missing here')]);
    // History from last year, moved in just now: active by its creation, not its sent_at.
    const imported = await post(t.api, 'backdated', [
      { ...user('an old note'), sent_at: '2025-01-01T00:00:00Z' },
    ]);
    await vectorsFor(svc, t.tenantId, 'swept', seqs);
    await vectorsFor(svc, t.tenantId, 'complete', complete);
    await vectorsFor(svc, t.tenantId, 'backdated', imported);
    // As if the embed job for the last two had failed for good (or never been enqueued).
    await svc.deps.db.query(
      'DELETE FROM message_vectors WHERE tenant_id = $1 AND session_id = $2 AND seq >= $3',
      [t.tenantId, 'swept', seqs[1]],
    );
    await svc.deps.db.query('DELETE FROM message_vectors WHERE tenant_id = $1 AND session_id = $2', [
      t.tenantId,
      'backdated',
    ]);
    // Sessions with a message in the last five minutes are left to their own jobs.
    assert.equal(await sweepMissingVectors(svc.deps, 'local-hash'), 0);
    assert.equal((await vectors(svc, t.tenantId, 'swept')).size, 1);

    assert.equal(await sweepMissingVectors(svc.deps, 'local-hash', { idleMs: 0 }), 2);
    const v = await vectorsFor(svc, t.tenantId, 'swept', seqs);
    assertClose(v.get(seqs[2]!)!, localEmbed('third note', 384));
    await vectorsFor(svc, t.tenantId, 'backdated', imported);
    assert.equal(
      await sweepMissingVectors(svc.deps, 'local-hash', { idleMs: 0 }),
      0,
      'nothing left to sweep',
    );
  });

  void test('a huge session gets its own HNSW index, which its search can use; it goes with the session', async () => {
    const t = await svc.newTenant();
    const texts = Array.from({ length: 30 }, (_, i) =>
      i === 17 ? 'the quokka migration plan for the billing cluster' : `routine status update number ${i}`,
    );
    const seqs = await post(
      t.api,
      'huge',
      texts.map((x, i) => (i % 2 === 0 ? user(x) : assistant(x))),
    );
    const small = await post(t.api, 'tiny', [user('a small session about quokka')]);
    await vectorsFor(svc, t.tenantId, 'huge', seqs);
    await vectorsFor(svc, t.tenantId, 'tiny', small);
    const name = annIndexName(t.tenantId, 'huge', 384);
    const indexDef = async () =>
      (
        await svc.deps.db.query<{ indexdef: string }>(
          'SELECT indexdef FROM pg_indexes WHERE indexname = $1',
          [name],
        )
      ).rows[0]?.indexdef ?? null;

    const built = await maintainAnnIndexes(svc.deps, { minVectors: 20, maxBuilds: 5 });
    assert.ok(built.built.includes(name), JSON.stringify(built));
    assert.ok(!built.built.includes(annIndexName(t.tenantId, 'tiny', 384)), 'small sessions get none');
    assert.match((await indexDef()) ?? '', /USING hnsw .*vector\(384\).*session_id = 'huge'/);
    const again = await maintainAnnIndexes(svc.deps, { minVectors: 20, maxBuilds: 5 });
    assert.ok(!again.built.includes(name) && !again.dropped.includes(name), 'a second pass changes nothing');

    // The search statement can use it: with sorting priced out, the planner takes the HNSW index
    // (30 vectors are too few for it to choose it on its own) and finds the same top hit.
    const search = { query: 'quokka migration', match: 'semantic' as const, limit: 3 };
    const plain = await t.api.post('/v1/sessions/huge/search', search);
    assert.equal(plain.status, 200, plain.text);
    assert.equal(plain.body.hits[0]?.seq, seqs[17]);
    const plan = await svc.deps.db.transaction(async (tx) => {
      await tx.query('SET LOCAL enable_sort = off');
      let sent: { text: string; params?: unknown[] } | null = null;
      const rec = {
        binaryParams: true,
        query: <R>(text: string, params?: unknown[]) => {
          // The search's statement, not the list of sessions with indexes of their own.
          if (!text.includes('session_search_indexes')) sent ??= { text, params };
          return tx.query<R>(text, params);
        },
      };
      const hits = await searchSession({ ...svc.deps, db: { ...svc.deps.db, ...rec } }, t.tenantId, 'huge', {
        ...search,
        time_range: 'all',
        exclude_window: false,
      });
      assert.equal(hits.hits[0]?.seq, seqs[17]);
      const r = await tx.query<{ 'QUERY PLAN': string }>(`EXPLAIN ${sent!.text}`, sent!.params);
      return r.rows.map((x) => x['QUERY PLAN']).join('\n');
    });
    assert.match(plan, new RegExp(`Index Scan using ${name} on message_vectors`));

    // Deleting the session drops its index, and then its record, right after the answer (the
    // worker's pass drops the index first: waiting for that alone, the record was read in between).
    assert.equal((await t.api.del('/v1/sessions/huge')).status, 204);
    const recorded = async () =>
      (await svc.deps.db.query('SELECT 1 FROM vector_ann_indexes WHERE index_name = $1', [name])).rowCount;
    await eventually(
      async () => (await indexDef()) === null && (await recorded()) === 0,
      20_000,
      'the index dropped and forgotten',
    );
  });

  void test('an HNSW index is dropped when its session shrinks below half the threshold', async () => {
    const t = await svc.newTenant();
    const seqs = await post(
      t.api,
      'shrinks',
      Array.from({ length: 24 }, (_, i) => user(`note ${i} about shrinking sessions`)),
    );
    await vectorsFor(svc, t.tenantId, 'shrinks', seqs);
    const name = annIndexName(t.tenantId, 'shrinks', 384);
    assert.ok(
      (await maintainAnnIndexes(svc.deps, { minVectors: 20, maxBuilds: 5 })).built.includes(name),
      '(await maintainAnnIndexes(svc.deps, { minVectors: 20, maxBuilds: 5 })).built.includes(name)',
    );
    // As after a reset or a compaction.
    await svc.deps.db.query(
      'DELETE FROM message_vectors WHERE tenant_id = $1 AND session_id = $2 AND seq > $3',
      [t.tenantId, 'shrinks', seqs[5]],
    );
    const r = await maintainAnnIndexes(svc.deps, { minVectors: 20, maxBuilds: 5 });
    assert.ok(r.dropped.includes(name), JSON.stringify(r));
    const left = await svc.deps.db.query('SELECT 1 FROM pg_indexes WHERE indexname = $1', [name]);
    assert.equal(left.rowCount, 0);
  });

  void test('an invalid index a failed build left behind is dropped and rebuilt, registered or not', async () => {
    const t = await svc.newTenant();
    const seqs = await post(
      t.api,
      'crashed',
      Array.from({ length: 24 }, (_, i) => user(`note ${i} about crashed builds`)),
    );
    await vectorsFor(svc, t.tenantId, 'crashed', seqs);
    const name = annIndexName(t.tenantId, 'crashed', 384);
    const stray = `mv_ann_stray_${t.tenantId.slice(2)}`;
    // What a CREATE INDEX CONCURRENTLY leaves when Postgres restarts under it: an INVALID index. A
    // unique build over duplicates fails the same way. One was registered by a pass that took the
    // leftover for its own index (IF NOT EXISTS), the other never was.
    for (const index of [name, stray]) {
      await assert.rejects(
        svc.deps.db.query(
          `CREATE UNIQUE INDEX CONCURRENTLY ${index} ON message_vectors (tenant_id) WHERE session_id = 'crashed'`,
        ),
        /could not create unique index/,
      );
    }
    await svc.deps.db.query(
      `INSERT INTO vector_ann_indexes (index_name, tenant_id, session_id, dimensions, vectors)
       VALUES ($1, $2, 'crashed', 384, 24)`,
      [name, t.tenantId],
    );

    const r = await maintainAnnIndexes(svc.deps, { minVectors: 20, maxBuilds: 5 });

    assert.ok(r.dropped.includes(name) && r.dropped.includes(stray), JSON.stringify(r));
    assert.ok(r.built.includes(name), JSON.stringify(r));
    const left = await svc.deps.db.query<{ name: string; valid: boolean; def: string }>(
      `SELECT c.relname AS name, i.indisvalid AS valid, pg_get_indexdef(i.indexrelid) AS def
       FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = ANY($1)`,
      [[name, stray]],
    );
    assert.equal(left.rows.length, 1);
    assert.equal(left.rows[0]!.name, name);
    assert.equal(left.rows[0]!.valid, true);
    assert.match(left.rows[0]!.def, /USING hnsw/);
  });

  void test('reembed does not bring back vectors that a delete, a reset or a compaction removed while it ran', async () => {
    const t = await svc.newTenant();
    const turns = (p: string) =>
      Array.from({ length: 6 }, (_, i) =>
        i % 2 ? assistant(`${p} answer ${i}`) : user(`${p} question ${i}`),
      );
    const cut = await post(t.api, 'cut', turns('cut'));
    const gone = await post(t.api, 'gone', turns('gone'));
    const wiped = await post(t.api, 'wiped', turns('wiped'));
    for (const [sid, seqs] of [
      ['cut', cut],
      ['gone', gone],
      ['wiped', wiped],
    ] as const)
      await vectorsFor(svc, t.tenantId, sid, seqs);

    // The shadow table is built in primary-key order: when the last message of `wiped` is embedded,
    // the other 17 already have their new vectors. Then the three purges run, as they could while
    // an operator's reembed is at work.
    const local = makeEmbedder(svc.config, null);
    let purged = false;
    const embedder = {
      ...local,
      async embed(texts: string[], ctx: Parameters<typeof local.embed>[1]) {
        if (!purged && texts.includes('wiped answer 5')) {
          purged = true;
          assert.equal((await t.api.del('/v1/sessions/gone')).status, 204);
          assert.equal((await t.api.post('/v1/sessions/wiped/reset')).status, 200);
          const hot = await svc.deps.db.query<{ hot_bytes: string }>(
            `SELECT hot_bytes FROM sessions WHERE tenant_id = $1 AND id = 'cut'`,
            [t.tenantId],
          );
          const maxHistoryBytes = Math.floor(Number(hot.rows[0]!.hot_bytes) * 0.7);
          const compacted = await compactSession(
            { db: svc.deps.db, config: { ...svc.config, maxHistoryBytes } },
            t.tenantId,
            'cut',
          );
          assert.equal(compacted.outcome, 'cut');
        }
        return local.embed(texts, ctx);
      },
    };
    const result = await reembed(svc.deps.db, svc.config, embedder, { force: true, batchSize: 1 });
    assert.equal(result.status, 'rebuilt');
    assert.ok(purged, 'the purges ran during the rebuild');

    const start = await svc.deps.db.query<{ start_seq: string }>(
      `SELECT start_seq FROM sessions WHERE tenant_id = $1 AND id = 'cut'`,
      [t.tenantId],
    );
    const startSeq = Number(start.rows[0]!.start_seq);
    assert.ok(startSeq > cut[0]!, 'the cutoff moved');
    assert.deepEqual([...(await vectors(svc, t.tenantId, 'gone')).keys()], []);
    assert.deepEqual([...(await vectors(svc, t.tenantId, 'wiped')).keys()], []);
    assert.deepEqual(
      [...(await vectors(svc, t.tenantId, 'cut')).keys()],
      cut.filter((s) => s >= startSeq),
    );
  });
});

void describe('a huge session deleted while its HNSW index is built', () => {
  // A service of its own: the maintenance pass looks at every session of the database.
  let svc: TestService;
  before(async () => {
    svc = await startTestService();
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(svc.config.databaseUrl!);
  });

  void test('the index built meanwhile is dropped when the build finishes, not left to the next pass', async () => {
    // Setup: a session over the threshold, and a transaction holding an old snapshot open, which
    // every CREATE INDEX CONCURRENTLY of the database waits out.
    const t = await svc.newTenant();
    const texts = Array.from({ length: 30 }, (_, i) => `routine status update number ${i}`);
    const seqs = await post(
      t.api,
      'huge',
      texts.map((x, i) => (i % 2 === 0 ? user(x) : assistant(x))),
    );
    await vectorsFor(svc, t.tenantId, 'huge', seqs);
    const snapshot = await holdOldSnapshot(svc.config.databaseUrl!);
    try {
      const name = annIndexName(t.tenantId, 'huge', 384);
      const pass = maintainAnnIndexes(svc.deps, { minVectors: 20, maxBuilds: 1 });
      await indexBuildWaiting(svc.deps.db, name);

      // Action: the session is deleted while the build waits; then the build finishes.
      assert.equal((await t.api.del('/v1/sessions/huge')).status, 204);
      await snapshot.release();
      const done = await pass;

      // Assert: no index of the deleted session exists or is recorded.
      assert.ok(done.dropped.includes(name), JSON.stringify(done));
      const left = await svc.deps.db.query('SELECT 1 FROM pg_class WHERE relname = $1', [name]);
      assert.equal(left.rowCount, 0, 'the index is gone');
      const recorded = await svc.deps.db.query(
        'SELECT 1 FROM vector_ann_indexes WHERE tenant_id = $1 AND session_id = $2',
        [t.tenantId, 'huge'],
      );
      assert.equal(recorded.rowCount, 0);
    } finally {
      await snapshot.release();
    }
  });
});

void describe('a recent index wider than HNSW allows (EMBEDDING_DIMENSIONS=2500)', () => {
  // pgvector builds HNSW over `vector` up to 2,000 dimensions; text-embedding-3-large has 3,072.
  let svc: TestService;
  const logged: string[] = [];
  before(async () => {
    const logger = pino({ level: 'warn' }, { write: (line: string) => void logged.push(line) });
    svc = await startTestService({ env: { EMBEDDING_DIMENSIONS: '2500', ANN_MIN_VECTORS: '20' }, logger });
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(svc.config.databaseUrl!);
  });

  void test('a huge session gets no index, the ann-indexes pass succeeds and says why once, and search answers', async () => {
    // Setup: a session over ANN_MIN_VECTORS, embedded at 2,500 dimensions.
    const t = await svc.newTenant();
    const texts = Array.from({ length: 30 }, (_, i) =>
      i === 17 ? 'the quokka migration plan for the billing cluster' : `routine status update number ${i}`,
    );
    const seqs = await post(
      t.api,
      'wide',
      texts.map((x, i) => (i % 2 === 0 ? user(x) : assistant(x))),
    );
    const v = await vectorsFor(svc, t.tenantId, 'wide', seqs);
    assert.equal(v.get(seqs[0]!)!.length, 2500);
    assert.ok(
      svc.config.warnings.some((w) => /EMBEDDING_DIMENSIONS=2500: .*ANN_MIN_VECTORS is ignored/.test(w)),
      JSON.stringify(svc.config.warnings),
    );

    // Action: two passes run by the worker, as the schedule or a delete asks for them.
    const pass = async () => {
      const job = await svc.deps.queues.maintenance.add(
        REQUESTED,
        { v: 1, kind: 'ann-indexes' },
        { removeOnComplete: false },
      );
      // A failed attempt waits (delayed) for its retry: only completed or failed is an outcome.
      const state = await eventually(
        async () => {
          const s = await svc.deps.queues.maintenance.getJobState(job.id!);
          return s === 'completed' || s === 'failed' ? s : null;
        },
        30_000,
        'the ann-indexes pass finished',
      );
      const done = await svc.deps.queues.maintenance.getJob(job.id!);
      return { state, failedReason: done?.failedReason, result: done?.returnvalue as unknown };
    };
    const first = await pass();
    const second = await pass();

    // Assert: no pass failed or was dead-lettered, none built an index, and each says why.
    for (const p of [first, second]) {
      assert.equal(p.state, 'completed', p.failedReason);
      assert.match(JSON.stringify(p.result), /2500 dimensions, more than the 2000/);
    }
    assert.equal((await svc.deps.queues.maintenance.getFailed()).length, 0);
    const indexes = await svc.deps.db.query(
      `SELECT 1 FROM vector_ann_indexes UNION ALL SELECT 1 FROM pg_class WHERE relname LIKE 'mv_ann_%'`,
    );
    assert.equal(indexes.rowCount, 0);
    const warned = logged.filter((l) => l.includes('huge sessions get no HNSW index of their own'));
    assert.equal(warned.length, 1, 'said once per process, not every pass');
    const search = await t.api.post('/v1/sessions/wide/search', {
      query: 'quokka migration',
      match: 'semantic',
      limit: 3,
    });
    assert.equal(search.status, 200, search.text);
    assert.equal(search.body.hits[0]?.seq, seqs[17]);
  });
});

void describe('a reembed stopped and never rerun', () => {
  let svc: TestService;
  before(async () => {
    svc = await startTestService();
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(svc.config.databaseUrl!);
  });

  void test('a delete, a reset and a tenant erasure leave none of the session’s vectors in its shadow table', async () => {
    // Setup: two tenants' sessions embedded, then a reembed that dies after its first page (a
    // killed process; the operator went back to the old embedder and never reran it).
    const t = await svc.newTenant();
    const erased = await svc.newTenant();
    const pair = (p: string) => [user(`${p} question`), assistant(`${p} answer`)];
    for (const [tenant, sid] of [
      [t, 'gone'],
      [t, 'wiped'],
      [t, 'kept'],
      [erased, 'theirs'],
    ] as const) {
      await vectorsFor(svc, tenant.tenantId, sid, await post(tenant.api, sid, pair(sid)));
    }
    const died = new Error('killed');
    await assert.rejects(
      reembed(svc.deps.db, svc.config, makeEmbedder(svc.config, null), {
        force: true,
        batchSize: 100,
        onProgress: () => {
          throw died;
        },
      }),
      (err) => err === died,
    );
    const shadowRows = async (tenantId: string, sid?: string) =>
      (
        await svc.deps.db.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM message_vectors_next
           WHERE tenant_id = $1 AND ($2::text IS NULL OR session_id = $2)`,
          [tenantId, sid ?? null],
        )
      ).rows[0]!.n;
    assert.equal(await shadowRows(t.tenantId, 'gone'), 2, 'the dead run left its rows');

    // Action
    assert.equal((await t.api.del('/v1/sessions/gone')).status, 204);
    assert.equal((await t.api.post('/v1/sessions/wiped/reset')).status, 200);
    const admin = api(svc.base, ADMIN_TOKEN);
    assert.equal((await admin.del(`/v1/admin/tenants/${erased.tenantId}`)).status, 204);

    // Assert
    assert.equal(await shadowRows(t.tenantId, 'gone'), 0);
    assert.equal(await shadowRows(t.tenantId, 'wiped'), 0);
    assert.equal(await shadowRows(erased.tenantId), 0);
    assert.equal(await shadowRows(t.tenantId, 'kept'), 2, 'other sessions keep theirs');
  });
});

void describe('the recent index yields to archiving during a burst', () => {
  let svc: TestService;
  let probes = 0;
  const probePrefix = () => `${svc.config.prefix}:probe${++probes}`;
  before(async () => {
    svc = await startTestService({ env: { EMBED_MAX_DEFER_MS: '8000' } });
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(svc.config.databaseUrl!);
  });

  void test('archiving is behind when a session has waited for its drain longer than the threshold', async () => {
    const { redis } = svc.deps;
    // A prefix of its own: the running service's ingest sweeper re-stamps (and its worker drains)
    // sessions armed under the service's prefix, which would race these probes.
    const prefix = probePrefix();
    const armed = `${prefix}:armed`;
    // A threshold of 10 s, not 250 ms: on a loaded machine 250 ms passed between the ZADD of "just
    // now" and the check.
    assert.equal(await archivingBehind(redis, prefix, 10_000), false);
    await redis.zadd(armed, Date.now(), 't-probe fresh');
    assert.equal(await archivingBehind(redis, prefix, 10_000), false, 'armed just now');
    await redis.zadd(armed, Date.now() - 60_000, 't-probe waiting');
    assert.equal(await archivingBehind(redis, prefix, 10_000), true, 'armed a minute ago');
    await redis.zrem(armed, 't-probe fresh', 't-probe waiting');
  });

  void test('a session whose drains keep taking entries is not behind, however long its inbox stays full', async () => {
    const { redis } = svc.deps;
    const prefix = probePrefix();
    defineInboxScripts(redis);
    const keys = inboxKeys(prefix, 't-probe', 'steady');
    await redis.hset(keys.sess, 'seq', 3, 'gen', 1, 'armed', '1', 'archived', 0);
    await redis.rpush(keys.inbox, '1 1 {}', '2 1 {}', '3 1 {}');
    // Armed a minute ago: its inbox has held entries ever since.
    await redis.zadd(keys.armed, Date.now() - 60_000, keys.member);
    assert.equal(await archivingBehind(redis, prefix, 250), true);
    // A drain that takes nothing (it found nothing it could archive) is no progress.
    assert.equal(await finishDrain(redis, keys, 0), 3);
    assert.equal(await archivingBehind(redis, prefix, 250), true);
    // A drain takes seq 1 and leaves 2 and 3: waiting is counted from now.
    assert.equal(await finishDrain(redis, keys, 1), 2);
    assert.equal(await archivingBehind(redis, prefix, 250), false);
    // The last drain empties the inbox and disarms the session.
    assert.equal(await finishDrain(redis, keys, 3), 0);
    assert.equal(await redis.zscore(keys.armed, keys.member), null);
    await redis.del(keys.sess);
  });

  void test('embed jobs wait while archiving is behind, at most EMBED_MAX_DEFER_MS, and run once it catches up', async () => {
    const t = await svc.newTenant();
    const armed = `${svc.config.prefix}:armed`;
    const embedQueue = svc.deps.queues?.embed;
    assert.ok(embedQueue, 'embedQueue');
    // A session whose accepted messages have waited a second for their drain, kept that way:
    // younger than the ingest sweeper's threshold (2 s here), which would re-request its flush.
    const stuck = `${t.tenantId} stuck`;
    const keepBehind = () => svc.deps.redis.zadd(armed, Date.now() - 1000, stuck);
    await keepBehind();
    const keeper = setInterval(() => void keepBehind(), 200);
    try {
      const held = await post(t.api, 'held', [
        user('first message while archiving is behind'),
        user('second'),
      ]);
      await eventually(
        async () =>
          (await embedQueue.getDelayedCount()) >= 1 && (await vectors(svc, t.tenantId, 'held')).size === 0,
        5000,
        'the embed job deferred, no vectors written',
      );
      // The bound: archiving is still behind, yet the vectors arrive once the job is 8 s old.
      await vectorsFor(svc, t.tenantId, 'held', held);
      assert.equal(await archivingBehind(svc.deps.redis, svc.config.prefix, 250), true);
    } finally {
      clearInterval(keeper);
    }

    // Archiving caught up: the next session's vectors follow at once.
    await svc.deps.redis.zrem(armed, stuck);
    const free = await post(t.api, 'free', [user('archiving has caught up')]);
    await vectorsFor(svc, t.tenantId, 'free', free);
  });
});

void describe('EMBED_DEFER_BEHIND_MS: when archiving counts as behind', () => {
  let svc: TestService;
  before(async () => {
    svc = await startTestService({ env: { EMBED_MAX_DEFER_MS: '60000', EMBED_DEFER_BEHIND_MS: '5000' } });
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(svc.config.databaseUrl!);
  });

  void test('a drain wait below the threshold (a slow link) does not defer embedding', async () => {
    const t = await svc.newTenant();
    const armed = `${svc.config.prefix}:armed`;
    // A session whose accepted messages have waited a second for their drain: behind under the
    // default 250 ms, as every session is on a link where a drain takes that long, but not under
    // the 5 s configured here.
    const waiting = `${t.tenantId} waiting`;
    const keepWaiting = () => svc.deps.redis.zadd(armed, Date.now() - 1000, waiting);
    await keepWaiting();
    const keeper = setInterval(() => void keepWaiting(), 200);
    try {
      assert.equal(await archivingBehind(svc.deps.redis, svc.config.prefix, 250), true);
      const seqs = await post(t.api, 'slow-link', [user('embedded while a drain takes a second')]);
      // Deferred, the job would wait up to EMBED_MAX_DEFER_MS (60 s) for its vectors.
      await eventually(
        async () => (await vectors(svc, t.tenantId, 'slow-link')).size === seqs.length,
        10_000,
        'vectors written without deferral',
      );
      assert.equal(await svc.deps.queues!.embed.getDelayedCount(), 0, 'no embed job deferred');
    } finally {
      clearInterval(keeper);
      await svc.deps.redis.zrem(armed, waiting);
    }
  });
});

void describe('embed job coalescing (BullMQ deduplication per session)', () => {
  void test('one waiting job per session; adds while it runs leave exactly one follow-up', async () => {
    const prefix = testPrefix();
    const producer = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
    const queues = makeQueues(producer, prefix);
    const ran: string[] = [];
    const done: string[] = [];
    let release = () => {};
    const gate = new Promise<void>((r) => (release = r));
    let first = () => {};
    const firstRunning = new Promise<void>((r) => (first = r));
    const workerConnection = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
    let worker: Worker | null = null;
    try {
      const busy = { tenantId: 't1', sessionId: 'agent:42:busy', generation: 1 };
      // Setup: while no worker runs, 20 requests for one session leave one waiting job.
      for (let i = 0; i < 20; i++) await enqueueEmbed(queues, busy);
      assert.equal(await queues.embed.getWaitingCount(), 1);

      worker = new Worker(
        'embed',
        async (job) => {
          ran.push((job.data as { sessionId: string }).sessionId);
          if (ran.length === 1) {
            first();
            await gate;
          }
        },
        { connection: workerConnection, prefix, concurrency: 4 },
      );
      worker.on('completed', (job) => done.push((job.data as { sessionId: string }).sessionId));
      await firstRunning;
      // Action: 50 more requests while the job runs (batches archived after it looked for work).
      for (let i = 0; i < 50; i++) await enqueueEmbed(queues, busy);
      await enqueueEmbed(queues, { ...busy, sessionId: 'another' });
      // The handler records its run when it starts; BullMQ moves the job to completed after it
      // returns, so wait for that before counting what is active.
      await eventually(async () => done.includes('another'));
      const during = await queues.embed.getJobCounts('waiting', 'active', 'delayed');
      assert.deepEqual(during, { waiting: 0, active: 1, delayed: 0 }, 'no second job runs beside the first');
      release();

      // Assert: exactly one follow-up for the busy session, created when the running job ended.
      await eventually(async () => {
        const c = await queues.embed.getJobCounts('waiting', 'active', 'delayed');
        return ran.length >= 3 && Object.values(c).every((n) => n === 0);
      });
      assert.deepEqual(ran, ['agent:42:busy', 'another', 'agent:42:busy']);
    } finally {
      release();
      await worker?.close();
      await queues.close();
      workerConnection.disconnect();
      producer.disconnect();
      await deleteRedisPrefix(prefix);
    }
  });
});
