import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import express from 'express';
import { fairKey, nextFairPriority } from '../services/fair-priority.js';
import { makeErrorHandler } from '../services/http-errors.js';
import { reapTempSessions } from '../services/lifecycle/temp-reaper.js';
import { KEY_CACHE_MS, makeKeyAuthenticator } from '../services/tenants.js';
import { makeLogger } from '../services/logger.js';
import { inboxKeys } from '../services/messages/inbox.js';
import { makeEmbedder } from '../services/recent-index/embedder.js';
import { ReembedBusyError, reembed } from '../services/recent-index/reembed.js';
import { rateLimit } from '../services/rate-limit.js';
import type { Redis } from '../services/redis.js';
import { deleteRedisPrefix, eventually, startTestService } from './support/harness.js';
import type { TestService } from './support/harness.js';

// Time shared between processes comes from Postgres or Redis, and deadlines from a monotonic
// clock: a process whose own clock is skewed or steps (NTP, a resumed VM) must not lose data,
// hang a request or change anyone's budget. The process clock is moved here by replacing Date
// (the API and the worker run in this process); tests time themselves with performance.now().

const HOUR = 3_600_000;
const user = (content: string) => ({ role: 'user', content });
const sid = (what: string) => `${what}-${randomBytes(3).toString('hex')}`;

/** Moves this process's wall clock (Date.now() and new Date()) by `ms`; returns the undo. */
function shiftClock(ms: number): () => void {
  const Real = Date;
  class Shifted extends Real {
    constructor(...args: unknown[]) {
      if (args.length === 0) super(Real.now() + ms);
      else super(...(args as [string]));
    }
    static override now(): number {
      return Real.now() + ms;
    }
  }
  globalThis.Date = Shifted as unknown as DateConstructor;
  return () => {
    globalThis.Date = Real;
  };
}

/** Redis's clock, in ms. */
async function redisMs(redis: Redis): Promise<number> {
  const [s, us] = await redis.time();
  return Number(s) * 1000 + Math.floor(Number(us) / 1000);
}

/**
 * Resolves when the next `hmget` of `key` is sent: a wait for a seq polls the session's archived
 * mark right after taking its deadline, so a clock step after this falls inside the wait.
 */
function firstPoll(redis: Redis, key: string): { polled: Promise<void>; restore: () => void } {
  const r = redis as unknown as { hmget: (...a: unknown[]) => Promise<unknown> };
  const own = r.hmget;
  let seen!: () => void;
  const polled = new Promise<void>((resolve) => (seen = resolve));
  r.hmget = function (this: unknown, ...a: unknown[]) {
    if (a[0] === key) seen();
    return own.apply(this, a);
  };
  return { polled, restore: () => void delete (r as { hmget?: unknown }).hmget };
}

void describe("clocks: shared time is the database's, deadlines are monotonic", () => {
  let svc: TestService;
  let apiOnly: TestService;
  before(async () => {
    svc = await startTestService();
    // No worker: nothing is archived, so a wait runs to its deadline.
    apiOnly = await startTestService({ mode: 'api' });
  });
  after(async () => {
    await Promise.all([svc.stop(), apiOnly.stop()]);
    await Promise.all([deleteRedisPrefix(svc.config.prefix), deleteRedisPrefix(apiOnly.config.prefix)]);
  });

  void test('the temp reaper measures idleness by Postgres time: a worker clock an hour ahead deletes no active session', async () => {
    const t = await svc.newTenant();
    const recent = sid('temp-recent');
    const idle = sid('temp-idle');
    for (const s of [recent, idle]) {
      const r = await t.api.post(`/v1/sessions/${s}/messages?wait=true`, { messages: [user(`hi ${s}`)] });
      assert.equal(r.status, 201, r.text);
    }
    // Idle for two hours by Postgres's clock.
    await svc.deps.db.query(
      `UPDATE sessions SET created_at = now() - interval '2 hours', last_message_at = now() - interval '2 hours'
       WHERE tenant_id = $1 AND id = $2`,
      [t.tenantId, idle],
    );
    await svc.deps.db.query(
      `UPDATE messages SET archived_at = now() - interval '2 hours' WHERE tenant_id = $1 AND session_id = $2`,
      [t.tenantId, idle],
    );

    const undo = shiftClock(HOUR);
    let outcome: { deleted: number };
    try {
      outcome = await reapTempSessions(svc.deps, () => svc.extensions);
    } finally {
      undo();
    }

    assert.ok(outcome.deleted >= 1, 'outcome.deleted >= 1');
    assert.equal((await t.api.get(`/v1/sessions/${idle}`)).status, 404, 'idle by Postgres time: reaped');
    assert.equal((await t.api.get(`/v1/sessions/${recent}`)).status, 200, 'posted a moment ago: kept');
    assert.equal((await t.api.get(`/v1/sessions/${recent}/messages`)).body.messages.length, 1);
  });

  void test("a reembed judges another run's lease by Postgres time, whatever this process's clock says", async () => {
    const { db } = svc.deps;
    const embedder = makeEmbedder(svc.config, null);
    const index = async () =>
      (
        await db.query<{ state: string; reembed_id: string | null }>(
          'SELECT state, reembed_id FROM vector_index',
        )
      ).rows[0];
    /** The lease another process holds, its last heartbeat `minutesAgo` by Postgres's clock. */
    const leaseBeatAgo = (minutesAgo: number) =>
      db.query(
        `UPDATE vector_index SET state = 'reembedding', target_model = $1, target_dimensions = $2,
           reembed_id = 'other-run', reembed_started_at = now() - interval '1 hour',
           updated_at = now() - make_interval(mins => $3)`,
        [embedder.model, embedder.dimensions, minutesAgo],
      );
    const withClock = async <T>(ms: number, fn: () => Promise<T>): Promise<T> => {
      const undo = shiftClock(ms);
      try {
        return await fn();
      } finally {
        undo();
      }
    };

    // Alive (a beat a minute ago), seen from a clock an hour ahead: it still refuses.
    await leaseBeatAgo(1);
    await assert.rejects(
      withClock(HOUR, () => reembed(db, svc.config, embedder)),
      (err) => err instanceof ReembedBusyError && /another reembed .* is running/.test(err.message),
    );
    assert.deepEqual(
      await index(),
      { state: 'reembedding', reembed_id: 'other-run' },
      'the live run keeps its lease',
    );

    // Dead (no beat for 20 minutes), seen from a clock an hour behind: it takes over and finishes.
    await leaseBeatAgo(20);
    const result = await withClock(-HOUR, () => reembed(db, svc.config, embedder));
    assert.equal(result.status, 'rebuilt');
    assert.deepEqual(await index(), { state: 'ready', reembed_id: null });
  });

  void test('a key revoked in another process stops working here within 5 s, also after the wall clock steps back', async () => {
    const t = await svc.newTenant();
    // The wall clock as the authenticator would read it, stepping back an hour below.
    const realNow = Date.now;
    let offset = 0;
    Date.now = () => realNow() + offset;
    let keys;
    try {
      keys = makeKeyAuthenticator(svc.deps.db);
    } finally {
      Date.now = realNow;
    }
    assert.equal((await keys.authenticate(t.apiKey))?.tenantId, t.tenantId, 'good, and now cached');
    offset = -HOUR;
    // Revoked by another process: straight in the database, this cache not told.
    await svc.deps.db.query('UPDATE api_keys SET revoked_at = now() WHERE tenant_id = $1', [t.tenantId]);
    await new Promise((resolve) => setTimeout(resolve, KEY_CACHE_MS + 500));
    assert.equal(await keys.authenticate(t.apiKey), null, `still accepted ${KEY_CACHE_MS + 500} ms after`);
  });

  void test('?wait=true answers its 202 after 10 s when the wall clock steps back an hour during the wait', async () => {
    const t = await apiOnly.newTenant();
    const s = sid('step-wait');
    const { polled, restore } = firstPoll(
      apiOnly.deps.redis,
      inboxKeys(apiOnly.config.prefix, t.tenantId, s).sess,
    );
    let undo: (() => void) | null = null;
    const started = performance.now();
    try {
      const answer = fetch(`${apiOnly.base}/v1/sessions/${s}/messages?wait=true`, {
        method: 'POST',
        headers: { authorization: `Bearer ${t.apiKey}`, 'content-type': 'application/json' },
        body: JSON.stringify({ messages: [user('wait for me')] }),
        // Far past the documented 10 s: the old deadline waited for the hour to come back.
        signal: AbortSignal.timeout(15_000),
      });
      await polled;
      undo = shiftClock(-HOUR);
      const r = await answer;
      const elapsed = performance.now() - started;
      assert.equal(r.status, 202);
      assert.equal(((await r.json()) as { accepted: number }).accepted, 1);
      assert.ok(elapsed >= 9_000 && elapsed < 12_000, `answered after ${Math.round(elapsed)} ms`);
    } finally {
      undo?.();
      restore();
    }
  });

  void test('a context min_seq wait ends after 5 s when the wall clock steps back an hour during it', async () => {
    const t = await apiOnly.newTenant();
    const s = sid('step-ctx');
    assert.equal(
      (await t.api.post(`/v1/sessions/${s}/messages`, { messages: [user('not archived')] })).status,
      202,
    );
    const { polled, restore } = firstPoll(
      apiOnly.deps.redis,
      inboxKeys(apiOnly.config.prefix, t.tenantId, s).sess,
    );
    let undo: (() => void) | null = null;
    const started = performance.now();
    try {
      const answer = fetch(`${apiOnly.base}/v1/sessions/${s}/context`, {
        method: 'POST',
        headers: { authorization: `Bearer ${t.apiKey}`, 'content-type': 'application/json' },
        body: JSON.stringify({ min_seq: 1 }),
        signal: AbortSignal.timeout(10_000),
      });
      await polled;
      undo = shiftClock(-HOUR);
      const r = await answer;
      const elapsed = performance.now() - started;
      assert.equal(r.status, 200);
      assert.equal(r.headers.get('x-mnemos-min-seq'), 'timeout');
      assert.ok(elapsed >= 4_500 && elapsed < 7_000, `answered after ${Math.round(elapsed)} ms`);
    } finally {
      undo?.();
      restore();
    }
  });

  void test("the fair-queue count decays by Redis's clock, whatever the clock of the process counting", async () => {
    const prefix = `${svc.config.prefix}-fairclock`;
    const redis = svc.deps.redis;
    try {
      // Two tenants at the same count, last counted a minute ago by Redis's clock; one counted by
      // a process 10 minutes ahead, the other by one 10 minutes behind.
      const values: number[] = [];
      for (const [tenant, skew] of [
        ['ahead', 10 * 60_000],
        ['behind', -10 * 60_000],
      ] as const) {
        const key = fairKey(prefix, 'flush', tenant);
        await redis.hset(key, 'v', 100, 't', (await redisMs(redis)) - 60_000, 'b', 11);
        const undo = shiftClock(skew);
        try {
          await nextFairPriority(redis, prefix, 'flush', tenant);
        } finally {
          undo();
        }
        values.push(Number(await redis.hget(key, 'v')));
        const stamped = Number(await redis.hget(key, 't'));
        assert.ok(Math.abs(stamped - (await redisMs(redis))) < 5_000, `${tenant}: stamped with Redis's time`);
      }
      // Decayed by e over the minute, plus this job: about 37.8 for both (the process clocks gave
      // 1.0 and 101).
      for (const v of values) assert.ok(Math.abs(v - (100 / Math.E + 1)) < 0.2, `count ${v}`);

      // The accept step counts a flush the same way.
      const t = await apiOnly.newTenant();
      const undo = shiftClock(10 * 60_000);
      try {
        assert.equal(
          (await t.api.post(`/v1/sessions/${sid('fair')}/messages`, { messages: [user('x')] })).status,
          202,
        );
      } finally {
        undo();
      }
      const stamped = Number(
        await apiOnly.deps.redis.hget(fairKey(apiOnly.config.prefix, 'flush', t.tenantId), 't'),
      );
      assert.ok(
        Math.abs(stamped - (await redisMs(apiOnly.deps.redis))) < 5_000,
        "accept: stamped with Redis's time",
      );
    } finally {
      await deleteRedisPrefix(prefix);
    }
  });

  void describe('per-key rate limit', () => {
    const budget = 5;
    let keyId = '';
    /** An API process's limiter on the shared Redis, with its own clock. */
    const limiter = (clock: () => number) => {
      const app = express();
      app.use((_req, res, next) => {
        res.locals.keyId = keyId;
        next();
      });
      const deps = { ...svc.deps, config: { ...svc.config, rateLimitPerMin: budget } };
      app.use(rateLimit(deps, clock));
      app.get('/', (_req, res) => {
        res.json({ ok: true });
      });
      app.use(makeErrorHandler(makeLogger('silent')));
      return new Promise<{ get: () => Promise<number>; close: () => void }>((resolve) => {
        const s = app.listen(0, '127.0.0.1', () => {
          const url = `http://127.0.0.1:${(s.address() as { port: number }).port}`;
          resolve({ get: async () => (await fetch(url)).status, close: () => s.close() });
        });
      });
    };
    /** Redis's count for the key in Redis's current minute. */
    const counted = async () =>
      Number(
        await svc.deps.redis.get(
          `${svc.config.prefix}:rl:${keyId}:${Math.floor((await redisMs(svc.deps.redis)) / 60_000)}`,
        ),
      );
    /** Starts each test well inside one minute of Redis's clock, so that no window turns in it. */
    const freshMinute = async () => {
      keyId = `clock-${randomBytes(4).toString('hex')}`;
      const into = (await redisMs(svc.deps.redis)) % 60_000;
      if (into > 40_000) await new Promise((r) => setTimeout(r, 60_500 - into));
    };

    void test('two processes whose clocks are an hour apart share one budget', async () => {
      await freshMinute();
      const [p1, p2] = await Promise.all([limiter(() => Date.now()), limiter(() => Date.now() + HOUR)]);
      try {
        for (let i = 0; i < budget; i++) assert.equal(await p1.get(), 200);
        assert.equal(await p1.get(), 429);
        await eventually(async () => (await counted()) === budget, 5_000, 'the budget counted in Redis');
        // p2 has heard nothing yet: its first request passes (README) and brings back the total.
        let passed = 0;
        for (let i = 0; i < budget; i++) {
          if ((await p2.get()) === 200) passed++;
          // Read on the limiter's Redis connection: once the count shows, its answer has landed.
          await eventually(
            async () => (await counted()) === budget + passed,
            5_000,
            "p2's requests counted in the window p1 spent",
          );
        }
        assert.equal(passed, 1, 'the budget spent through the other process counts here');
      } finally {
        p1.close();
        p2.close();
      }
    });

    void test('a process whose clock steps back an hour keeps its spent budget', async () => {
      await freshMinute();
      let skew = 0;
      const p = await limiter(() => Date.now() + skew);
      try {
        for (let i = 0; i < budget; i++) assert.equal(await p.get(), 200);
        await eventually(async () => (await counted()) === budget, 5_000, 'the budget counted in Redis');
        skew = -HOUR;
        assert.equal(await p.get(), 429);
        assert.equal(await p.get(), 429);
      } finally {
        p.close();
      }
    });
  });
});
