import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { makeRedis } from '../services/redis.js';
import { enqueueSummarizeMany } from '../services/summary/enqueue-summarize.js';
import { SWEEP_SCHEDULER_ID } from '../services/summary/summary-extension.js';
import { makeQueues } from '../workers/queues.js';
import { runSummarySweep } from '../workers/summary-sweep.js';
import { startFakeOpenAI } from './support/fake-openai.js';
import type { ChatScript, FakeOpenAI } from './support/fake-openai.js';
import {
  ADMIN_TOKEN,
  REDIS_URL,
  api,
  createTestDatabase,
  eventually,
  startTestService,
  testPrefix,
} from './support/harness.js';
import type { Api, TestService } from './support/harness.js';

const SENT_AT = '2026-01-02T03:04:05Z';
const sid = (what: string) => `${what}-${randomBytes(3).toString('hex')}`;
const user = (content: string) => ({ role: 'user', content, sent_at: SENT_AT });
const assistant = (content: string) => ({ role: 'assistant', content, sent_at: SENT_AT });
const sized = (token: string, chars: number) =>
  `${token} ${'x'.repeat(Math.max(0, chars - token.length - 1))}`;
const tokensIn = (text: string) => [...text.matchAll(/\[T:[a-z0-9]+\]/g)].map((m) => m[0]);
const userText = (body: any) => String(body?.messages?.[1]?.content ?? '');

function echoSummary(body: any): ChatScript {
  return {
    content: JSON.stringify({
      key_decisions: [],
      past_discussions: [],
      current_discussion: {
        topic: 't',
        description: tokensIn(userText(body)).join(' '),
        perspectives: '',
        direction: '',
      },
    }),
  };
}

async function archive(api: Api, session: string, messages: unknown[]): Promise<number[]> {
  const r = await api.post(`/v1/sessions/${session}/messages?wait=true`, { messages });
  assert.equal(r.status, 201, r.text);
  return (r.body.messages as Array<{ seq: number }>).map((m) => m.seq);
}

let fake: FakeOpenAI;
before(async () => {
  fake = await startFakeOpenAI();
});
after(async () => {
  await fake?.close();
});

void describe('summary sweep', () => {
  let svc: TestService;
  let api: Api;
  before(async () => {
    svc = await startTestService({
      env: {
        OPENAI_BASE_URL: fake.url,
        OPENAI_API_KEY: 'test',
        SUMMARY_RUNES: '500',
        SUMMARY_CRON: '*/1 * * * * *',
      },
    });
    api = (await svc.newTenant()).api;
  });
  after(async () => {
    await svc?.stop();
  });

  void test('summarises changed sessions, skips temp- sessions, and leaves unchanged ones alone', async () => {
    fake.reset();
    fake.onChat(echoSummary);
    const s = sid('alpha');
    const temp = sid('temp-scratch');
    const seqs = await archive(api, s, [user('[T:w1] plan the release'), assistant('[T:w2] ok')]);
    await archive(api, temp, [user('[T:tmp1] throwaway'), assistant('[T:tmp2] sure')]);
    const summary = await eventually(
      async () => {
        const r = await api.get(`/v1/sessions/${s}/summary`);
        return r.status === 200 && r.body.cursor_seq === seqs[1] ? r.body : null;
      },
      20_000,
      'the sweep to summarise the session',
    );
    assert.equal(summary.version, 1);
    assert.equal(summary.summary.current_discussion.description, '[T:w1] [T:w2]');

    // Two further sweeps find nothing to do.
    const mark = Date.now();
    const calls = fake.chatRequests().length;
    const later = await eventually(
      async () => {
        const jobs = await svc.deps.queues.summary.getJobs(['completed'], 0, -1);
        const sweeps = jobs.filter((j) => j.name === 'sweep' && (j.processedOn ?? 0) > mark);
        return sweeps.length >= 2 ? sweeps : null;
      },
      20_000,
      'two more sweeps',
    );
    assert.ok(
      later.every((j) => (j.returnvalue as { candidates: number }).candidates === 0),
      'later.every((j) => (j.returnvalue as { candidates: number }).candidates === 0)',
    );
    assert.equal(fake.chatRequests().length, calls, 'no LLM call for an unchanged session');
    assert.equal((await api.get(`/v1/sessions/${temp}/summary`)).status, 404);
    assert.ok(!fake.chatRequests().some((r) => userText(r.body).includes('[T:tmp')), 'temp- never sent');

    // New messages make the session a candidate again.
    const more = await archive(api, s, [user('[T:w3] and the changelog'), assistant('[T:w4] drafted')]);
    await eventually(
      async () => (await api.get(`/v1/sessions/${s}/summary`)).body.cursor_seq === more[1],
      20_000,
      'the sweep to pick up new messages',
    );
  });

  void test("a summarize the API asks for goes before the sweep's backlog, also when it joins a sweep's job", async () => {
    fake.reset();
    fake.onChat(echoSummary);
    const queue = svc.deps.queues.summary;
    const t = await svc.newTenant();
    const [backlog, joined, own] = [sid('backlog'), sid('joined'), sid('own')];
    const seqs = new Map<string, number>();
    for (const s of [backlog, joined, own]) seqs.set(s, (await archive(t.api, s, [user(`[T:p1] ${s}`)]))[0]!);
    // This suite's sweep runs every second: let it summarise them first, and let whatever job is
    // running end after the pause, so that none of these sessions has a job running (a request
    // would join it there, and never be in the wait list).
    await eventually(
      async () => {
        for (const [s, seq] of seqs) {
          if ((await t.api.get(`/v1/sessions/${s}/summary`)).body.cursor_seq !== seq) return false;
        }
        return true;
      },
      20_000,
      'the sweep to summarise the three sessions',
    );
    await queue.pause();
    await eventually(async () => (await queue.getActiveCount()) === 0, 20_000, 'running jobs to end');
    try {
      // What a sweep queues for a tenant with many changed sessions (here two of them).
      await enqueueSummarizeMany(
        svc.deps.queues,
        [backlog, joined].map((sessionId) => ({ tenantId: t.tenantId, sessionId })),
      );
      const ids: Record<string, string> = {};
      for (const s of [joined, own]) {
        const r = await t.api.post(`/v1/sessions/${s}/summarize`);
        assert.equal(r.status, 202);
        ids[s] = String(r.body.job_id).replace(/^summary\./, '');
      }
      // The order a worker takes them in: the requests' jobs (the joined one moved up), then the
      // sweep's.
      assert.deepEqual(await takeOrder(queue, [t.tenantId]), [joined, own, backlog]);
      assert.ok(
        (await queue.getJobs(['prioritized'])).some((j) => j.id === ids[joined]),
        "(await queue.getJobs(['prioritized'])).some((j) => j.id === ids[joined])",
      );
    } finally {
      await queue.resume();
    }
  });

  void test("the sweep interleaves tenants: a tenant whose id sorts late is not behind another's backlog", async () => {
    fake.reset();
    fake.onChat(echoSummary);
    const queue = svc.deps.queues.summary;
    // Setup: two tenants, in the order the sweep reads them, and no sweep running meanwhile.
    const tenants = [await svc.newTenant(), await svc.newTenant()];
    const order = await svc.deps.db.query<{ id: string }>(
      'SELECT id FROM tenants WHERE id = ANY($1::text[]) ORDER BY id',
      [tenants.map((t) => t.tenantId)],
    );
    const [early, late] = order.rows.map((r) => tenants.find((t) => t.tenantId === r.id)!);
    await queue.pause();
    await eventually(async () => (await queue.getActiveCount()) === 0, 20_000, 'running jobs to end');
    try {
      // The first with a backlog of four changed sessions, the second with two.
      const base = sid('fair');
      const backlog = [0, 1, 2, 3].map((i) => `${base}-b${i}`);
      const few = [0, 1].map((i) => `${base}-f${i}`);
      for (const s of backlog) await archive(early!.api, s, [user(`[T:fb] ${s}`)]);
      for (const s of few) await archive(late!.api, s, [user(`[T:ff] ${s}`)]);

      // Action: a sweep, reading two sessions a page.
      await runSummarySweep(svc.deps, { pageSize: 2 });

      // Assert: workers take the tenants' sessions in turn (the second tenant's came after all
      // of the first's).
      assert.deepEqual(await takeOrder(queue, [early!.tenantId, late!.tenantId]), [
        backlog[0],
        few[0],
        backlog[1],
        few[1],
        backlog[2],
        backlog[3],
      ]);
    } finally {
      await queue.resume();
    }
  });

  void test("a tenant's many summarize requests do not hold up another tenant's", async () => {
    fake.reset();
    fake.onChat(echoSummary);
    const queue = svc.deps.queues.summary;
    const [heavy, light] = [await svc.newTenant(), await svc.newTenant()];
    const many = Array.from({ length: 6 }, (_, i) => sid(`many${i}`));
    for (const s of many) await archive(heavy.api, s, [user(`[T:h] ${s}`)]);
    const mine = sid('mine');
    const seq = (await archive(light.api, mine, [user('[T:l] mine')]))[0]!;
    await queue.pause();
    await eventually(async () => (await queue.getActiveCount()) === 0, 20_000, 'running jobs to end');
    try {
      for (const s of many) assert.equal((await heavy.api.post(`/v1/sessions/${s}/summarize`)).status, 202);
      assert.equal((await light.api.post(`/v1/sessions/${mine}/summarize`)).status, 202);
      // The light tenant's one request goes behind the heavy tenant's first only (each tenant's
      // first in a while is 1, first come first served); the heavy tenant's keep their order.
      assert.deepEqual(await takeOrder(queue, [heavy.tenantId, light.tenantId]), [
        many[0],
        mine,
        ...many.slice(1),
      ]);
    } finally {
      await queue.resume();
    }
    await eventually(
      async () => (await light.api.get(`/v1/sessions/${mine}/summary`)).body.cursor_seq === seq,
      20_000,
      'the light tenant summarised',
    );
  });
});

/** The sessions of these tenants' waiting summarize jobs, in the order a worker takes them. */
async function takeOrder(
  queue: ReturnType<typeof makeQueues>['summary'],
  tenants: string[],
): Promise<string[]> {
  const mine = (j: { data: unknown }) => tenants.includes((j.data as { tenantId?: string }).tenantId ?? '');
  const session = (j: { data: unknown }) => (j.data as { sessionId: string }).sessionId;
  // The wait list (jobs without a priority) first, then the prioritized ones, lowest number first.
  const waiting = (await queue.getJobs(['wait'], 0, -1, true)).filter(mine);
  const prioritized = (await queue.getJobs(['prioritized'], 0, -1, true)).filter(mine);
  return [...waiting, ...prioritized].map(session);
}

void describe('two worker processes', () => {
  const DELAY_MS = 150;
  const sessions = ['k1', 'k2', 'k3'];
  let apiSvc: TestService;
  let workers: TestService[] = [];
  let startWorker: () => Promise<TestService>;

  before(async () => {
    const databaseUrl = await createTestDatabase();
    const prefix = testPrefix();
    const env = {
      OPENAI_BASE_URL: fake.url,
      OPENAI_API_KEY: 'test',
      SUMMARY_RUNES: '500',
      SUMMARY_CRON: '*/1 * * * * *',
    };
    apiSvc = await startTestService({ mode: 'api', databaseUrl, prefix, env });
    startWorker = () => startTestService({ mode: 'worker', databaseUrl, prefix, env });
    workers = [await startWorker(), await startWorker()];
  });
  after(async () => {
    await Promise.all([apiSvc, ...workers].map((s) => s?.stop()));
  });

  void test('never summarises one session twice at once, and merges every message exactly once', async () => {
    fake.reset();
    const inFlight = new Map<string, number>();
    let maxPerSession = 0;
    fake.onChat((body) => {
      const key = /\[T:(k\d)m/.exec(userText(body))?.[1] ?? 'other';
      const now = (inFlight.get(key) ?? 0) + 1;
      inFlight.set(key, now);
      maxPerSession = Math.max(maxPerSession, now);
      // The fake answers after DELAY_MS; this timer was set first, so it fires first.
      setTimeout(() => inFlight.set(key, (inFlight.get(key) ?? 1) - 1), DELAY_MS);
      return { delayMs: DELAY_MS, then: echoSummary(body) };
    });
    const { api } = await apiSvc.newTenant();
    const names = new Map(sessions.map((k) => [k, sid(`shared-${k}`)]));
    const expected = new Map<string, string[]>();
    const lastSeq = new Map<string, number>();
    for (const k of sessions) {
      // Four chunks per session: each pair is ~200 code points of a 500 budget.
      const messages = Array.from({ length: 8 }, (_, i) =>
        i % 2 === 0 ? user(sized(`[T:${k}m${i}]`, 160)) : assistant(sized(`[T:${k}m${i}]`, 160)),
      );
      const seqs = await archive(api, names.get(k)!, messages);
      expected.set(
        k,
        messages.map((m) => tokensIn(m.content)[0]!),
      );
      lastSeq.set(k, seqs[seqs.length - 1]!);
    }
    // The API asks too, while the sweeps of both workers run.
    for (let i = 0; i < 3; i++) {
      for (const k of sessions) {
        const r = await api.post(`/v1/sessions/${names.get(k)!}/summarize`);
        assert.equal(r.status, 202);
      }
    }
    await eventually(
      async () => {
        for (const k of sessions) {
          const r = await api.get(`/v1/sessions/${names.get(k)!}/summary`);
          if (r.status !== 200 || r.body.cursor_seq !== lastSeq.get(k)) return false;
        }
        return true;
      },
      30_000,
      'all sessions summarised',
    );
    assert.equal(maxPerSession, 1, 'at most one LLM call in flight per session');
    for (const k of sessions) {
      const merged = fake
        .chatRequests()
        .flatMap((r) => tokensIn(userText(r.body)).filter((t) => t.startsWith(`[T:${k}m`)));
      assert.deepEqual(merged, expected.get(k), `session ${k}: every message sent exactly once, in order`);
    }
  });
  void test('a worker shutting down stops between chunks; the job goes back to the queue and another worker finishes it', async () => {
    fake.reset();
    const sent: Array<{ at: number; tokens: string[] }> = [];
    fake.onChat((body) => {
      sent.push({ at: Date.now(), tokens: tokensIn(userText(body)) });
      return { delayMs: DELAY_MS, then: echoSummary(body) };
    });
    const { api } = await apiSvc.newTenant();
    const s = sid('shutdown');
    // Twenty chunks: each pair of ~330 code points fills one of a 500 budget.
    const messages = Array.from({ length: 40 }, (_, i) =>
      i % 2 === 0 ? user(sized(`[T:z${i}]`, 160)) : assistant(sized(`[T:z${i}]`, 160)),
    );
    const seqs = await archive(api, s, messages);
    assert.equal((await api.post(`/v1/sessions/${s}/summarize`)).status, 202);
    await eventually(async () => sent.length >= 2, 20_000, 'the job to be running');
    const stopAt = Date.now();
    await Promise.all(workers.map((w) => w.stop()));
    const late = sent.filter((x) => x.at > stopAt).length;
    // At most the chunk whose check passed just before the signal; before, all 18 or so left.
    assert.ok(late <= 1, `${late} chunks sent after the workers began to stop`);
    assert.ok(sent.length < 20, 'sent.length < 20');
    workers = [await startWorker()];
    await eventually(
      async () => (await api.get(`/v1/sessions/${s}/summary`)).body.cursor_seq === seqs[seqs.length - 1],
      30_000,
      'the next worker to finish the job',
    );
    assert.deepEqual(
      sent.flatMap((x) => x.tokens),
      messages.map((m) => tokensIn(m.content)[0]!),
      'every message sent exactly once, in order',
    );
  });
});

void describe('after the LLM configuration is fixed', () => {
  let svc: TestService | undefined;
  after(async () => {
    await svc?.stop();
  });

  void test('the sweep retries stalled summaries at once under the new configuration; one that fails again backs off from the first step', async () => {
    fake.reset();
    // A wrong model name fails everything; under the right one, `[T:refused]` is still refused.
    fake.onChat((body: any) => {
      if (body?.model === 'bad-model') {
        return {
          status: 404,
          body: {
            error: { code: 'model_not_found', type: 'invalid_request_error', message: 'no such model' },
          },
        };
      }
      if (userText(body).includes('[T:refused]')) {
        return {
          status: 400,
          body: { error: { code: 'invalid_value', type: 'invalid_request_error', message: 'no' } },
        };
      }
      return echoSummary(body);
    });
    const databaseUrl = await createTestDatabase();
    const prefix = testPrefix();
    const llm = { OPENAI_BASE_URL: fake.url, OPENAI_API_KEY: 'test', SUMMARY_RUNES: '500' };
    // Every run fails; five of them stall the sessions (back-off from 10 min).
    svc = await startTestService({
      databaseUrl,
      prefix,
      env: { ...llm, SUMMARY_MODEL: 'bad-model', SUMMARY_CRON: '0 0 1 1 *' },
    });
    const t = await svc.newTenant();
    const [healed, failing] = [sid('healed'), sid('failing')];
    const healedSeqs = await archive(t.api, healed, [user('[T:h1] question'), assistant('[T:h2] answer')]);
    await archive(t.api, failing, [user('[T:refused] question'), assistant('[T:f2] answer')]);
    for (const s of [healed, failing]) {
      let last: any;
      for (let i = 0; i < 5; i++) last = (await t.api.post(`/v1/sessions/${s}/summarize?wait=true`)).body;
      assert.equal(last.status, 'stalled');
      assert.equal(last.last_error, 'llm bad_request (HTTP 404: model_not_found)');
    }
    await svc.stop();

    // The operator fixes the model and restarts; no tenant's key is needed.
    svc = await startTestService({ databaseUrl, prefix, env: { ...llm, SUMMARY_CRON: '*/1 * * * * *' } });
    const a = api(svc.base, t.apiKey);
    const summary = await eventually(
      async () => {
        const r = await a.get(`/v1/sessions/${healed}/summary`);
        return r.status === 200 ? r.body : null;
      },
      20_000,
      'the sweep to summarise the stalled session under the fixed model',
    );
    assert.equal(summary.status, 'ok');
    assert.equal(summary.failures, 0);
    assert.equal(summary.cursor_seq, healedSeqs[1]);
    assert.equal(summary.summary.current_discussion.description, '[T:h1] [T:h2]');

    // The other fails again under the new configuration: its count starts from 1, and five
    // failures stall it with the first back-off step (10 min).
    const again = await eventually(
      async () => {
        const details = (await a.get(`/v1/sessions/${failing}/summary`)).body.error?.details;
        return details?.status === 'stalled' &&
          details.last_error === 'llm bad_request (HTTP 400: invalid_value)'
          ? details
          : null;
      },
      30_000,
      'the failing session to stall again under the new model',
    );
    assert.equal(again.failures, 5);
    // Both from one statement's now(): the back-off is exactly the first step.
    assert.equal(Date.parse(again.next_attempt_at) - Date.parse(again.updated_at), 600_000);
  });
});

void describe('POST /v1/admin/summaries/retry', () => {
  let svc: TestService;
  before(async () => {
    svc = await startTestService({
      env: {
        OPENAI_BASE_URL: fake.url,
        OPENAI_API_KEY: 'test',
        SUMMARY_RUNES: '500',
        SUMMARY_CRON: '0 0 1 1 *',
      },
    });
  });
  after(async () => {
    await svc?.stop();
  });

  void test("clears the back-off of a tenant's stalled summaries, or of all, and the sweep retries them", async () => {
    fake.reset();
    // A key the endpoint refused (fixed at the endpoint since): the configuration is unchanged.
    let refused = true;
    fake.onChat((body: any) =>
      refused
        ? {
            status: 401,
            body: { error: { code: 'invalid_api_key', type: 'invalid_request_error', message: 'no' } },
          }
        : echoSummary(body),
    );
    const [one, two] = [await svc.newTenant(), await svc.newTenant()];
    const s = sid('retry');
    for (const t of [one, two]) {
      await archive(t.api, s, [user('[T:r1] question'), assistant('[T:r2] answer')]);
      let last: any;
      for (let i = 0; i < 5; i++) last = (await t.api.post(`/v1/sessions/${s}/summarize?wait=true`)).body;
      assert.equal(last.status, 'stalled');
    }
    refused = false;
    const admin = api(svc.base, ADMIN_TOKEN);
    assert.equal(
      (await admin.post('/v1/admin/summaries/retry', { tenant_id: 'no-such-tenant' })).status,
      404,
    );
    assert.equal((await one.api.post('/v1/admin/summaries/retry')).status, 403, 'a tenant key is no admin');

    const mine = await admin.post('/v1/admin/summaries/retry', { tenant_id: one.tenantId });
    assert.equal(mine.status, 200, mine.text);
    assert.deepEqual(mine.body, { sessions: 1 });
    const healed = await eventually(
      async () => {
        const r = await one.api.get(`/v1/sessions/${s}/summary`);
        return r.status === 200 ? r.body : null;
      },
      20_000,
      "the sweep to summarise the first tenant's session",
    );
    assert.equal(healed.status, 'ok');
    // The other tenant's session is still in its back-off.
    const other = (await two.api.get(`/v1/sessions/${s}/summary`)).body.error.details;
    assert.equal(other.status, 'stalled');
    assert.ok(other.next_attempt_at !== null, 'other.next_attempt_at !== null');

    // Without a tenant: all of them (a body is optional).
    const all = await admin.post('/v1/admin/summaries/retry');
    assert.equal(all.status, 200, all.text);
    assert.ok(all.body.sessions >= 1, `sessions ${all.body.sessions}`);
    await eventually(
      async () => (await two.api.get(`/v1/sessions/${s}/summary`)).status === 200,
      20_000,
      "the sweep to summarise the second tenant's session",
    );
  });
});

void describe('without an LLM', () => {
  let svc: TestService;
  let prefix: string;
  before(async () => {
    prefix = testPrefix();
    // A scheduler left behind by an earlier deploy that had an LLM.
    const redis = makeRedis(REDIS_URL, 'worker');
    const queues = makeQueues(redis, prefix);
    await queues.summary.upsertJobScheduler(
      SWEEP_SCHEDULER_ID,
      { every: 60_000 },
      { name: 'sweep', data: { v: 1, kind: 'sweep' } },
    );
    await queues.close();
    redis.disconnect();
    svc = await startTestService({ prefix, env: { OPENAI_BASE_URL: '', OPENAI_API_KEY: '' } });
  });
  after(async () => {
    await svc?.stop();
  });

  void test('summarize is a 409 llm_not_configured and no sweep is scheduled', async () => {
    const { api } = await svc.newTenant();
    const s = sid('nollm');
    await archive(api, s, [user('[T:n1] hello')]);
    const r = await api.post(`/v1/sessions/${s}/summarize?wait=true`);
    assert.equal(r.status, 409);
    assert.equal(r.body.error.code, 'llm_not_configured');
    // An unknown session is a 404 first, as on every route.
    assert.equal((await api.post(`/v1/sessions/${s}-nobody/summarize`)).status, 404);
    assert.deepEqual(await svc.deps.queues.summary.getJobSchedulers(), []);
    assert.equal((await api.get(`/v1/sessions/${s}/summary`)).status, 404);
    const usage = await api.get('/v1/usage?window=7d');
    assert.deepEqual(usage.body, { window: '7d', rows: [] });
  });
});
