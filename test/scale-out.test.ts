import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { makePgDb } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import { createTenant } from '../services/tenants.js';
import { startFakeOpenAI } from './support/fake-openai.js';
import type { FakeOpenAI } from './support/fake-openai.js';
import {
  REDIS_URL,
  api,
  createTestDatabase,
  deleteRedisPrefix,
  dropTestDatabase,
  eventually,
  spawnService,
  testPrefix,
} from './support/harness.js';
import type { Api, ChildService } from './support/harness.js';

/**
 * The scale-out proof (issue 12): three worker processes and two API processes on one Postgres and
 * Redis, a mixed load over 50 sessions (batches and single messages, searches and context reads
 * meanwhile), then: order and exactly-once per session, every message summarised exactly once (no
 * duplicate summary work), and an embedding for every embeddable message.
 */
const SESSIONS = 50;
const token = (s: number, m: number) => `[T:s${s}m${m}]`;
const tokensIn = (text: string) => [...text.matchAll(/\[T:s\d+m\d+\]/g)].map((m) => m[0]);
const promptText = (body: any) =>
  (body?.messages as Array<{ role: string; content: string }> | undefined)
    ?.filter((m) => m.role !== 'system')
    .map((m) => m.content)
    .join('\n') ?? '';

void describe('scale-out: 2 API + 3 worker processes, 50 sessions', () => {
  let fake: FakeOpenAI;
  let db: Db;
  let dbUrl: string;
  let prefix: string;
  const children: ChildService[] = [];
  let apis: Api[] = [];

  before(async () => {
    fake = await startFakeOpenAI();
    // Summaries echo nothing of the messages, so counting tokens in prompts counts summarised messages.
    fake.onChat(() => ({
      content: JSON.stringify({
        key_decisions: ['Do: keep answers short'],
        past_discussions: [],
        current_discussion: { topic: 'load', description: 'a load test', perspectives: '', direction: '' },
      }),
    }));
    dbUrl = await createTestDatabase();
    prefix = testPrefix();
    db = makePgDb({ connectionString: dbUrl, max: 2 });
    const env = {
      DATABASE_URL: dbUrl,
      MNEMOS_PREFIX: prefix,
      REDIS_URL,
      OPENAI_BASE_URL: fake.url,
      OPENAI_API_KEY: 'test',
      EMBEDDING_DIMENSIONS: '64',
      SUMMARY_CRON: '*/2 * * * * *',
      WORKER_CONCURRENCY: '4',
    };
    const started = await Promise.all([
      spawnService('api', env),
      spawnService('api', env),
      spawnService('worker', env),
      spawnService('worker', env),
      spawnService('worker', env),
    ]);
    children.push(...started);
    const { api_key } = await createTenant(db, 'scale');
    apis = [api(started[0]!.url!, api_key), api(started[1]!.url!, api_key)];
  });

  after(async () => {
    await Promise.all(children.map((c) => c.stop()));
    await fake?.close();
    await db?.close();
    await dropTestDatabase(dbUrl);
    await deleteRedisPrefix(prefix);
  });

  void test('order, exactly-once, no duplicate summaries, no lost embeddings', async () => {
    // Mixed load: per session, 3 batches of 8 and 6 single messages, alternating users and
    // assistants, spread over both API processes by 10 concurrent clients; reads meanwhile.
    const expected = new Map<number, string[]>();
    const plans = Array.from({ length: SESSIONS }, (_, s) => {
      const msgs = Array.from({ length: 30 }, (_, m) => ({
        id: `s${s}-m${m}`,
        role: m % 2 === 0 ? 'user' : 'assistant',
        content: `${token(s, m)} message ${m} of session ${s} about ${m % 3 === 0 ? 'deployments' : 'indexes'}`,
      }));
      expected.set(
        s,
        msgs.map((x) => x.id),
      );
      const requests: Array<typeof msgs> = [msgs.slice(0, 8), msgs.slice(8, 16), msgs.slice(16, 24)];
      for (const one of msgs.slice(24)) requests.push([one]);
      return { s, requests };
    });
    let next = 0;
    const clients = Array.from({ length: 10 }, (_, c) =>
      (async () => {
        for (;;) {
          const i = next++;
          if (i >= plans.length) return;
          const plan = plans[i]!;
          for (const batch of plan.requests) {
            const r = await apis[c % 2]!.post(`/v1/sessions/load-${plan.s}/messages`, { messages: batch });
            assert.equal(r.status, 202, r.text);
            if (batch.length === 1) {
              const ctx = await apis[(c + 1) % 2]!.post(`/v1/sessions/load-${plan.s}/context`, {
                input: 'status?',
              });
              assert.ok([200, 404].includes(ctx.status), ctx.text);
              const hits = await apis[c % 2]!.post(`/v1/sessions/load-${plan.s}/search`, {
                query: 'deployments',
              });
              assert.ok([200, 404].includes(hits.status), hits.text);
            }
          }
        }
      })(),
    );
    await Promise.all(clients);

    // Order and exactly-once: every session holds its 30 messages once, in posting order.
    await eventually(
      async () => {
        const r = await db.query<{ n: number }>('SELECT count(*)::int AS n FROM messages');
        return r.rows[0]!.n === SESSIONS * 30;
      },
      60_000,
      'all messages archived',
    );
    for (let s = 0; s < SESSIONS; s++) {
      const r = await apis[s % 2]!.get(`/v1/sessions/load-${s}/messages?limit=100`);
      const got = r.body.messages as Array<{ id: string; seq: number }>;
      assert.deepEqual(
        got.map((m) => m.id),
        expected.get(s),
        `session ${s} in order, once`,
      );
      for (let i = 1; i < got.length; i++)
        assert.ok(got[i]!.seq > got[i - 1]!.seq, 'got[i]!.seq > got[i - 1]!.seq');
    }

    // Every message summarised exactly once, across the three workers' sweeps.
    await eventually(
      async () => {
        const r = await db.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM summaries su JOIN sessions s
             ON s.tenant_id = su.tenant_id AND s.id = su.session_id
           WHERE su.cursor_seq = s.next_seq - 1 AND su.version > 0`,
        );
        return r.rows[0]!.n === SESSIONS;
      },
      90_000,
      'every session summarised up to its last message',
    );
    const seen = new Map<string, number>();
    for (const req of fake.chatRequests()) {
      for (const t of tokensIn(promptText(req.body))) seen.set(t, (seen.get(t) ?? 0) + 1);
    }
    assert.equal(seen.size, SESSIONS * 30, 'every message reached a summary prompt');
    const twice = [...seen].filter(([, n]) => n !== 1);
    assert.deepEqual(twice, [], 'no message was summarised twice');

    // No lost embeddings: every user and assistant message has a vector.
    await eventually(
      async () => {
        const r = await db.query<{ n: number }>('SELECT count(*)::int AS n FROM message_vectors');
        return r.rows[0]!.n === SESSIONS * 30;
      },
      60_000,
      'a vector for every message',
    );
    const dims = await db.query<{ d: number }>(
      'SELECT DISTINCT vector_dims(embedding) AS d FROM message_vectors',
    );
    assert.deepEqual(
      dims.rows.map((r) => r.d),
      [64],
    );
  });
});
