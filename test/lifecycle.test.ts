import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import http from 'node:http';
import { connect } from 'node:net';
import type { Socket } from 'node:net';
import { randomBytes } from 'node:crypto';
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { after, before, describe, test } from 'node:test';
import { Redis } from 'ioredis';
import pg from 'pg';
import type { Queue } from 'bullmq';
import { eraseTenant, keyBelongsTo } from '../services/lifecycle/tenant-erasure.js';
import { reconcileGenerations } from '../services/lifecycle/session-lifecycle.js';
import { lifecycleExtension } from '../services/lifecycle/lifecycle-extension.js';
import { deleteSessionMessages, markSessionCleared, sessionsBehindInRedis } from '../db/queries/lifecycle.js';
import { reapTempSessions } from '../services/lifecycle/temp-reaper.js';
import {
  EXPORT_PAGE_BYTES,
  openSessionExport,
  SessionChangedError,
} from '../services/lifecycle/export-session.js';
import { parseImportJson, parseImportLines, readJsonLines } from '../services/lifecycle/import-input.js';
import type { Queryable } from '../db/pool.js';
import { buildAnnIndex, dropAnnIndex } from '../db/queries/ann-indexes.js';
import { buildSessionIndex, dropSessionIndex } from '../db/queries/session-indexes.js';
import { pageSummaryCandidates } from '../db/queries/summaries.js';
import { SESSION_STATE_TTL_SECONDS, inboxKeys } from '../services/messages/inbox.js';
import { settleImport } from '../services/lifecycle/lifecycle-redis.js';
import { QUEUE_NAMES, requestMaintenance } from '../workers/queues.js';
import { summaryConfigFingerprint } from '../workers/summary-sweep.js';
import { drainSession } from '../workers/ingest.js';
import {
  ADMIN_TOKEN,
  REDIS_URL,
  api,
  deleteRedisPrefix,
  dropTestDatabase,
  eventually,
  spawnService,
  startTestService,
} from './support/harness.js';
import type { Api, TestService } from './support/harness.js';
import { startPrivateRedis } from './support/private-redis.js';

type Msg = Record<string, unknown>;
const user = (content: unknown, extra: Msg = {}): Msg => ({ role: 'user', content, ...extra });
const assistant = (content: unknown, extra: Msg = {}): Msg => ({ role: 'assistant', content, ...extra });
const sid = (what: string) => `${what}-${randomBytes(3).toString('hex')}`;

const SUMMARY = {
  key_decisions: ['Do: answer in English', "Don't: use tabs"],
  past_discussions: [
    { topic: 'deploys', description: 'moved to blue/green', direction: 'done', last_discussed: '2026-01-02' },
  ],
  current_discussion: {
    topic: 'export',
    description: 'JSON Lines',
    perspectives: 'streamed',
    direction: 'ship it',
  },
};

let svc: TestService;
let redis: Redis;

async function archive(t: Api, session: string, messages: Msg[]): Promise<number[]> {
  const r = await t.post(`/v1/sessions/${session}/messages?wait=true`, { messages });
  assert.equal(r.status, 201, JSON.stringify(r.body));
  return r.body.messages.map((m: { seq: number }) => m.seq);
}

/** Posts without waiting (202): with the ingest worker held back, the messages stay in the inbox. */
async function accepted(t: Api, session: string, messages: Msg[]): Promise<number[]> {
  const r = await t.post(`/v1/sessions/${session}/messages`, { messages });
  assert.equal(r.status, 202, JSON.stringify(r.body));
  return r.body.messages.map((m: { seq: number }) => m.seq);
}

/** Inbox entries dropped so far (mnemos_messages_dropped_total). */
const dropped = async () => (await svc.deps.metrics.messagesDropped.get()).values[0]?.value ?? 0;

async function listed(t: Api, session: string): Promise<any[] | null> {
  const out: any[] = [];
  let after: number | null = null;
  for (;;) {
    const r: { status: number; body: any } = await t.get(
      `/v1/sessions/${session}/messages?limit=500${after === null ? '' : `&after_seq=${after}`}`,
    );
    if (r.status === 404) return null;
    assert.equal(r.status, 200);
    out.push(...r.body.messages);
    if (r.body.next === null) return out;
    after = r.body.next;
  }
}

async function q<T = any>(sql: string, params: unknown[] = []): Promise<T[]> {
  return (await svc.deps.db.query<T>(sql, params)).rows;
}

async function putSummary(tenantId: string, session: string, cursorSeq: number | null): Promise<void> {
  await q(
    `INSERT INTO summaries (tenant_id, session_id, summary, cursor_seq, version) VALUES ($1, $2, $3::jsonb, $4, 1)
     ON CONFLICT (tenant_id, session_id) DO UPDATE SET summary = EXCLUDED.summary, cursor_seq = EXCLUDED.cursor_seq`,
    [tenantId, session, JSON.stringify(SUMMARY), cursorSeq],
  );
}

/** Rows of the session in every table that has (tenant_id, session_id), plus its sessions row. */
async function sessionRows(tenantId: string, session: string): Promise<Record<string, number>> {
  const tables = await q<{ table_name: string }>(
    `SELECT c.table_name FROM information_schema.columns c
     JOIN information_schema.columns t ON t.table_schema = c.table_schema AND t.table_name = c.table_name
       AND t.column_name = 'tenant_id'
     WHERE c.table_schema = 'public' AND c.column_name = 'session_id' ORDER BY 1`,
  );
  const out: Record<string, number> = {};
  for (const { table_name } of tables) {
    const [r] = await q<{ n: number }>(
      `SELECT count(*)::int AS n FROM "${table_name}" WHERE tenant_id = $1 AND session_id = $2`,
      [tenantId, session],
    );
    out[table_name] = r!.n;
  }
  return out;
}

async function allKeys(): Promise<string[]> {
  const keys: string[] = [];
  let cursor = '0';
  do {
    const [next, batch] = await redis.scan(cursor, 'MATCH', `${svc.config.prefix}:*`, 'COUNT', 1000);
    cursor = next;
    keys.push(...batch);
  } while (cursor !== '0');
  return keys;
}

const sessionKeys = async (tenantId: string, session: string) =>
  (await allKeys())
    .filter((k) => k.endsWith(`:${tenantId}:${session}`) || k.includes(`:${tenantId}:${session}:`))
    .sort();

/** Until no ingest or embed work is queued or running and the session's inbox is empty. */
async function settled(tenantId: string, session: string): Promise<void> {
  const keys = inboxKeys(svc.config.prefix, tenantId, session);
  await eventually(
    async () => {
      if ((await redis.llen(keys.inbox)) > 0) return false;
      for (const name of ['ingest', 'embed', 'compact'] as const) {
        const c = await (svc.deps.queues[name] as unknown as Queue).getJobCounts(
          'active',
          'waiting',
          'delayed',
          'prioritized',
        );
        if (Object.values(c).some((n) => n > 0)) return false;
      }
      return true;
    },
    30_000,
    'ingest and embed queues to drain',
  );
}

const lifecycle = () => svc.extensions;

before(async () => {
  svc = await startTestService({ env: { TZ: 'Asia/Taipei' } });
  redis = new Redis(REDIS_URL);
});

after(async () => {
  redis.disconnect();
  await svc.stop();
  await deleteRedisPrefix(svc.config.prefix);
});

void describe('reset', () => {
  void test('clears messages, vectors, cutoff and pending work, keeps the summary and its cursor, and seq continues', async () => {
    const t = await svc.newTenant();
    const s = sid('chat');
    await archive(t.api, s, [user('one'), assistant('two'), user('three'), assistant('four')]);
    await eventually(async () => (await sessionRows(t.tenantId, s)).message_vectors === 4, 15_000, 'vectors');
    await putSummary(t.tenantId, s, 4);
    await q('UPDATE sessions SET start_seq = 3, start_at_ns = 1 WHERE tenant_id = $1 AND id = $2', [
      t.tenantId,
      s,
    ]);

    const r = await t.api.post(`/v1/sessions/${s}/reset`);
    assert.equal(r.status, 200, JSON.stringify(r.body));
    assert.deepEqual(r.body, { session_id: s, reset: true, summary_kept: true });

    assert.deepEqual(await listed(t.api, s), []);
    const info = await t.api.get(`/v1/sessions/${s}`);
    assert.equal(info.status, 200);
    assert.equal(info.body.message_count, 0);
    assert.equal(info.body.hot_bytes, 0);
    assert.equal(info.body.start_seq, 0);
    assert.equal(info.body.start_at, null);
    assert.deepEqual(info.body.summary, { version: 1, cursor_seq: 4, status: 'ok' });
    const rows = await sessionRows(t.tenantId, s);
    assert.equal(rows.messages, 0);
    assert.equal(rows.message_vectors, 0);
    assert.equal(rows.summaries, 1);
    const summary = await t.api.get(`/v1/sessions/${s}/summary`);
    assert.equal(summary.status, 200);
    assert.deepEqual(summary.body.summary, SUMMARY);

    // Redis: no pending work or idempotency entries; the state hash moved to the new generation.
    const keys = inboxKeys(svc.config.prefix, t.tenantId, s);
    assert.deepEqual(await sessionKeys(t.tenantId, s), [keys.sess]);
    assert.equal(await redis.hget(keys.sess, 'gen'), '2');

    assert.deepEqual(await archive(t.api, s, [user('five')]), [5]);
    const after = await listed(t.api, s);
    assert.deepEqual(
      after!.map((m) => [m.seq, m.content]),
      [[5, 'five']],
    );
    // The summary still points before the new message, so the sweep summarises it next.
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).body.summary.cursor_seq, 4);
  });

  void test('?keep_summary=false clears the summary too', async () => {
    const t = await svc.newTenant();
    const s = sid('chat');
    await archive(t.api, s, [user('one'), assistant('two')]);
    await putSummary(t.tenantId, s, 2);
    const r = await t.api.post(`/v1/sessions/${s}/reset?keep_summary=false`);
    assert.equal(r.status, 200);
    assert.deepEqual(r.body, { session_id: s, reset: true, summary_kept: false });
    assert.equal((await t.api.get(`/v1/sessions/${s}/summary`)).status, 404);
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).body.summary, null);
    assert.equal((await sessionRows(t.tenantId, s)).summaries, 0);
    assert.equal((await t.api.post(`/v1/sessions/${s}/reset?keep_summary=maybe`)).status, 400);
  });

  void test('options in a body or unknown query parameters are a 400 that changes nothing', async () => {
    const t = await svc.newTenant();
    const s = sid('opts');
    await archive(t.api, s, [user('one'), assistant('two')]);
    await putSummary(t.tenantId, s, 2);
    // The option belongs in the query: a body is refused rather than ignored.
    const r = await t.api.post(`/v1/sessions/${s}/reset`, { keep_summary: false });
    assert.equal(r.status, 400);
    assert.match(r.body.error.message, /\?keep_summary=false/);
    const summarize = await t.api.post(`/v1/sessions/${s}/summarize`, { wait: true });
    assert.equal(summarize.status, 400);
    assert.match(summarize.body.error.message, /\?wait=true/);
    // Every route of a session (and the tenant's tools and jobs) refuses a parameter it does not know.
    for (const [what, bad] of [
      ['delete', t.api.del(`/v1/sessions/${s}?foo=1`)],
      ['export', t.api.get(`/v1/sessions/${s}/export?format=csv`)],
      ['reset', t.api.post(`/v1/sessions/${s}/reset?foo=1`)],
      ['session', t.api.get(`/v1/sessions/${s}?foo=1`)],
      ['summary', t.api.get(`/v1/sessions/${s}/summary?foo=1`)],
      ['tools', t.api.get('/v1/tools?foo=1')],
      ['tool call', t.api.post(`/v1/sessions/${s}/tools/chat_history?foo=1`, { keyword: 'one' })],
      ['job', t.api.get('/v1/jobs/summary.1?foo=1')],
    ] as const) {
      const r = await bad;
      assert.equal(r.status, 400, what);
      assert.match(JSON.stringify(r.body.error), /foo|format/, what);
    }
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).body.message_count, 2);
    assert.equal((await t.api.get(`/v1/sessions/${s}/summary`)).status, 200);
    // An empty body (what most clients send with a bare POST) is fine.
    assert.equal((await t.api.post(`/v1/sessions/${s}/reset`, {})).status, 200);
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).body.message_count, 0);
  });

  void test('drops messages still waiting in the inbox (the worker is held back)', async () => {
    const t = await svc.newTenant();
    const s = sid('held');
    await archive(t.api, s, [user('kept until reset')]);
    const ingest = svc.workers!.workers.find((w) => w.name === 'ingest')!;
    await ingest.pause();
    try {
      assert.deepEqual(await accepted(t.api, s, [user('pending a'), user('pending b')]), [2, 3]);
      assert.equal(await redis.llen(inboxKeys(svc.config.prefix, t.tenantId, s).inbox), 2);
      const before = await dropped();
      assert.equal((await t.api.post(`/v1/sessions/${s}/reset`)).status, 200);
      assert.equal(await redis.llen(inboxKeys(svc.config.prefix, t.tenantId, s).inbox), 0);
      // Accepted and never archived: counted, so that accepted = archived + dropped.
      assert.equal((await dropped()) - before, 2);
    } finally {
      await ingest.resume();
    }
    assert.deepEqual(await archive(t.api, s, [user('after')]), [4]);
    await settled(t.tenantId, s);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => [m.seq, m.content]),
      [[4, 'after']],
    );
  });
  void test('a message accepted while a reset runs keeps its id: a retry gets its seq, another body 409', async () => {
    const t = await svc.newTenant();
    const s = sid('racing');
    await archive(t.api, s, [user('before the reset', { id: 'old-1' })]);
    const ingest = svc.workers!.workers.find((w) => w.name === 'ingest')!;
    await ingest.pause();
    // A lock that the reset's DELETE waits for: the reset has taken its cut (seq 1) and holds the
    // session row while X is accepted, so X is kept by the reset, still in the inbox.
    const locker = new pg.Client({ connectionString: svc.config.databaseUrl });
    await locker.connect();
    try {
      await locker.query('BEGIN');
      await locker.query('LOCK TABLE messages IN SHARE MODE');
      const reset = t.api.post(`/v1/sessions/${s}/reset`);
      await eventually(
        async () =>
          (
            await q<{ n: number }>(
              `SELECT count(*)::int AS n FROM pg_locks WHERE NOT granted AND relation = 'messages'::regclass
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`,
            )
          )[0]!.n > 0,
        10_000,
        'the reset waiting for the lock',
      );
      const x = await t.api.post(`/v1/sessions/${s}/messages`, {
        messages: [user('posted during the reset', { id: 'X' })],
      });
      assert.equal(x.status, 202, JSON.stringify(x.body));
      assert.equal(x.body.messages[0].seq, 2);
      await locker.query('COMMIT');
      assert.equal((await reset).status, 200);

      const again = await t.api.post(`/v1/sessions/${s}/messages`, {
        messages: [user('posted during the reset', { id: 'X' })],
      });
      assert.equal(again.status, 202, JSON.stringify(again.body));
      assert.equal(again.body.accepted, 0);
      assert.equal(again.body.messages[0].seq, 2);
      const other = await t.api.post(`/v1/sessions/${s}/messages`, {
        messages: [user('another body under the same id', { id: 'X' })],
      });
      assert.equal(other.status, 409, JSON.stringify(other.body));
      assert.equal(other.body.error.code, 'id_conflict');
    } finally {
      await locker.end();
      await ingest.resume();
    }
    await settled(t.tenantId, s);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => [m.seq, m.id, m.content]),
      [[2, 'X', 'posted during the reset']],
    );
  });

  void test('a message accepted while a reset runs whose flush request was lost is flushed by the reset, not left to the sweeper', async () => {
    const own = await quietService();
    const ingestQueue = own.deps.queues.ingest as unknown as {
      add: (...args: unknown[]) => Promise<unknown>;
    };
    const locker = new pg.Client({ connectionString: own.config.databaseUrl });
    try {
      const t = await own.newTenant();
      const s = sid('lost-flush');
      await archive(t.api, s, [user('before the reset')]);
      const { running: reset } = await whileMessagesLocked(own, locker, () =>
        t.api.post(`/v1/sessions/${s}/reset`),
      );
      // X is accepted (kept by the reset: after its cut), but adding its flush job fails (a Redis
      // blip between the accept script and the add): the session is armed and no job is queued.
      const failuresBefore = (await own.deps.metrics.enqueueFailures.get()).values[0]?.value ?? 0;
      ingestQueue.add = () => Promise.reject(new Error('Connection is closed.'));
      const x = await t.api
        .post(`/v1/sessions/${s}/messages`, { messages: [user('posted during the reset', { id: 'X' })] })
        .finally(() => delete (ingestQueue as { add?: unknown }).add);
      assert.equal(x.status, 202, JSON.stringify(x.body));
      assert.equal(x.body.messages[0].seq, 2);
      assert.equal(
        ((await own.deps.metrics.enqueueFailures.get()).values[0]?.value ?? 0) - failuresBefore,
        1,
      );

      await locker.query('COMMIT');
      assert.equal((await reset).status, 200);

      // The reset's Redis step found X waiting and asked for its flush: archived now.
      await archivedAlone(own, t, s, 'posted during the reset');
    } finally {
      await stopQuiet(own, locker);
    }
  });
});

/** A service of its own whose ingest sweeper never comes round in a test (in production: every 30 s). */
const quietService = () =>
  startTestService({ worker: { ingestSweepEveryMs: 3_600_000, ingestSweepAfterMs: 3_600_000 } });

async function stopQuiet(own: TestService, locker?: pg.Client): Promise<void> {
  await locker?.end();
  await own.stop();
  await deleteRedisPrefix(own.config.prefix);
  await dropTestDatabase(own.config.databaseUrl!);
}

/**
 * Starts `clear` (a reset or delete) while `locker` holds `messages` in SHARE mode: the clear has
 * taken its cut and holds the session row, waiting. Returns it running; COMMIT on `locker` lets it on.
 */
async function whileMessagesLocked<T>(
  own: TestService,
  locker: pg.Client,
  clear: () => Promise<T>,
): Promise<{ running: Promise<T> }> {
  await locker.connect();
  await locker.query('BEGIN');
  await locker.query('LOCK TABLE messages IN SHARE MODE');
  const running = clear();
  await eventually(
    async () =>
      (
        await own.deps.db.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM pg_locks WHERE NOT granted AND relation = 'messages'::regclass
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`,
        )
      ).rows[0]!.n > 0,
    10_000,
    'the clear waiting for the lock',
  );
  return { running };
}

/** Until `content` (id X, seq 2) is the session's only archived message, and its inbox is empty. */
async function archivedAlone(
  own: TestService,
  t: { api: Api; tenantId: string },
  s: string,
  content: string,
) {
  const archived = await eventually(
    async () => {
      const m = await listed(t.api, s);
      return m && m.length > 0 ? m : null;
    },
    10_000,
    'the message accepted during the clear to be archived',
  );
  assert.deepEqual(
    archived.map((m) => [m.seq, m.id, m.content]),
    [[2, 'X', content]],
  );
  assert.equal(await redis.llen(inboxKeys(own.config.prefix, t.tenantId, s).inbox), 0);
}

void describe('delete', () => {
  void test("a message accepted while a delete runs is archived at once: its flush is not removed with the old session's jobs", async () => {
    const own = await quietService();
    const locker = new pg.Client({ connectionString: own.config.databaseUrl });
    try {
      const t = await own.newTenant();
      const s = sid('during-delete');
      await archive(t.api, s, [user('before the delete')]);
      const { running: deleting } = await whileMessagesLocked(own, locker, () =>
        t.api.del(`/v1/sessions/${s}`),
      );
      // The worker is behind: X's flush job waits in the queue while the delete finishes, which
      // removed it with the deleted session's queued jobs, and the one its Redis step asked for.
      const ingest = own.workers!.workers.find((w) => w.name === 'ingest')!;
      await ingest.pause();
      try {
        const x = await t.api.post(`/v1/sessions/${s}/messages`, {
          messages: [user('posted during the delete', { id: 'X' })],
        });
        assert.equal(x.status, 202, JSON.stringify(x.body));
        assert.equal(x.body.messages[0].seq, 2);
        await locker.query('COMMIT');
        assert.equal((await deleting).status, 204);
      } finally {
        await ingest.resume();
      }
      await archivedAlone(own, t, s, 'posted during the delete');
    } finally {
      await stopQuiet(own, locker);
    }
  });

  void test("a message posted between a delete's commit and its job scan is archived at once, not left to the sweeper", async () => {
    const own = await quietService();
    type Scanned = { getRanges: (...a: unknown[]) => Promise<string[]> };
    const queues = QUEUE_NAMES.map((n) => own.deps.queues[n] as unknown as Scanned);
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    let scanning = false;
    try {
      const t = await own.newTenant();
      const s = sid('after-commit');
      await archive(t.api, s, [user('before the delete')]);
      // The delete has committed and waits before scanning the session's queued jobs (a busy
      // Redis, long queues); the worker is behind, so a flush job queued meanwhile is still there.
      for (const queue of queues) {
        const scan = queue.getRanges.bind(queue);
        queue.getRanges = async (...a: unknown[]) => {
          if (!scanning) {
            scanning = true;
            await gate;
          }
          return scan(...a);
        };
      }
      const ingest = own.workers!.workers.find((w) => w.name === 'ingest')!;
      await ingest.pause();
      try {
        const deleting = t.api.del(`/v1/sessions/${s}`);
        await eventually(async () => scanning, 10_000, 'the delete to reach its job scan');
        // X finds Redis behind the archive, moves it to the new generation itself and queues its
        // flush, which the scan then removes with the old session's jobs; the delete's own Redis
        // step has nothing left to do.
        const x = await t.api.post(`/v1/sessions/${s}/messages`, {
          messages: [user('posted after the delete committed', { id: 'X' })],
        });
        assert.equal(x.status, 202, JSON.stringify(x.body));
        assert.equal(x.body.messages[0].seq, 2);
        release();
        assert.equal((await deleting).status, 204);
      } finally {
        release();
        for (const queue of queues) delete (queue as Partial<Scanned>).getRanges;
        await ingest.resume();
      }
      await archivedAlone(own, t, s, 'posted after the delete committed');
    } finally {
      await stopQuiet(own);
    }
  });

  void test('removes messages, vectors, summary, caches and queued payloads; usage keeps its counts without the id', async () => {
    const t = await svc.newTenant();
    const s = sid('gone');
    const seqs = await archive(t.api, s, [user('secret one'), assistant('secret two'), user('secret three')]);
    await eventually(async () => (await sessionRows(t.tenantId, s)).message_vectors === 3, 15_000, 'vectors');
    await putSummary(t.tenantId, s, 3);
    await q(
      `INSERT INTO llm_usage (tenant_id, session_id, purpose, model, calls, input_tokens, output_tokens)
       VALUES ($1, $2, 'summary', 'm', 2, 100, 20)`,
      [t.tenantId, s],
    );
    const cache = `${svc.config.prefix}:ctxrel:${t.tenantId}:${s}`;
    const dead = `${svc.config.prefix}:dead:${t.tenantId}:${s}`;
    await redis.hset(cache, 'v1:abc', 'secret judgement');
    await redis.rpush(dead, '9 1 {"secret":true}');

    const r = await t.api.del(`/v1/sessions/${s}`);
    assert.equal(r.status, 204);
    assert.equal(r.text, '');

    for (const path of [
      `/v1/sessions/${s}`,
      `/v1/sessions/${s}/messages`,
      `/v1/sessions/${s}/export`,
      `/v1/sessions/${s}/summary`,
    ]) {
      assert.equal((await t.api.get(path)).status, 404, path);
    }
    assert.equal((await t.api.del(`/v1/sessions/${s}`)).status, 404);
    assert.equal((await t.api.post(`/v1/sessions/${s}/reset`)).status, 404);
    const listedSessions = await t.api.get('/v1/sessions');
    assert.ok(
      !listedSessions.body.sessions.some((x: { id: string }) => x.id === s),
      '!listedSessions.body.sessions.some((x: { id: string }) => x.id === s)',
    );

    // Postgres: nothing in any session table but a content-free tombstone and the usage counts.
    const rows = await sessionRows(t.tenantId, s);
    for (const [table, n] of Object.entries(rows)) assert.equal(n, 0, `${table} still holds ${n} rows`);
    const [tomb] = await q(
      'SELECT generation, message_count, hot_bytes, deleted_at, last_message_at, next_seq FROM sessions WHERE tenant_id = $1 AND id = $2',
      [t.tenantId, s],
    );
    assert.ok(tomb.deleted_at instanceof Date, 'tomb.deleted_at instanceof Date');
    assert.equal(tomb.generation, 2);
    assert.equal(tomb.message_count, 0);
    assert.equal(tomb.hot_bytes, '0');
    assert.equal(tomb.last_message_at, null);
    const usage = await q('SELECT session_id, calls, input_tokens FROM llm_usage WHERE tenant_id = $1', [
      t.tenantId,
    ]);
    assert.deepEqual(usage, [{ session_id: null, calls: 2, input_tokens: '100' }]);

    // Redis: only the counter state remains, without any content, marked deleted (the next accept
    // revives the row at once).
    const keys = inboxKeys(svc.config.prefix, t.tenantId, s);
    assert.deepEqual(await sessionKeys(t.tenantId, s), [keys.sess]);
    const state = await redis.hgetall(keys.sess);
    assert.deepEqual(Object.keys(state).sort(), [
      'archived',
      'armed',
      'deleted',
      'gen',
      'idsat',
      'idsmark',
      'seq',
    ]);
    assert.equal(state.gen, '2');
    assert.equal(state.deleted, '1');
    // …for a day, not for good (every deleted or reaped temp- session kept one): losing it loses
    // nothing, the next accept seeds it from the tombstone row.
    const ttl = await redis.ttl(keys.sess);
    assert.ok(ttl > 86_000 && ttl <= 86_400, `ttl ${ttl}`);
    await redis.del(keys.sess);

    // Writing again starts a new session after the old seqs (seq is never reused), created now.
    const again = await archive(t.api, s, [user('new life')]);
    assert.ok(again[0]! > Math.max(...seqs), 'again[0]! > Math.max(...seqs)');
    // The live session's state expires a week after its last accept (not for good: an idle
    // session's state is seeded again from Postgres and its inbox at its next accept).
    const live = await redis.ttl(keys.sess);
    assert.ok(live > SESSION_STATE_TTL_SECONDS - 100 && live <= SESSION_STATE_TTL_SECONDS, `ttl ${live}`);
    assert.equal(SESSION_STATE_TTL_SECONDS, 7 * 86_400);
    assert.equal(await redis.hget(keys.sess, 'deleted'), null);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => m.content),
      ['new life'],
    );
    const reborn = (await t.api.get(`/v1/sessions/${s}`)).body;
    assert.equal(reborn.summary, null);
    assert.equal(reborn.message_count, 1);
    assert.ok(
      new Date(reborn.created_at) >= tomb.deleted_at,
      `created_at ${reborn.created_at} is the old life's`,
    );
  });

  void test('a session whose state and armed mark are lost while its inbox holds messages is flushed at its next post', async () => {
    // The inbox outlived the session's state hash and its member of the armed set (and its flush
    // job): the seed marked the session armed, so the next accept asked for no flush, and nothing
    // (not the ingest sweeper, which reads the armed set) ever drained it.
    const t = await svc.newTenant();
    const s = sid('unarmed');
    const keys = inboxKeys(svc.config.prefix, t.tenantId, s);
    const ingest = svc.workers!.workers.find((w) => w.name === 'ingest')!;
    await ingest.pause();
    try {
      const first = await t.api.post(`/v1/sessions/${s}/messages`, { messages: [user('waiting')] });
      assert.equal(first.status, 202, first.text);
      for (const job of await svc.deps.queues.ingest.getJobs(['waiting', 'prioritized', 'delayed'])) {
        if (job.data.sessionId === s) await job.remove();
      }
      await redis.del(keys.sess);
      assert.equal(await redis.zrem(keys.armed, keys.member), 1);
      assert.equal(await redis.llen(keys.inbox), 1);
    } finally {
      await ingest.resume();
    }
    const second = await t.api.post(`/v1/sessions/${s}/messages?wait=true`, { messages: [user('next')] });
    assert.equal(second.status, 201, second.text);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => m.content),
      ['waiting', 'next'],
    );
  });

  void test('deleting a deleted session whose new messages still wait removes those too', async () => {
    const t = await svc.newTenant();
    const s = sid('again');
    await archive(t.api, s, [user('first life')]);
    assert.equal((await t.api.del(`/v1/sessions/${s}`)).status, 204);
    const ingest = svc.workers!.workers.find((w) => w.name === 'ingest')!;
    await ingest.pause();
    try {
      assert.equal(
        (await t.api.post(`/v1/sessions/${s}/messages`, { messages: [user('second life')] })).status,
        202,
      );
      // A session exists from its first accepted message, before its drain.
      assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 200);
      assert.equal((await t.api.del(`/v1/sessions/${s}`)).status, 204);
      assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404);
    } finally {
      await ingest.resume();
    }
    await settled(t.tenantId, s);
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404);
    assert.equal((await sessionRows(t.tenantId, s)).messages, 0);
    assert.equal((await t.api.del(`/v1/sessions/${s}`)).status, 404);
  });

  void test('a reset sent to a half-deleted session answers 404 and leaves it deleted: the next post brings it back at once', async () => {
    const t = await svc.newTenant();
    const s = sid('half-deleted');
    await archive(t.api, s, [user('before the delete')]);
    // The delete's transaction committed, then its process died before the Redis step.
    await deleteSessionMessages(svc.deps.db, t.tenantId, s);
    await markSessionCleared(svc.deps.db, {
      tenantId: t.tenantId,
      sessionId: s,
      generation: 2,
      deleted: true,
      clearedThroughSeq: 1,
    });
    assert.equal((await t.api.post(`/v1/sessions/${s}/reset`)).status, 404);
    const ingest = svc.workers!.workers.find((w) => w.name === 'ingest')!;
    await ingest.pause();
    try {
      assert.deepEqual(await accepted(t.api, s, [user('a fresh session')]), [2]);
      // Visible (GET, lists) from that post on, before its first message is archived.
      assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 200);
      const list = await t.api.get('/v1/sessions');
      assert.deepEqual(
        list.body.sessions.map((x: { id: string }) => x.id),
        [s],
      );
    } finally {
      await ingest.resume();
    }
    await settled(t.tenantId, s);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => [m.seq, m.content]),
      [[2, 'a fresh session']],
    );
  });

  void test('a delete racing queued ingest work: nothing of the old generation reappears', async () => {
    // 3,000 messages per round: the delete lands while drains are committing batches of 500
    // (measured: 0-500 archived and 2,500-3,000 still in the inbox at the moment of the delete).
    const t = await svc.newTenant();
    for (let round = 0; round < 3; round++) {
      const s = sid('race');
      const posts = await Promise.all(
        Array.from({ length: 30 }, (_, i) =>
          t.api.post(`/v1/sessions/${s}/messages`, {
            messages: Array.from({ length: 100 }, (_, j) => user(`old ${round}/${i}/${j}`)),
          }),
        ),
      );
      assert.ok(
        posts.every((p) => p.status === 202),
        'posts.every((p) => p.status === 202)',
      );
      const oldMax = Math.max(...posts.flatMap((p) => p.body.messages.map((m: { seq: number }) => m.seq)));
      const del = await t.api.del(`/v1/sessions/${s}`);
      assert.equal(del.status, 204);
      await settled(t.tenantId, s);

      assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404);
      const rows = await sessionRows(t.tenantId, s);
      for (const [table, n] of Object.entries(rows))
        assert.equal(n, 0, `round ${round}: ${table} holds ${n} rows`);

      const fresh = await archive(t.api, s, [user(`new ${round}`), assistant('ok')]);
      assert.ok(fresh[0]! > oldMax, `round ${round}: seq ${fresh[0]} after ${oldMax}`);
      await settled(t.tenantId, s);
      const now = await listed(t.api, s);
      assert.deepEqual(
        now!.map((m) => m.content),
        [`new ${round}`, 'ok'],
      );
      assert.equal((await sessionRows(t.tenantId, s)).messages, 2);
    }
  });

  void test('a reset whose Redis step never ran is finished by the reconciler (new messages are kept)', async () => {
    const t = await svc.newTenant();
    const s = sid('crash');
    await archive(t.api, s, [user('before')]);
    // What a crash right after the reset's commit leaves: Postgres moved on, Redis did not.
    await q(
      `UPDATE sessions SET generation = generation + 1, message_count = 0, hot_bytes = 0 WHERE tenant_id = $1 AND id = $2`,
      [t.tenantId, s],
    );
    await q('DELETE FROM messages WHERE tenant_id = $1 AND session_id = $2', [t.tenantId, s]);
    const [behind] = await q(
      'SELECT generation, redis_generation FROM sessions WHERE tenant_id = $1 AND id = $2',
      [t.tenantId, s],
    );
    assert.deepEqual(behind, { generation: 2, redis_generation: 1 });

    const r = await reconcileGenerations(svc.deps, lifecycle);
    assert.ok(r.reconciled >= 1, 'r.reconciled >= 1');
    assert.equal(await redis.hget(inboxKeys(svc.config.prefix, t.tenantId, s).sess, 'gen'), '2');
    const [caught] = await q('SELECT redis_generation FROM sessions WHERE tenant_id = $1 AND id = $2', [
      t.tenantId,
      s,
    ]);
    assert.equal(caught.redis_generation, 2);
    const seqs = await archive(t.api, s, [user('after')]);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => [m.seq, m.content]),
      [[seqs[0], 'after']],
    );
  });

  void test('the reconciler finds lagging sessions through its index, and a worker runs it at start once, not at every re-assert', async () => {
    const t = await svc.newTenant();
    // Many sessions, none lagging: what every idle minute of a big deployment looks like.
    await q(
      `INSERT INTO sessions (tenant_id, id) SELECT $1, 'idle-' || i FROM generate_series(1, 5000) AS i`,
      [t.tenantId],
    );
    await q('ANALYZE sessions');
    let sent: { text: string; params: unknown[] } | null = null;
    const recording: Queryable = {
      query: (text, params) => {
        sent = { text, params: params ?? [] };
        return Promise.resolve({ rows: [], rowCount: 0 }) as never;
      },
    };
    await sessionsBehindInRedis(recording, 500);
    const call = sent as unknown as { text: string; params: unknown[] };
    const [plan] = await q(`EXPLAIN (FORMAT JSON) ${call.text}`, call.params);
    const nodes = JSON.stringify(plan['QUERY PLAN']);
    assert.match(nodes, /sessions_redis_behind/, nodes);
    assert.doesNotMatch(nodes, /Seq Scan/, nodes);

    // workers/main.ts calls every extension's schedule() again each minute.
    let reconciles = 0;
    const counting = {
      ...svc.deps,
      db: {
        ...svc.deps.db,
        query: (text: string, params?: unknown[], o?: unknown) => {
          if (text.includes('redis_generation <> generation')) reconciles++;
          return svc.deps.db.query(text, params as never, o as never);
        },
      },
    };
    const ext = await lifecycleExtension(counting as never, []);
    await ext.schedule!();
    await ext.schedule!();
    await ext.schedule!();
    await eventually(async () => reconciles >= 1, 5000, 'the start-up reconcile');
    await new Promise((r) => setTimeout(r, 300));
    assert.equal(reconciles, 1);
    await q(`DELETE FROM sessions WHERE tenant_id = $1 AND id LIKE 'idle-%'`, [t.tenantId]);
  });

  void test('messages accepted between a reset’s commit and its Redis step (a crash) are kept', async () => {
    const t = await svc.newTenant();
    const s = sid('window');
    await archive(t.api, s, [user('cleared 1'), user('cleared 2')]);
    // The reset's transaction committed (it records the history it cleared), then the process died.
    await q(
      `UPDATE sessions SET generation = generation + 1, message_count = 0, hot_bytes = 0,
         cleared_through_seq = next_seq - 1 WHERE tenant_id = $1 AND id = $2`,
      [t.tenantId, s],
    );
    await q('DELETE FROM messages WHERE tenant_id = $1 AND session_id = $2', [t.tenantId, s]);
    // Redis still stamps the old generation on new messages; they were acknowledged: keep them.
    const seqs = await archive(t.api, s, [user('accepted meanwhile 1'), user('accepted meanwhile 2')]);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => [m.seq, m.content]),
      [
        [seqs[0], 'accepted meanwhile 1'],
        [seqs[1], 'accepted meanwhile 2'],
      ],
    );
    await reconcileGenerations(svc.deps, lifecycle);
    const later = await archive(t.api, s, [user('after reconcile')]);
    assert.ok(later[0]! > seqs[1]!, 'later[0]! > seqs[1]!');
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => m.content),
      ['accepted meanwhile 1', 'accepted meanwhile 2', 'after reconcile'],
    );
  });

  void test('messages a reset cleared that still wait in the inbox when its Redis step never ran are dropped and counted, not archived', async () => {
    const t = await svc.newTenant();
    const s = sid('cut');
    await archive(t.api, s, [user('archived before the reset')]);
    const before = await dropped();
    const ingest = svc.workers!.workers.find((w) => w.name === 'ingest')!;
    await ingest.pause();
    try {
      assert.deepEqual(await accepted(t.api, s, [user('cleared a'), user('cleared b')]), [2, 3]);
      // The reset's transaction committed (its cut is everything handed out: seq 3), then the
      // process died before its Redis step: the inbox still holds seqs 2 and 3 under generation 1.
      await deleteSessionMessages(svc.deps.db, t.tenantId, s);
      await markSessionCleared(svc.deps.db, {
        tenantId: t.tenantId,
        sessionId: s,
        generation: 2,
        deleted: false,
        clearedThroughSeq: 3,
      });
    } finally {
      await ingest.resume();
    }
    await settled(t.tenantId, s);
    // The drain tells the cleared history (an older generation, at or below the cut) from
    // messages accepted since: these were cleared, so they are not archived, and they are counted
    // as dropped, so that accepted = archived + dropped still holds.
    assert.deepEqual(await listed(t.api, s), []);
    assert.equal((await dropped()) - before, 2);
    // The reconciler finishes the reset without counting them again, and seq goes on past them.
    await reconcileGenerations(svc.deps, lifecycle);
    assert.equal((await dropped()) - before, 2);
    assert.deepEqual(await archive(t.api, s, [user('after')]), [4]);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => [m.seq, m.content]),
      [[4, 'after']],
    );
  });
});

void describe('export and import', () => {
  const varied = (): Msg[] => [
    { role: 'system', content: 'be brief', sent_at: '2026-01-02T03:04:05.123456789Z' },
    user(
      [
        { type: 'text', text: 'look at this' },
        { type: 'image_url', image_url: { url: 'https://x.test/a.png', detail: 'low' } },
      ],
      {
        id: 'u-1',
        sent_at: '2026-01-02T03:04:06Z',
        metadata: { agent: 'a1', n: 1 },
      },
    ),
    assistant(null, {
      sent_at: '2026-01-02 11:04:07',
      tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'ls', arguments: '{"path":"/"}' } }],
    }),
    { role: 'tool', tool_call_id: 'call_1', name: 'ls', content: 'bin etc', sent_at: '1767323048000000000' },
    assistant('二十個字的中文回答', { id: 'a-2', sent_at: '2026-01-02T03:04:09Z' }),
    user('no sent_at given'),
  ];

  void test('export streams JSON Lines and import into a new session gives identical messages and summary', async () => {
    const t = await svc.newTenant();
    const src = sid('src');
    // A reset first, so the source seqs do not start at 1 and the cursor has to be mapped.
    await archive(t.api, src, [user('dropped by reset'), user('also dropped')]);
    assert.equal((await t.api.post(`/v1/sessions/${src}/reset`)).status, 200);
    const seqs = await archive(t.api, src, varied());
    assert.deepEqual(seqs, [3, 4, 5, 6, 7, 8]);
    await putSummary(t.tenantId, src, 6);

    const ex = await t.api.get(`/v1/sessions/${src}/export`);
    assert.equal(ex.status, 200);
    assert.match(ex.headers.get('content-type') ?? '', /^application\/x-ndjson/);
    const lines = ex.text
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l));
    assert.equal(lines.length, 7);
    assert.deepEqual(
      lines.map((l) => l.type),
      ['message', 'message', 'message', 'message', 'message', 'message', 'summary'],
    );
    const original = (await listed(t.api, src))!;
    assert.deepEqual(
      lines.slice(0, 6).map(({ type: _t, ...m }) => m),
      original,
    );
    assert.deepEqual(lines[6].summary, SUMMARY);
    assert.equal(lines[6].cursor_seq, 6);

    const dst = sid('dst');
    const im = await t.api.post(`/v1/sessions/${dst}/import`, ex.text, {
      'content-type': 'application/x-ndjson',
    });
    assert.equal(im.status, 201, JSON.stringify(im.body));
    assert.deepEqual(im.body, {
      session_id: dst,
      imported: 6,
      first_seq: 1,
      last_seq: 6,
      summary: { restored: true, version: 1, cursor_seq: 4 },
    });
    const copied = (await listed(t.api, dst))!;
    const strip = (m: any) => {
      const { seq: _s, ...rest } = m;
      return rest;
    };
    assert.deepEqual(copied.map(strip), original.map(strip));
    assert.deepEqual(
      copied.map((m) => m.seq),
      [1, 2, 3, 4, 5, 6],
    );
    const sum = await t.api.get(`/v1/sessions/${dst}/summary`);
    assert.deepEqual(sum.body.summary, SUMMARY);
    assert.equal(sum.body.cursor_seq, 4);

    // A second round trip is byte-identical apart from seq numbers.
    const again = await t.api.get(`/v1/sessions/${dst}/export`);
    const norm = (text: string) =>
      text
        .trim()
        .split('\n')
        .map((l) => {
          const { seq: _s, cursor_seq: _c, updated_at: _u, ...rest } = JSON.parse(l);
          return rest;
        });
    assert.deepEqual(norm(again.text), norm(ex.text));

    const twice = await t.api.post(`/v1/sessions/${dst}/import`, ex.text, {
      'content-type': 'application/jsonl',
    });
    assert.equal(twice.status, 409);
    assert.equal(twice.body.error.code, 'session_not_empty');
  });

  void test('import archives in sent_at order (stable for equal times), only into an empty session', async () => {
    const t = await svc.newTenant();
    const s = sid('imp');
    const r = await t.api.post(`/v1/sessions/${s}/import`, {
      messages: [
        user('third', { sent_at: '2025-05-01T00:00:03Z' }),
        user('first', { sent_at: '2025-05-01T00:00:01Z' }),
        user('second a', { sent_at: '2025-05-01T00:00:02Z', id: 'same-time-1' }),
        user('second b', { sent_at: '2025-05-01T00:00:02Z', id: 'same-time-2' }),
      ],
    });
    assert.equal(r.status, 201, JSON.stringify(r.body));
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => [m.seq, m.content]),
      [
        [1, 'first'],
        [2, 'second a'],
        [3, 'second b'],
        [4, 'third'],
      ],
    );
    // Idempotency covers imported ids like posted ones.
    const repost = await t.api.post(`/v1/sessions/${s}/messages`, {
      messages: [user('second a', { id: 'same-time-1', sent_at: '2025-05-01T00:00:02Z' })],
    });
    assert.equal(repost.status, 202);
    assert.deepEqual(repost.body.messages, [{ id: 'same-time-1', seq: 2 }]);
    assert.equal(repost.body.accepted, 0);

    const more = await t.api.post(`/v1/sessions/${s}/import`, { messages: [user('late')] });
    assert.equal(more.status, 409);
    // New posts continue after the imported seqs.
    assert.deepEqual(await archive(t.api, s, [user('live')]), [5]);

    // A deleted session is empty: import brings it back.
    assert.equal((await t.api.del(`/v1/sessions/${s}`)).status, 204);
    const back = await t.api.post(`/v1/sessions/${s}/import?wait=true`, {
      messages: [user('reborn', { sent_at: '2025-06-01T00:00:00Z' })],
    });
    assert.equal(back.status, 201);
    assert.equal(back.body.first_seq, 6);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => m.content),
      ['reborn'],
    );
  });

  // An import publishes its messages to the inbox from inside its transaction; these make that
  // transaction end without committing, after the publish (a deferred trigger on `summaries` runs
  // at COMMIT, for this session only).
  const importLines = (tag: string) =>
    [
      ...[1, 2, 3].map((i) =>
        JSON.stringify({
          type: 'message',
          seq: i,
          id: `${tag}-${i}`,
          role: 'user',
          content: `${tag} note ${i}`,
          sent_at: `2026-01-0${i}T00:00:00Z`,
        }),
      ),
      JSON.stringify({ type: 'summary', summary: SUMMARY, cursor_seq: 2 }),
    ].join('\n');
  const atCommit = async (session: string, body: string) => {
    const fn = `commit_${randomBytes(4).toString('hex')}`;
    await q(`CREATE FUNCTION ${fn}() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN IF NEW.session_id = '${session}' THEN ${body} END IF; RETURN NULL; END $$`);
    await q(`CREATE CONSTRAINT TRIGGER ${fn} AFTER INSERT OR UPDATE ON summaries
      DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ${fn}()`);
    return async () => {
      await q(`DROP TRIGGER IF EXISTS ${fn} ON summaries`);
      await q(`DROP FUNCTION IF EXISTS ${fn}()`);
    };
  };
  const ndjson = { 'content-type': 'application/x-ndjson' };

  void test('an import whose COMMIT fails stores nothing, and its retry imports the messages and the summary', async () => {
    // Setup: this session's COMMIT fails once its messages are in the inbox.
    const t = await svc.newTenant();
    const s = sid('commit-fails');
    const restore = await atCommit(s, `RAISE EXCEPTION 'commit refused';`);
    let failed;
    try {
      // Action
      failed = await t.api.post(`/v1/sessions/${s}/import`, importLines('cf'), ndjson);
    } finally {
      await restore();
    }

    // Assert: an error, and nothing stored or waiting (before, the messages stayed in the inbox
    // and were archived without the summary, and the retry answered 409 session_not_empty).
    assert.ok(failed.status >= 500, `${failed.status} ${failed.text}`);
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404);
    const keys = inboxKeys(svc.config.prefix, t.tenantId, s);
    assert.equal(await redis.llen(keys.inbox), 0);
    // Not left armed by the publish: the retry's publish asks for a flush (else it waited for
    // the ingest sweeper, 60-90 s in production).
    assert.notEqual(await redis.hget(keys.sess, 'armed'), '1');
    assert.equal(await redis.zscore(`${svc.config.prefix}:armed`, keys.member), null);
    const retry = await t.api.post(`/v1/sessions/${s}/import?wait=true`, importLines('cf'), ndjson);
    assert.equal(retry.status, 201, retry.text);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => [m.seq, m.id, m.content]),
      [1, 2, 3].map((i) => [i, `cf-${i}`, `cf note ${i}`]),
    );
    const sum = await t.api.get(`/v1/sessions/${s}/summary`);
    assert.deepEqual([sum.body.summary, sum.body.cursor_seq], [SUMMARY, 2]);
  });

  void test('a drain that waits on an import whose COMMIT fails leaves no session behind', async () => {
    // Setup: this session's COMMIT waits 2 s, then fails, once its messages are in the inbox.
    const t = await svc.newTenant();
    const s = sid('drain-waits');
    const keys = inboxKeys(svc.config.prefix, t.tenantId, s);
    const restore = await atCommit(s, `PERFORM pg_sleep(2); RAISE EXCEPTION 'commit refused';`);
    let failed;
    let drained;
    try {
      const importing = t.api.post(`/v1/sessions/${s}/import`, importLines('dw'), ndjson);
      await eventually(async () => (await redis.llen(keys.inbox)) === 3, 30_000, 'the import published');

      // Action: a drain meanwhile (a flush asked for by the ingest sweeper, or added by hand):
      // no row yet, an import pending; it waits for the import's transaction.
      const draining = drainSession(svc.deps, t.tenantId, s);
      failed = await importing;
      drained = await draining;
    } finally {
      await restore();
    }

    // Assert: nothing archived, no session (before, the drain's row was committed after the
    // import rolled back: a live, empty session, listed, that the failed import never made).
    assert.ok(failed.status >= 500, `${failed.status} ${failed.text}`);
    assert.equal(drained.archived, 0);
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404);
    assert.deepEqual((await t.api.get('/v1/sessions?limit=100')).body.sessions, []);
    assert.equal(await redis.llen(keys.inbox), 0);
    assert.equal(await redis.zscore(`${svc.config.prefix}:armed`, keys.member), null);
  });

  void test('a message posted while an import is committing is archived at once when that COMMIT fails', async () => {
    // Setup: a service whose ingest sweeper never comes round; this session's COMMIT waits 2 s,
    // then fails, once the import's messages are in the inbox (armed by the import's publish).
    const own = await quietService();
    const locker = new pg.Client({ connectionString: own.config.databaseUrl });
    const fn = `commit_${randomBytes(4).toString('hex')}`;
    try {
      const t = await own.newTenant();
      const s = sid('post-during-commit');
      const keys = inboxKeys(own.config.prefix, t.tenantId, s);
      await locker.connect();
      await locker.query(`CREATE FUNCTION ${fn}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_sleep(2); RAISE EXCEPTION 'commit refused'; END $$`);
      await locker.query(`CREATE CONSTRAINT TRIGGER ${fn} AFTER INSERT OR UPDATE ON summaries
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ${fn}()`);
      const importing = t.api.post(`/v1/sessions/${s}/import`, importLines('pc'), ndjson);
      await eventually(async () => (await redis.llen(keys.inbox)) === 3, 30_000, 'the import published');

      // Action: another agent posts meanwhile.
      const posted = await t.api.post(`/v1/sessions/${s}/messages`, {
        messages: [user('live', { id: 'live-1' })],
      });
      assert.ok((await importing).status >= 500, 'the import failed');

      // Assert: accepted after the import's entries, and archived without the ingest sweeper
      // (before, the import's publish had armed the session, so the post asked for no flush, and
      // the failed import's settle removed its entries and left the post armed with no flush to
      // come: archived by the sweeper, 60-90 s later in production).
      assert.equal(posted.status, 202, posted.text);
      assert.equal(posted.body.messages[0].seq, 4);
      await eventually(
        async () => (await listed(t.api, s))?.map((m) => m.id).join() === 'live-1',
        20_000,
        'the posted message archived',
      );
      assert.equal(await redis.llen(keys.inbox), 0);
    } finally {
      await locker.query(`DROP TRIGGER IF EXISTS ${fn} ON summaries`).catch(() => undefined);
      await stopQuiet(own, locker);
    }
  });

  /**
   * An import through a second API process of this deployment, whose COMMIT is held (a sleeping
   * deferred trigger) once its messages are in the inbox; then the process dies, and Postgres
   * ends the transaction.
   */
  const importDiesMidCommit = async (t: { apiKey: string; tenantId: string }, s: string) => {
    const keys = inboxKeys(svc.config.prefix, t.tenantId, s);
    const restore = await atCommit(s, 'PERFORM pg_sleep(60);');
    const child = await spawnService('api', {
      DATABASE_URL: svc.config.databaseUrl!,
      REDIS_URL,
      MNEMOS_PREFIX: svc.config.prefix,
    });
    try {
      const pending = api(child.url!, t.apiKey)
        .post(`/v1/sessions/${s}/import`, importLines('ad'), ndjson)
        .catch(() => null);
      await eventually(async () => (await redis.llen(keys.inbox)) === 3, 30_000, 'the import published');
      await child.kill();
      await pending;
      await q(
        `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND query ILIKE 'COMMIT%'`,
      );
    } finally {
      await restore();
      await child.kill().catch(() => undefined);
    }
    return keys;
  };

  void test('an import whose API process dies during its COMMIT stores nothing: the drain removes its messages, the retry imports them', async () => {
    // Setup, action
    const t = await svc.newTenant();
    const s = sid('api-dies');
    const keys = await importDiesMidCommit(t, s);

    // Assert: the worker's drain (the session is armed) removes the messages instead of archiving
    // them without their summary; the retry then finds the session empty.
    await eventually(async () => (await redis.llen(keys.inbox)) === 0, 30_000, 'the inbox settled');
    assert.equal((await t.api.get(`/v1/sessions/${s}/messages`)).body.messages?.length ?? 0, 0);
    const retry = await t.api.post(`/v1/sessions/${s}/import?wait=true`, importLines('ad'), ndjson);
    assert.equal(retry.status, 201, retry.text);
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => m.id),
      ['ad-1', 'ad-2', 'ad-3'],
    );
    assert.equal((await t.api.get(`/v1/sessions/${s}/summary`)).body.cursor_seq, 2);
  });

  void test("a post of a dead import's ids before any drain is stored, not answered as a duplicate of it", async () => {
    // Setup: no drain runs (the ingest queue is paused), and an import died mid-commit.
    const t = await svc.newTenant();
    const s = sid('ids-of-dead');
    await svc.deps.queues.ingest.pause();
    let posted;
    try {
      await importDiesMidCommit(t, s);

      // Action: the client posts the same messages instead.
      posted = await t.api.post(`/v1/sessions/${s}/messages`, {
        messages: [user('ad note 1', { id: 'ad-1', sent_at: '2026-01-01T00:00:00Z' })],
      });
    } finally {
      await svc.deps.queues.ingest.resume();
    }

    // Assert: accepted as new, and archived (before, the import's id answered it as a duplicate,
    // and the drain then removed the import's entry: the message was lost).
    assert.equal(posted.status, 202, posted.text);
    assert.equal(posted.body.accepted, 1, posted.text);
    await eventually(async () => (await listed(t.api, s))?.length === 1, 30_000, 'the message archived');
    assert.deepEqual(
      (await listed(t.api, s))!.map((m) => [m.id, m.content]),
      [['ad-1', 'ad note 1']],
    );
  });

  void test('settling an aborted import that left nothing in the inbox keeps the counter at the archived mark', async () => {
    // Setup: a session archived through seq 3, whose state still marks an import of seqs 1-3 by a
    // transaction that aborted (its entries taken by a reset or an older worker meanwhile).
    const t = await svc.newTenant();
    const s = sid('settle-nothing');
    await archive(t.api, s, [user('one'), user('two'), user('three')]);
    const keys = inboxKeys(svc.config.prefix, t.tenantId, s);
    let xid = '';
    await svc.deps.db
      .transaction(async (tx) => {
        xid = (await tx.query<{ xid: string }>('SELECT txid_current()::text AS xid')).rows[0]!.xid;
        throw new Error('rolled back');
      })
      .catch(() => undefined);
    await redis.hset(keys.sess, 'impxid', xid, 'impfrom', '1', 'impto', '3');

    // Action
    await settleImport(svc.deps.db, redis, keys);

    // Assert: the mark is gone and the counter did not go back below what is archived (a post
    // taking seq 1 again would be dropped by its drain as already archived).
    assert.equal(await redis.hget(keys.sess, 'impxid'), null);
    assert.equal(await redis.hget(keys.sess, 'seq'), '3');
    assert.deepEqual(await archive(t.api, s, [user('four')]), [4]);
  });

  void test('bad import input is a 400 naming the line and stores nothing', async () => {
    const t = await svc.newTenant();
    const s = sid('bad');
    const ndjson = { 'content-type': 'application/x-ndjson' };
    const body = [
      JSON.stringify({ type: 'message', role: 'user', content: 'fine' }),
      '',
      JSON.stringify({ type: 'message', role: 'robot', content: 'not a role' }),
    ].join('\n');
    const r = await t.api.post(`/v1/sessions/${s}/import`, body, ndjson);
    assert.equal(r.status, 400);
    assert.equal(r.body.error.details.problems[0].path, 'lines[3].role');
    // A 413 of a line's content names the line as a malformed line's 400 does (`line`, from 1),
    // beside `index`, which counts the message lines from 0.
    const huge = [
      JSON.stringify({ type: 'message', role: 'user', content: 'fine' }),
      '',
      JSON.stringify({ type: 'message', role: 'user', content: 'x'.repeat(1_048_577) }),
    ].join('\n');
    const tooBig = await t.api.post(`/v1/sessions/${s}/import`, huge, ndjson);
    assert.equal(tooBig.status, 413);
    assert.equal(tooBig.body.error.code, 'message_too_large');
    assert.equal(tooBig.body.error.details.path, 'lines[3].content');
    assert.equal(tooBig.body.error.details.line, 3);
    assert.equal(tooBig.body.error.details.index, 1);

    const broken = await t.api.post(
      `/v1/sessions/${s}/import`,
      '{"role":"user","content":"x"}\n{not json}\n',
      ndjson,
    );
    assert.equal(broken.status, 400);
    assert.equal(broken.body.error.code, 'malformed_json');
    assert.equal(broken.body.error.details.line, 2);

    const badSummary = await t.api.post(
      `/v1/sessions/${s}/import`,
      `${JSON.stringify({ role: 'user', content: 'x' })}\n${JSON.stringify({ type: 'summary', summary: { key_decisions: ['always'] } })}\n`,
      ndjson,
    );
    assert.equal(badSummary.status, 400);
    assert.match(badSummary.body.error.details.problems[0].path, /^lines\[2\]\.summary/);
    // Text Postgres's jsonb cannot hold is bad input too (it was a 500 at the summary's insert).
    for (const bad of ['Do: a\u0000b', 'Do: a\ud800b']) {
      const summary = {
        key_decisions: [bad],
        past_discussions: [],
        current_discussion: { topic: 't', description: 'd', perspectives: 'p', direction: 'x' },
      };
      const r = await t.api.post(
        `/v1/sessions/${s}/import`,
        `${JSON.stringify({ role: 'user', content: 'x' })}\n${JSON.stringify({ type: 'summary', summary })}\n`,
        ndjson,
      );
      assert.equal(r.status, 400, JSON.stringify(r.body));
      assert.equal(r.body.error.details.problems[0].path, 'lines[2].summary.key_decisions[0]');
    }
    // A union whose form matched but broke a rule says which rule, not "Invalid input".
    const many = {
      key_decisions: [],
      past_discussions: [],
      current_discussion: { topic: 't', description: 'd', perspectives: Array(20).fill('p'), direction: 'x' },
    };
    const tooMany = await t.api.post(
      `/v1/sessions/${s}/import`,
      `${JSON.stringify({ role: 'user', content: 'x' })}\n${JSON.stringify({ type: 'summary', summary: many })}\n`,
      ndjson,
    );
    assert.equal(tooMany.status, 400);
    assert.equal(
      tooMany.body.error.details.problems[0].path,
      'lines[2].summary.current_discussion.perspectives',
    );
    assert.match(tooMany.body.error.message, /<=16 items/);

    // An export line says its time twice; an edit of one of them is refused, not ignored.
    const instant = { sent_at: '2026-01-01T00:00:00.000000001Z', sent_at_ns: '1767225600000000001' };
    const agree = JSON.stringify({ role: 'user', content: 'same instant', ...instant });
    const disagree = JSON.stringify({
      role: 'user',
      content: 'edited',
      ...instant,
      sent_at: '2026-01-01T00:00:00Z',
    });
    const edited = await t.api.post(`/v1/sessions/${s}/import`, `${agree}\n${disagree}\n`, ndjson);
    assert.equal(edited.status, 400);
    assert.equal(edited.body.error.details.problems[0].path, 'lines[2].sent_at');

    const dup = await t.api.post(`/v1/sessions/${s}/import`, {
      messages: [user('a', { id: 'x' }), user('b', { id: 'x' })],
    });
    assert.equal(dup.status, 400);
    assert.equal(dup.body.error.code, 'duplicate_id');
    // JSON Lines are validated 1,000 lines at a time: an id repeated in a later chunk is refused
    // too, and an error in a later chunk names its own line.
    const numbered = (n: number) =>
      Array.from({ length: n }, (_, i) => JSON.stringify({ role: 'user', content: 'x', id: `l${i + 1}` }));
    const crossChunk = await t.api.post(
      `/v1/sessions/${s}/import`,
      [...numbered(1002), JSON.stringify({ role: 'user', content: 'again', id: 'l1' })].join('\n'),
      ndjson,
    );
    assert.equal(crossChunk.status, 400);
    assert.equal(crossChunk.body.error.code, 'duplicate_id');
    assert.equal(crossChunk.body.error.message, 'lines[1003].id repeats lines[1].id');
    const pastFirstChunk = await t.api.post(
      `/v1/sessions/${s}/import`,
      [...numbered(1003), JSON.stringify({ role: 'robot', content: 'x' })].join('\n'),
      ndjson,
    );
    assert.equal(pastFirstChunk.status, 400);
    assert.equal(pastFirstChunk.body.error.details.problems[0].path, 'lines[1004].role');

    const unknownField = await t.api.post(`/v1/sessions/${s}/import`, {
      messages: [user('a', { colour: 'red' })],
    });
    assert.equal(unknownField.status, 400);
    assert.equal(unknownField.body.error.details.problems[0].path, 'messages[0].colour');
    // A JSON null is no import (it was read as {}).
    const nullBody = await t.api.post(`/v1/sessions/${s}/import`, 'null', {
      'content-type': 'application/json',
    });
    assert.equal(nullBody.status, 400);
    assert.equal(nullBody.body.error.details.problems[0].path, 'body');

    // A line is one message: at most a POST body's 8 MiB, refused before it is parsed.
    const longLine = await t.api.post(
      `/v1/sessions/${s}/import`,
      `${JSON.stringify({ role: 'user', content: 'x' })}\n{"role":"user","metadata":${'['.repeat(40)}${'[0],'.repeat(2.5 * 1024 * 1024)}0${']'.repeat(40)}}\n`,
      ndjson,
    );
    assert.equal(longLine.status, 413, longLine.text.slice(0, 200));
    assert.equal(longLine.body.error.code, 'line_too_large');
    assert.equal(longLine.body.error.details.line, 2);
    // Lines are validated a request body's worth at a time, as they arrive: a bad first line is
    // refused once 8 MiB have come, while the client is still sending (before, every line was
    // parsed and held until the end: concurrent imports of such lines exhausted the heap).
    const { request } = await import('node:http');
    const early = await new Promise<{ status: number; body: string }>((resolve, reject) => {
      const req = request(`${svc.base}/v1/sessions/${s}/import`, {
        method: 'POST',
        headers: { authorization: `Bearer ${t.apiKey}`, 'content-type': 'application/x-ndjson' },
      });
      req.on('response', (res) => {
        let body = '';
        res.on('data', (d) => (body += d));
        res.on('end', () => resolve({ status: res.statusCode!, body }));
      });
      req.on('error', (err) =>
        err.message.includes('EPIPE') || err.message.includes('ECONNRESET') ? undefined : reject(err),
      );
      req.write(`{"role":"robot","content":"${'x'.repeat(5 * 1024 * 1024)}"}\n`);
      req.write(`{"role":"user","content":"${'y'.repeat(4 * 1024 * 1024)}"}\n`);
      // …and never ends its body.
      setTimeout(() => {
        req.destroy();
        reject(new Error('no answer while the body was still open'));
      }, 15_000).unref();
    });
    assert.equal(early.status, 400, early.body.slice(0, 200));
    assert.equal(JSON.parse(early.body).error.details.problems[0].path, 'lines[1].role');
    assert.equal((await t.api.post(`/v1/sessions/${s}/import`, '', ndjson)).status, 400);
    const plain = await t.api.post(`/v1/sessions/${s}/import`, 'role=user', { 'content-type': 'text/plain' });
    assert.equal(plain.status, 415);
    assert.match(
      plain.body.error.message,
      /application\/x-ndjson/,
      'names the JSON Lines type export writes',
    );
    // Routing ignores case and a trailing slash; so does the JSON Lines check.
    for (const path of [`/v1/sessions/${s}/import/`, `/v1/sessions/${s}/IMPORT`]) {
      assert.notEqual((await t.api.post(path, 'not json lines', ndjson)).status, 415, path);
    }
    // JSON Lines only where a route reads them: elsewhere the body went unread (a 200 as if none).
    for (const path of [
      `/v1/sessions/${s}/messages`,
      `/v1/sessions/${s}/reset`,
      `/v1/sessions/${s}/context`,
    ]) {
      const r = await t.api.post(path, '{"keep_summary":false}\n', ndjson);
      assert.equal(r.status, 415, path);
      assert.equal(r.body.error.code, 'unsupported_media_type');
    }
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404);
    const rows = await sessionRows(t.tenantId, s);
    assert.equal(rows.messages, 0);
  });

  void test('export pages through a large session in seq order', async () => {
    const t = await svc.newTenant();
    const s = sid('big');
    const lines = Array.from({ length: 1203 }, (_, i) =>
      JSON.stringify({
        role: i % 2 ? 'assistant' : 'user',
        content: `message ${i}`,
        sent_at: String(1_700_000_000_000_000_000n + BigInt(i)),
      }),
    );
    const im = await t.api.post(`/v1/sessions/${s}/import`, `${lines.join('\n')}\n`, {
      'content-type': 'application/x-ndjson',
    });
    assert.equal(im.status, 201, JSON.stringify(im.body));
    const ex = await t.api.get(`/v1/sessions/${s}/export`);
    assert.equal(ex.status, 200);
    assert.equal(ex.headers.get('transfer-encoding'), 'chunked');
    const out = ex.text
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l));
    assert.equal(out.length, 1203);
    assert.deepEqual(
      out.map((m) => m.seq),
      Array.from({ length: 1203 }, (_, i) => i + 1),
    );
    assert.equal(out[1202].content, 'message 1202');

    // A malformed request pipelined behind the streaming export gets no error written into the
    // export's body: the connection closes (as with Node's own handler).
    const raw = await new Promise<string>((resolve, reject) => {
      const socket = connect(Number(new URL(svc.base).port), '127.0.0.1', () =>
        socket.write(
          `GET /v1/sessions/${s}/export HTTP/1.1\r\nhost: x\r\nauthorization: Bearer ${t.apiKey}\r\n\r\n`,
        ),
      );
      let data = '';
      let sent = false;
      socket.on('data', (d) => {
        data += d.toString();
        if (!sent && data.includes('\r\n\r\n')) {
          sent = true;
          socket.write('NOT HTTP\r\n\r\n');
        }
      });
      socket.on('close', () => resolve(data));
      socket.on('error', reject);
    });
    assert.match(raw, /^HTTP\/1\.1 200 OK\r\n/);
    assert.doesNotMatch(raw.slice(raw.indexOf('\r\n\r\n')), /HTTP\/1\.1 400/);
  });
  void test('a large import lets other requests run while it is read and validated', async () => {
    // Each turn of the event loop is one run of this self-rescheduling callback: a request of
    // another tenant would be served in such a turn, none while the import holds the loop.
    const turnsWhile = async <T>(work: () => Promise<T>): Promise<{ result: T; turns: number }> => {
      let turns = 0;
      let running = true;
      const tick = () => {
        if (!running) return;
        turns++;
        setImmediate(tick);
      };
      setImmediate(tick);
      try {
        return { result: await work(), turns };
      } finally {
        running = false;
      }
    };
    const n = 5000;
    const lines = async function* () {
      for (let i = 0; i < n; i++) {
        yield { line: i + 1, value: user(`message ${i}`), bytes: 40 };
      }
    };
    // A body already buffered: its chunks come through promises alone, as from a fast client.
    const blankThenOne = async function* () {
      yield `${'\n'.repeat(50_000)}${JSON.stringify(user('after the blank lines'))}\n`;
    };

    const jsonl = await turnsWhile(() => parseImportLines(lines(), 'UTC'));
    const blank = await turnsWhile(() => parseImportLines(readJsonLines(blankThenOne()), 'UTC'));
    const json = await turnsWhile(() =>
      parseImportJson({ messages: Array.from({ length: n }, (_, i) => user(`message ${i}`)) }, 'UTC'),
    );

    assert.equal(jsonl.result.messages.length, n);
    assert.equal(jsonl.result.messages[n - 1]!.message.content, `message ${n - 1}`);
    assert.ok(jsonl.turns >= n / 200, `JSON Lines: ${jsonl.turns} turns in ${n} lines`);
    assert.deepEqual(
      blank.result.messages.map((m) => m.message.content),
      ['after the blank lines'],
    );
    assert.ok(blank.turns >= 50_000 / 200, `blank lines: ${blank.turns} turns in 50000 lines`);
    assert.equal(json.result.messages.length, n);
    assert.ok(json.turns >= n / 200, `JSON: ${json.turns} turns in ${n} messages`);
  });

  void test('export pages of big messages are cut by bytes: every message once, in order', async () => {
    const t = await svc.newTenant();
    const s = sid('heavy');
    // 20 messages of 512 KiB: 10 MiB, one page of rows but several pages of EXPORT_PAGE_BYTES.
    const body = (i: number) => `${String(i).padStart(4, '0')} ${'x'.repeat(512 * 1024)}`;
    const lines = Array.from({ length: 20 }, (_, i) => JSON.stringify(user(body(i))));
    const im = await t.api.post(`/v1/sessions/${s}/import`, `${lines.join('\n')}\n`, {
      'content-type': 'application/x-ndjson',
    });
    assert.equal(im.status, 201, JSON.stringify(im.body));

    const ex = await t.api.get(`/v1/sessions/${s}/export`);
    assert.equal(ex.status, 200);
    const out = ex.text
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l));
    assert.deepEqual(
      out.map((m) => m.seq),
      Array.from({ length: 20 }, (_, i) => i + 1),
    );
    assert.ok(
      out.every((m, i) => m.content === body(i)),
      'out.every((m, i) => m.content === body(i))',
    );

    // The statements the export sends: each page of messages holds about EXPORT_PAGE_BYTES.
    const pages: number[] = [];
    const spy = {
      query: async (text: string, params?: unknown[]) => {
        const r = await svc.deps.db.query(text, params);
        if (/FROM messages/.test(text)) {
          pages.push(r.rows.reduce((n: number, m: any) => n + String(m.content ?? '').length, 0));
        }
        return r;
      },
    } as unknown as Queryable;
    const again = (await openSessionExport(spy, t.tenantId, s))!;
    let n = 0;
    for await (const line of again) if (JSON.parse(line).type === 'message') n++;
    assert.equal(n, 20);
    assert.ok(pages.length >= 3, `pages: ${pages.join(', ')}`);
    assert.ok(
      pages.every((bytes) => bytes <= EXPORT_PAGE_BYTES + 1024 * 1024),
      `page sizes: ${pages.join(', ')}`,
    );
  });

  void test('an export racing a reset or delete fails, never a short body that looks complete', async () => {
    for (const clear of ['reset', 'delete'] as const) {
      const t = await svc.newTenant();
      const s = sid(`cut-${clear}`);
      await archive(t.api, s, [
        user('one'),
        assistant('two'),
        user('three'),
        assistant('four'),
        user('five'),
      ]);
      // Pages of two, as the route's pages of 500: the clear lands between two pages.
      const lines = (await openSessionExport(svc.deps.db, t.tenantId, s, 2))!;
      const first = await lines.next();
      assert.equal(JSON.parse(first.value as string).content, 'one');
      const cleared =
        clear === 'reset'
          ? await t.api.post(`/v1/sessions/${s}/reset`)
          : await t.api.del(`/v1/sessions/${s}`);
      assert.equal(cleared.status, clear === 'reset' ? 200 : 204);
      const rest: string[] = [];
      await assert.rejects(
        (async () => {
          for (let n = await lines.next(); !n.done; n = await lines.next()) rest.push(n.value);
        })(),
        SessionChangedError,
        clear,
      );
      // The page already read may still be sent; nothing after the clear, and no normal end.
      assert.deepEqual(
        rest.map((l) => JSON.parse(l).content),
        ['two'],
      );
    }
  });

  void test('a clear between the last page and the summary line fails the export too', async () => {
    const t = await svc.newTenant();
    const s = sid('cut-summary');
    await archive(t.api, s, [user('one'), assistant('two'), user('three')]);
    await putSummary(t.tenantId, s, 3);
    // Pages of two: the second page (one message) is the last; the summary is read after it.
    const lines = (await openSessionExport(svc.deps.db, t.tenantId, s, 2))!;
    for (const content of ['one', 'two', 'three'])
      assert.equal(JSON.parse((await lines.next()).value as string).content, content);
    assert.equal((await t.api.post(`/v1/sessions/${s}/reset?keep_summary=false`)).status, 200);
    // Not a normal end without the summary line: the body would look complete.
    await assert.rejects(lines.next(), SessionChangedError);
  });
});

void describe('listing across a reset or delete', () => {
  const contents = (r: { body: any }) => r.body.messages.map((m: { content: unknown }) => m.content);

  void test("a listing's next page after a reset, or a delete and a new post, answers 409 session_changed, not the new session's messages", async () => {
    for (const clear of ['reset', 'delete'] as const) {
      // Setup: two turns, the first of them read as the listing's first page.
      const t = await svc.newTenant();
      const s = sid(`list-${clear}`);
      await archive(t.api, s, [user('old1'), assistant('old1-reply')]);
      await archive(t.api, s, [user('old2'), assistant('old2-reply')]);
      const first = await t.api.get(`/v1/sessions/${s}/messages?limit=2`);
      assert.equal(first.status, 200, JSON.stringify(first.body));
      assert.deepEqual(contents(first), ['old1', 'old1-reply']);
      assert.equal(first.body.next, 2);
      const generation: unknown = first.body.generation;
      assert.equal(typeof generation, 'number');
      const page2 = `/v1/sessions/${s}/messages?limit=2&after_seq=2&generation=${String(generation)}`;
      // The first page's generation is the current one until the clear: the listing goes on.
      const unchanged = await t.api.get(page2);
      assert.equal(unchanged.status, 200, JSON.stringify(unchanged.body));
      assert.deepEqual(contents(unchanged), ['old2', 'old2-reply']);
      assert.equal(unchanged.body.generation, generation);

      // Action: the session is cleared and written to again.
      const cleared =
        clear === 'reset'
          ? await t.api.post(`/v1/sessions/${s}/reset`)
          : await t.api.del(`/v1/sessions/${s}`);
      assert.equal(cleared.status, clear === 'reset' ? 200 : 204);
      if (clear === 'delete') {
        // A deleted session is not found, whatever generation the client holds.
        const gone = await t.api.get(page2);
        assert.equal(gone.status, 404, JSON.stringify(gone.body));
        assert.equal(gone.body.error.code, 'not_found');
      }
      await archive(t.api, s, [user('new1'), assistant('new1-reply')]);

      // Assert: the listing's next page is refused, where it used to be the new session's messages.
      const next = await t.api.get(page2);
      assert.equal(next.status, 409, `${clear}: ${JSON.stringify(next.body)}`);
      assert.equal(next.body.error.code, 'session_changed');
      assert.match(next.body.error.message, /reset or deleted/);
      // Starting over lists the new session alone, under a generation of its own.
      const again = await t.api.get(`/v1/sessions/${s}/messages?limit=1`);
      assert.deepEqual(contents(again), ['new1']);
      assert.notEqual(again.body.generation, generation);
      const rest = await t.api.get(
        `/v1/sessions/${s}/messages?limit=1&after_seq=${again.body.next}&generation=${again.body.generation}`,
      );
      assert.equal(rest.status, 200, JSON.stringify(rest.body));
      assert.deepEqual(contents(rest), ['new1-reply']);
      assert.equal(rest.body.next, null);
    }
  });

  void test('an empty page carries the generation too, and a stale one on it is a 409', async () => {
    const t = await svc.newTenant();
    const s = sid('list-empty');
    await archive(t.api, s, [user('only')]);
    const last = await t.api.get(`/v1/sessions/${s}/messages?after_seq=1`);
    assert.equal(last.status, 200, JSON.stringify(last.body));
    assert.deepEqual(last.body.messages, []);
    assert.equal(last.body.next, null);
    assert.equal(typeof last.body.generation, 'number');
    assert.equal((await t.api.post(`/v1/sessions/${s}/reset`)).status, 200);
    const stale = await t.api.get(
      `/v1/sessions/${s}/messages?after_seq=1&generation=${last.body.generation}`,
    );
    assert.equal(stale.status, 409, JSON.stringify(stale.body));
    assert.equal(stale.body.error.code, 'session_changed');
  });
});

void describe('temp reaper', () => {
  void test('deletes idle temp- sessions by the injected clock, keeps active and non-temp ones', async () => {
    const t = await svc.newTenant();
    const idle = sid('temp-idle');
    const active = sid('temp-active');
    const keep = sid('chat-keep');
    // Its message says it was sent in 2099 (a client clock far ahead): idle all the same.
    const ahead = sid('temp-ahead');
    for (const s of [idle, active, keep]) await archive(t.api, s, [user(`hello ${s}`)]);
    await archive(t.api, ahead, [{ ...user('from the future'), sent_at: '2099-01-01T00:00:00Z' }]);
    for (const s of [idle, keep, ahead]) {
      // Two hours idle; a message time ahead of the clock stays as the client sent it.
      await q(
        `UPDATE sessions SET created_at = now() - interval '2 hours',
           last_message_at = CASE WHEN last_message_at > now() THEN last_message_at
                                  ELSE now() - interval '2 hours' END
         WHERE tenant_id = $1 AND id = $2`,
        [t.tenantId, s],
      );
      await q(
        `UPDATE messages SET archived_at = now() - interval '2 hours' WHERE tenant_id = $1 AND session_id = $2`,
        [t.tenantId, s],
      );
    }

    const first = await reapTempSessions(svc.deps, lifecycle, { now: new Date(Date.now() + 10 * 60_000) });
    assert.ok(first.deleted >= 1, 'first.deleted >= 1');
    assert.equal((await t.api.get(`/v1/sessions/${idle}`)).status, 404);
    assert.equal((await t.api.get(`/v1/sessions/${ahead}`)).status, 404);
    assert.equal((await t.api.get(`/v1/sessions/${active}`)).status, 200);
    assert.equal((await t.api.get(`/v1/sessions/${keep}`)).status, 200);
    assert.equal((await sessionRows(t.tenantId, idle)).messages, 0);

    await reapTempSessions(svc.deps, lifecycle, { now: new Date(Date.now() + 31 * 60_000) });
    assert.equal((await t.api.get(`/v1/sessions/${active}`)).status, 404);
    assert.equal((await t.api.get(`/v1/sessions/${keep}`)).status, 200);
  });

  void test('runs every 30 minutes as the temp-reaper maintenance task', async () => {
    const scheduler = await svc.deps.queues.maintenance.getJobScheduler('temp-reaper');
    assert.equal(Number(scheduler?.every), 30 * 60_000);
    const ext = svc.extensions.find((e) => e.name === 'lifecycle');
    assert.equal(typeof ext?.maintenance?.['temp-reaper'], 'function');
  });
});

void describe('tenant erasure', () => {
  async function tenantRows(tenantId: string): Promise<Record<string, number>> {
    const tables = await q<{ table_name: string }>(
      `SELECT table_name FROM information_schema.columns WHERE table_schema = 'public' AND column_name = 'tenant_id' ORDER BY 1`,
    );
    const out: Record<string, number> = {};
    for (const { table_name } of tables) {
      const [r] = await q<{ n: number }>(
        `SELECT count(*)::int AS n FROM "${table_name}" WHERE tenant_id = $1`,
        [tenantId],
      );
      out[table_name] = r!.n;
    }
    out.tenants = (await q('SELECT 1 FROM tenants WHERE id = $1', [tenantId])).length;
    return out;
  }

  void test('DELETE /v1/admin/tenants/{id} leaves no key, job or row of the tenant and nothing else is touched', async () => {
    const admin = api(svc.base, ADMIN_TOKEN);
    const victim = await svc.newTenant();
    const bystander = await svc.newTenant();
    // The bystander's session id names the victim's id: its keys must survive.
    const tricky = `peer:${victim.tenantId}:chat`;
    await archive(bystander.api, tricky, [user('bystander data')]);
    await archive(victim.api, 'one', [user('victim one'), assistant('reply')]);
    await archive(victim.api, 'two:with:colons', [user('victim two')]);
    await putSummary(victim.tenantId, 'one', 2);
    await q(
      `INSERT INTO llm_usage (tenant_id, session_id, purpose, model) VALUES ($1, 'one', 'summary', 'm')`,
      [victim.tenantId],
    );
    const err = await victim.api.post('/v1/errors', {
      tool_name: 'shell',
      symptom: 'permission denied on /srv/app',
      action: 'ran with sudo',
      outcome: 'resolved',
    });
    assert.equal(err.status, 201);
    await redis.zadd(`${svc.config.prefix}:armed`, Date.now(), `${victim.tenantId} stale-session`);
    await redis.rpush(`${svc.config.prefix}:impstage:${victim.tenantId}:one:abc`, 'leftover');
    await svc.deps.queues.embed.add(
      'embed',
      { v: 1, tenantId: victim.tenantId, sessionId: 'one', generation: 1 },
      { delay: 3_600_000 },
    );
    await eventually(
      async () => (await tenantRows(victim.tenantId)).message_vectors === 3,
      15_000,
      'vectors',
    );

    // Both sessions as if they were huge: each gets its own HNSW index.
    const victimIndex = await buildAnnIndex(svc.deps.db, {
      tenantId: victim.tenantId,
      sessionId: 'one',
      dimensions: 384,
      vectors: 3,
    });
    const bystanderIndex = await buildAnnIndex(svc.deps.db, {
      tenantId: bystander.tenantId,
      sessionId: tricky,
      dimensions: 384,
      vectors: 1,
    });
    // And their own full-text indexes (search-indexes task).
    const victimFts = await buildSessionIndex(svc.deps.db, {
      tenantId: victim.tenantId,
      sessionId: 'one',
      kind: 'fts',
      messages: 3,
    });
    const bystanderFts = await buildSessionIndex(svc.deps.db, {
      tenantId: bystander.tenantId,
      sessionId: tricky,
      kind: 'fts',
      messages: 1,
    });
    const indexExists = async (name: string) =>
      (await q('SELECT 1 FROM pg_indexes WHERE indexname = $1', [name])).length > 0;
    assert.ok(await indexExists(victimIndex), 'await indexExists(victimIndex)');
    assert.ok(await indexExists(victimFts), 'await indexExists(victimFts)');

    const r = await admin.del(`/v1/admin/tenants/${victim.tenantId}`);
    assert.equal(r.status, 204, r.text);
    assert.equal((await admin.del(`/v1/admin/tenants/${victim.tenantId}`)).status, 404);
    // Dropped by the passes the erasure asked a worker for, which keep every live session's.
    // (A pass drops an index, then forgets it: both are waited for.)
    const victimRecords = async () =>
      (
        await q(
          `SELECT 1 FROM session_search_indexes WHERE tenant_id = $1
           UNION ALL SELECT 1 FROM vector_ann_indexes WHERE tenant_id = $1`,
          [victim.tenantId],
        )
      ).length;
    await eventually(
      async () =>
        !(await indexExists(victimIndex)) && !(await indexExists(victimFts)) && (await victimRecords()) === 0,
      20_000,
      "the erased tenant's HNSW and full-text indexes dropped and forgotten",
    );
    assert.ok(await indexExists(bystanderIndex), "the bystander's index stays");
    assert.ok(await indexExists(bystanderFts), "the bystander's full-text index stays");
    await dropAnnIndex(svc.deps.db, bystanderIndex);
    await dropSessionIndex(svc.deps.db, bystanderFts);
    assert.equal((await victim.api.get('/v1/sessions')).status, 401);

    for (const [table, n] of Object.entries(await tenantRows(victim.tenantId)))
      assert.equal(n, 0, `${table}: ${n} rows`);
    const leftovers = (await allKeys()).filter(
      (k) => k.includes(victim.tenantId) && !k.includes(`:${bystander.tenantId}:`),
    );
    assert.deepEqual(leftovers, []);
    assert.equal(
      (await redis.zscan(`${svc.config.prefix}:armed`, '0', 'MATCH', `${victim.tenantId} *`))[1].length,
      0,
    );
    assert.equal(await redis.sismember(`${svc.config.prefix}:err:tenants`, victim.tenantId), 0);
    for (const name of QUEUE_NAMES) {
      const jobs = await (svc.deps.queues[name] as unknown as Queue).getJobs([
        'waiting',
        'delayed',
        'prioritized',
        'failed',
        'completed',
      ]);
      assert.ok(
        !jobs.some((j) => j?.data?.tenantId === victim.tenantId),
        `${name} still holds a job of the tenant`,
      );
    }

    assert.deepEqual(
      (await listed(bystander.api, tricky))!.map((m) => m.content),
      ['bystander data'],
    );
    assert.ok(
      (await sessionKeys(bystander.tenantId, tricky)).length > 0,
      '(await sessionKeys(bystander.tenantId, tricky)).length > 0',
    );
    assert.equal((await bystander.api.post(`/v1/sessions/${tricky}/reset`)).status, 200);
  });

  void test('no key can be created for a tenant under erasure, and the summary sweep leaves its sessions alone', async () => {
    const admin = api(svc.base, ADMIN_TOKEN);
    const victim = await svc.newTenant();
    await archive(victim.api, 'chat', [user('hello'), assistant('hi')]);
    const unsummarised = async () =>
      (
        await pageSummaryCandidates(svc.deps.db, {
          afterTenantId: '',
          afterSessionId: '',
          limit: 100_000,
          config: summaryConfigFingerprint(svc.config),
        })
      ).some((c) => c.tenant_id === victim.tenantId);
    assert.ok(await unsummarised(), 'a candidate before the erasure');

    const erasing = admin.del(`/v1/admin/tenants/${victim.tenantId}`);
    // The erasure marks the tenant, then waits out the API processes' key cache (5 s).
    await eventually(
      async () =>
        (await q('SELECT 1 FROM tenants WHERE id = $1 AND erasing_at IS NOT NULL', [victim.tenantId]))
          .length === 1,
      5000,
      'the erasure mark',
    );
    const late = await admin.post(`/v1/admin/tenants/${victim.tenantId}/keys`, { name: 'late' });
    assert.equal(late.status, 404, late.text);
    assert.equal(await unsummarised(), false, 'no candidate while it is erased');
    assert.equal((await erasing).status, 204);
    assert.equal((await q('SELECT 1 FROM api_keys WHERE tenant_id = $1', [victim.tenantId])).length, 0);
  });

  void test('a retry after an erasure failed past the tenants row finishes the Redis clean-up (404)', async () => {
    const admin = api(svc.base, ADMIN_TOKEN);
    const victim = await svc.newTenant();
    // What an erasure leaves when Redis fails after the tenants row went: the row gone, keys and
    // a job left, the tenant listed as owing its Redis clean-up.
    const left = `${svc.config.prefix}:sess:${victim.tenantId}:late`;
    await redis.hset(left, 'seq', '3');
    const job = await svc.deps.queues.embed.add(
      'embed',
      { v: 1, tenantId: victim.tenantId, sessionId: 'late', generation: 1 },
      { delay: 3_600_000 },
    );
    await redis.sadd(`${svc.config.prefix}:erasures`, victim.tenantId);
    await q('DELETE FROM tenants WHERE id = $1', [victim.tenantId]);
    const r = await admin.del(`/v1/admin/tenants/${victim.tenantId}`);
    assert.equal(r.status, 404);
    assert.equal(await redis.exists(left), 0);
    assert.equal(await svc.deps.queues.embed.getJob(job.id!), undefined);
    assert.equal(await redis.sismember(`${svc.config.prefix}:erasures`, victim.tenantId), 0);
  });

  void test('an erasure whose Redis sweep fails after the tenants row went is finished by a retry, or by the tenant-erasures task', async () => {
    const admin = api(svc.base, ADMIN_TOKEN);
    // Setup: two tenants, each with a session's keys and a queued job, whose erasure's Redis fails
    // at its sweep (SCAN), after the tenants row went.
    const failingScan = new Proxy(svc.deps.redis, {
      get(target, key) {
        if (key === 'scan') return () => Promise.reject(new Error('Redis went away'));
        const value: unknown = Reflect.get(target, key, target);
        return typeof value === 'function' ? (value as (...a: unknown[]) => unknown).bind(target) : value;
      },
    });
    const left: Array<{ tenantId: string; keys: string[]; jobId: string }> = [];
    for (const t of [await svc.newTenant(), await svc.newTenant()]) {
      await archive(t.api, 'chat', [user('my address is 1 Main St')]);
      const job = await svc.deps.queues.embed.add(
        'embed',
        { v: 1, tenantId: t.tenantId, sessionId: 'chat', generation: 1 },
        { delay: 3_600_000 },
      );
      await assert.rejects(
        eraseTenant({ ...svc.deps, redis: failingScan }, () => svc.extensions, t.tenantId, {
          revocationGraceMs: 0,
        }),
        /Redis went away/,
      );
      const keys = (await allKeys()).filter((k) => k.includes(t.tenantId));
      assert.equal((await tenantRows(t.tenantId)).tenants, 0, 'the tenants row went');
      assert.ok(keys.length > 0, 'its keys are left');
      left.push({ tenantId: t.tenantId, keys, jobId: job.id! });
    }
    const [retried, resumed] = left as [(typeof left)[0], (typeof left)[0]];
    const gone = async ({ tenantId, keys, jobId }: (typeof left)[0]) =>
      (await redis.exists(...keys)) === 0 &&
      (await svc.deps.queues.embed.getJob(jobId)) === undefined &&
      (await redis.sismember(`${svc.config.prefix}:erasures`, tenantId)) === 0;

    // Action, assert: the retry the 503 asks for finishes the first (404: the tenant is gone)…
    assert.equal((await admin.del(`/v1/admin/tenants/${retried.tenantId}`)).status, 404);
    assert.ok(await gone(retried), "the retried erasure's keys and job are gone");
    // …and the worker's task the second, nobody retrying it.
    assert.equal(await gone(resumed), false);
    await requestMaintenance(svc.deps.queues, 'tenant-erasures');
    await eventually(() => gone(resumed), 30_000, 'a worker to finish the erasure past its tenants row');
  });

  void test('a worker finishes an erasure whose process died mid-way; until then the admin list shows it erasing', async () => {
    const admin = api(svc.base, ADMIN_TOKEN);
    const listedTenant = async (id: string) =>
      ((await admin.get('/v1/admin/tenants?limit=500')).body.tenants as any[]).find(
        (t) => t.tenant_id === id,
      );
    const victim = await svc.newTenant();
    await archive(victim.api, 'chat', [user('my address is 1 Main St'), assistant('noted')]);
    const err = await victim.api.post('/v1/errors', {
      tool_name: 'shell',
      symptom: 'permission denied on /home/alice',
      action: 'ran with sudo',
      outcome: 'resolved',
    });
    assert.equal(err.status, 201);
    // Another erasure still inside its request (waiting out the key cache): not the worker's.
    const live = await svc.newTenant();
    await archive(live.api, 'chat', [user('erased by its own request')]);
    assert.equal((await listedTenant(victim.tenantId))?.erasing_at, null);
    // What a DELETE killed during its key-cache wait leaves, three minutes on: the mark and the
    // revoked keys (one transaction), and every row and Redis key of the tenant.
    for (const [t, ago] of [
      [victim.tenantId, '3 minutes'],
      [live.tenantId, '0 seconds'],
    ] as const) {
      await q(`UPDATE tenants SET erasing_at = now() - $2::interval WHERE id = $1`, [t, ago]);
      await q(`UPDATE api_keys SET revoked_at = now() - $2::interval WHERE tenant_id = $1`, [t, ago]);
    }
    const [mark] = await q<{ erasing_at: Date }>('SELECT erasing_at FROM tenants WHERE id = $1', [
      victim.tenantId,
    ]);
    assert.equal((await listedTenant(victim.tenantId))?.erasing_at, mark!.erasing_at.toISOString());
    assert.ok((await tenantRows(victim.tenantId)).messages! > 0, 'its messages are still there');

    await requestMaintenance(svc.deps.queues, 'tenant-erasures');

    await eventually(
      async () => !(await listedTenant(victim.tenantId)),
      30_000,
      'a worker to finish the interrupted erasure',
    );
    assert.deepEqual(
      Object.entries(await tenantRows(victim.tenantId)).filter(([, n]) => n > 0),
      [],
    );
    assert.deepEqual(await redis.keys(`${svc.config.prefix}:*${victim.tenantId}*`), []);
    assert.equal(await redis.sismember(`${svc.config.prefix}:err:tenants`, victim.tenantId), 0);
    // The fresh one is left to its request, which finishes it.
    assert.notEqual((await listedTenant(live.tenantId))?.erasing_at ?? null, null);
    assert.equal((await tenantRows(live.tenantId)).messages, 1);
    assert.equal((await admin.del(`/v1/admin/tenants/${live.tenantId}`)).status, 204);
    assert.equal(await listedTenant(live.tenantId), undefined);
  });

  /** A POST whose first 5 bytes go at once and the rest when `finish` is called. */
  function slowPost(apiKey: string, path: string, text: string, contentType = 'application/json') {
    const req = http.request(`${svc.base}${path}`, {
      method: 'POST',
      headers: {
        authorization: `Bearer ${apiKey}`,
        'content-type': contentType,
        'content-length': Buffer.byteLength(text),
      },
    });
    const answer = new Promise<{ status: number; body: any }>((resolve, reject) => {
      req.on('response', (res) => {
        let data = '';
        res.setEncoding('utf8');
        res.on('data', (c: string) => (data += c));
        res.on('end', () => resolve({ status: res.statusCode!, body: JSON.parse(data) }));
      });
      req.on('error', reject);
    });
    req.write(text.slice(0, 5));
    return { finish: () => req.end(text.slice(5)), answer };
  }

  void test('a request whose body arrives after its tenant was erased is a 401 and leaves nothing behind', async () => {
    const admin = api(svc.base, ADMIN_TOKEN);
    const victim = await svc.newTenant();
    await archive(victim.api, 'chat', [user('hello')]);
    // Requests whose key is verified before the erasure, and whose bodies take longer than it.
    const slow = (path: string, body: unknown) => slowPost(victim.apiKey, path, JSON.stringify(body));
    const error = slow('/v1/errors', {
      tool_name: 'shell',
      symptom: 'late symptom',
      action: 'retry',
      outcome: 'resolved',
    });
    const post = slow('/v1/sessions/late/messages', { messages: [user('late message')] });
    // Both requests are past authentication before the erasure starts.
    await new Promise((r) => setTimeout(r, 300));
    assert.equal((await admin.del(`/v1/admin/tenants/${victim.tenantId}`)).status, 204);
    error.finish();
    post.finish();
    const [e, p] = await Promise.all([error.answer, post.answer]);
    assert.equal(e.status, 401, JSON.stringify(e.body));
    assert.equal(e.body.error.code, 'unauthorized');
    assert.equal(p.status, 401, JSON.stringify(p.body));
    assert.deepEqual(await redis.keys(`${svc.config.prefix}:*${victim.tenantId}*`), []);
    assert.equal(await redis.sismember(`${svc.config.prefix}:err:tenants`, victim.tenantId), 0);
    const rows = await tenantRows(victim.tenantId);
    assert.deepEqual(
      Object.entries(rows).filter(([, n]) => n > 0),
      [],
    );
  });

  void test('a key revoked elsewhere while a body arrives is refused once the body is in, also for a JSON Lines import', async () => {
    const revoke = (tenantId: string) =>
      q('UPDATE api_keys SET revoked_at = now() WHERE tenant_id = $1', [tenantId]);
    const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
    // This process read the key from the database over a second ago and keeps it cached; another
    // process revokes it (no cache of ours is cleared), and the body takes under a second.
    const a = await svc.newTenant();
    await archive(a.api, 'chat', [user('hello')]);
    await sleep(1200);
    const error = slowPost(
      a.apiKey,
      '/v1/errors',
      JSON.stringify({ tool_name: 'shell', symptom: 'revoked', action: 'a', outcome: 'resolved' }),
    );
    await revoke(a.tenantId);
    await sleep(300);
    error.finish();
    const e = await error.answer;
    assert.equal(e.status, 401, JSON.stringify(e.body));
    assert.deepEqual(await redis.keys(`${svc.config.prefix}:err:${a.tenantId}:*`), []);

    // A JSON Lines import reads its body itself, after the check that follows a JSON body.
    const b = await svc.newTenant();
    const lines = [user('one', { id: 'i1' }), user('two', { id: 'i2' })]
      .map((m) => JSON.stringify(m))
      .join('\n');
    const imported = slowPost(b.apiKey, '/v1/sessions/imp/import', lines, 'application/x-ndjson');
    await sleep(200);
    await revoke(b.tenantId);
    await sleep(1200);
    imported.finish();
    const i = await imported.answer;
    assert.equal(i.status, 401, JSON.stringify(i.body));
    assert.equal((await q('SELECT 1 FROM sessions WHERE tenant_id = $1', [b.tenantId])).length, 0);
  });

  void test('slow JSON Lines uploads hold no import memory for what they have not sent: other imports go on', async () => {
    const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
    const t = await svc.newTenant();
    const lines = (tag: string) =>
      [user(`${tag} one`, { id: `${tag}-1` }), user(`${tag} two`, { id: `${tag}-2` })]
        .map((m) => JSON.stringify(m))
        .join('\n');
    // Two imports whose bodies are still arriving (they took both slots before their bodies).
    const held = ['held-a', 'held-b'].map((s) =>
      slowPost(t.apiKey, `/v1/sessions/${s}/import`, lines(s), 'application/x-ndjson'),
    );
    await sleep(300);
    const other = await svc.newTenant();
    const started = Date.now();
    const third = await other.api.raw('/v1/sessions/third/import', {
      method: 'POST',
      headers: { 'content-type': 'application/x-ndjson' },
      body: lines('third'),
    });
    assert.equal(third.status, 201, third.text);
    assert.ok(Date.now() - started < 5000, 'it did not wait for a slot');
    for (const h of held) h.finish();
    for (const h of held) assert.equal((await h.answer).status, 201);
  });

  void test("imports hold at most two imports' worth of body per process, one per tenant; past it one waits, then answers 503 import_busy", async () => {
    const MiB = 1024 * 1024;
    const port = Number(new URL(svc.base).port);
    const serverSide = new Map<number, Socket>();
    const onConnection = (s: Socket) => serverSide.set(s.remotePort!, s);
    svc.server!.on('connection', onConnection);
    // An import of 64 MiB of blank lines (they take room, hold no message), all sent but its
    // last byte: it keeps its room until it ends.
    const hold = async (apiKey: string, session: string) => {
      const socket = connect(port, '127.0.0.1');
      socket.on('error', () => undefined);
      await new Promise((r) => socket.once('connect', r));
      const head =
        `POST /v1/sessions/${session}/import HTTP/1.1\r\nhost: x\r\nauthorization: Bearer ${apiKey}\r\n` +
        `content-type: application/x-ndjson\r\ncontent-length: ${64 * MiB}\r\n\r\n`;
      socket.write(head);
      const blank = Buffer.alloc(MiB, ' ');
      blank[MiB - 1] = 10;
      for (let i = 0; i < 63; i++) socket.write(blank);
      socket.write(blank.subarray(0, MiB - 1));
      const server = await eventually(async () => serverSide.get(socket.localPort!), 5000, 'its connection');
      await eventually(
        async () => server.bytesRead >= head.length + 64 * MiB - 1,
        30_000,
        'the server to read the body',
      );
      return socket;
    };
    const small = (t: Api, session: string, tag: string) =>
      t.raw(`/v1/sessions/${session}/import`, {
        method: 'POST',
        headers: { 'content-type': 'application/x-ndjson' },
        // Over a megabyte: more than any room left while the big imports hold theirs.
        body: `${' '.repeat(MiB)}\n${JSON.stringify(user(`${tag} one`, { id: `${tag}-1` }))}`,
      });
    try {
      const a = await svc.newTenant();
      const heldA = await hold(a.apiKey, 'big-a');
      // The same tenant's next import waits for its own room; another tenant's fits beside it,
      // also while that one waits.
      const secondOfA = small(a.api, 'second', 'a2');
      const d = await svc.newTenant();
      assert.equal((await small(d.api, 'beside', 'd')).status, 201);
      const b = await svc.newTenant();
      const heldB = await hold(b.apiKey, 'big-b');
      // Two imports' worth is held: a third tenant's import waits, then is refused.
      const c = await svc.newTenant();
      const started = Date.now();
      const busy = await small(c.api, 'third', 'c');
      assert.equal(busy.status, 503, busy.text);
      assert.equal(busy.body.error.code, 'import_busy');
      assert.equal(busy.body.error.details.scope, 'process');
      assert.match(busy.body.error.message, /this process's import memory \(2 imports' worth\)/);
      assert.equal(busy.headers.get('retry-after'), '5');
      assert.ok(Date.now() - started >= 9_000, 'it waited for room first');
      const second = await secondOfA;
      assert.equal(second.status, 503, second.text);
      assert.equal(second.body.error.code, 'import_busy');
      // It was its own tenant's share that was held, not the process's: the answer says so.
      assert.equal(second.body.error.details.scope, 'tenant');
      assert.match(second.body.error.message, /this tenant's other imports hold its share/);
      assert.equal((await c.api.get('/v1/sessions/third')).status, 404, 'nothing stored');
      // The room comes back when they end.
      heldA.destroy();
      heldB.destroy();
      const retried = await small(c.api, 'third', 'c');
      assert.equal(retried.status, 201, retried.text);
    } finally {
      svc.server!.off('connection', onConnection);
    }
  });

  void test('a request whose tenant is erased under it (its key still cached) is a 401, not a 500', async () => {
    const victim = await svc.newTenant();
    await archive(victim.api, 'chat', [user('hello')]);
    // The key is in this process's cache (5 s); the tenants row goes, as an erasure's last step.
    await q('DELETE FROM tenants WHERE id = $1', [victim.tenantId]);
    const r = await victim.api.post('/v1/sessions/new-one/messages', { messages: [user('after')] });
    assert.equal(r.status, 401, r.text);
    assert.equal(r.body.error.code, 'unauthorized');
    assert.equal(
      (await q('SELECT count(*)::int AS n FROM sessions WHERE tenant_id = $1', [victim.tenantId]))[0].n,
      0,
    );
  });

  void test('an inbox whose tenant the database does not know is dropped, counted and logged, and drains stop', async () => {
    // What a worker sees when a tenant was erased with work still queued, or when another
    // deployment with another database shares MNEMOS_PREFIX: the session row cannot be created.
    const t = await svc.newTenant();
    const s = sid('orphan');
    const before = await dropped();
    const ingest = svc.workers!.workers.find((w) => w.name === 'ingest')!;
    await ingest.pause();
    try {
      const r = await t.api.post(`/v1/sessions/${s}/messages`, {
        messages: [user('a'), user('b'), user('c')],
      });
      assert.equal(r.status, 202);
      await q('DELETE FROM tenants WHERE id = $1', [t.tenantId]);
    } finally {
      await ingest.resume();
    }
    await eventually(
      async () => (await dropped()) === before + 3,
      15_000,
      'three entries counted as dropped',
    );
    await settled(t.tenantId, s);
    assert.equal(
      (await q('SELECT count(*)::int AS n FROM sessions WHERE tenant_id = $1', [t.tenantId]))[0].n,
      0,
    );
  });

  void test('the admin route needs the admin token and answers 404 for an unknown tenant', async () => {
    const t = await svc.newTenant();
    assert.equal((await api(svc.base, ADMIN_TOKEN).del('/v1/admin/tenants/t_aaaaaaaaaaaaaaaa')).status, 404);
    assert.equal((await t.api.del(`/v1/admin/tenants/${t.tenantId}`)).status, 403);
    assert.equal((await api(svc.base).del(`/v1/admin/tenants/${t.tenantId}`)).status, 401);
    assert.equal((await t.api.get('/v1/sessions')).status, 200);
  });

  void test('keyBelongsTo: the first tenant id in a key name is its owner', () => {
    const a = 't_aaaaaaaaaaaaaaaa';
    const b = 't_bbbbbbbbbbbbbbbb';
    assert.equal(keyBelongsTo(`p:inbox:${a}:s1`, 'p', a), true);
    assert.equal(keyBelongsTo(`p:err:${a}:term:x`, 'p', a), true);
    assert.equal(keyBelongsTo(`p:inbox:${b}:peer:${a}:x`, 'p', a), false);
    assert.equal(keyBelongsTo(`p:inbox:${a}x:s1`, 'p', a), false);
    assert.equal(keyBelongsTo(`q:inbox:${a}:s1`, 'p', a), false);
    assert.equal(keyBelongsTo(`p:summary:de:summary-${a}-s1`, 'p', a), true);
  });

  void test("an erasure walks the keyspace once and reads no job whole; other tenants' keys and jobs stay", async () => {
    // A Redis of its own, to count what the erasure asks of it, and an API process only (no
    // worker takes the queued jobs, so they stay as queued).
    const server = await startPrivateRedis();
    const own = await startTestService({ mode: 'api', env: { REDIS_URL: server.url } });
    const r = new Redis(server.url);
    const calls = async (command: string) => {
      const stats = (await r.info('commandstats')).split('\r\n');
      return Number(
        /calls=(\d+)/.exec(stats.find((l) => l.startsWith(`cmdstat_${command}:`)) ?? '')?.[1] ?? 0,
      );
    };
    const queue = (name: (typeof QUEUE_NAMES)[number]) => own.deps.queues[name] as unknown as Queue;
    const STATES = ['waiting', 'delayed', 'prioritized', 'failed', 'completed'] as const;
    // (Maintenance jobs are no tenant's: the erasure asks for some.)
    const jobsOf = async (tenantId: string, mine: boolean) =>
      (
        await Promise.all(
          QUEUE_NAMES.filter((n) => n !== 'maintenance').map((n) => queue(n).getJobs([...STATES])),
        )
      )
        .flat()
        .filter((j) => (j.data?.tenantId === tenantId) === mine)
        .map((j) => `${j.queueName}/${j.id}`)
        .sort();
    const erase = (tenantId: string) =>
      eraseTenant(own.deps, () => own.extensions, tenantId, { revocationGraceMs: 0 });
    try {
      const p = own.config.prefix;
      const victim = await own.newTenant();
      const bystander = await own.newTenant();
      for (const t of [victim, bystander]) {
        const posted = await t.api.post('/v1/sessions/chat/messages', { messages: [user('hello')] });
        assert.equal(posted.status, 202, posted.text);
        const err = await t.api.post('/v1/errors', {
          tool_name: 'shell',
          symptom: 'permission denied on /srv/app',
          action: 'ran with sudo',
          outcome: 'resolved',
        });
        assert.equal(err.status, 201, err.text);
      }
      // The rest of a deployment: 20,000 keys of other tenants, and 1,200 summaries queued, more
      // than a page (1,000) of the waiting list ahead of the victim's summary.
      const fill = r.pipeline();
      for (let i = 0; i < 20_000; i++) fill.set(`${p}:ids:other-${i % 50}:s${i}`, 'x');
      await fill.exec();
      await own.deps.queues.summary.addBulk(
        Array.from({ length: 1200 }, (_, i) => ({
          name: 'summarize',
          data: {
            v: 1 as const,
            kind: 'summarize' as const,
            tenantId: bystander.tenantId,
            sessionId: `s${i}`,
            reason: 'api' as const,
          },
        })),
      );
      await own.deps.queues.summary.add('summarize', {
        v: 1,
        kind: 'summarize',
        tenantId: victim.tenantId,
        sessionId: 'chat',
        reason: 'api',
      });
      const theirJobs = await jobsOf(victim.tenantId, false);
      assert.equal(theirJobs.length, 1201, "the bystander's flush and summaries");
      const victimJobs = await jobsOf(victim.tenantId, true);
      assert.equal(victimJobs.length, 2, "the victim's flush and summary");
      const victimJobKeys = victimJobs.map((j) => `${p}:${j.replace('/', ':')}`);
      const theirs = (await r.keys(`${p}:*`)).filter(
        (k) => !k.includes(victim.tenantId) && !victimJobKeys.some((j) => k === j || k.startsWith(`${j}:`)),
      );
      assert.ok((await r.keys(`${p}:*${victim.tenantId}*`)).length >= 5, "the victim's keys");

      // One full pass of SCAN over this keyspace, for scale.
      let scans = await calls('scan');
      let cursor = '0';
      do [cursor] = await r.scan(cursor, 'MATCH', `${p}:none:*`, 'COUNT', 1000);
      while (cursor !== '0');
      const pass = (await calls('scan')) - scans;
      assert.ok(pass >= 15, `one pass is ${pass} calls`);

      scans = await calls('scan');
      const whole = await calls('hgetall');
      assert.equal(await erase(victim.tenantId), true);
      const erasureScans = (await calls('scan')) - scans;
      const readWhole = (await calls('hgetall')) - whole;
      // Before: four passes (the context cache's purge, error memory's, and the sweep before and
      // after the tenants row), and every kept job read whole, twice.
      assert.ok(erasureScans <= pass + 1, `the erasure made ${erasureScans} SCAN calls; one pass is ${pass}`);
      assert.ok(readWhole < 30, `the erasure read ${readWhole} job hashes whole (1,201 are queued)`);

      // A DELETE of a tenant that is gone, or never was, walks nothing.
      scans = await calls('scan');
      assert.equal(await erase(victim.tenantId), false);
      assert.equal(await erase('t_aaaaaaaaaaaaaaaa'), false);
      assert.equal((await calls('scan')) - scans, 0, 'SCAN calls of two DELETEs of gone tenants');

      assert.deepEqual(await r.keys(`${p}:*${victim.tenantId}*`), []);
      assert.equal(await r.sismember(`${p}:erasures`, victim.tenantId), 0);
      assert.deepEqual(await jobsOf(victim.tenantId, true), []);
      let kept = 0;
      for (let i = 0; i < theirs.length; i += 1000) kept += await r.exists(...theirs.slice(i, i + 1000));
      assert.equal(kept, theirs.length, "other tenants' keys");
      assert.deepEqual(await jobsOf(victim.tenantId, false), theirJobs, "other tenants' jobs");
    } finally {
      r.disconnect();
      await own.stop();
      await server.stop();
      await dropTestDatabase(own.config.databaseUrl!);
    }
  });
});

void describe('tenant isolation', () => {
  void test("every lifecycle route answers 404 for another tenant's session and leaves it alone", async () => {
    const owner = await svc.newTenant();
    const other = await svc.newTenant();
    const s = sid('mine');
    await archive(owner.api, s, [user('private')]);
    assert.equal((await other.api.post(`/v1/sessions/${s}/reset`)).status, 404);
    assert.equal((await other.api.post(`/v1/sessions/${s}/reset?keep_summary=false`)).status, 404);
    assert.equal((await other.api.del(`/v1/sessions/${s}`)).status, 404);
    assert.equal((await other.api.get(`/v1/sessions/${s}/export`)).status, 404);
    // Session ids are per tenant: an import under the same id makes the other tenant's own session.
    const im = await other.api.post(`/v1/sessions/${s}/import`, { messages: [user('theirs')] });
    assert.equal(im.status, 201);
    assert.deepEqual(
      (await listed(owner.api, s))!.map((m) => m.content),
      ['private'],
    );
    assert.deepEqual(
      (await listed(other.api, s))!.map((m) => m.content),
      ['theirs'],
    );
    for (const path of [`/v1/sessions/nope/reset`, `/v1/sessions/nope/export`]) {
      const r = path.endsWith('reset') ? await owner.api.post(path) : await owner.api.get(path);
      assert.equal(r.status, 404, path);
    }
    assert.equal((await owner.api.del('/v1/sessions/nope')).status, 404);
    assert.equal((await owner.api.post('/v1/sessions/..%2F/reset')).status, 400);
  });
});

void describe('cli', () => {
  const run = promisify(execFile);
  const cli = path.resolve(import.meta.dirname, '..', 'bin', 'mnemos.js');
  const cliEnv = () => ({
    ...process.env,
    DATABASE_URL: svc.config.databaseUrl,
    MNEMOS_PREFIX: svc.config.prefix,
    REDIS_URL,
    TZ: 'Asia/Taipei',
    LOG_LEVEL: 'silent',
  });
  const mnemos = (...args: string[]) => run(process.execPath, [cli, ...args], { env: cliEnv() });

  void test('mnemos tenant list shows since when a tenant is under erasure', async () => {
    const healthy = await svc.newTenant();
    const erasing = await svc.newTenant();
    await q(`UPDATE tenants SET erasing_at = now() WHERE id = $1`, [erasing.tenantId]);
    const [mark] = await q<{ erasing_at: Date }>('SELECT erasing_at FROM tenants WHERE id = $1', [
      erasing.tenantId,
    ]);
    const since = mark!.erasing_at.toISOString();

    const json = JSON.parse((await mnemos('tenant', 'list', '--json')).stdout) as any[];
    const text = (await mnemos('tenant', 'list')).stdout.split('\n');

    assert.equal(json.find((t) => t.tenant_id === healthy.tenantId)?.erasing_at, null);
    assert.equal(json.find((t) => t.tenant_id === erasing.tenantId)?.erasing_at, since);
    assert.match(
      text.find((l) => l.startsWith(erasing.tenantId)) ?? '',
      new RegExp(`\tERASING since ${since}$`),
    );
    assert.doesNotMatch(text.find((l) => l.startsWith(healthy.tenantId)) ?? '', /ERASING/);
  });

  void test('mnemos export, import jsonl and tenant delete <name>', async () => {
    const name = `cli-${randomBytes(3).toString('hex')}`;
    const t = await svc.newTenant(name);
    await archive(t.api, 'orig', [
      user('first', { sent_at: '2025-01-01T00:00:00Z', metadata: { k: 'v' } }),
      assistant('second', { sent_at: '2025-01-01T00:00:01Z' }),
    ]);
    await putSummary(t.tenantId, 'orig', 1);
    const dir = mkdtempSync(path.join(tmpdir(), 'mnemos-export-'));
    try {
      const file = path.join(dir, 'orig.jsonl');
      await mnemos('export', 'orig', '--tenant', name, '--out', file);
      const lines = readFileSync(file, 'utf8').trim().split('\n');
      assert.equal(lines.length, 3);
      const stdout = (await mnemos('export', 'orig', '--tenant', t.tenantId)).stdout;
      assert.equal(stdout, readFileSync(file, 'utf8'));

      const imported = await mnemos('import', 'jsonl', file, '--tenant', name, '--session', 'copy');
      assert.match(imported.stdout, /copy: imported 2 messages \(seq 1-2\), summary restored/);
      // Durable when the command returns.
      const strip = ({ seq: _s, ...m }: any) => m;
      assert.deepEqual((await listed(t.api, 'copy'))!.map(strip), (await listed(t.api, 'orig'))!.map(strip));
      assert.equal((await t.api.get('/v1/sessions/copy/summary')).body.cursor_seq, 1);
      await assert.rejects(
        mnemos('import', 'jsonl', file, '--tenant', name, '--session', 'copy'),
        /session_not_empty|empty session/,
      );

      const erased = await mnemos('tenant', 'delete', name);
      assert.match(erased.stdout, new RegExp(`erased tenant ${t.tenantId}`));
      assert.equal((await t.api.get('/v1/sessions')).status, 401);
      assert.equal((await q('SELECT 1 FROM sessions WHERE tenant_id = $1', [t.tenantId])).length, 0);
      await assert.rejects(mnemos('tenant', 'delete', name), /no tenant/);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  void test('an export --out cut by a reset leaves no file, and an earlier file at that path as it was', async () => {
    const t = await svc.newTenant();
    const s = sid('cli-cut');
    await archive(t.api, s, [user('one'), assistant('two'), user('three')]);
    const dir = mkdtempSync(path.join(tmpdir(), 'mnemos-export-cut-'));
    const file = path.join(dir, 'backup.jsonl');
    const locker = new pg.Client({ connectionString: svc.config.databaseUrl });
    await locker.connect();
    try {
      for (const earlier of [null, '{"type":"message","content":"an earlier export"}\n']) {
        // Setup: the CLI's connections carry a name of their own, so its statements can be found.
        if (earlier !== null) writeFileSync(file, earlier);
        const app = `export-cut-${randomBytes(3).toString('hex')}`;
        const url = new URL(svc.config.databaseUrl!);
        url.searchParams.set('application_name', app);
        // The summary read comes after every message line: the export waits there, its lines written.
        await locker.query('BEGIN');
        await locker.query('LOCK TABLE summaries IN ACCESS EXCLUSIVE MODE');
        let child!: ChildProcess;
        const exited = new Promise<{ code: number | null; stderr: string }>((resolve) => {
          child = execFile(
            process.execPath,
            [cli, 'export', s, '--tenant', t.tenantId, '--out', file],
            { env: { ...cliEnv(), DATABASE_URL: url.toString() } },
            (err, _stdout, stderr) => resolve({ code: err ? (err.code as number) : 0, stderr }),
          );
        });
        const backend = await eventually(
          async () =>
            (
              await q<{ pid: number }>(
                `SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'
                   AND query LIKE '%FROM summaries%'`,
                [app],
              )
            )[0]?.pid,
          30_000,
          'the export waiting for the summary',
        );

        // Action: the CLI is held (SIGSTOP) while its summary read runs and the session is reset,
        // so its next look at the session comes after the reset.
        child.kill('SIGSTOP');
        await locker.query('ROLLBACK');
        await eventually(
          async () =>
            (await q(`SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'idle'`, [backend])).length >
            0,
          10_000,
          'the summary read to end',
        );
        assert.equal((await t.api.post(`/v1/sessions/${s}/reset`)).status, 200);
        child.kill('SIGCONT');
        const { code, stderr } = await exited;

        // Assert: exit 1 and the reason; nothing at the path, or the earlier file untouched.
        assert.equal(code, 1, stderr);
        assert.match(stderr, /the session was reset or deleted during the export/);
        if (earlier === null) assert.equal(existsSync(file), false, 'a partial export was left at the path');
        else assert.equal(readFileSync(file, 'utf8'), earlier);
        assert.deepEqual(readdirSync(dir), earlier === null ? [] : ['backup.jsonl'], 'no temporary left');
        // Written again for the next round (the reset emptied the session).
        await archive(t.api, s, [user('one'), assistant('two'), user('three')]);
      }
    } finally {
      await locker.end();
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
