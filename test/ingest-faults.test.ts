import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { afterEach, describe, test } from 'node:test';
import { Redis } from 'ioredis';
import { pino } from 'pino';
import { migrate } from '../db/migrate.js';
import { makePgDb } from '../db/pool.js';
import { deleteSessionMessages, markSessionCleared } from '../db/queries/lifecycle.js';
import { acceptMessages, confirmArchived } from '../services/messages/accept-messages.js';
import { defineInboxScripts, inboxKeys, readInbox } from '../services/messages/inbox.js';
import { parseMessages } from '../services/messages/message-input.js';
import { createTenant } from '../services/tenants.js';
import { DRAIN_BATCH, DRAIN_MAX_BYTES, drainSession } from '../workers/ingest.js';
import { runIngestSweep } from '../workers/ingest-sweep.js';
import {
  ADMIN_TOKEN,
  REDIS_URL,
  api,
  createTestDatabase,
  deleteRedisPrefix,
  dropTestDatabase,
  eventually,
  spawnService,
  startTestService,
  testPrefix,
} from './support/harness.js';
import type { Api, ChildService, Res, TestService } from './support/harness.js';
import { startPrivatePostgres } from './support/private-postgres.js';
import { startPrivateRedis } from './support/private-redis.js';
import { startTcpProxy } from './support/tcp-proxy.js';

const user = (content: string, extra: Record<string, unknown> = {}) => ({ role: 'user', content, ...extra });

async function allMessages(
  t: Api,
  sid: string,
): Promise<Array<{ seq: number; id: string; content: string }>> {
  const out: Array<{ seq: number; id: string; content: string }> = [];
  let afterSeq = 0;
  for (;;) {
    const r: { status: number; body: any } = await t.get(
      `/v1/sessions/${sid}/messages?limit=500&after_seq=${afterSeq}`,
    );
    if (r.status !== 200) return out;
    out.push(...r.body.messages);
    if (r.body.next === null) return out;
    afterSeq = r.body.next;
  }
}

/** Until the session lists exactly `n` messages (within `timeoutMs`); returns them. */
const archivedExactly = (t: Api, sid: string, n: number, timeoutMs: number, what?: string) =>
  eventually(
    async () => {
      const m = await allMessages(t, sid);
      return m.length === n ? m : null;
    },
    timeoutMs,
    what,
  );

void describe('ingestion under faults and many processes', () => {
  // Each test's services, private instances and databases go when it ends: kept to the end of
  // the file, the services' connection pools together passed Postgres's max_connections.
  const cleanups: Array<() => Promise<void>> = [];
  afterEach(async () => {
    for (const c of cleanups.splice(0).reverse()) await c().catch(() => undefined);
  });

  /** A service on a Redis of the test's own, which the test may stop, flush or edit. */
  async function onPrivateRedis() {
    const redis = await startPrivateRedis();
    const prefix = testPrefix();
    const svc = await startTestService({ env: { REDIS_URL: redis.url }, prefix });
    cleanups.push(async () => {
      await svc.stop();
      await redis.stop();
    });
    return { redis, prefix, svc };
  }

  /**
   * Holds `LOCK TABLE messages IN EXCLUSIVE MODE` on a connection of its own (a slow commit, as
   * testers staged it): `locked` once it is held; `drainBlocked()` waits until a drain's INSERT
   * (archiveBatch's statement) waits on it; `release()` ends it.
   */
  async function holdMessagesLock(databaseUrl: string) {
    const pg = makePgDb({ connectionString: databaseUrl, max: 2 });
    cleanups.push(() => pg.close());
    let release!: () => void;
    const held = new Promise<void>((r) => (release = r));
    let locked!: () => void;
    const isLocked = new Promise<void>((r) => (locked = r));
    const locking = pg.transaction(async (tx) => {
      await tx.query('LOCK TABLE messages IN EXCLUSIVE MODE');
      locked();
      await held;
    });
    const drainBlocked = () =>
      eventually(
        async () => {
          // This database's drain: pg_stat_activity is cluster-wide, and another file's drains
          // wait on locks of their own.
          const r = await pg.query<{ n: number }>(
            `SELECT count(*)::int AS n FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query ILIKE 'WITH ins AS (INSERT INTO messages%'`,
          );
          return r.rows[0]!.n > 0 ? true : null;
        },
        20_000,
        'a drain waits on its INSERT',
      );
    return {
      locked: isLocked,
      drainBlocked,
      release: async () => {
        release();
        await locking;
      },
    };
  }

  void test('2 API and 2 worker processes, 4 clients, a worker SIGKILLed mid-drain: all archived once, in order, no gap ever visible', async () => {
    const dbUrl = await createTestDatabase();
    const prefix = testPrefix();
    cleanups.push(
      () => dropTestDatabase(dbUrl),
      () => deleteRedisPrefix(prefix),
    );
    const env = { DATABASE_URL: dbUrl, MNEMOS_PREFIX: prefix, REDIS_URL, WORKER_CONCURRENCY: '4' };
    const db = makePgDb({ connectionString: dbUrl, max: 2 });
    cleanups.push(() => db.close());
    const { api_key: key } = await createTenant(db, 'multi');

    const children: ChildService[] = [];
    cleanups.push(async () => {
      await Promise.all(children.map((c) => c.stop()));
    });
    const [api1, api2, w1, w2] = await Promise.all([
      spawnService('api', env),
      spawnService('api', env),
      spawnService('worker', env),
      spawnService('worker', env),
    ]);
    children.push(api1, api2, w1, w2);
    const apis = [api(api1.url!, key), api(api2.url!, key)];
    const sid = 'shared';

    let stop = false;
    const violations: string[] = [];
    let maxSeen = 0;
    const reader = (async () => {
      while (!stop) {
        for (const a of apis) {
          const r = await a.get(`/v1/sessions/${sid}/messages?limit=500&order=desc`);
          if (r.status !== 200 || r.body.messages.length === 0) continue;
          // The newest message visible must have every earlier seq visible too: check the top page.
          const seqs = (r.body.messages as Array<{ seq: number }>).map((m) => m.seq).reverse();
          const top = seqs[seqs.length - 1]!;
          maxSeen = Math.max(maxSeen, top);
          for (let i = 1; i < seqs.length; i++) {
            if (seqs[i] !== seqs[i - 1]! + 1) violations.push(`gap between ${seqs[i - 1]} and ${seqs[i]}`);
          }
          if (seqs.length < 500 && seqs[0] !== 1) violations.push(`prefix starts at ${seqs[0]}`);
        }
      }
    })();

    const BATCHES = 30;
    const SIZE = 20;
    let killed = false;
    const clients = Array.from({ length: 4 }, (_, c) =>
      (async () => {
        const seqs: number[][] = [];
        for (let b = 0; b < BATCHES; b++) {
          const r = await apis[c % 2]!.post(`/v1/sessions/${sid}/messages`, {
            messages: Array.from({ length: SIZE }, (_, i) =>
              user(`c${c} b${b} m${i}`, { id: `c${c}-b${b}-m${i}` }),
            ),
          });
          assert.equal(r.status, 202, JSON.stringify(r.body));
          seqs.push(r.body.messages.map((m: { seq: number }) => m.seq));
          if (c === 0 && b === 10 && !killed) {
            killed = true;
            await w1.kill();
          }
        }
        return seqs;
      })(),
    );
    const batches = (await Promise.all(clients)).flat();
    const total = 4 * BATCHES * SIZE;
    const rows = await eventually(
      async () => {
        const r = await allMessages(apis[0]!, sid);
        return r.length >= total ? r : null;
      },
      60_000,
      'all messages archived after the SIGKILL',
    );
    stop = true;
    await reader;

    assert.ok(killed, 'killed');
    assert.deepEqual(violations.slice(0, 5), []);
    assert.ok(maxSeen > 0, 'maxSeen > 0');
    assert.equal(rows.length, total, 'archived exactly once');
    assert.equal(new Set(rows.map((r) => r.id)).size, total);
    assert.deepEqual(
      rows.map((r) => r.seq),
      Array.from({ length: total }, (_, i) => i + 1),
      'seq strictly increasing without gaps',
    );
    const bySeq = new Map(rows.map((r) => [r.seq, r.id]));
    for (const b of batches) {
      for (let i = 1; i < b.length; i++)
        assert.equal(b[i], b[i - 1]! + 1, 'each request got a contiguous range');
      const ids = b.map((s) => bySeq.get(s)!);
      const base = ids[0]!.replace(/-m0$/, '');
      assert.deepEqual(
        ids,
        b.map((_, i) => `${base}-m${i}`),
        'in request order',
      );
    }
  });

  void test('Redis coming back empty: counters re-seed from Postgres, seq keeps increasing, ids stay idempotent', async () => {
    const { redis, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    const first = await t.api.post('/v1/sessions/s/messages?wait=true', {
      messages: Array.from({ length: 10 }, (_, i) => user(`before ${i}`, { id: `b${i}` })),
    });
    assert.equal(first.status, 201);

    const admin = new Redis(redis.url);
    await admin.flushall();
    admin.disconnect();

    const second = await t.api.post('/v1/sessions/s/messages?wait=true', {
      messages: Array.from({ length: 5 }, (_, i) => user(`after ${i}`, { id: `a${i}` })),
    });
    assert.equal(second.status, 201);
    assert.deepEqual(
      second.body.messages.map((m: { seq: number }) => m.seq),
      [11, 12, 13, 14, 15],
    );
    const replay = await t.api.post('/v1/sessions/s/messages', {
      messages: [user('before 3', { id: 'b3' })],
    });
    assert.deepEqual(replay.body.messages, [{ id: 'b3', seq: 4 }]);
    assert.equal(replay.body.accepted, 0);
    const rows = await allMessages(t.api, 's');
    assert.deepEqual(
      rows.map((r) => r.seq),
      Array.from({ length: 15 }, (_, i) => i + 1),
    );

    // A restart (kill + start: this Redis keeps nothing) behaves the same, workers reconnect.
    await redis.kill();
    await redis.start();
    const third = await eventually(
      async () => {
        const r = await t.api.post('/v1/sessions/s/messages?wait=true', {
          messages: [user('after restart', { id: 'r1' })],
        });
        return r.status === 201 ? r : null;
      },
      30_000,
      'write after Redis restart',
    );
    assert.deepEqual(third.body.messages, [{ id: 'r1', seq: 16 }]);
  });

  void test('after Redis lost its state, a ?wait=true re-post of archived ids is a 201 at once', async () => {
    const { redis, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    const batch = { messages: [user('kept', { id: 'k1' }), user('kept too', { id: 'k2' })] };
    assert.equal((await t.api.post('/v1/sessions/s/messages?wait=true', batch)).status, 201);
    const admin = new Redis(redis.url);
    await admin.flushall();
    admin.disconnect();
    // The README's recovery step: post again with the same ids. Nothing reaches the inbox (both are
    // archived), so no archived mark ever would: it waited 10 s for a 202.
    const started = Date.now();
    const again = await t.api.post('/v1/sessions/s/messages?wait=true', batch);
    assert.equal(again.status, 201, JSON.stringify(again.body));
    assert.deepEqual(again.body, {
      session_id: 's',
      accepted: 0,
      messages: [
        { id: 'k1', seq: 1 },
        { id: 'k2', seq: 2 },
      ],
    });
    assert.ok(Date.now() - started < 5_000, 'answered without waiting for a mark');
  });

  void test('Redis back behind Postgres (an AOF that lost its last second): new messages get seqs after the archive', async () => {
    const { redis, prefix, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    const post = (body: unknown) => t.api.post('/v1/sessions/s/messages?wait=true', body);
    const first = await post({ messages: [1, 2, 3, 4, 5].map((n) => user(`a${n}`, { id: `a${n}` })) });
    assert.equal(first.status, 201);
    // The session's Redis state as it was after a2: the writes of a3–a5 were in the lost second,
    // their archive rows were not.
    const admin = new Redis(redis.url);
    await admin.hset(inboxKeys(prefix, t.tenantId, 's').sess, 'seq', 2, 'archived', 2);
    admin.disconnect();
    // Before, these got seqs 3 and 4: the drain skipped them as replays of a3 and a4, the 202s
    // were lost, and the ?wait=true answered 503 "lost" to every re-post.
    const withId = await post({ messages: [user('c1', { id: 'c1' })] });
    assert.equal(withId.status, 201, JSON.stringify(withId.body));
    assert.deepEqual(withId.body.messages, [{ id: 'c1', seq: 6 }]);
    const withoutId = await post({ messages: [user('no id')] });
    assert.equal(withoutId.status, 201, JSON.stringify(withoutId.body));
    assert.equal(withoutId.body.messages[0].seq, 7);
    assert.deepEqual(
      (await allMessages(t.api, 's')).map((m) => `${m.seq}:${m.content}`),
      ['1:a1', '2:a2', '3:a3', '4:a4', '5:a5', '6:c1', '7:no id'],
    );
  });

  void test('Redis back behind a drain that waits on Postgres: the drain rolls back, the new message takes the seq', async () => {
    const { redis, prefix, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    const post = (path: string, body: unknown) => t.api.post(`/v1/sessions/s/messages${path}`, body);
    assert.equal((await post('?wait=true', { messages: [user('m1', { id: 'm1' })] })).status, 201);
    // A slow commit, as the tester staged it: the drain reads A, then waits on its INSERT.
    const lock = await holdMessagesLock(svc.config.databaseUrl!);
    try {
      // Posted before the lock, A could be archived at once, and no drain would wait.
      await lock.locked;
      const a = await post('', { messages: [user('A', { id: 'A' })] });
      assert.deepEqual(a.body.messages, [{ id: 'A', seq: 2 }]);
      await lock.drainBlocked();
      // Redis comes back without its last second: A's entry, its id and its seq are gone.
      const admin = new Redis(redis.url);
      const keys = inboxKeys(prefix, t.tenantId, 's');
      await admin.del(keys.inbox);
      await admin.hdel(keys.ids, 'A');
      await admin.hset(keys.sess, 'seq', 1, 'archived', 1);
      admin.disconnect();
      const b = await post('', { messages: [user('B', { id: 'B' })] });
      assert.deepEqual(b.body.messages, [{ id: 'B', seq: 2 }]);
    } finally {
      await lock.release();
    }
    // Before, the drain committed A at seq 2 and then skipped B as a replay of it: B, accepted
    // after Redis came back, was lost without a trace. A was in the lost second.
    await eventually(
      async () => {
        const all = (await allMessages(t.api, 's')).map((m) => `${m.seq}:${m.id}`);
        return all.length === 2 ? all : null;
      },
      20_000,
      'both archived',
    );
    assert.deepEqual(
      (await allMessages(t.api, 's')).map((m) => `${m.seq}:${m.id}`),
      ['1:m1', '2:B'],
    );
    const again = await post('?wait=true', { messages: [user('B', { id: 'B' })] });
    assert.equal(again.status, 201);
    const metrics = await fetch(`${svc.base}/metrics`).then((r) => r.text());
    assert.match(metrics, /mnemos_ingest_inbox_moved_total [1-9]/);
  });

  void test('a drain that read replays another drain trims before its check commits: no rollback, no alarm', async () => {
    // An api process: the test runs the drains itself, in the order that raced in a rolling
    // deploy (drain B locked the session as soon as A committed, read the inbox before A's trim,
    // and A's trim then came before B's check).
    const prefix = testPrefix();
    const svc = await startTestService({ mode: 'api', prefix });
    cleanups.push(async () => {
      await svc.stop();
      await deleteRedisPrefix(prefix);
    });
    const t = await svc.newTenant();
    const post = (ids: string[]) =>
      t.api.post('/v1/sessions/s/messages', { messages: ids.map((id) => user(id, { id })) });
    // More replays than a check could name one by one (a re-tester's runs read up to 90).
    const as = Array.from({ length: 90 }, (_, i) => `a${i + 1}`);
    assert.equal((await post(as)).status, 202);
    const keys = inboxKeys(prefix, t.tenantId, 's');
    const real = svc.deps.redis as unknown as Record<string, (...a: unknown[]) => Promise<unknown>>;
    const withRedis = (overrides: Record<string, (...a: unknown[]) => Promise<unknown>>) =>
      new Proxy(svc.deps.redis, {
        get(target, prop, receiver) {
          if (typeof prop === 'string' && prop in overrides) return overrides[prop];
          const v = Reflect.get(target, prop, receiver) as unknown;
          return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
        },
      });
    // Drain A archives a1–a90 and has not trimmed them yet.
    let trimA!: () => Promise<unknown>;
    const drainA = await drainSession(
      {
        ...svc.deps,
        redis: withRedis({
          mnemosFinish: (...args) => ((trimA = () => real.mnemosFinish!(...args)), Promise.resolve([0, 90])),
        }),
      },
      t.tenantId,
      's',
    );
    assert.equal(drainA.archived, 90);
    assert.equal(await svc.deps.redis.llen(keys.inbox), 90, 'not trimmed yet');
    assert.equal((await post(['b1', 'b2'])).status, 202);
    // Drain B reads a1–a90 (replays) and b1–b2; A's trim lands before B's check.
    const movedBefore = (await svc.deps.metrics.ingestInboxMoved.get()).values[0]?.value ?? 0;
    let checks = 0;
    const drainB = await drainSession(
      {
        ...svc.deps,
        redis: withRedis({
          mnemosCheck: async (...args) => {
            if (checks++ === 0) await trimA();
            return real.mnemosCheck!(...args);
          },
        }),
      },
      t.tenantId,
      's',
    );
    assert.equal(drainB.archived, 2);
    assert.equal(checks, 1, 'committed on its first read: no rollback');
    assert.equal((await svc.deps.metrics.ingestInboxMoved.get()).values[0]?.value ?? 0, movedBefore);
    assert.equal(await svc.deps.redis.llen(keys.inbox), 0);
    assert.deepEqual(
      (await allMessages(t.api, 's')).map((m) => `${m.seq}:${m.id}`),
      [...as.map((id, i) => `${i + 1}:${id}`), '91:b1', '92:b2'],
    );
    // The session counts what it archived: the 90 replays drain B read are not counted again.
    assert.equal((await t.api.get('/v1/sessions/s')).body.message_count, 92);
  });

  void test('a drain that stalls past the idle-transaction timeout while another drains its messages: no alarm of Redis going back', async () => {
    const prefix = testPrefix();
    const svc = await startTestService({
      mode: 'api',
      prefix,
      env: { PG_IDLE_IN_TRANSACTION_TIMEOUT_MS: '1000' },
    });
    cleanups.push(async () => {
      await svc.stop();
      await deleteRedisPrefix(prefix);
    });
    const t = await svc.newTenant();
    assert.equal(
      (await t.api.post('/v1/sessions/s/messages', { messages: ['a1', 'a2'].map((id) => user(id, { id })) }))
        .status,
      202,
    );
    const real = svc.deps.redis as unknown as Record<string, (...a: unknown[]) => Promise<unknown>>;
    const stalling = new Proxy(svc.deps.redis, {
      get(target, prop, receiver) {
        if (prop === 'mnemosCheck') {
          // Drain A has read a1-a2 and written them in its transaction, then stalls before its
          // check: Postgres ends its idle transaction, and drain B archives and trims a1-a2.
          return async (...args: unknown[]) => {
            if (!drainB) drainB = drainSession(svc.deps, t.tenantId, 's');
            await drainB;
            return real.mnemosCheck!(...args);
          };
        }
        const v = Reflect.get(target, prop, receiver) as unknown;
        return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
      },
    });
    let drainB: Promise<unknown> | undefined;
    const movedBefore = (await svc.deps.metrics.ingestInboxMoved.get()).values[0]?.value ?? 0;
    const drainA = await drainSession({ ...svc.deps, redis: stalling }, t.tenantId, 's').catch(
      (err: Error) => err,
    );
    assert.ok(drainB, 'drain A reached its check');
    assert.equal(((await drainB) as { archived: number }).archived, 2);
    // Drain A ends either way (its connection was closed under it, or it read the inbox again).
    assert.ok(drainA instanceof Error || drainA.archived === 0, JSON.stringify(drainA));
    assert.equal((await svc.deps.metrics.ingestInboxMoved.get()).values[0]?.value ?? 0, movedBefore);
    assert.deepEqual(
      (await allMessages(t.api, 's')).map((m) => `${m.seq}:${m.id}`),
      ['1:a1', '2:a2'],
    );
  });

  void test('Redis back from before a reset or delete: re-posted ids of the cleared history are new messages', async () => {
    const { redis, prefix, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    const admin = new Redis(redis.url);
    cleanups.push(async () => void admin.disconnect());
    for (const op of ['reset', 'delete'] as const) {
      const s = `lost-${op}`;
      const keys = inboxKeys(prefix, t.tenantId, s);
      const batch = { messages: [1, 2, 3].map((n) => user(`a${n}`, { id: `a${n}` })) };
      assert.equal((await t.api.post(`/v1/sessions/${s}/messages?wait=true`, batch)).status, 201);
      const before = { sess: await admin.hgetall(keys.sess), ids: await admin.hgetall(keys.ids) };
      const done =
        op === 'reset' ? await t.api.post(`/v1/sessions/${s}/reset`) : await t.api.del(`/v1/sessions/${s}`);
      assert.ok(done.status < 300, `${op}: ${done.status}`);
      // The second after the archive's commit, its reset or delete included, is lost to Redis.
      await admin.del(keys.sess, keys.ids);
      await admin.hset(keys.sess, before.sess);
      await admin.hset(keys.ids, before.ids);
      // Before, the re-post was a "duplicate" of the cleared a1 (202 at seq 1, never archived; a
      // ?wait=true answered 409 session_cleared), and after a delete the session stayed gone.
      const again = await t.api.post(`/v1/sessions/${s}/messages?wait=true`, batch);
      assert.equal(again.status, 201, `${op}: ${JSON.stringify(again.body)}`);
      assert.deepEqual(
        again.body.messages.map((m: { seq: number }) => m.seq),
        [4, 5, 6],
        op,
      );
      assert.deepEqual(
        (await allMessages(t.api, s)).map((m) => `${m.seq}:${m.id}`),
        ['4:a1', '5:a2', '6:a3'],
        op,
      );
      assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 200, op);
    }
  });

  void test('a reset or delete whose Redis step Redis does not answer after the commit is a 200/204: it happened, and the session works at once', async () => {
    const { redis, prefix, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    const generations = async (s: string) =>
      (
        await svc.deps.db.query<{ generation: number; redis_generation: number }>(
          'SELECT generation, redis_generation FROM sessions WHERE tenant_id = $1 AND id = $2',
          [t.tenantId, s],
        )
      ).rows[0]!;
    for (const op of ['reset', 'delete'] as const) {
      const s = `stalled-${op}`;
      const batch = { messages: [1, 2, 3].map((n) => user(`a${n}`, { id: `a${n}` })) };
      assert.equal((await t.api.post(`/v1/sessions/${s}/messages?wait=true`, batch)).status, 201);
      // Redis stalls once the clear's transaction has read it and before it commits. (Only this
      // database's statements: another test file's DELETE waiting on a lock paused Redis before
      // the clear had read it, and the clear answered a true 503 before anything was done.)
      const lock = await holdMessagesLock(svc.config.databaseUrl!);
      await lock.locked;
      const answer = op === 'reset' ? t.api.post(`/v1/sessions/${s}/reset`) : t.api.del(`/v1/sessions/${s}`);
      await eventually(
        async () =>
          (
            await svc.deps.db.query<{ n: number }>(
              `SELECT count(*)::int AS n FROM pg_stat_activity
               WHERE datname = current_database() AND wait_event_type = 'Lock'
                 AND query ILIKE 'DELETE FROM messages%'`,
            )
          ).rows[0]!.n > 0,
        20_000,
        `the ${op} waits on its DELETE`,
      );
      redis.pause();
      let done: Res;
      try {
        await lock.release();
        done = await answer;
      } finally {
        redis.resume();
      }
      // Before, a 503 "redis is unavailable, retry later" for a clear that had been done: its
      // retry wiped what was posted meanwhile (reset) or answered 404 (delete).
      assert.equal(done.status, op === 'reset' ? 200 : 204, `${op}: ${done.text}`);
      const gone = await t.api.get(`/v1/sessions/${s}`);
      if (op === 'reset') assert.equal(gone.body.message_count, 0, op);
      else assert.equal(gone.status, 404, op);
      // The cleared ids are new messages, and the session goes on after the cleared history
      // (503s while the stalled Redis connection is replaced: retried, as they say).
      await eventually(
        async () => {
          const again = await t.api.post(`/v1/sessions/${s}/messages?wait=true`, batch);
          if (again.status !== 503) assert.equal(again.status, 201, `${op}: ${again.text}`);
          return again.status === 201;
        },
        20_000,
        `${op}: the re-post`,
      );
      assert.deepEqual(
        (await allMessages(t.api, s)).map((m) => `${m.seq}:${m.id}`),
        ['4:a1', '5:a2', '6:a3'],
        op,
      );
      assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 200, op);
      const g = await eventually(
        async () => {
          const r = await generations(s);
          return r.redis_generation === r.generation ? r : null;
        },
        15_000,
        `the ${op}'s Redis step recorded`,
      );
      assert.equal(g.generation, 2, op);
      assert.equal(await svc.deps.redis.hget(inboxKeys(prefix, t.tenantId, s).sess, 'gen'), '2', op);
    }
  });

  void test('a reset or delete whose Redis step has not run yet (the process died after the commit): a re-post of a cleared id is a new message', async () => {
    const { prefix, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    for (const op of ['reset', 'delete'] as const) {
      const s = `pending-${op}`;
      const batch = { messages: [1, 2, 3].map((n) => user(`a${n}`, { id: `a${n}` })) };
      assert.equal((await t.api.post(`/v1/sessions/${s}/messages?wait=true`, batch)).status, 201);
      // The clear's transaction, committed; its Redis step (and the reconciler's, a minute away)
      // has not run: Redis still holds generation 1 and the cleared ids.
      await deleteSessionMessages(svc.deps.db, t.tenantId, s);
      await markSessionCleared(svc.deps.db, {
        tenantId: t.tenantId,
        sessionId: s,
        generation: 2,
        deleted: op === 'delete',
        clearedThroughSeq: 3,
      });
      // Before, a1 was a "duplicate" of the cleared seq 1 (a ?wait=true answered 409
      // session_cleared, a plain post 202 for a message never stored), and a deleted session
      // stayed gone until a drain.
      const again = await t.api.post(`/v1/sessions/${s}/messages?wait=true`, batch);
      assert.equal(again.status, 201, `${op}: ${again.text}`);
      assert.deepEqual(
        again.body.messages.map((m: { seq: number }) => m.seq),
        [4, 5, 6],
        op,
      );
      assert.deepEqual(
        (await allMessages(t.api, s)).map((m) => `${m.seq}:${m.id}`),
        ['4:a1', '5:a2', '6:a3'],
        op,
      );
      assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 200, op);
      assert.equal(await svc.deps.redis.hget(inboxKeys(prefix, t.tenantId, s).sess, 'gen'), '2', op);
    }
  });

  void test('an import into a reset session whose Redis state is behind Postgres is numbered after the archive', async () => {
    const { redis, prefix, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    const first = await t.api.post('/v1/sessions/imp/messages?wait=true', {
      messages: [1, 2, 3].map((n) => user(`a${n}`, { id: `a${n}` })),
    });
    assert.equal(first.status, 201);
    assert.equal((await t.api.post('/v1/sessions/imp/reset')).status, 200);
    // Empty again (an import needs that), its counter in Postgres past 3; Redis lost that.
    const admin = new Redis(redis.url);
    await admin.hset(inboxKeys(prefix, t.tenantId, 'imp').sess, 'seq', 1, 'archived', 1);
    admin.disconnect();
    const imported = await t.api.post('/v1/sessions/imp/import', {
      messages: [
        user('i1', { id: 'i1', sent_at: '2026-01-01T00:00:00Z' }),
        user('i2', { id: 'i2', sent_at: '2026-01-01T00:00:01Z' }),
      ],
    });
    assert.equal(imported.status, 201, JSON.stringify(imported.body));
    assert.deepEqual([imported.body.first_seq, imported.body.last_seq], [4, 5]);
    assert.deepEqual(
      (await allMessages(t.api, 'imp')).map((m) => `${m.seq}:${m.id}`),
      ['4:i1', '5:i2'],
    );
  });

  void test('an accept whose answer a connection cut lost is a 503, not run twice; its retry is drained at once', async () => {
    const redis = await startPrivateRedis();
    const { createServer, connect } = await import('node:net');
    // A proxy in front of Redis that, once armed, lets the command carrying MARKER reach Redis,
    // drops its answer, cuts the connection and refuses new ones for a second.
    const MARKER = 'drop-this-answer';
    let armed = false;
    let refuseUntil = 0;
    const proxy = createServer((client) => {
      if (Date.now() < refuseUntil) return void client.destroy();
      const upstream = connect(Number(new URL(redis.url).port), '127.0.0.1');
      let doomed = false;
      client.on('data', (d) => {
        if (armed && d.includes(MARKER)) {
          armed = false;
          doomed = true;
        }
        upstream.write(d);
      });
      upstream.on('data', (d) => {
        if (!doomed) return void client.write(d);
        refuseUntil = Date.now() + 1000;
        client.destroy();
        upstream.destroy();
      });
      for (const [a, b] of [
        [client, upstream],
        [upstream, client],
      ] as const) {
        a.on('error', () => b.destroy());
        a.on('close', () => b.destroy());
      }
    });
    await new Promise<void>((resolve) => proxy.listen(0, '127.0.0.1', resolve));
    const port = (proxy.address() as { port: number }).port;
    // The ingest sweeper as in production (a session armed for 60 s), so that only a flush the
    // retry asks for can archive the message within the test.
    const svc = await startTestService({
      env: { REDIS_URL: `redis://127.0.0.1:${port}` },
      prefix: testPrefix(),
      worker: { ingestSweepAfterMs: 60_000 },
    });
    cleanups.push(async () => {
      await svc.stop();
      proxy.close();
      await redis.stop();
    });
    const t = await svc.newTenant();
    const warm = await t.api.post('/v1/sessions/cut/messages?wait=true', {
      messages: [user('warm', { id: 'w' })],
    });
    assert.equal(warm.status, 201);
    armed = true;
    const body = { messages: [user(MARKER, { id: 'm1' })] };
    // Before: ioredis sent the script again after reconnecting, and the answer was a 202 that
    // counted the new message as a duplicate of itself (a message without an id was queued twice).
    const cut = await t.api.post('/v1/sessions/cut/messages', body);
    assert.equal(cut.status, 503, JSON.stringify(cut.body));
    assert.equal(armed, false, 'the accept script went through the proxy');
    // The API's connection back once the proxy takes connections again (its reconnects come 200,
    // 600, 1,200 ms after the cut: a fixed 1.2 s pause sent the retry, under load, before the last).
    await eventually(
      async () => svc.deps.redis.status === 'ready',
      10_000,
      "the API's Redis connection back",
    );
    // The client's retry: the message is in the inbox already (the script did run), with no flush
    // asked for (that was in the lost answer). The retry asks for one, so the message is archived
    // now rather than when the ingest sweeper finds the session (30–90 s).
    const retry = await t.api.post('/v1/sessions/cut/messages', body);
    assert.equal(retry.status, 202, JSON.stringify(retry.body));
    assert.deepEqual(retry.body, { session_id: 'cut', accepted: 0, messages: [{ id: 'm1', seq: 2 }] });
    await eventually(
      async () => (await allMessages(t.api, 'cut')).map((m) => `${m.seq}:${m.id}`).join() === '1:w,2:m1',
      10_000,
      'the retried message archived at its seq',
    );
  });

  void test('a ?wait=true whose confirmation Postgres cannot give is a 202, never a 503 claiming nothing was stored', async () => {
    const failing = { query: () => Promise.reject(new Error('Connection terminated unexpectedly')) };
    assert.equal(await confirmArchived({ db: failing as never }, 't', 's', [{ id: 'a', seq: 1 }]), false);
  });

  void test('a ?wait=true whose messages Redis lost is never a 201, though their seqs get archived by others', async () => {
    const redis = await startPrivateRedis();
    const prefix = testPrefix();
    // The API alone first: accepted messages wait in the inbox, as behind a slow worker.
    const api = await startTestService({ mode: 'api', env: { REDIS_URL: redis.url }, prefix });
    let worker: TestService | null = null;
    cleanups.push(async () => {
      await worker?.stop();
      await api.stop();
      await redis.stop();
    });
    const t = await api.newTenant();
    const waiting = t.api.post('/v1/sessions/s/messages?wait=true', {
      messages: [user('lost 0', { id: 'l0' }), user('lost 1', { id: 'l1' })],
    });
    await eventually(
      async () => ((await api.deps.redis.llen(`${prefix}:inbox:${t.tenantId}:s`)) === 2 ? true : null),
      10_000,
      'the waiting request is in the inbox',
    ).catch(() => undefined);
    const admin = new Redis(redis.url);
    await admin.flushall();
    admin.disconnect();
    // Redis came back empty: the counter re-seeds from the archive (empty), so these get seqs 1-3,
    // the seqs the lost messages were acknowledged with.
    const others = await t.api.post('/v1/sessions/s/messages', {
      messages: [user('other 0', { id: 'o0' }), user('other 1', { id: 'o1' }), user('other 2', { id: 'o2' })],
    });
    assert.deepEqual(
      others.body.messages.map((m: { seq: number }) => m.seq),
      [1, 2, 3],
    );
    worker = await startTestService({
      mode: 'worker',
      env: { REDIS_URL: redis.url },
      prefix,
      databaseUrl: api.config.databaseUrl!,
    });
    const r = await waiting;
    assert.equal(r.status, 503, JSON.stringify(r.body));
    assert.equal(r.body.error.details.lost, true);
    assert.ok(r.headers.get('retry-after'), "r.headers.get('retry-after')");
    // Posting them again (same ids) stores them, now durable.
    const again = await t.api.post('/v1/sessions/s/messages?wait=true', {
      messages: [user('lost 0', { id: 'l0' }), user('lost 1', { id: 'l1' })],
    });
    assert.equal(again.status, 201);
    assert.deepEqual(
      (await allMessages(t.api, 's')).map((m) => m.id),
      ['o0', 'o1', 'o2', 'l0', 'l1'],
    );
  });

  void test('a Redis connection that dies without a reset is replaced: 503s stop without a restart', async () => {
    const redis = await startPrivateRedis();
    // Connections open but carrying nothing more (a partition, a VIP moved away): the kernel sends
    // no reset, so only a timeout can tell.
    const proxy = await startTcpProxy(Number(new URL(redis.url).port));
    const port = proxy.port;
    const dbUrl = await createTestDatabase();
    const prefix = testPrefix();
    const db = makePgDb({ connectionString: dbUrl, max: 1 });
    const { api_key: key } = await createTenant(db, 'silent');
    await db.close();
    const child = await spawnService('api', {
      DATABASE_URL: dbUrl,
      MNEMOS_PREFIX: prefix,
      REDIS_URL: `redis://127.0.0.1:${port}`,
    });
    // Killed, not stopped: its queues' connections are among the silent ones.
    cleanups.push(async () => {
      await child.kill();
      await proxy.close();
      await redis.stop();
      await dropTestDatabase(dbUrl);
    });
    const t = { api: api(child.url!, key) };
    const post = () => t.api.post('/v1/sessions/s/messages', { messages: [user('hello')] });
    assert.equal((await post()).status, 202);
    // Every open connection goes silent; new ones work.
    proxy.hole();
    proxy.heal();
    const during = await post();
    assert.equal(during.status, 503, JSON.stringify(during.body));
    assert.ok(during.headers.get('retry-after'), "during.headers.get('retry-after')");
    // Before, every request answered 503 until the process restarted: ioredis kept the connection.
    await eventually(async () => ((await post()).status === 202 ? true : null), 30_000, 'a 202 again');
  });

  void test('Redis stalled past the command timeout: the 503 says the messages may be stored, and they are', async () => {
    const { redis, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    assert.equal(
      (await t.api.post('/v1/sessions/s/messages?wait=true', { messages: [user('one')] })).status,
      201,
    );
    redis.pause();
    let r: Res;
    try {
      r = await t.api.post('/v1/sessions/s/messages', { messages: [user('two')] });
    } finally {
      redis.resume();
    }
    assert.equal(r.status, 503, r.text);
    assert.equal(r.body.error.code, 'unavailable');
    assert.ok(r.headers.get('retry-after'), "r.headers.get('retry-after')");
    // Before, a plain "redis is unavailable": a client without ids retried and stored it twice.
    assert.deepEqual(r.body.error.details, { dependency: 'redis', maybe_stored: true });
    // Redis ran the accept it had queued once it went on.
    const rows = await archivedExactly(t.api, 's', 2, 30_000, 'the stalled accept archived');
    assert.deepEqual(
      rows.map((m) => m.content),
      ['one', 'two'],
    );
  });

  void test('Redis stopped: writes get 503 with retry-after and nothing is half-written', async () => {
    const { redis, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/s/messages?wait=true', { messages: [user('one', { id: 'one' })] });
    await redis.kill();
    for (let i = 0; i < 3; i++) {
      const r = await t.api.post('/v1/sessions/s/messages', { messages: [user('lost?', { id: `x${i}` })] });
      assert.equal(r.status, 503);
      assert.equal(r.body.error.code, 'unavailable');
      assert.ok(r.headers.get('retry-after'), "r.headers.get('retry-after')");
    }
    // Reads that need only Postgres keep working.
    assert.equal((await t.api.get('/v1/sessions/s/messages')).status, 200);
    await redis.start();
    const ok = await eventually(
      async () => {
        const r = await t.api.post('/v1/sessions/s/messages?wait=true', {
          messages: [user('two', { id: 'two' })],
        });
        return r.status === 201 ? r : null;
      },
      30_000,
      'write after Redis is back',
    );
    assert.equal(ok.body.messages[0].seq, 2);
    const rows = await allMessages(t.api, 's');
    assert.deepEqual(
      rows.map((r) => r.id),
      ['one', 'two'],
      'the rejected requests stored nothing',
    );
  });

  void test('a worker process stopped while Redis is down does not wait out the whole grace period', async () => {
    const redis = await startPrivateRedis();
    const dbUrl = await createTestDatabase();
    const prefix = testPrefix();
    const env = {
      DATABASE_URL: dbUrl,
      REDIS_URL: redis.url,
      MNEMOS_PREFIX: prefix,
      SHUTDOWN_TIMEOUT_MS: '15000',
    };
    const worker = await spawnService('worker', env);
    cleanups.push(async () => {
      await worker.kill();
      await redis.stop();
      await dropTestDatabase(dbUrl);
    });
    await redis.kill();
    // Long enough for its connections to notice.
    await new Promise((r) => setTimeout(r, 2000));
    const started = Date.now();
    await worker.stop();
    const took = Date.now() - started;
    // BullMQ's graceful close never ends without Redis: the worker waited all 15 s for it.
    assert.ok(took < 8000, `the worker took ${took} ms to exit`);
    assert.equal(worker.child.exitCode, 0);
  });

  void test('erasing a tenant while Redis is down is a 503 with retry-after, and the retry erases it', async () => {
    const { redis, svc } = await onPrivateRedis();
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/s/messages?wait=true', { messages: [user('one')] });
    const admin = api(svc.base, ADMIN_TOKEN);
    await redis.kill();
    const down = await admin.del(`/v1/admin/tenants/${t.tenantId}`);
    assert.equal(down.status, 503, down.text);
    assert.equal(down.body.error.code, 'unavailable');
    assert.ok(down.headers.get('retry-after'), "down.headers.get('retry-after')");
    await redis.start();
    await eventually(
      async () => (await admin.del(`/v1/admin/tenants/${t.tenantId}`)).status === 204,
      30_000,
      'the retried erasure',
    );
    const left = await svc.deps.db.query<{ n: number }>(
      'SELECT count(*)::int AS n FROM messages WHERE tenant_id = $1',
      [t.tenantId],
    );
    assert.equal(left.rows[0]!.n, 0);
  });

  void test('Postgres stopped and started again: 503s meanwhile, the process stays up, every accepted message archived once', async () => {
    const pg = await startPrivatePostgres();
    cleanups.push(() => pg.destroy());
    const admin = makePgDb({ connectionString: pg.adminUrl, max: 1 });
    await admin.query('CREATE DATABASE mnemos');
    await admin.close();
    const url = pg.urlOf('mnemos');
    const db = makePgDb({ connectionString: url, max: 1 });
    await migrate(db);
    const { api_key: key } = await createTenant(db, 'pg-outage');
    await db.close();
    const prefix = testPrefix();
    cleanups.push(() => deleteRedisPrefix(prefix));
    // A process of its own: were a dropped connection to end it, the test would see it exit.
    const svc = await spawnService('serve', { DATABASE_URL: url, MNEMOS_PREFIX: prefix, REDIS_URL });
    cleanups.push(() => svc.stop());
    const a = api(svc.url!, key);
    const first = await a.post('/v1/sessions/s/messages?wait=true', {
      messages: [user('before', { id: 'b0' })],
    });
    assert.equal(first.status, 201);

    // One client posts one message at a time throughout, so seq order is the order of acceptance.
    const accepted: string[] = [];
    const rejected: string[] = [];
    const unexpected: string[] = [];
    let writing = true;
    const writer = (async () => {
      for (let n = 0; writing; n++) {
        const id = `w${n}`;
        try {
          const r = await a.post('/v1/sessions/s/messages', { messages: [user(`message ${id}`, { id })] });
          if (r.status === 202 || r.status === 201) accepted.push(id);
          else if (r.status === 503 && r.headers.get('retry-after')) rejected.push(id);
          else unexpected.push(`${id}: ${r.status} ${JSON.stringify(r.body)}`);
        } catch (err) {
          // No answer at all (the process gone): recorded, and the loop goes on until told to stop.
          unexpected.push(`${id}: ${(err as Error).message}`);
        }
        await new Promise((res) => setTimeout(res, 10));
      }
    })();
    await new Promise((res) => setTimeout(res, 300));
    await pg.stop();
    const write = await a.post('/v1/sessions/s/messages', { messages: [user('during', { id: 'd0' })] });
    assert.equal(write.status, 503);
    assert.equal(write.body.error.code, 'unavailable');
    // Every read that needs Postgres is a 503 too, not a 500.
    for (const [what, r] of [
      ['messages', await a.get('/v1/sessions/s/messages')],
      ['session', await a.get('/v1/sessions/s')],
      ['sessions', await a.get('/v1/sessions')],
      ['search', await a.post('/v1/sessions/s/search', { query: 'message' })],
      ['context', await a.post('/v1/sessions/s/context', {})],
      ['export', await a.get('/v1/sessions/s/export')],
    ] as const) {
      assert.equal(r.status, 503, `${what}: ${JSON.stringify(r.body)}`);
      assert.ok(r.headers.get('retry-after'), what);
    }
    // Drains fail and are retried meanwhile.
    await new Promise((res) => setTimeout(res, 1500));
    assert.equal(svc.child.exitCode, null, 'the service is still running');
    await pg.start();
    await eventually(
      async () =>
        accepted.length > 0 && rejected.length > 0 && (await a.get('/v1/sessions/s')).status === 200,
      30_000,
      'writes and reads again',
    );
    const settle = accepted.length;
    await eventually(
      async () => accepted.length >= settle + 5,
      30_000,
      'more writes accepted after the restart',
    );
    writing = false;
    await writer;
    assert.deepEqual(unexpected, [], 'every write was accepted, or refused with 503 and retry-after');
    const rows = await eventually(
      async () => {
        const m = await allMessages(a, 's');
        return m.length >= accepted.length + 1 ? m : null;
      },
      30_000,
      'everything accepted archived',
    );
    assert.deepEqual(
      rows.map((r) => r.id),
      ['b0', ...accepted],
      'each accepted message once, in order; none of the rejected ones',
    );
    assert.deepEqual(
      rows.map((r) => r.seq),
      rows.map((_, i) => i + 1),
    );
    assert.equal(svc.child.exitCode, null);
  });

  void test('Postgres stopped: a re-post of an archived id that Redis no longer holds is a 503, never a new seq', async () => {
    const pg = await startPrivatePostgres();
    cleanups.push(() => pg.destroy());
    const admin = makePgDb({ connectionString: pg.adminUrl, max: 1 });
    await admin.query('CREATE DATABASE mnemos');
    await admin.close();
    const db = makePgDb({ connectionString: pg.urlOf('mnemos'), max: 1 });
    await migrate(db);
    await db.close();
    const svc = await startTestService({ databaseUrl: pg.urlOf('mnemos') });
    cleanups.push(async () => {
      await svc.stop();
      await deleteRedisPrefix(svc.config.prefix);
    });
    const t = await svc.newTenant();
    const post = (path: string) => t.api.post(path, { messages: [user('archived', { id: 'X' })] });
    const first = await post('/v1/sessions/s/messages?wait=true');
    assert.equal(first.status, 201, first.text);
    // Its idempotency entry pruned (an hour after its drain) or lost: only the archive knows X.
    await svc.deps.redis.hdel(inboxKeys(svc.config.prefix, t.tenantId, 's').ids, 'X');

    await pg.stop();
    const during = await post('/v1/sessions/s/messages');
    await pg.start();

    assert.equal(during.status, 503, during.text);
    assert.equal(during.body.error.code, 'unavailable');
    assert.ok(during.headers.get('retry-after'), "during.headers.get('retry-after')");
    // The retry, once Postgres answers, finds X archived: its seq, and nothing stored twice.
    const retried = await eventually(
      async () => {
        const r = await post('/v1/sessions/s/messages?wait=true');
        return r.status === 503 ? null : r;
      },
      30_000,
      'Postgres answering again',
    );
    assert.equal(retried.status, 201, retried.text);
    assert.deepEqual(retried.body.messages, [{ id: 'X', seq: 1 }]);
    assert.deepEqual(
      (await allMessages(t.api, 's')).map((m) => [m.seq, m.id]),
      [[1, 'X']],
    );
    assert.equal(await svc.deps.redis.llen(inboxKeys(svc.config.prefix, t.tenantId, 's').inbox), 0);
  });

  void test('Postgres gone silent without a reset: requests answer 503 with retry-after within the bound, and the same key works once it answers again', async () => {
    const dbUrl = await createTestDatabase();
    const proxy = await startTcpProxy(Number(new URL(dbUrl).port || 5432));
    const proxied = new URL(dbUrl);
    proxied.port = String(proxy.port);
    const svc = await startTestService({
      mode: 'api',
      databaseUrl: proxied.toString(),
      env: { PG_REQUEST_TIMEOUT_MS: '2000' },
    });
    cleanups.push(async () => {
      await svc.stop();
      await proxy.close();
      await deleteRedisPrefix(svc.config.prefix);
      await dropTestDatabase(dbUrl);
    });
    // Key a is verified (and cached) before the outage, so its requests reach their routes'
    // statements; key b is first looked up during it.
    const a = await svc.newTenant();
    const b = await svc.newTenant();
    assert.equal((await a.api.get('/v1/sessions')).status, 200);

    // Each call gives up after 20 s: before the fix, they got no answer at all.
    const call = (t: { api: Api }, method: string, path: string, body?: unknown) => {
      const began = Date.now();
      return t.api
        .raw(path, {
          method,
          headers: body === undefined ? {} : { 'content-type': 'application/json' },
          ...(body === undefined ? {} : { body: JSON.stringify(body) }),
          signal: AbortSignal.timeout(20_000),
        })
        .then((r) => ({ ...r, ms: Date.now() - began }));
    };
    proxy.hole();
    const answers = await Promise.all([
      call(a, 'POST', '/v1/sessions/s/messages', { messages: [user('during')] }),
      call(a, 'GET', '/v1/sessions'),
      call(a, 'GET', '/v1/sessions/s/messages'),
      call(a, 'POST', '/v1/sessions/s/search', { query: 'during' }),
      call(a, 'POST', '/v1/sessions/s/context', {}),
      call(b, 'GET', '/v1/sessions'),
      call(b, 'POST', '/v1/sessions/s/messages', { messages: [user('during')] }),
    ]);
    for (const r of answers) {
      assert.equal(r.status, 503, r.text);
      assert.equal(r.body.error.code, 'unavailable');
      assert.ok(r.headers.get('retry-after'), "r.headers.get('retry-after')");
      // 2 s for a statement on a connection that went silent, 5 s for a new connection's start.
      assert.ok(r.ms < 12_000, `answered in ${r.ms} ms`);
    }

    proxy.heal();
    // Connections that went silent are closed as requests find them, never given back: once one
    // request has its answer, the next ones do too, on the same process and with the same key.
    await eventually(
      async () => (await call(b, 'GET', '/v1/sessions')).status === 200,
      60_000,
      'key b again',
    );
    for (let i = 0; i < 5; i++) {
      assert.equal((await call(b, 'GET', '/v1/sessions')).status, 200);
      assert.equal((await call(a, 'GET', '/v1/sessions')).status, 200);
    }
    const posted = await call(b, 'POST', '/v1/sessions/s/messages', { messages: [user('after')] });
    assert.equal(posted.status, 202, posted.text);
  });

  void test("a new Postgres connection whose setup stalls: the 503 names the setup's bound, not PG_REQUEST_TIMEOUT_MS", async () => {
    const dbUrl = await createTestDatabase();
    const proxy = await startTcpProxy(Number(new URL(dbUrl).port || 5432));
    const proxied = new URL(dbUrl);
    proxied.port = String(proxy.port);
    const svc = await startTestService({
      mode: 'api',
      databaseUrl: proxied.toString(),
      env: { PG_REQUEST_TIMEOUT_MS: '2000' },
    });
    const admin = makePgDb({ connectionString: dbUrl, max: 1 });
    cleanups.push(async () => {
      await svc.stop();
      await proxy.close();
      await admin.close();
      await deleteRedisPrefix(svc.config.prefix);
      await dropTestDatabase(dbUrl);
    });
    // Key a is verified (and cached) before, so its requests reach their routes' statements; key
    // b is first looked up during the stall.
    const a = await svc.newTenant();
    const b = await svc.newTenant();
    assert.equal((await a.api.get('/v1/sessions')).status, 200);
    const database = new URL(dbUrl).pathname.slice(1);
    const requests = () =>
      Promise.all([
        a.api.get('/v1/sessions'),
        a.api.post('/v1/sessions/s/messages', { messages: [user('during')] }),
        b.api.get('/v1/sessions'),
      ]);
    const assertSetupStalled = (answers: Res[]) => {
      for (const r of answers) {
        assert.equal(r.status, 503, r.text);
        assert.equal(r.body.error.code, 'unavailable');
        assert.ok(r.headers.get('retry-after'), "r.headers.get('retry-after')");
        assert.match(
          r.body.error.message,
          /^Postgres gave no answer within 5000 ms to a new connection's setup \(connecting, its startup and settings: a fixed bound, not PG_REQUEST_TIMEOUT_MS\)/,
        );
      }
    };

    // Postgres lets new connections in and answers nothing more (their settings wait): the pool's
    // connections are closed, so that each request needs a new one. Once Postgres has seen them
    // go, so has the pool (in this process), and none is handed out dead.
    const before = (await admin.query<{ now: Date }>('SELECT clock_timestamp() AS now')).rows[0]!.now;
    proxy.stallAfterStartup();
    proxy.reset();
    await eventually(
      async () =>
        (
          await admin.query<{ n: number }>(
            `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = $1 AND backend_start < $2 AND pid <> pg_backend_pid()`,
            [database, before],
          )
        ).rows[0]!.n === 0,
      10_000,
      'the connections closed by the proxy gone',
    );
    assertSetupStalled(await requests());

    // New connections are taken and never answered at all (no startup).
    proxy.hole();
    assertSetupStalled(await requests());

    proxy.heal();
    await eventually(async () => (await a.api.get('/v1/sessions')).status === 200, 30_000, 'Postgres again');
    assert.equal((await b.api.get('/v1/sessions')).status, 200);
  });

  void test('a transaction left idle by a stalled process is ended by Postgres, and the session drains again', async () => {
    const svc = await startTestService({ env: { PG_IDLE_IN_TRANSACTION_TIMEOUT_MS: '1000' } });
    cleanups.push(async () => {
      await svc.stop();
      await deleteRedisPrefix(svc.config.prefix);
    });
    const t = await svc.newTenant();
    const first = await t.api.post('/v1/sessions/s/messages?wait=true', {
      messages: [user('one', { id: 'one' })],
    });
    assert.equal(first.status, 201);

    // A drain of this process that stalls mid-transaction (a paused VM, a network partition): it
    // holds the session's row lock and sends nothing more.
    let locked!: () => void;
    const holding = new Promise<void>((res) => (locked = res));
    let wake!: () => void;
    const stall = new Promise<void>((res) => {
      wake = res;
      setTimeout(res, 60_000).unref();
    });
    const stalled = svc.deps.db
      .transaction(async (tx) => {
        await tx.query('SELECT 1 FROM sessions WHERE tenant_id = $1 AND id = $2 FOR UPDATE', [
          t.tenantId,
          's',
        ]);
        locked();
        await stall;
      })
      .then(
        () => null,
        (err: unknown) => err,
      );
    await holding;
    const second = await t.api.post('/v1/sessions/s/messages?wait=true', {
      messages: [user('two', { id: 'two' })],
    });
    assert.equal(second.status, 201, 'archived once Postgres ended the idle transaction and its lock');
    wake();
    assert.ok((await stalled) instanceof Error, 'the stalled transaction did not commit');
    const third = await t.api.post('/v1/sessions/s/messages?wait=true', {
      messages: [user('three', { id: 'three' })],
    });
    assert.equal(third.status, 201);
    const rows = await allMessages(t.api, 's');
    assert.deepEqual(
      rows.map((r) => [r.seq, r.id]),
      [
        [1, 'one'],
        [2, 'two'],
        [3, 'three'],
      ],
    );
  });

  /** An API-only service (accepted messages wait in the inbox), and a worker to start later. */
  async function apiFirst() {
    const prefix = testPrefix();
    const apiSvc = await startTestService({ mode: 'api', prefix });
    const h = {
      api: apiSvc,
      worker: null as TestService | null,
      inboxLength: (tenantId: string, sid: string) =>
        apiSvc.deps.redis.llen(`${prefix}:inbox:${tenantId}:${sid}`),
      startWorker: async () => {
        h.worker = await startTestService({
          mode: 'worker',
          prefix,
          databaseUrl: apiSvc.config.databaseUrl!,
        });
      },
    };
    cleanups.push(async () => {
      await h.worker?.stop();
      await apiSvc.stop();
      await deleteRedisPrefix(prefix);
    });
    return h;
  }

  void test('a backlog of large messages drains in transactions of bounded size, all of it, in order', async () => {
    const h = await apiFirst();
    const t = await h.api.newTenant();
    // 24 messages of ~1 MB wait in the inbox (a worker outage). One drain used to take up to 500
    // entries whatever their size, and Postgres refuses a jsonb parameter over 256 MB.
    const text = (i: number) => `message ${i} ${'x'.repeat(1_000_000)}`;
    for (let r = 0; r < 4; r++) {
      const batch = Array.from({ length: 6 }, (_, j) => user(text(r * 6 + j), { id: `b${r * 6 + j}` }));
      assert.equal((await t.api.post('/v1/sessions/big/messages', { messages: batch })).status, 202);
    }
    const keys = inboxKeys(h.api.config.prefix, t.tenantId, 'big');
    defineInboxScripts(h.api.deps.redis);
    const { entries: head } = await readInbox(h.api.deps.redis, keys, DRAIN_BATCH, DRAIN_MAX_BYTES);
    assert.deepEqual(
      head.map((e) => e.seq),
      Array.from({ length: 16 }, (_, i) => i + 1),
      'a drain reads 16 MiB of entries',
    );
    assert.equal(
      (await readInbox(h.api.deps.redis, keys, DRAIN_BATCH, 10)).entries.length,
      1,
      'but at least one',
    );
    assert.equal(await h.inboxLength(t.tenantId, 'big'), 24, 'reading takes nothing away');

    await h.startWorker();
    const last = await t.api.post('/v1/sessions/big/messages', { messages: [user('small')] });
    assert.equal(last.status, 202, last.text);
    // (Not ?wait=true: draining 24 MB can outlast its 10 s on a loaded machine, a CI failure.)
    await eventually(
      async () => (await t.api.get('/v1/sessions/big')).body.message_count === 25,
      120_000,
      'the backlog and the message after it archived',
    );
    const rows = await allMessages(t.api, 'big');
    assert.deepEqual(
      rows.map((m) => [m.seq, m.content.length, m.content.slice(0, 12)]),
      [
        ...Array.from({ length: 24 }, (_, i) => [i + 1, text(i).length, text(i).slice(0, 12)]),
        [25, 5, 'small'],
      ],
    );
  });

  void test('a ?wait=true whose messages a reset cleared before their drain is a 409, not a "lost" 503', async () => {
    const h = await apiFirst();
    const t = await h.api.newTenant();
    const waiting = t.api.post('/v1/sessions/r/messages?wait=true', {
      messages: [user('before', { id: 'a' })],
    });
    await eventually(async () => (await h.inboxLength(t.tenantId, 'r')) === 1, 10_000, 'accepted');
    assert.equal((await t.api.post('/v1/sessions/r/reset')).status, 200);
    assert.equal(
      (await t.api.post('/v1/sessions/r/messages', { messages: [user('after', { id: 'b' })] })).status,
      202,
    );
    await h.startWorker();
    const r = await waiting;
    assert.equal(r.status, 409, r.text);
    assert.equal(r.body.error.code, 'session_cleared');
    assert.equal(r.body.error.details.cleared_through_seq, 1);
    // The message posted after the reset is archived; the cleared one never is.
    const rows = await eventually(
      async () => {
        const m = await allMessages(t.api, 'r');
        return m.length > 0 ? m : null;
      },
      20_000,
      'the later message archived',
    );
    assert.deepEqual(
      rows.map((m) => [m.seq, m.id]),
      [[2, 'b']],
    );
  });

  void test('a ?wait=true cleared by a reset with nothing after it is a 409 at once, not a 202 after the wait', async () => {
    const h = await apiFirst();
    const t = await h.api.newTenant();
    const started = Date.now();
    const waiting = t.api.post('/v1/sessions/q/messages?wait=true', {
      messages: [user('before', { id: 'a' })],
    });
    await eventually(async () => (await h.inboxLength(t.tenantId, 'q')) === 1, 10_000, 'accepted');
    assert.equal((await t.api.post('/v1/sessions/q/reset')).status, 200);
    // No worker and no later message: the archived mark never moves.
    const r = await waiting;
    assert.equal(r.status, 409, r.text);
    assert.equal(r.body.error.code, 'session_cleared');
    assert.ok(Date.now() - started < 9_000, 'answered before the 10 s wait ran out');
  });

  void test('a deleted session whose Redis state was lost is visible at its next post too', async () => {
    const h = await apiFirst();
    const t = await h.api.newTenant();
    assert.equal((await t.api.post('/v1/sessions/l/messages', { messages: [user('old')] })).status, 202);
    assert.equal((await t.api.del('/v1/sessions/l')).status, 204);
    // Redis lost the session's state (and with it the deleted mark): the accept seeds it again.
    await h.api.deps.redis.del(inboxKeys(h.api.config.prefix, t.tenantId, 'l').sess);
    assert.equal((await t.api.post('/v1/sessions/l/messages', { messages: [user('new')] })).status, 202);
    const s = await t.api.get('/v1/sessions/l');
    assert.equal(s.status, 200);
    assert.equal(s.body.pending_jobs, 1);
  });

  void test('a session state that expired while its inbox held messages (a week of worker outage) numbers after them', async () => {
    const h = await apiFirst();
    const t = await h.api.newTenant();
    const keys = inboxKeys(h.api.config.prefix, t.tenantId, 'x');
    const first = await t.api.post('/v1/sessions/x/messages', { messages: [user('a'), user('b')] });
    assert.deepEqual(
      first.body.messages.map((m: { seq: number }) => m.seq),
      [1, 2],
    );
    // The state carries the idle expiry; it runs out with the two still waiting for a worker.
    assert.ok(
      (await h.api.deps.redis.ttl(keys.sess)) > 6 * 86_400,
      '(await h.api.deps.redis.ttl(keys.sess)) > 6 * 86_400',
    );
    await h.api.deps.redis.del(keys.sess);
    const next = await t.api.post('/v1/sessions/x/messages', { messages: [user('c')] });
    assert.equal(next.status, 202);
    assert.deepEqual(next.body.messages[0].seq, 3);
    await h.startWorker();
    await eventually(async () => (await allMessages(t.api, 'x')).length === 3, 20_000, 'all three archived');
    assert.deepEqual(
      (await allMessages(t.api, 'x')).map((m) => `${m.seq}:${m.content}`),
      ['1:a', '2:b', '3:c'],
    );
  });

  void test('a ?wait=true whose session state vanishes before its drain commits still answers 201 once archived', async () => {
    const prefix = testPrefix();
    const svc = await startTestService({ prefix });
    cleanups.push(async () => {
      await svc.stop();
      await deleteRedisPrefix(prefix);
    });
    const t = await svc.newTenant();
    const keys = inboxKeys(prefix, t.tenantId, 'w');
    assert.equal(
      (await t.api.post('/v1/sessions/w/messages?wait=true', { messages: [user('w0')] })).status,
      201,
    );
    // The drain of w1 waits on a table lock while the session's Redis state goes (evicted, or
    // expired): the drain's trim does not make it again, so its archived mark never moves.
    const lock = await holdMessagesLock(svc.config.databaseUrl!);
    let answer: Promise<Res>;
    try {
      await lock.locked;
      answer = t.api.post('/v1/sessions/w/messages?wait=true', { messages: [user('w1')] });
      await lock.drainBlocked();
      assert.equal(await svc.deps.redis.del(keys.sess), 1);
    } finally {
      await lock.release();
    }
    const started = Date.now();
    const r = await answer;
    // Before, it waited out its 10 s and answered 202, the message archived a moment after.
    assert.equal(r.status, 201, JSON.stringify(r.body));
    assert.deepEqual(
      r.body.messages.map((m: { seq: number }) => m.seq),
      [2],
    );
    assert.ok(Date.now() - started < 8_000, `answered after ${Date.now() - started} ms`);
  });

  void test('a re-post under the id the server gave, before its drain, gets the original seq', async () => {
    const h = await apiFirst();
    const t = await h.api.newTenant();
    const first = await t.api.post('/v1/sessions/g/messages', { messages: [user('no id given')] });
    assert.equal(first.status, 202);
    const given = first.body.messages[0] as { id: string; seq: number };
    // The client retries with the id from the answer, beside a new message; nothing is archived yet.
    const again = await t.api.post('/v1/sessions/g/messages', {
      messages: [user('no id given', { id: given.id }), user('new', { id: 'n' })],
    });
    assert.equal(again.status, 202, again.text);
    assert.equal(again.body.accepted, 1);
    assert.deepEqual(again.body.messages, [given, { id: 'n', seq: 2 }]);
    const changed = await t.api.post('/v1/sessions/g/messages', {
      messages: [user('other text', { id: given.id })],
    });
    assert.equal(changed.status, 409);
    assert.equal(changed.body.error.code, 'id_conflict');
    await h.startWorker();
    const waited = await t.api.post('/v1/sessions/g/messages?wait=true', {
      messages: [user('no id given', { id: given.id }), user('new', { id: 'n' })],
    });
    assert.equal(waited.status, 201, waited.text);
    assert.deepEqual(waited.body.messages, [given, { id: 'n', seq: 2 }]);
    assert.deepEqual(
      (await allMessages(t.api, 'g')).map((m) => [m.seq, m.id]),
      [
        [1, given.id],
        [2, 'n'],
      ],
    );
  });

  void test('a re-post before its drain with another sent_at is a 409; without one, the original seq', async () => {
    const h = await apiFirst();
    const t = await h.api.newTenant();
    const at = (sentAt?: string) => user('same text', { id: 'z1', ...(sentAt ? { sent_at: sentAt } : {}) });
    const first = await t.api.post('/v1/sessions/st/messages', { messages: [at('2026-01-01T00:00:00Z')] });
    assert.equal(first.status, 202, first.text);

    // Nothing is archived yet: only Redis's record of z1 can tell the two apart.
    const later = await t.api.post('/v1/sessions/st/messages', { messages: [at('2026-01-01T00:00:01Z')] });
    const unsaid = await t.api.post('/v1/sessions/st/messages', { messages: [at()] });

    assert.equal(later.status, 409, later.text);
    assert.equal(later.body.error.code, 'id_conflict');
    // A retry that leaves sent_at to the server is the same message.
    assert.equal(unsaid.status, 202, unsaid.text);
    assert.deepEqual(unsaid.body.messages, first.body.messages);
    assert.equal(unsaid.body.accepted, 0);
    assert.equal(await h.inboxLength(t.tenantId, 'st'), 1);
  });

  void test('an id accepted twice because Redis lost its idempotency entry is archived once, and the session keeps draining', async () => {
    const h = await apiFirst();
    const t = await h.api.newTenant();
    const post = (body: unknown) => t.api.post('/v1/sessions/twice/messages', body);
    const first = await post({ messages: [user('x', { id: 'X' })] });
    assert.deepEqual(first.body.messages, [{ id: 'X', seq: 1 }]);
    // The session's client-id hash goes (evicted, or lost with Redis's last second) before any
    // drain: nothing in Redis or Postgres knows X, so its retry is taken as a new message.
    await h.api.deps.redis.del(inboxKeys(h.api.config.prefix, t.tenantId, 'twice').ids);
    const retry = await post({ messages: [user('x', { id: 'X' })] });
    assert.equal(retry.status, 202, retry.text);
    assert.equal(retry.body.accepted, 1);
    await h.startWorker();
    // One drain reads both copies: the second is a duplicate of the archived id, skipped, and
    // does not fail the drain (which would hold back every later message of the session).
    const later = await t.api.post('/v1/sessions/twice/messages?wait=true', {
      messages: [user('later', { id: 'L' })],
    });
    assert.equal(later.status, 201, later.text);
    assert.deepEqual(
      (await allMessages(t.api, 'twice')).map((m) => `${m.seq}:${m.id}`),
      ['1:X', '3:L'],
    );
    assert.equal((await t.api.get('/v1/sessions/twice')).body.message_count, 2);
  });

  void test('a re-posted id given a second seq after Redis lost its id state is dropped by the drain, counted and logged', async () => {
    // Setup: an api process (the test runs the drain), a message waiting in the inbox, and the
    // session's Redis state lost (as a volatile-lru Redis evicted it: sess and ids carry TTLs).
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino({ level: 'warn' }, { write: (line: string) => void lines.push(JSON.parse(line)) });
    const svc = await startTestService({ mode: 'api', logger });
    cleanups.push(async () => {
      await svc.stop();
      await deleteRedisPrefix(svc.config.prefix);
    });
    const t = await svc.newTenant();
    const post = (content: string) =>
      t.api.post('/v1/sessions/lost/messages', { messages: [user(content, { id: 'A' })] });
    assert.deepEqual((await post('first')).body.messages, [{ id: 'A', seq: 1 }]);
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'lost');
    await svc.deps.redis.del(keys.sess, keys.ids);
    const dropped = async () => (await svc.deps.metrics.messagesDropped.get()).values[0]?.value ?? 0;

    // Action: the same id with other content (answered 202 at a seq of its own), then the drain.
    const again = await post('changed');
    assert.equal(again.status, 202, again.text);
    assert.deepEqual(again.body.messages, [{ id: 'A', seq: 2 }]);
    const replay = (await svc.deps.redis.lrange(keys.inbox, 0, 0))[0]!;
    const drain = await drainSession(svc.deps, t.tenantId, 'lost');

    // Assert: the archive keeps the first message of the id, once; the second is counted as
    // dropped, and one line names the session and the likely cause.
    assert.equal(drain.archived, 1);
    assert.deepEqual(
      (await allMessages(t.api, 'lost')).map((m) => `${m.seq}:${m.id}:${m.content}`),
      ['1:A:first'],
    );
    assert.equal(await dropped(), 1);
    const said = lines.filter((l) => /whose id this session had archived already/.test(String(l.msg)));
    assert.equal(said.length, 1, JSON.stringify(lines));
    assert.equal(said[0]!.tenantId, t.tenantId);
    assert.equal(said[0]!.sessionId, 'lost');
    assert.equal(said[0]!.dropped, 1);
    assert.match(
      String(said[0]!.msg),
      /Redis lost the session's id state \(a maxmemory-policy other than noeviction/,
    );

    // A replay (an archived seq read again, as after a drain whose trim was lost) is no drop.
    await svc.deps.redis.lpush(keys.inbox, replay);
    await drainSession(svc.deps, t.tenantId, 'lost');
    assert.equal(await svc.deps.redis.llen(keys.inbox), 0);
    assert.equal(await dropped(), 1);
    assert.equal(
      lines.filter((l) => /whose id this session had archived already/.test(String(l.msg))).length,
      1,
    );
  });

  void test("a message left in another prefix's inbox, whose seq the archive gave to another message, is counted and logged when drained; replays stay quiet", async () => {
    // Setup: an api process on prefix A (the test runs the drains) accepts c1 at seq 1, which
    // waits in A's inbox. Meanwhile the session is served under prefix B (as a process started
    // with another MNEMOS_PREFIX did): B numbers it from the archive, where nothing is, and d1 is
    // archived at seq 1.
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino({ level: 'warn' }, { write: (line: string) => void lines.push(JSON.parse(line)) });
    const svc = await startTestService({ mode: 'api', logger });
    const other = testPrefix();
    cleanups.push(async () => {
      await svc.stop();
      await deleteRedisPrefix(svc.config.prefix);
      await deleteRedisPrefix(other);
    });
    const t = await svc.newTenant();
    const c1 = await t.api.post('/v1/sessions/s/messages', { messages: [user('c1', { id: 'c1' })] });
    assert.deepEqual(c1.body.messages, [{ id: 'c1', seq: 1 }]);
    const underB = { ...svc.deps, config: { ...svc.deps.config, prefix: other } };
    const d1 = await acceptMessages(
      underB,
      t.tenantId,
      's',
      parseMessages({ messages: [user('d1', { id: 'd1' })] }, 'UTC'),
    );
    assert.deepEqual(d1.outcome.messages, [{ id: 'd1', seq: 1 }]);
    assert.equal((await drainSession(underB, t.tenantId, 's')).archived, 1);
    const dropped = async () => (await svc.deps.metrics.messagesDropped.get()).values[0]?.value ?? 0;
    const said = () =>
      lines.filter((l) => /whose seqs the archive holds other messages at/.test(String(l.msg)));

    // Action: prefix A's drain (A back in use).
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 's');
    const drain = await drainSession(svc.deps, t.tenantId, 's');

    // Assert: c1 is gone from A's inbox and not archived (the archive keeps d1 at seq 1), and the
    // loss is counted as a drop and logged once, naming the session and the likely cause.
    assert.equal(drain.archived, 0);
    assert.equal(drain.dropped, 1);
    assert.equal(await svc.deps.redis.llen(keys.inbox), 0);
    assert.deepEqual(
      (await allMessages(t.api, 's')).map((m) => `${m.seq}:${m.id}`),
      ['1:d1'],
    );
    assert.equal(await dropped(), 1);
    assert.equal(said().length, 1, JSON.stringify(lines));
    assert.equal(said()[0]!.tenantId, t.tenantId);
    assert.equal(said()[0]!.sessionId, 's');
    assert.equal(said()[0]!.dropped, 1);
    assert.match(String(said()[0]!.msg), /another Redis namespace \(MNEMOS_PREFIX or Redis database\)/);

    // A replay (an archived message read again, as after a drain whose trim was lost) is no drop.
    assert.equal(
      (await t.api.post('/v1/sessions/s/messages', { messages: [user('c2', { id: 'c2' })] })).status,
      202,
    );
    const replay = (await svc.deps.redis.lrange(keys.inbox, 0, 0))[0]!;
    assert.equal((await drainSession(svc.deps, t.tenantId, 's')).archived, 1);
    await svc.deps.redis.lpush(keys.inbox, replay);
    await drainSession(svc.deps, t.tenantId, 's');
    assert.equal(await svc.deps.redis.llen(keys.inbox), 0);
    assert.deepEqual(
      (await allMessages(t.api, 's')).map((m) => `${m.seq}:${m.id}`),
      ['1:d1', '2:c2'],
    );
    assert.equal(await dropped(), 1);
    assert.equal(said().length, 1);
  });

  void test('a deleted session posted to again is visible at once, before its first drain', async () => {
    const h = await apiFirst();
    const t = await h.api.newTenant();
    assert.equal((await t.api.post('/v1/sessions/d/messages', { messages: [user('old')] })).status, 202);
    assert.equal((await t.api.del('/v1/sessions/d')).status, 204);
    assert.equal((await t.api.get('/v1/sessions/d')).status, 404);
    const again = await t.api.post('/v1/sessions/d/messages', { messages: [user('new', { id: 'n' })] });
    assert.equal(again.status, 202);
    const s = await t.api.get('/v1/sessions/d');
    assert.equal(s.status, 200, 'a session exists from its first accepted message');
    assert.equal(s.body.message_count, 0);
    assert.equal(s.body.pending_jobs, 1);
    const list = await t.api.get('/v1/sessions');
    assert.deepEqual(
      list.body.sessions.map((x: { id: string }) => x.id),
      ['d'],
    );
    assert.deepEqual((await t.api.get('/v1/sessions/d/messages')).body.messages, []);
    // Deleted again before any drain: it stays deleted, and its message never arrives.
    assert.equal((await t.api.del('/v1/sessions/d')).status, 204);
    assert.equal((await t.api.get('/v1/sessions/d')).status, 404);
    await h.startWorker();
    const w = await t.api.post('/v1/sessions/other/messages?wait=true', { messages: [user('x')] });
    assert.equal(w.status, 201);
    assert.equal((await t.api.get('/v1/sessions/d')).status, 404);
    assert.equal(await h.inboxLength(t.tenantId, 'd'), 0);
  });

  void test('Redis restored from a snapshot that held the session armed: a new message is drained at once, and the operator is told', async () => {
    const lines: Array<{ msg: string; sessionId?: string }> = [];
    const logger = pino({ level: 'warn' }, { write: (line: string) => void lines.push(JSON.parse(line)) });
    // No stall check and no sweeper within the test: what recovers the session is the accept.
    const slow = { lockDurationMs: 600_000, stalledIntervalMs: 600_000, ingestSweepAfterMs: 600_000 };
    const svc = await startTestService({ worker: slow, logger });
    cleanups.push(async () => {
      await svc.stop();
      await deleteRedisPrefix(svc.config.prefix);
    });
    const t = await svc.newTenant();
    const post = (s: string, id: string) =>
      t.api.post(`/v1/sessions/${s}/messages?wait=true`, { messages: [user(id, { id })] });
    for (const s of ['armed', 'counter']) {
      assert.equal((await post(s, `${s}-1`)).status, 201);
      assert.equal((await post(s, `${s}-2`)).status, 201);
    }
    // The snapshot was taken while the drain of message 2 ran: armed, its flush job active (gone
    // with the worker that held it), message 2 not yet archived as far as Redis knows.
    await svc.deps.redis.hset(
      inboxKeys(svc.config.prefix, t.tenantId, 'armed').sess,
      'armed',
      '1',
      'archived',
      1,
    );
    // Taken before message 2 was even accepted: the counter is behind too.
    await svc.deps.redis.hset(
      inboxKeys(svc.config.prefix, t.tenantId, 'counter').sess,
      'armed',
      '1',
      'archived',
      1,
      'seq',
      1,
    );
    for (const s of ['armed', 'counter']) {
      const r = await post(s, `${s}-3`);
      assert.equal(r.status, 201, r.text);
      assert.deepEqual(r.body.messages, [{ id: `${s}-3`, seq: 3 }]);
    }
    const behind = lines.filter((l) => l.msg.startsWith('redis state is behind the archive'));
    assert.deepEqual(
      behind.map((l) => l.sessionId),
      ['counter'],
    );
    assert.match(await svc.deps.metrics.registry.metrics(), /^mnemos_redis_behind_total 1$/m);
  });

  void test('a flush request lost between accept and enqueue is recovered by the ingest sweeper', async () => {
    const svc = await startTestService();
    cleanups.push(async () => {
      await svc.stop();
      await deleteRedisPrefix(svc.config.prefix);
    });
    const t = await svc.newTenant();
    // Pause the ingest queue so the flush job is held, then drop it as if the API had died.
    await svc.deps.queues.ingest.pause();
    const r = await t.api.post('/v1/sessions/orphan/messages', { messages: [user('orphaned')] });
    assert.equal(r.status, 202);
    await svc.deps.queues.ingest.drain(true);
    await svc.deps.queues.ingest.resume();
    const rows = await archivedExactly(t.api, 'orphan', 1, 20_000, 'sweeper re-requests the flush');
    assert.equal(rows[0]!.content, 'orphaned');
  });

  void test('a drain that keeps failing gets one re-requested flush, not one more at every sweep', async () => {
    const svc = await startTestService();
    const marker = `poison-${randomUUID()}`;
    cleanups.push(async () => {
      await svc.deps.db.query(`ALTER TABLE messages DROP CONSTRAINT IF EXISTS sweep_poison`);
      await svc.stop();
      await deleteRedisPrefix(svc.config.prefix);
    });
    const t = await svc.newTenant();
    // The archive refuses this one message: its drain fails on every attempt, and its job retries.
    await svc.deps.db.query(
      `ALTER TABLE messages ADD CONSTRAINT sweep_poison CHECK (content IS NULL OR content <> '${marker}') NOT VALID`,
    );
    const r = await t.api.post('/v1/sessions/stuck/messages', { messages: [user(marker)] });
    assert.equal(r.status, 202);
    const pending = async () =>
      (await svc.deps.queues.ingest.getJobs(['waiting', 'delayed', 'active', 'prioritized'])).filter(
        (j) => (j.data as { sessionId?: string }).sessionId === 'stuck',
      ).length;
    await eventually(async () => (await svc.deps.queues.ingest.getJobs(['delayed'])).length > 0);
    for (let i = 0; i < 4; i++) await runIngestSweep(svc.deps, 0);
    // The request's own flush and one sweep's.
    assert.equal(await pending(), 2);
    await svc.deps.db.query(`ALTER TABLE messages DROP CONSTRAINT sweep_poison`);
    for (let i = 0; i < 3; i++) await runIngestSweep(svc.deps, 0);
    const rows = await archivedExactly(t.api, 'stuck', 1, 60_000);
    assert.equal(rows[0]!.content, marker);
  });
});
