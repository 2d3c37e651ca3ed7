import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import { describe, test } from 'node:test';
import express from 'express';
import { Redis } from 'ioredis';
import { pino } from 'pino';
import { makePgDb } from '../db/pool.js';
import { AppError } from '../services/errors.js';
import { openErrorMemory } from '../services/error-memory/error-store.js';
import { makeErrorHandler } from '../services/http-errors.js';
import { makeLlmClient } from '../services/llm/llm-client.js';
import { drainSession } from '../workers/ingest.js';
import { startWorkers } from '../workers/main.js';
import { startFakeOpenAI } from './support/fake-openai.js';
import { deleteRedisPrefix, eventually, startTestService, testPrefix } from './support/harness.js';
import { startPrivatePostgres } from './support/private-postgres.js';
import { startPrivateRedis } from './support/private-redis.js';

type Line = Record<string, unknown>;

/** A logger whose lines (at `level` and above) are kept, parsed, as an operator would read them. */
function capturedLogger(level = 'info') {
  const lines: Line[] = [];
  const logger = pino({ level }, { write: (line: string) => void lines.push(JSON.parse(line) as Line) });
  return { lines, logger };
}

const REDIS_DOWN = 'redis is unavailable, retry later';
const message = { messages: [{ role: 'user', content: 'private message text' }] };

void describe('request log lines', () => {
  void test('a 503 in a Redis outage names the request id, tenant and route, never the session, once per 5 s; the recovery is logged', async () => {
    // Setup: an API on a Redis of its own, a tenant, and a session named by an e-mail address.
    const redis = await startPrivateRedis();
    const { lines, logger } = capturedLogger();
    const own = await startTestService({ mode: 'api', env: { REDIS_URL: redis.url }, logger });
    const sid = 'alice@example.com';
    let down = false;
    try {
      const t = await own.newTenant();
      assert.equal((await t.api.post(`/v1/sessions/${sid}/messages`, message)).status, 202);

      // Action: Redis goes; the client retries one call under one request id until it sees the 503.
      await redis.kill();
      down = true;
      const first = await eventually(async () => {
        const r = await t.api.post(`/v1/sessions/${sid}/messages`, message, { 'x-request-id': 'call-1' });
        return r.status === 503 ? r : null;
      });
      assert.equal(first.headers.get('x-request-id'), 'call-1');

      // Assert: the line says which request, tenant and route, and names no session.
      const refusals = () =>
        lines.filter((l) => l.msg === REDIS_DOWN && l.route === '/v1/sessions/:sid/messages');
      const line = refusals()[0];
      assert.ok(line, JSON.stringify(lines));
      assert.deepEqual(
        [line.reqId, line.tenantId, line.method, line.code, line.level],
        ['call-1', t.tenantId, 'POST', 'unavailable', 40],
      );
      assert.ok(!('path' in line), JSON.stringify(line));
      // And why: the Redis client's own error (the connection is refused).
      assert.equal(typeof line.redis_error, 'string', JSON.stringify(line));

      // Action: 50 more requests within the 5 s.
      const more = await Promise.all(
        Array.from({ length: 50 }, (_, i) =>
          t.api.post(`/v1/sessions/${sid}/messages`, message, { 'x-request-id': `flood-${i}` }),
        ),
      );
      assert.deepEqual(new Set(more.map((r) => r.status)), new Set([503]));
      assert.equal(refusals().length, 1, 'one line for 51 requests');

      // The flood stops. At the end of the 5 s, the last request left out is logged, counting
      // the 49 others: every refused request is a line or counted in one.
      const second = await eventually(async () => refusals()[1], 10_000, 'a second line');
      assert.match(String(second.reqId), /^flood-\d+$/);
      assert.equal(second.suppressed, 49, JSON.stringify(second));
      assert.ok(Number(second.time) - Number(line.time) >= 4900, JSON.stringify([line, second]));

      // A request after that window is logged at once, with nothing left out before it.
      await new Promise((r) => setTimeout(r, 5100 - (Date.now() - Number(second.time))));
      await t.api.post(`/v1/sessions/${sid}/messages`, message, { 'x-request-id': 'later' });
      const third = await eventually(async () => refusals()[2], 2000, 'a third line');
      assert.deepEqual([third.reqId, third.suppressed], ['later', 0]);
      assert.equal(refusals().length, 3);

      // Redis is back: one line says so, with how long it was down.
      await redis.start();
      down = false;
      const restored = await eventually(
        async () => lines.find((l) => l.msg === 'redis connection restored' && l.role === 'producer'),
        15_000,
        'the restored line',
      );
      assert.ok(Number(restored.errors) >= 1 && Number(restored.down_ms) > 0, JSON.stringify(restored));
      assert.equal(restored.level, 30);

      // No line names the session (the raw path did).
      assert.deepEqual(
        lines.filter((l) => JSON.stringify(l).includes(sid)),
        [],
      );
    } finally {
      // (A start while it runs would leave this one behind: the new one cannot take the port.)
      if (down) await redis.start();
      await own.stop();
      await redis.stop();
    }
  });

  void test('a Redis refusal is named in the 503 line (redis_error)', async () => {
    // Setup: an API whose Redis runs out of memory (noeviction), so writes are refused.
    const redis = await startPrivateRedis();
    const { lines, logger } = capturedLogger('warn');
    const own = await startTestService({ mode: 'api', env: { REDIS_URL: redis.url }, logger });
    const admin = new Redis(redis.url);
    try {
      const t = await own.newTenant();
      await admin.config('SET', 'maxmemory', '1');

      // Action: an error-memory write, refused by Redis.
      const r = await t.api.post(
        '/v1/errors',
        { tool_name: 'npm', symptom: 'ERESOLVE', action: 'x', outcome: 'resolved' },
        {
          'x-request-id': 'oom-1',
        },
      );

      // Assert
      assert.equal(r.status, 503, r.text);
      const line = lines.find((l) => l.reqId === 'oom-1');
      assert.equal(line?.msg, REDIS_DOWN, JSON.stringify(lines));
      assert.equal(line.route, '/v1/errors');
      assert.match(String(line.redis_error), /^OOM command not allowed when used memory > 'maxmemory'/);
    } finally {
      await admin.config('SET', 'maxmemory', '0').catch(() => undefined);
      admin.disconnect();
      await own.stop();
      await redis.stop();
    }
  });

  void test('the error handler quotes the Redis reply behind a 503, and logs a flood of one 500 once per 5 s', async () => {
    // Setup: routes that meet a Redis refusal (as ioredis throws it) and errors nothing maps.
    const { lines, logger } = capturedLogger('warn');
    const app = express();
    const router = express.Router();
    router.post('/:sid/messages', () => {
      throw Object.assign(new Error("READONLY You can't write against a read only replica."), {
        command: { name: 'evalsha', args: ['private message text'] },
      });
    });
    router.get('/:sid', () => {
      throw Object.assign(new TypeError('boom'), { code: 'E_BOOM' });
    });
    router.get('/:sid/other', () => {
      throw new RangeError('other');
    });
    router.get('/:sid/bare', () => {
      throw new AppError(503, 'unavailable', REDIS_DOWN, { dependency: 'redis' });
    });
    app.use('/v1/sessions', router);
    app.use(makeErrorHandler(logger));
    const server = app.listen(0, '127.0.0.1');
    await new Promise((resolve) => server.once('listening', resolve));
    const base = `http://127.0.0.1:${(server.address() as { port: number }).port}/v1/sessions/bob@example.com`;
    try {
      // Action
      const readOnly = await fetch(`${base}/messages`, { method: 'POST', headers: { 'x-request-id': 'r1' } });
      const booms: number[] = [];
      for (let i = 0; i < 20; i++) booms.push((await fetch(base)).status);
      const other = await fetch(`${base}/other`);
      const bare = await fetch(`${base}/bare`);

      // Assert: the 503 line quotes Redis, and nothing of the command.
      assert.deepEqual([readOnly.status, bare.status, other.status], [503, 503, 500]);
      assert.deepEqual(new Set(booms), new Set([500]));
      const refused = lines.find((l) => l.msg === REDIS_DOWN && l.route === '/:sid/messages');
      assert.equal(refused?.redis_error, "READONLY You can't write against a read only replica.");
      assert.ok(
        !JSON.stringify(lines).includes('private message text'),
        "!JSON.stringify(lines).includes('private message text')",
      );
      const bareLine = lines.find((l) => l.msg === REDIS_DOWN && l.route === '/:sid/bare');
      assert.ok(bareLine && !('redis_error' in bareLine), 'nothing to quote without a cause');
      // One line per kind of error and route, however many requests met it.
      assert.deepEqual(
        lines.filter((l) => l.msg === 'unhandled error').map((l) => [(l.err as Line).type, l.route, l.level]),
        [
          ['TypeError', '/:sid', 50],
          ['RangeError', '/:sid/other', 50],
        ],
      );
      assert.ok(
        !JSON.stringify(lines).includes('bob@example.com'),
        "!JSON.stringify(lines).includes('bob@example.com')",
      );
    } finally {
      server.close();
    }
  });
  void test('a NUL that reached Postgres is a 400 invalid_characters, logged once as a gap in the route’s validation', async () => {
    // Setup: a route whose statement Postgres refuses for a NUL (SQLSTATE 22021, as pg throws it).
    const { lines, logger } = capturedLogger('warn');
    const app = express();
    app.post('/v1/sessions/:sid/messages', () => {
      throw Object.assign(new Error('invalid byte sequence for encoding "UTF8": 0x00'), { code: '22021' });
    });
    app.use(makeErrorHandler(logger));
    const server = app.listen(0, '127.0.0.1');
    await new Promise((resolve) => server.once('listening', resolve));
    const url = `http://127.0.0.1:${(server.address() as { port: number }).port}/v1/sessions/s1/messages`;
    try {
      // Action
      const answers = [];
      for (let i = 0; i < 3; i++) {
        const r = await fetch(url, { method: 'POST' });
        answers.push([r.status, ((await r.json()) as { error: { code: string } }).error.code]);
      }

      // Assert: bad input for the client, not a 500; one warning for the operator.
      assert.deepEqual(answers, Array(3).fill([400, 'invalid_characters']));
      assert.deepEqual(
        lines.map((l) => [l.level, l.msg, l.code, l.route]),
        [[40, 'unvalidated NUL reached Postgres', '22021', '/v1/sessions/:sid/messages']],
      );
    } finally {
      server.close();
    }
  });
});

void describe('job and worker log lines', () => {
  void test('attempts that will be retried are logged once per error per 5 s; final failures always', async () => {
    // Setup: workers whose embed processor fails as in a Postgres outage, on an API's deps.
    const { lines, logger } = capturedLogger('warn');
    const own = await startTestService({ mode: 'api' });
    const workers = await startWorkers({ ...own.deps, logger }, [
      {
        name: 'failing',
        processors: { embed: () => Promise.reject(new Error('connect ECONNREFUSED 127.0.0.1:5432')) },
      },
    ]);
    try {
      // Action: 30 jobs of two attempts each, of a tenant that exists (a job of an erased one ends
      // as done), fail at once.
      const { tenantId } = await own.newTenant();
      for (let i = 0; i < 30; i++) {
        await own.deps.queues.embed.add('embed', { v: 1, tenantId, sessionId: `s-${i}` } as never, {
          attempts: 2,
          backoff: { type: 'fixed', delay: 10 },
        });
      }
      const finals = () => lines.filter((l) => l.msg === 'job failed' && l.final === true);
      await eventually(async () => finals().length === 30, 20_000, 'every job to fail for good');

      // Assert: 30 lines for the 30 final failures; the 30 retried attempts took one or two.
      const retried = lines.filter((l) => l.msg === 'job failed' && l.final === false);
      assert.ok(retried.length >= 1 && retried.length <= 2, JSON.stringify(retried));
      assert.equal(retried[0]!.tenantId, tenantId);
    } finally {
      await workers.close(5000);
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
    }
  });

  void test("a job's Postgres refusal is logged as a request's: its SQLSTATE and at most 200 characters of it", async () => {
    // Setup: workers whose embed processor meets a Postgres error that quotes a long value.
    const { lines, logger } = capturedLogger('warn');
    const own = await startTestService({ mode: 'api' });
    const quoted = `secret-${'v'.repeat(400)}`;
    const workers = await startWorkers({ ...own.deps, logger }, [
      { name: 'failing', processors: { embed: () => own.deps.db.query('SELECT $1::int', [quoted]) } },
    ]);
    try {
      const { tenantId } = await own.newTenant();

      // Action
      const job = await own.deps.queues.embed.add('embed', { v: 1, tenantId, sessionId: 's' } as never, {
        attempts: 1,
      });

      // Assert: the SQLSTATE, and the message cut as request lines cut it (it was 437 characters).
      const failed = await eventually(
        async () => lines.find((l) => l.msg === 'job failed' && l.jobId === job.id),
        15_000,
        'the job to fail',
      );
      assert.equal(failed.pg_code, '22P02', JSON.stringify(failed));
      const logged = (failed.err as { message: string }).message;
      assert.ok(logged.length <= 200, JSON.stringify(failed));
      assert.match(logged, /^invalid input syntax for type integer/);
    } finally {
      await workers.close(5000);
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
    }
  });

  void test('a job failing while Postgres is unreachable is kept as failed, not dropped as an erased tenant’s', async () => {
    // Setup: workers whose embed processor fails, and whose database cannot be reached: whether
    // the job's tenant was erased cannot be read.
    const { lines, logger } = capturedLogger('info');
    const own = await startTestService({ mode: 'api' });
    const unreachable = makePgDb({ connectionString: 'postgres://postgres@127.0.0.1:1/mnemos' });
    const workers = await startWorkers({ ...own.deps, db: unreachable, logger }, [
      {
        name: 'failing',
        processors: { embed: () => Promise.reject(new Error('connect ECONNREFUSED 127.0.0.1:5432')) },
      },
    ]);
    try {
      const { tenantId } = await own.newTenant();

      // Action: a job of a tenant that exists fails.
      const job = await own.deps.queues.embed.add('embed', { v: 1, tenantId, sessionId: 's' } as never, {
        attempts: 1,
      });

      // Assert: its failure is logged and its record kept, to be retried (it was completed, as an
      // erased tenant's job).
      await eventually(
        async () => lines.some((l) => l.msg === 'job failed' && l.jobId === job.id),
        15_000,
        'the job to fail',
      );
      assert.equal(await own.deps.queues.embed.getJobState(job.id!), 'failed');
      assert.ok(!lines.some((l) => l.msg === 'dropped a failed job of an erased tenant'), 'not dropped');
    } finally {
      await workers.close(5000);
      await unreachable.close();
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
    }
  });

  void test('a failed job names its tenant and session, nothing else of its payload', async () => {
    // Setup: a worker, and a job its processor refuses (a payload of a version it does not read).
    const { lines, logger } = capturedLogger('warn');
    const own = await startTestService({ mode: 'worker', logger });
    try {
      const t = await own.newTenant();
      const job = await own.deps.queues.ingest.add('flush', {
        v: 99,
        tenantId: t.tenantId,
        sessionId: 'carol@example.com',
        content: 'private message text',
      } as never);

      // Action: the worker runs it.
      const failed = await eventually(
        async () => lines.find((l) => l.msg === 'job failed' && l.jobId === job.id),
        15_000,
        'the job to fail',
      );

      // Assert
      assert.deepEqual(
        [failed.queue, failed.tenantId, failed.sessionId],
        ['ingest', t.tenantId, 'carol@example.com'],
      );
      assert.ok(!JSON.stringify(failed).includes('private message text'), JSON.stringify(failed));
    } finally {
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
    }
  });

  void test('a job of an erased tenant that fails ends as done, leaving no record of the tenant', async () => {
    // Setup: a worker, and a job its processor refuses, of a tenant the database does not have
    // (erased while its summary's LLM call ran: the erasure had swept before the job failed).
    const { lines, logger } = capturedLogger('info');
    const own = await startTestService({ mode: 'worker', logger });
    try {
      const job = await own.deps.queues.ingest.add('flush', {
        v: 99,
        tenantId: 't_erased_meanwhile',
        sessionId: 'dave@example.com',
      } as never);

      // Action: the worker runs it.
      await eventually(
        async () =>
          lines.some((l) => l.msg === 'dropped a failed job of an erased tenant' && l.jobId === job.id),
        15_000,
        'the job dropped',
      );

      // Assert: no failed record kept (ingest keeps failed jobs for good), nothing logged as failed.
      assert.equal(await own.deps.queues.ingest.getJob(job.id!), undefined);
      assert.equal(await own.deps.queues.ingest.getFailedCount(), 0);
      assert.ok(!lines.some((l) => l.msg === 'job failed' && l.jobId === job.id), 'no failure logged');
    } finally {
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
    }
  });

  void test('dead-lettered inbox entries are logged with the session, the list to read, and where the docs say what to do', async () => {
    // Setup: an inbox holding an entry that is no message.
    const { lines, logger } = capturedLogger('warn');
    const own = await startTestService({ mode: 'api' });
    const redis = new Redis(own.config.redisUrl);
    try {
      const t = await own.newTenant();
      const sid = 'dave@example.com';
      await redis.rpush(`${own.config.prefix}:inbox:${t.tenantId}:${sid}`, '1 0 this is not JSON');

      // Action: a drain.
      await drainSession({ ...own.deps, logger }, t.tenantId, sid);

      // Assert: the line leads to the list, and the list holds the entry.
      const line = lines.find((l) => l.msg === 'unreadable inbox entries dead-lettered');
      assert.ok(line, JSON.stringify(lines));
      const key = `${own.config.prefix}:dead:${t.tenantId}:${sid}`;
      assert.deepEqual(
        [line.level, line.tenantId, line.sessionId, line.count, line.key],
        [50, t.tenantId, sid, 1, key],
      );
      assert.deepEqual(await redis.lrange(key, 0, -1), ['1 0 this is not JSON']);
      // The hint points at text the docs hold.
      const [, doc, heading] = /see (docs\/[\w.-]+), "([^"]+)"/.exec(String(line.hint)) ?? [];
      assert.ok(doc && heading, String(line.hint));
      assert.ok((await readFile(doc, 'utf8')).includes(heading), `${doc} has "${heading}"`);
    } finally {
      redis.disconnect();
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
    }
  });

  void test("the error memory's reconnect errors are one line per 5 s, without a stack, and its recovery is logged", async () => {
    // Setup: the store on a Redis of its own.
    const redis = await startPrivateRedis();
    const { lines, logger } = capturedLogger();
    const store = await openErrorMemory({ redisUrl: redis.url, prefix: testPrefix(), ttlDays: 1, logger });
    let down = false;
    try {
      assert.equal(await store.ping(), true);

      // Action: Redis is gone for 3 s (reconnect attempts after 100, 200, 400, 800, 1,600 ms), then back.
      await redis.kill();
      down = true;
      await new Promise((r) => setTimeout(r, 3000));
      await redis.start();
      down = false;
      const restored = await eventually(
        async () => lines.find((l) => l.msg === 'error-memory redis connection restored'),
        15_000,
        'the restored line',
      );

      // Assert
      // One line per 5 s: a Redis slow to come back (a loaded machine) may take a second window.
      const errors = lines.filter((l) => l.msg === 'error-memory redis connection error');
      assert.ok(errors.length >= 1, JSON.stringify(errors));
      for (let i = 1; i < errors.length; i++) {
        const gap = Number(errors[i]!.time) - Number(errors[i - 1]!.time);
        assert.ok(gap >= 4900, `lines ${gap} ms apart: ${JSON.stringify(errors)}`);
      }
      const err = errors[0]!.err as Line;
      assert.ok(err.message && !String(err.stack ?? '').includes(' at '), JSON.stringify(errors));
      assert.ok(Number(restored.errors) >= 3, JSON.stringify(restored));
      assert.equal(await store.ping(), true);
    } finally {
      if (down) await redis.start();
      await store.close();
      await redis.stop();
    }
  });

  void test('the end of a Postgres outage is logged once, with how long it lasted and how many statements failed', async () => {
    // Setup: a pool on a Postgres of its own, used once: no line at a first connect.
    const server = await startPrivatePostgres();
    const { lines, logger } = capturedLogger();
    const db = makePgDb({ connectionString: server.adminUrl, max: 4, logger });
    const restoredLines = () => lines.filter((l) => l.msg === 'postgres connection restored');
    let down = false;
    try {
      assert.equal((await db.query<{ n: number }>('SELECT 1 AS n')).rows[0]!.n, 1);
      // Four connections open, idle when Postgres goes.
      await Promise.all(Array.from({ length: 4 }, () => db.query('SELECT pg_sleep(0.2)')));
      assert.deepEqual(restoredLines(), []);

      // Action: Postgres stops (its sessions are terminated); three statements fail; it comes back.
      await server.stop();
      down = true;
      for (let i = 0; i < 3; i++) await assert.rejects(db.query('SELECT 1'));
      await server.start();
      down = false;
      await db.query('SELECT 1');
      await db.query('SELECT 1');

      // Assert: one line, at info, counting the failures (and the idle connection it lost).
      const restored = await eventually(async () => restoredLines()[0], 5000, 'the restored line');
      assert.equal(restored.level, 30);
      assert.ok(Number(restored.errors) >= 3 && Number(restored.down_ms) > 0, JSON.stringify(restored));
      assert.equal(restoredLines().length, 1);
      // The four idle connections lost: one line, then at the end of its 5 s one counting the
      // rest (throttled), not a line each.
      const idleLines = () => lines.filter((l) => l.msg === 'postgres idle client error');
      const idle = await eventually(async () => idleLines().length === 2 && idleLines(), 8000, 'two lines');
      assert.equal(
        idle.reduce((n, l) => n + 1 + Number(l.suppressed), 0),
        4,
        JSON.stringify(idle),
      );
    } finally {
      if (down) await server.start();
      await db.close();
      await server.destroy();
    }
  });
});

void describe('LLM client log lines', () => {
  void test('retried LLM attempts are one line per purpose, model and failure per 5 s, naming the tenant and session', async () => {
    // Setup: an endpoint that answers 500 to every call, and a client logging as the service does.
    const fake = await startFakeOpenAI();
    fake.onChat(() => ({ status: 500 }));
    const { lines, logger } = capturedLogger('warn');
    const llm = makeLlmClient({ baseURL: fake.url, timeoutMs: 5000, baseDelayMs: 1, maxDelayMs: 5, logger });
    try {
      // Action: 20 summary calls of 3 attempts each fail: 40 attempts are retried.
      const calls = Array.from({ length: 20 }, (_, i) =>
        llm
          .chat({
            purpose: 'summary',
            model: 'sum-model',
            tenantId: 'tenant-1',
            sessionId: `session-${i}`,
            messages: [{ role: 'user', content: 'private message text' }],
          })
          .then(
            () => 'answered',
            () => 'failed',
          ),
      );
      assert.deepEqual(new Set(await Promise.all(calls)), new Set(['failed']));

      // Assert: one line (before, one per retried attempt), saying whose call it was.
      const retried = () => lines.filter((l) => l.msg === 'llm call failed, retrying');
      assert.equal(retried().length, 1, JSON.stringify(retried()));
      const line = retried()[0]!;
      assert.deepEqual(
        [line.purpose, line.model, line.tenantId, line.kind, line.status, line.suppressed],
        ['summary', 'sum-model', 'tenant-1', 'server', 500, 0],
      );
      assert.match(String(line.sessionId), /^session-\d+$/);
      // At the end of the 5 s, the last attempt left out is written, counting the 38 others.
      const last = await eventually(async () => retried()[1], 10_000, 'the line counting the others');
      assert.equal(last.suppressed, 38, JSON.stringify(last));
      assert.ok(!JSON.stringify(lines).includes('private message text'), 'no prompt text');
    } finally {
      await fake.close();
    }
  });
});
