import assert from 'node:assert/strict';
import { once } from 'node:events';
import { get as httpGet } from 'node:http';
import type { IncomingMessage } from 'node:http';
import { connect } from 'node:net';
import type { Socket } from 'node:net';
import { after, before, describe, test } from 'node:test';
import express from 'express';
import { Redis } from 'ioredis';
import pg from 'pg';
import { pino } from 'pino';
import { makePgDb } from '../db/pool.js';
import { makeErrorHandler } from '../services/http-errors.js';
import { makeLogger } from '../services/logger.js';
import { inboxKeys } from '../services/messages/inbox.js';
import { oldestUnsummarisedAgeSeconds } from '../db/queries/summaries.js';
import { sampleQueues, sampleSummaryLag } from '../services/metrics-sampler.js';
import { makeMetrics } from '../services/metrics.js';
import { createTenant } from '../services/tenants.js';
import { rateLimit } from '../services/rate-limit.js';
import { startFakeOpenAI } from './support/fake-openai.js';
import {
  ADMIN_TOKEN,
  ADMIN_URL,
  REDIS_URL,
  api,
  createTestDatabase,
  deleteRedisPrefix,
  dropTestDatabase,
  eventually,
  startTestService,
} from './support/harness.js';
import type { TestService } from './support/harness.js';

const metricValue = (text: string, name: string, labels = ''): number => {
  const line = text
    .split('\n')
    .find((l) => l.startsWith(`${name}${labels ? `{${labels}` : ''}`) && (labels || /^[a-z_]+ /.test(l)));
  return line ? Number(line.slice(line.lastIndexOf(' ') + 1)) : NaN;
};

void describe('operations', () => {
  let svc: TestService;
  before(async () => {
    svc = await startTestService({ env: { RATE_LIMIT_PER_MIN: '5' } });
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
  });

  void test('metrics are present, move with traffic, and carry no tenant or session labels', async () => {
    const t = await svc.newTenant();
    // A client that gives up (a context waiting up to 5 s for a seq that never comes) is counted
    // when it goes, as 499: it was not counted at all. (A key of its own: this suite's rate limit
    // is 5 requests a minute.)
    const waiter = await svc.newTenant();
    const first = { messages: [{ role: 'user', content: 'hello' }] };
    assert.equal((await waiter.api.post('/v1/sessions/waits/messages?wait=true', first)).status, 201);
    await assert.rejects(
      fetch(`${svc.base}/v1/sessions/waits/context`, {
        method: 'POST',
        headers: { authorization: `Bearer ${waiter.apiKey}`, 'content-type': 'application/json' },
        body: JSON.stringify({ min_seq: 1_000_000 }),
        signal: AbortSignal.timeout(300),
      }),
    );
    const gaveUp =
      /mnemos_http_request_duration_seconds_count\{method="POST",route="\/v1\/sessions\/:sid\/context",status="499"\} 1/;
    await eventually(async () => gaveUp.test(await (await fetch(`${svc.base}/metrics`)).text()));
    const before = await (await fetch(`${svc.base}/metrics`)).text();
    const acceptedBefore = metricValue(before, 'mnemos_messages_accepted_total');
    const archivedBefore = metricValue(before, 'mnemos_messages_archived_total');
    const r = await t.api.post('/v1/sessions/secret-session-name/messages?wait=true', {
      messages: [
        { role: 'user', content: 'one' },
        { role: 'assistant', content: 'two' },
      ],
    });
    assert.equal(r.status, 201);
    // Errors keep the full route pattern (not the router-relative "/:id").
    assert.equal((await t.api.get('/v1/jobs/ingest.nope')).status, 404);
    assert.equal((await t.api.get('/v1/sessions/secret-session-name/messages?limit=0')).status, 400);
    assert.equal((await t.api.get('/v1/sessions?limit=1')).status, 200);
    // Answered before any route matched: labelled by the mount, not lumped with unknown paths.
    assert.equal((await api(svc.base, 'mn_wrong').get('/v1/sessions/x/messages')).status, 401);
    // Routing ignores case; labels must not, or each spelling would be a series of its own.
    assert.equal((await api(svc.base, 'mn_wrong').get('/V1/SESSIONS/x/messages')).status, 401);
    assert.equal((await t.api.get('/V1/Sessions?limit=1')).status, 200);
    assert.equal((await fetch(`${svc.base}/no/such/path`)).status, 404);
    await sampleQueues(svc.deps);
    const text = await (await fetch(`${svc.base}/metrics`)).text();
    const labelled = (route: string, status: number) =>
      new RegExp(
        `mnemos_http_request_duration_seconds_count\\{method="GET",route="${route}",status="${status}"\\} [1-9]`,
      );
    assert.match(text, labelled('/v1/jobs/:id', 404));
    assert.match(text, labelled('/v1/sessions/:sid/messages', 400));
    assert.match(text, labelled('/v1/sessions', 200));
    assert.match(text, labelled('/v1/sessions/\\*', 401));
    assert.match(text, labelled('unmatched', 404));
    assert.doesNotMatch(text, /route="[^"]*[A-Z][^"]*"/, 'no label in the client’s spelling');
    assert.equal(metricValue(text, 'mnemos_messages_accepted_total'), acceptedBefore + 2);
    assert.equal(metricValue(text, 'mnemos_messages_archived_total'), archivedBefore + 2);
    // The waiter's post and this one.
    assert.match(
      text,
      /mnemos_http_request_duration_seconds_count\{method="POST",route="\/v1\/sessions\/:sid\/messages",status="201"\} 2/,
    );
    assert.match(text, /mnemos_queue_jobs\{queue="ingest",state="failed"\} \d+/);
    assert.match(text, /mnemos_queue_oldest_job_age_seconds\{queue="ingest"\} \d+/);
    assert.match(text, /mnemos_job_duration_seconds_count\{queue="ingest"\} [1-9]/);
    assert.match(text, /mnemos_process_resident_memory_bytes/);
    assert.doesNotMatch(text, /secret-session-name/);
    assert.ok(!text.includes(t.tenantId), 'no tenant ids in metrics');
  });

  void test('answers given before the app runs (no Host, an unknown coding or expectation, a parse error) are in the request metric', async () => {
    const port = Number(new URL(svc.base).port);
    // The whole answer, once the server closes the connection (each of these answers closes it).
    const exchange = (request: string) =>
      new Promise<string>((resolve, reject) => {
        const socket = connect(port, '127.0.0.1', () => socket.write(request));
        let data = '';
        socket.on('data', (d) => (data += d.toString()));
        socket.on('close', () => resolve(data));
        // Refused before all of it was read (the oversized headers): what came back still counts.
        socket.on('error', () => undefined);
        socket.setTimeout(10_000, () => {
          socket.destroy();
          reject(new Error(`no answer within 10 s; read: ${JSON.stringify(data)}`));
        });
      });
    const series = [
      ['GET', 400],
      ['POST', 501],
      ['GET', 417],
      ['unknown', 431],
      ['unknown', 400],
    ] as const;
    const counts = async () => {
      const text = await (await fetch(`${svc.base}/metrics`)).text();
      const of = ([method, status]: (typeof series)[number]) =>
        metricValue(
          text,
          'mnemos_http_request_duration_seconds_count',
          `method="${method}",route="unmatched",status="${status}"`,
        ) || 0;
      return { text, counts: series.map(of) };
    };
    const before = await counts();

    const host = `host: 127.0.0.1:${port}\r\n`;
    const answers = [
      await exchange('GET /v1/sessions HTTP/1.1\r\n\r\n'),
      await exchange(`GET /v1/sessions HTTP/1.1\r\n${host}host: other.example\r\n\r\n`),
      await exchange(
        `POST /v1/sessions/x/messages HTTP/1.1\r\n${host}transfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n`,
      ),
      await exchange(`GET /v1/sessions HTTP/1.1\r\n${host}expect: foo\r\n\r\n`),
      await exchange(`GET /v1/sessions HTTP/1.1\r\n${host}x-big: ${'a'.repeat(20_000)}\r\n\r\n`),
      await exchange('NOT HTTP\r\n\r\n'),
    ];
    assert.deepEqual(
      answers.map((a) => a.slice(0, 12)),
      ['HTTP/1.1 400', 'HTTP/1.1 400', 'HTTP/1.1 501', 'HTTP/1.1 417', 'HTTP/1.1 431', 'HTTP/1.1 400'],
    );

    // Each answer is counted under its method and status, as "unmatched" (no route ran); the two
    // Host refusals share a series. Counted once the answer is sent.
    let after = await counts();
    await eventually(async () => {
      after = await counts();
      return after.counts.every((n, k) => n > before.counts[k]!);
    }, 5000).catch(() => undefined);
    assert.deepEqual(
      after.counts.map((n, i) => n - before.counts[i]!),
      [2, 1, 1, 1, 1],
    );
    // A summarize?wait=true waits up to 60 s: it has a bucket below +Inf.
    assert.match(after.text, /mnemos_http_request_duration_seconds_bucket\{le="60",/);
  });

  void test('a body that stops coming is one answer in the request metric, not two', async () => {
    // Setup: a short request timeout (Node checks it every 30 s at most) and an authenticated post
    // whose body stops half-way.
    const server = svc.server!;
    const saved = server.requestTimeout;
    server.requestTimeout = 1000;
    const t = await svc.newTenant();
    const total = async () =>
      [
        ...(await (await fetch(`${svc.base}/metrics`)).text()).matchAll(
          /^mnemos_http_request_duration_seconds_count\{[^}]*status="(?:4\d\d|499)"[^}]*\} (\d+)$/gm,
        ),
      ].reduce((n, m) => n + Number(m[1]), 0);
    try {
      const before = await total();

      // Action
      const answer = await new Promise<string>((resolve) => {
        const socket = connect(Number(new URL(svc.base).port), '127.0.0.1', () =>
          socket.write(
            `POST /v1/sessions/slow/messages HTTP/1.1\r\nhost: x\r\nauthorization: Bearer ${t.apiKey}\r\n` +
              `content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"messages":[`,
          ),
        );
        let data = '';
        socket.on('data', (d) => (data += d.toString()));
        socket.on('close', () => resolve(data));
        socket.on('error', () => undefined);
      });

      // Assert: the client got a 408, and the metric counts one refused request (it counted the
      // raw 408 and the app's own answer both).
      assert.match(answer, /^HTTP\/1\.1 408 /);
      await eventually(async () => (await total()) > before, 5000, 'the request counted');
      await new Promise((r) => setTimeout(r, 200));
      assert.equal((await total()) - before, 1);
    } finally {
      server.requestTimeout = saved;
    }
  });

  void test('summary lag counts from archiving, not from a back-dated message time', async () => {
    const t = await svc.newTenant();
    const old = { messages: [{ role: 'user', content: 'from last year', sent_at: '2025-01-01T00:00:00Z' }] };
    assert.equal((await t.api.post('/v1/sessions/imported/messages?wait=true', old)).status, 201);
    const lag = await oldestUnsummarisedAgeSeconds(svc.deps.db);
    // Everything in this suite's database was archived minutes ago, none of it summarised.
    assert.ok(lag > 0 && lag < 3600, `lag ${lag} s`);
  });

  void test('the summary lag is computed by one process of the fleet a minute and exported by all', async () => {
    const t = await svc.newTenant();
    const msg = { messages: [{ role: 'user', content: 'not summarised yet' }] };
    assert.equal((await t.api.post('/v1/sessions/lagging/messages?wait=true', msg)).status, 201);
    await new Promise((resolve) => setTimeout(resolve, 1100));
    let lagQueries = 0;
    const counting = {
      ...svc.deps.db,
      query: (text: string, params?: unknown[], o?: unknown) => {
        if (text.includes('extract(epoch FROM now() - min(first_at))')) lagQueries++;
        return svc.deps.db.query(text, params as never, o as never);
      },
    };
    const prefix = `${svc.config.prefix}-lag`;
    // Three API processes of one fleet (one Redis prefix), each with its own metrics.
    const processes = [0, 1, 2].map(() => ({
      db: counting as never,
      llm: {} as never,
      metrics: makeMetrics(),
      redis: svc.deps.redis,
      config: { ...svc.config, prefix },
    }));
    try {
      for (const p of processes) await sampleSummaryLag(p);
      assert.equal(lagQueries, 1, 'one query for the fleet');
      const exported = await Promise.all(
        processes.map(async (p) =>
          metricValue(await p.metrics.registry.metrics(), 'mnemos_summary_lag_seconds'),
        ),
      );
      const truth = await oldestUnsummarisedAgeSeconds(svc.deps.db);
      assert.ok(exported[0]! > 0 && Math.abs(exported[0]! - truth) < 60, `${exported[0]} against ${truth}`);
      assert.deepEqual(exported, [exported[0], exported[0], exported[0]]);
    } finally {
      await deleteRedisPrefix(prefix);
    }
  });

  void test('the ingest queue’s oldest age covers accepted messages whose drain has no waiting job', async () => {
    const t = await svc.newTenant();
    const ingest = svc.workers!.workers.find((w) => w.name === 'ingest')!;
    await ingest.pause();
    try {
      const r = await t.api.post('/v1/sessions/stuck/messages', {
        messages: [{ role: 'user', content: 'x' }],
      });
      assert.equal(r.status, 202);
      // As when its drain keeps failing: the job retries from the delayed set, none waits.
      await svc.deps.queues.ingest.drain();
      await new Promise((resolve) => setTimeout(resolve, 1100));
      await sampleQueues(svc.deps);
      const text = await (await fetch(`${svc.base}/metrics`)).text();
      assert.ok(metricValue(text, 'mnemos_queue_oldest_job_age_seconds', 'queue="ingest"') >= 1, text);
    } finally {
      await ingest.resume();
    }
    // The job was removed: a flush request (what the ingest sweeper sends within a minute or two).
    await svc.deps.queues.ingest.add('flush', { v: 1, tenantId: t.tenantId, sessionId: 'stuck' });
    await eventually(async () => (await t.api.get('/v1/sessions/stuck')).body.message_count === 1, 20_000);
  });

  void test('a drain stuck in Postgres shows as the ingest queue’s longest active job, though nothing waits', async () => {
    const t = await svc.newTenant();
    const locker = new pg.Client({ connectionString: svc.config.databaseUrl });
    await locker.connect();
    try {
      await t.api.post('/v1/sessions/held/messages?wait=true', {
        messages: [{ role: 'user', content: 'one' }],
      });
      // Its drain takes the session row first: held here, the drain's job stays active.
      await locker.query('BEGIN');
      await locker.query('SELECT 1 FROM sessions WHERE tenant_id = $1 AND id = $2 FOR UPDATE', [
        t.tenantId,
        'held',
      ]);
      assert.equal(
        (await t.api.post('/v1/sessions/held/messages', { messages: [{ role: 'user', content: 'two' }] }))
          .status,
        202,
      );
      await eventually(
        async () => ((await svc.deps.queues.ingest.getJobCounts('active')).active ?? 0) > 0,
        10_000,
        'the drain active',
      );
      await new Promise((resolve) => setTimeout(resolve, 1100));
      await sampleQueues(svc.deps);
      const text = await (await fetch(`${svc.base}/metrics`)).text();
      assert.ok(metricValue(text, 'mnemos_queue_longest_active_job_seconds', 'queue="ingest"') >= 1, text);
    } finally {
      await locker.query('ROLLBACK').catch(() => undefined);
      await locker.end();
    }
    await eventually(async () => (await t.api.get('/v1/sessions/held')).body.message_count === 2, 20_000);
    await sampleQueues(svc.deps);
    const after = await (await fetch(`${svc.base}/metrics`)).text();
    // Back under a second once it drained (another job may have just started).
    assert.ok(metricValue(after, 'mnemos_queue_longest_active_job_seconds', 'queue="ingest"') < 1, after);
  });

  void test('a queue paused in Bull Board shows as mnemos_queue_paused 1 until it is resumed', async () => {
    // Setup
    const board = api(svc.base, ADMIN_TOKEN);
    const paused = async () => {
      await sampleQueues(svc.deps);
      const text = await (await fetch(`${svc.base}/metrics`)).text();
      return ['compact', 'ingest'].map((q) => metricValue(text, 'mnemos_queue_paused', `queue="${q}"`));
    };
    assert.deepEqual(await paused(), [0, 0]);

    // Action: an operator pauses a queue, then resumes it
    assert.equal((await board.raw('/admin/queues/api/queues/compact/pause', { method: 'PUT' })).status, 200);
    try {
      // Assert
      assert.deepEqual(await paused(), [1, 0]);
    } finally {
      assert.equal(
        (await board.raw('/admin/queues/api/queues/compact/resume', { method: 'PUT' })).status,
        200,
      );
    }
    assert.deepEqual(await paused(), [0, 0]);
  });

  void test('a job that fails for good before its last attempt is counted as final', async () => {
    const failures = async (final: string) =>
      (await svc.deps.metrics.jobFailures.get()).values.find(
        (v) => v.labels.queue === 'maintenance' && v.labels.final === final,
      )?.value ?? 0;
    const [finalBefore, retryBefore] = [await failures('true'), await failures('false')];
    // A payload of a version this build does not know is a permanent fault (UnrecoverableError),
    // with 2 of 3 attempts left.
    await svc.deps.queues.maintenance.add('nope', { v: 2, kind: 'ingest-sweep' } as never);
    await eventually(async () => (await failures('true')) === finalBefore + 1, 15_000, 'a final failure');
    assert.equal(await failures('false'), retryBefore);
  });

  void test("a newer build's maintenance task completes as skipped, and its scheduler is left for Bull Board to remove", async () => {
    const failures = async () =>
      (await svc.deps.metrics.jobFailures.get()).values
        .filter((v) => v.labels.queue === 'maintenance')
        .reduce((n, v) => n + v.value, 0);
    const failedBefore = await failures();
    // Setup: what a newer build side by side with this one adds, as a job and as a schedule.
    const kind = 'from-a-newer-build';
    await svc.deps.queues.maintenance.upsertJobScheduler(
      kind,
      { every: 3_600_000 },
      { name: kind, data: { v: 1, kind } },
    );

    // Action
    const job = await svc.deps.queues.maintenance.add(kind, { v: 1, kind }, { removeOnComplete: false });
    const done = await eventually(
      async () => {
        const j = await svc.deps.queues.maintenance.getJob(job.id!);
        return j && ((await j.isCompleted()) || (await j.isFailed())) ? j : null;
      },
      15_000,
      'the job to end',
    );
    // The worker goes on: a task this build has, after it, runs too.
    const next = await svc.deps.queues.maintenance.add(
      'ingest-sweep',
      { v: 1, kind: 'ingest-sweep' },
      { removeOnComplete: false },
    );
    await eventually(
      async () => (await svc.deps.queues.maintenance.getJob(next.id!))?.isCompleted(),
      15_000,
      'a known task after it',
    );

    // Assert (read again: the job read before its state was checked may predate its end)
    const ended = (await svc.deps.queues.maintenance.getJob(done.id!))!;
    assert.equal(await ended.getState(), 'completed', ended.failedReason);
    assert.deepEqual(ended.returnvalue, { skipped: 'unknown maintenance task in this build' });
    assert.equal(await failures(), failedBefore, 'no job failure counted');
    assert.ok(
      await svc.deps.queues.maintenance.getJobScheduler(kind),
      "this build leaves the newer build's scheduler alone",
    );
    // After a rollback, README "Upgrading": an operator lists and removes it through Bull Board's API.
    const listed = await fetch(`${svc.base}/admin/queues/api/job-schedulers?queueName=maintenance`, {
      headers: { authorization: `Bearer ${ADMIN_TOKEN}` },
    });
    const { schedulers } = (await listed.json()) as { schedulers: Array<{ id: string }> };
    assert.ok(
      schedulers.some((sc) => sc.id === kind),
      JSON.stringify(schedulers),
    );
    const removed = await fetch(
      `${svc.base}/admin/queues/api/queues/maintenance/job-schedulers/${kind}/remove`,
      { method: 'PUT', headers: { authorization: `Bearer ${ADMIN_TOKEN}` } },
    );
    assert.equal(removed.status, 204);
    assert.equal(await svc.deps.queues.maintenance.getJobScheduler(kind), undefined);
  });

  void test('Bull Board takes changes only from its own origin; a job it adds with a bad payload fails at once', async () => {
    const basic = `Basic ${Buffer.from(`admin:${ADMIN_TOKEN}`).toString('base64')}`;
    const add = (headers: Record<string, string>) =>
      fetch(`${svc.base}/admin/queues/api/queues/ingest/add`, {
        method: 'POST',
        headers: { authorization: basic, ...headers },
        body: headers['content-type'] === 'application/json' ? '{"name":"x","data":{}}' : 'name=x',
      });
    const waitingBefore = await svc.deps.queues.ingest.getJobCounts();
    // What another site's page can make a browser send with the remembered Basic credentials.
    const foreign: Array<Record<string, string>> = [
      { origin: 'https://evil.example', 'content-type': 'application/x-www-form-urlencoded' },
      { origin: 'null', 'content-type': 'text/plain' },
      { 'sec-fetch-site': 'cross-site', 'content-type': 'application/x-www-form-urlencoded' },
    ];
    for (const headers of foreign) {
      const r = await add(headers);
      assert.equal(r.status, 403, JSON.stringify(headers));
      assert.equal(((await r.json()) as { error: { code: string } }).error.code, 'cross_origin');
    }
    assert.deepEqual(await svc.deps.queues.ingest.getJobCounts(), waitingBefore, 'nothing was added');
    // Behind a proxy: the origin's host and (default) port, as X-Forwarded-Host gives them, pass
    // the origin check (whatever the board then makes of the body); another port does not.
    const board = new URL(svc.base);
    const viaProxy = async (origin: string, forwarded: string) =>
      (
        await fetch(`${svc.base}/admin/queues/api/queues/ingest/add`, {
          method: 'POST',
          headers: {
            authorization: basic,
            origin,
            'x-forwarded-host': forwarded,
            'content-type': 'application/json',
          },
          body: '{}',
        })
      ).status;
    for (const [origin, forwarded] of [
      ['https://board.example.com', 'board.example.com'],
      ['https://board.example.com', 'board.example.com:443'],
      ['http://board.example.com', 'board.example.com:80'],
    ] as const) {
      assert.notEqual(await viaProxy(origin, forwarded), 403, `${origin} via ${forwarded}`);
    }
    for (const [origin, forwarded] of [
      ['https://board.example.com', 'board.example.com:8443'],
      [`http://${board.hostname}:1`, board.host],
    ] as const) {
      assert.equal(await viaProxy(origin, forwarded), 403, `${origin} via ${forwarded}`);
    }
    // The board's own page (same origin), as its UI sends it: the job is added, and its payload,
    // which no processor knows, fails at once instead of coming back for 12 attempts.
    const own = await add({ origin: svc.base, 'content-type': 'application/json' });
    assert.equal(own.status, 200);
    const id = ((await own.json()) as { job: { id: string } }).job.id;
    await eventually(
      async () => (await svc.deps.queues.ingest.getJob(id))?.isFailed(),
      15_000,
      'the bad job failed',
    );
    // Read once it has failed: a job read before its failure and checked after it kept the fields
    // it had then (attemptsMade 0; failed once in CI).
    const job = (await svc.deps.queues.ingest.getJob(id))!;
    assert.equal(job.attemptsMade, 1);
    assert.match(job.failedReason, /malformed ingest job payload \(v, tenantId, sessionId\): not retried/);
  });

  void test('rate limiting per API key: 429 with retry-after past the budget, other keys unaffected', async () => {
    const a = await svc.newTenant();
    const b = await svc.newTenant();
    for (let i = 0; i < 5; i++) {
      const r = await a.api.get('/v1/sessions');
      assert.equal(r.status, 200);
      assert.equal(r.headers.get('x-ratelimit-remaining'), String(4 - i));
    }
    const limited = await a.api.get('/v1/sessions');
    assert.equal(limited.status, 429);
    assert.equal(limited.body.error.code, 'rate_limited');
    const retryAfter = Number(limited.headers.get('retry-after'));
    assert.ok(retryAfter >= 1 && retryAfter <= 60, 'retryAfter >= 1 && retryAfter <= 60');
    // In seconds, to the end of the budget's minute (Redis's), not a flat 60.
    const [sec, us] = await svc.deps.redis.time();
    const left = Math.ceil((60_000 - ((Number(sec) * 1000 + Math.floor(Number(us) / 1000)) % 60_000)) / 1000);
    assert.ok(
      Math.abs(retryAfter - left) <= 2 || (retryAfter <= 2 && left >= 58),
      `retry-after ${retryAfter}, ${left} s left in the minute`,
    );
    assert.equal((await b.api.get('/v1/sessions')).status, 200, 'another key has its own budget');
    // A route of a capability module (mounted beside others on /v1/sessions) costs one request too.
    const search = await b.api.post('/v1/sessions/nope/search', { query: 'x' });
    assert.equal(search.headers.get('x-ratelimit-remaining'), '3');
    assert.equal((await api(svc.base).get('/healthz')).status, 200, 'ops endpoints are not limited');
    const text = await (await fetch(`${svc.base}/metrics`)).text();
    assert.ok(
      metricValue(text, 'mnemos_rate_limited_total') >= 1,
      "metricValue(text, 'mnemos_rate_limited_total') >= 1",
    );
  });

  void test('the budget is shared through Redis across processes, and a new minute restores it', async () => {
    // Two limiter instances (as in two API processes) on the same Redis, with a controllable clock.
    let now = Date.parse('2026-01-01T00:00:10Z');
    const mk = () => {
      const app = express();
      app.use((_req, res, next) => {
        res.locals.keyId = 'shared-key';
        next();
      });
      app.use(rateLimit(svc.deps, () => now));
      app.get('/', (_req, res) => {
        res.json({ ok: true });
      });
      app.use(makeErrorHandler(makeLogger('silent')));
      return new Promise<{ url: string; close: () => void }>((resolve) => {
        const s = app.listen(0, '127.0.0.1', () => {
          const port = (s.address() as { port: number }).port;
          resolve({ url: `http://127.0.0.1:${port}`, close: () => s.close() });
        });
      });
    };
    const [p1, p2] = await Promise.all([mk(), mk()]);
    try {
      for (let i = 0; i < 5; i++) assert.equal((await fetch(p1.url)).status, 200);
      assert.equal((await fetch(p1.url)).status, 429);
      // The other process has not seen a count yet: its first request passes and learns the total.
      assert.equal((await fetch(p2.url)).status, 200);
      await eventually(async () => {
        // The window is Redis's minute, whatever the processes' clocks say.
        const [sec] = await svc.deps.redis.time();
        const v = await svc.deps.redis.get(
          `${svc.config.prefix}:rl:shared-key:${Math.floor(Number(sec) / 60)}`,
        );
        return v === '6';
      });
      assert.equal((await fetch(p2.url)).status, 429, 'the budget spent elsewhere counts here too');
      now += 60_000;
      assert.equal((await fetch(p1.url)).status, 200, 'a new minute, a new budget');
      assert.equal((await fetch(p2.url)).status, 200);
    } finally {
      p1.close();
      p2.close();
    }
  });

  void test('a worker process serves health, readiness and metrics, and no API', async () => {
    const worker = await startTestService({
      mode: 'worker',
      databaseUrl: svc.config.databaseUrl!,
      prefix: svc.config.prefix,
    });
    try {
      assert.equal((await api(worker.base).get('/healthz')).status, 200);
      const ready = await eventually(async () => {
        const r = await api(worker.base).get('/readyz');
        return r.status === 200 ? r : null;
      });
      assert.equal(ready.body.checks.postgres, 'ok');
      const metrics = await (await fetch(`${worker.base}/metrics`)).text();
      assert.match(metrics, /mnemos_job_duration_seconds/);
      // Sampled by API processes only: a worker's constant 0 would read as "no lag".
      assert.doesNotMatch(metrics, /mnemos_summary_lag_seconds/);
      assert.equal((await api(worker.base).get('/v1/sessions')).status, 404);
      // As the API's: no ETag and no 304, even for a wildcard validator (over node:http: fetch
      // adds `cache-control: no-cache` to a conditional request, which Express honours).
      for (const path of ['/healthz', '/readyz', '/metrics', '/openapi.json']) {
        const r = await new Promise<IncomingMessage>((resolve, reject) =>
          httpGet(`${worker.base}${path}`, { headers: { 'if-none-match': '*' } }, (res) => {
            res.resume();
            res.on('end', () => resolve(res));
          }).on('error', reject),
        );
        assert.equal(r.statusCode, 200, path);
        assert.equal(r.headers.etag, undefined, path);
      }
    } finally {
      await worker.stop();
    }
  });
});

void describe('graceful shutdown', () => {
  void test('answers in flight on a keep-alive connection say connection: close, and none is cut off', async () => {
    const { request, Agent } = await import('node:http');
    // API only: a ?wait=true stays in flight (no worker drains it) until its 10 s wait ends.
    const svc = await startTestService({ mode: 'api' });
    const t = await svc.newTenant();
    const agent = new Agent({ keepAlive: true, maxSockets: 1 });
    const post = (path: string, body: unknown) =>
      new Promise<{ status: number; connection: string | undefined }>((resolve, reject) => {
        const data = JSON.stringify(body);
        const req = request(
          `${svc.base}${path}`,
          {
            method: 'POST',
            agent,
            headers: { authorization: `Bearer ${t.apiKey}`, 'content-type': 'application/json' },
          },
          (res) => {
            res.resume();
            res.on('end', () => resolve({ status: res.statusCode!, connection: res.headers.connection }));
          },
        );
        req.on('error', reject);
        req.end(data);
      });
    const warm = await post('/v1/sessions/s/messages', { messages: [{ role: 'user', content: 'warm' }] });
    assert.equal(warm.status, 202);
    assert.notEqual(warm.connection, 'close', 'kept alive while serving');
    const inFlight = post('/v1/sessions/s/messages?wait=true', {
      messages: [{ role: 'user', content: 'x' }],
    });
    // Stopped once it is accepted (waiting for its drain): after a fixed 200 ms, a request not yet
    // read found its idle connection closed by stop().
    const inbox = inboxKeys(svc.config.prefix, t.tenantId, 's').inbox;
    await eventually(async () => (await svc.deps.redis.llen(inbox)) === 2, 10_000, 'the message accepted');
    const stopped = svc.stop();
    const answer = await inFlight;
    assert.equal(answer.status, 202, 'answered, not cut off');
    assert.equal(answer.connection, 'close', 'the client is told to stop reusing the connection');
    await stopped;
    agent.destroy();
    await deleteRedisPrefix(svc.config.prefix);
  });

  void test('a post pipelined behind a ?wait=true in flight at the stop is not run: no answer, nothing stored', async () => {
    // Setup: session a exists, and its row is held, so that A (a ?wait=true to it) stays in flight
    // until one second before the 2 s deadline. Workers run: B, once accepted, would be archived.
    const svc = await startTestService({ env: { SHUTDOWN_TIMEOUT_MS: '2000' } });
    const locker = new pg.Client({ connectionString: svc.config.databaseUrl });
    await locker.connect();
    const redis = new Redis(REDIS_URL);
    let socket: Socket | null = null;
    let stopped = false;
    try {
      const t = await svc.newTenant();
      const first = await t.api.post('/v1/sessions/a/messages?wait=true', {
        messages: [{ role: 'user', content: 'first' }],
      });
      assert.equal(first.status, 201);
      await locker.query('BEGIN');
      await locker.query('SELECT 1 FROM sessions WHERE tenant_id = $1 AND id = $2 FOR UPDATE', [
        t.tenantId,
        'a',
      ]);
      const post = (path: string, content: string) => {
        const body = JSON.stringify({ messages: [{ role: 'user', content }] });
        return (
          `POST ${path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer ${t.apiKey}\r\n` +
          `content-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\n\r\n${body}`
        );
      };
      // Heard before the app's own listener, which rewrites req.url to its router's part.
      const bRead = new Promise<void>((resolve) =>
        svc.server!.prependListener('request', (req: IncomingMessage) => {
          if (req.url === '/v1/sessions/b/messages') resolve();
        }),
      );
      const raw = connect(Number(new URL(svc.base).port), '127.0.0.1');
      socket = raw;
      raw.on('error', () => undefined);
      let received = '';
      raw.setEncoding('latin1');
      raw.on('data', (d: string) => (received += d));
      const closed = new Promise<void>((resolve) => raw.once('close', () => resolve()));
      await once(raw, 'connect');
      raw.write(post('/v1/sessions/a/messages?wait=true', 'A') + post('/v1/sessions/b/messages', 'B'));
      const inboxA = inboxKeys(svc.config.prefix, t.tenantId, 'a').inbox;
      await eventually(async () => (await redis.llen(inboxA)) === 1, 10_000, "A's message accepted");
      await bRead;

      // Action
      stopped = true;
      await svc.stop();
      await closed;

      // Assert: A is answered and closes the connection; B gets no answer, and was not run.
      const statusLines = received.split('\r\n').filter((l) => l.startsWith('HTTP/1.1 '));
      assert.deepEqual(statusLines, ['HTTP/1.1 202 Accepted'], received);
      assert.match(received, /\r\nconnection: close\r\n/i);
      const b = inboxKeys(svc.config.prefix, t.tenantId, 'b');
      assert.equal(await redis.exists(b.inbox, b.sess, b.ids), 0, "B's message is not in an inbox");
      const sessions = await locker.query<{ id: string }>('SELECT id FROM sessions WHERE tenant_id = $1', [
        t.tenantId,
      ]);
      assert.deepEqual(
        sessions.rows.map((r) => r.id),
        ['a'],
        'no session b in Postgres',
      );
    } finally {
      socket?.destroy();
      await locker.query('COMMIT').catch(() => undefined);
      await locker.end();
      redis.disconnect();
      // A failure before the stop above left the service running.
      if (!stopped) await svc.stop();
      await deleteRedisPrefix(svc.config.prefix);
    }
  });

  /** A service whose summary calls answer only after 20 s, a tenant, and a session `s` of two messages. */
  async function withSlowSummaries(shutdownTimeoutMs: string) {
    const fake = await startFakeOpenAI();
    fake.onChat(() => ({ delayMs: 20_000, then: { content: '{}' } }));
    const svc = await startTestService({
      env: { OPENAI_BASE_URL: fake.url, OPENAI_API_KEY: 'test', SHUTDOWN_TIMEOUT_MS: shutdownTimeoutMs },
    });
    const cleanup = async () => {
      await fake.close();
      await deleteRedisPrefix(svc.config.prefix);
    };
    const t = await svc.newTenant();
    const posted = await t.api.post('/v1/sessions/s/messages?wait=true', {
      messages: [
        { role: 'user', content: 'hello' },
        { role: 'assistant', content: 'hi' },
      ],
    });
    assert.equal(posted.status, 201);
    return { fake, svc, t, cleanup };
  }

  void test('a job that outlives SHUTDOWN_TIMEOUT_MS is left to be retried, and stop() ends soon after the deadline', async () => {
    // The summary call is still running at the deadline.
    const { fake, svc, t, cleanup } = await withSlowSummaries('2000');
    try {
      assert.equal((await t.api.post('/v1/sessions/s/summarize')).status, 202);
      await eventually(async () => fake.chatRequests().length === 1, 10_000, 'the summary call');
      const started = Date.now();
      await svc.stop();
      const took = Date.now() - started;
      // The deadline (2 s) plus at most 1 s for the forced close; the old code waited for the
      // job, 20 s. The bound is loose: this is about not waiting for the job, not about speed.
      assert.ok(took < 8000, `stop() took ${took} ms`);
    } finally {
      await cleanup();
    }
  });

  void test('a summarize?wait=true and a context min_seq wait answer before the deadline, not cut off', async () => {
    // The summarize wait is 60 s, the deadline 3 s.
    const { fake, svc, t, cleanup } = await withSlowSummaries('3000');
    try {
      const summarizing = t.api.post('/v1/sessions/s/summarize?wait=true');
      await eventually(async () => fake.chatRequests().length === 1, 10_000, 'the summary call');
      // A seq that never comes: the context waits its 5 s, past the deadline. Stopped once the
      // request is in (after a fixed 200 ms, one not yet arrived found the server closed). Heard
      // before the app's own listener, which rewrites req.url to its router's part.
      const arrived = new Promise<void>((resolve) =>
        svc.server!.prependListener('request', (req: IncomingMessage) => {
          if (req.url === '/v1/sessions/s/context') resolve();
        }),
      );
      const context = t.api.post('/v1/sessions/s/context', { min_seq: 99 });
      await arrived;
      const stopped = svc.stop();
      const [summary, ctx] = await Promise.all([summarizing, context]);
      assert.equal(summary.status, 202, summary.text);
      assert.match(summary.body.job_id, /^summary\./);
      assert.equal(ctx.status, 200, ctx.text);
      assert.equal(ctx.headers.get('x-mnemos-min-seq'), 'timeout');
      await stopped;
    } finally {
      await cleanup();
    }
  });

  void test('a drain blocked in Postgres at the deadline holds neither stop() nor the ?wait=true waiting for it', async () => {
    const svc = await startTestService({ env: { SHUTDOWN_TIMEOUT_MS: '2000' } });
    const locker = new pg.Client({ connectionString: svc.config.databaseUrl });
    await locker.connect();
    let stopped = false;
    try {
      const t = await svc.newTenant();
      const first = await t.api.post('/v1/sessions/s/messages?wait=true', {
        messages: [{ role: 'user', content: 'a' }],
      });
      assert.equal(first.status, 201);
      await locker.query('BEGIN');
      await locker.query('LOCK TABLE messages IN ACCESS EXCLUSIVE MODE');
      // A ?wait=true in flight: its drain cannot finish, the deadline is shorter than its 10 s wait.
      const second = t.api.post('/v1/sessions/s/messages?wait=true', {
        messages: [{ role: 'user', content: 'b' }],
      });
      // Accepted (in the inbox: the request now waits for its drain), and something waits for the
      // lock. (Without the first condition, an embed job waiting for the lock let stop() begin
      // before the request had even arrived, and its new connection was closed as idle.)
      const inbox = inboxKeys(svc.config.prefix, t.tenantId, 's').inbox;
      await eventually(
        async () =>
          (await svc.deps.redis.llen(inbox)) > 0 &&
          (
            await locker.query<{ n: number }>(
              `SELECT count(*)::int AS n FROM pg_locks WHERE NOT granted
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`,
            )
          ).rows[0]!.n > 0,
        10_000,
        'the message accepted and the drain waiting for the lock',
      );
      // The lock goes after 15 s at the latest, so that a stop() waiting for the drain ends too.
      const release = setTimeout(() => void locker.query('COMMIT').catch(() => undefined), 15_000);
      const started = Date.now();
      stopped = true;
      await svc.stop();
      const took = Date.now() - started;
      clearTimeout(release);
      // The deadline (2 s) plus about a second; ending the pool waited for the blocked drain.
      assert.ok(took < 8000, `stop() took ${took} ms`);
      // It got its answer (accepted, not yet durable) instead of a cut connection.
      const answered = await second;
      assert.equal(answered.status, 202);
      assert.equal(answered.body.messages[0].seq, 2);
    } finally {
      await locker.query('COMMIT').catch(() => undefined);
      await locker.end();
      // A failure before the stop above left the service running, and the file with it.
      if (!stopped) await svc.stop();
      await deleteRedisPrefix(svc.config.prefix);
    }
  });
});

void describe('Postgres states that are not an outage', () => {
  /** A service on a database of its own, with what it logs at warn and above. */
  async function ownService() {
    const url = await createTestDatabase();
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino(
      { level: 'warn' },
      { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) },
    );
    const own = await startTestService({ mode: 'api', databaseUrl: url, logger });
    const name = new URL(url).pathname.slice(1);
    const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    const dropConnections = () =>
      admin.query(
        `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()`,
        [name],
      );
    return {
      own,
      url,
      name,
      admin,
      lines,
      dropConnections,
      async close() {
        await own.stop();
        await deleteRedisPrefix(own.config.prefix);
        await dropTestDatabase(url);
        await admin.close();
      },
    };
  }

  void test('a read-only database: /readyz says read_only (503), a write is a 503 saying so, the log has the SQLSTATE', async () => {
    const s = await ownService();
    try {
      // Setup: a tenant, then the database turns read-only (as a standby after a failover would be).
      const t = await s.own.newTenant();
      assert.equal((await api(s.own.base).get('/readyz')).status, 200);
      await s.admin.query(`ALTER DATABASE "${s.name}" SET default_transaction_read_only = on`);
      await s.dropConnections();

      // Action
      const ready = await eventually(async () => {
        const r = await api(s.own.base).get('/readyz');
        return r.status === 503 && r.body.checks.postgres === 'read_only' ? r : null;
      });
      const write = await t.api.del('/v1/sessions/s1');

      // Assert: readiness keeps its documented shape; reads still work; the write says why.
      assert.deepEqual(ready.body, {
        status: 'not_ready',
        checks: { postgres: 'read_only', redis: 'ok', migrations: 'ok', llm: 'disabled' },
      });
      assert.equal(ready.headers.get('retry-after'), '5');
      assert.equal((await t.api.get('/v1/sessions/s1')).status, 404);
      assert.equal(write.status, 503);
      assert.equal(write.body.error.code, 'read_only');
      assert.match(write.body.error.message, /postgres refuses writes: the database is read-only/);
      assert.ok(Number(write.headers.get('retry-after')) > 0, "Number(write.headers.get('retry-after')) > 0");
      const logged = s.lines.find(
        (l) => l.route === '/v1/sessions/:sid' && l.method === 'DELETE' && l.code === 'read_only',
      );
      assert.equal(logged?.pg_code, '25006', JSON.stringify(s.lines));
      assert.match(String(logged?.pg_message), /cannot execute SELECT FOR UPDATE in a read-only transaction/);
      // A post to a new session goes through the dependency mapping: it says the same.
      const posted = await t.api.post('/v1/sessions/fresh/messages', {
        messages: [{ role: 'user', content: 'x' }],
      });
      assert.equal(posted.status, 503, posted.text);
      assert.equal(posted.body.error.code, 'read_only');
      assert.ok(
        s.lines.some((l) => l.route === '/v1/sessions/:sid/messages' && l.pg_code === '25006'),
        "s.lines.some((l) => l.route === '/v1/sessions/:sid/messages' && l.pg_code === '25006')",
      );
      // A process started now (a restart or a deploy during the failover) starts and serves
      // reads: with nothing to migrate, its start writes nothing (it stopped at CREATE TABLE).
      const second = await startTestService({ mode: 'api', databaseUrl: s.url });
      try {
        assert.equal((await api(second.base, t.apiKey).get('/v1/sessions/s1')).status, 404);
      } finally {
        await second.stop();
        await deleteRedisPrefix(second.config.prefix);
      }

      // Writable again: ready again.
      await s.admin.query(`ALTER DATABASE "${s.name}" RESET default_transaction_read_only`);
      await s.dropConnections();
      await eventually(async () => (await api(s.own.base).get('/readyz')).status === 200);
      assert.equal((await t.api.del('/v1/sessions/s1')).status, 404);
    } finally {
      await s.close();
    }
  });

  void test('a first start on a migrated, read-only database serves reads, and embeds once it takes writes', async () => {
    // Setup: a migrated database that no service has started on (no embedder recorded in it yet),
    // with a tenant, turned read-only.
    const url = await createTestDatabase();
    const name = new URL(url).pathname.slice(1);
    const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    const setup = makePgDb({ connectionString: url, max: 1 });
    const { api_key: key } = await createTenant(setup, 'read-only').finally(() => setup.close());
    await admin.query(`ALTER DATABASE "${name}" SET default_transaction_read_only = on`);
    let svc: TestService | undefined;
    try {
      // Action
      svc = await startTestService({ databaseUrl: url });
      const ops = api(svc.base);
      const user = api(svc.base, key);

      // Assert: started, not ready, reads served.
      const ready = await ops.get('/readyz');
      assert.equal(ready.status, 503, ready.text);
      assert.equal(ready.body.checks.postgres, 'read_only');
      assert.equal((await user.get('/v1/sessions')).status, 200);
      // Writable again, without a restart: what is posted now is found by meaning too.
      await admin.query(`ALTER DATABASE "${name}" RESET default_transaction_read_only`);
      await admin.query(
        `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()`,
        [name],
      );
      await eventually(async () => (await ops.get('/readyz')).status === 200);
      const posted = await user.post('/v1/sessions/s1/messages?wait=true', {
        messages: [{ role: 'user', content: 'the solar panels on the roof' }],
      });
      assert.equal(posted.status, 201, posted.text);
      const found = await eventually(async () => {
        const r = await user.post('/v1/sessions/s1/search', {
          query: 'solar panels roof',
          match: 'semantic',
        });
        return r.status === 200 && r.body.hits.length === 1 ? r : null;
      });
      assert.equal(found.body.hits[0].source, 'recent');
    } finally {
      await svc?.stop();
      if (svc) await deleteRedisPrefix(svc.config.prefix);
      await dropTestDatabase(url);
      await admin.close();
    }
  });

  void test('a database dropped and re-created under the service: 503 schema_not_migrated, never 500', async () => {
    const s = await ownService();
    try {
      // Setup
      const t = await s.own.newTenant();
      assert.equal((await t.api.get('/v1/sessions')).status, 200);

      // Action: the database is re-created empty (no tables) while the service runs.
      await s.admin.query(`DROP DATABASE "${s.name}" WITH (FORCE)`);
      await s.admin.query(`CREATE DATABASE "${s.name}"`);
      const statuses: number[] = [];
      const refused = await eventually(async () => {
        const r = await t.api.get('/v1/sessions');
        statuses.push(r.status);
        return r.body?.error?.code === 'schema_not_migrated' ? r : null;
      });

      // Assert: every answer was a 503 (a connection cut by the drop is "unavailable"), none a 500.
      assert.deepEqual(new Set(statuses), new Set([503]), JSON.stringify(statuses));
      assert.equal(refused.status, 503);
      assert.match(refused.body.error.message, /no mnemos schema/);
      assert.ok(
        Number(refused.headers.get('retry-after')) > 0,
        "Number(refused.headers.get('retry-after')) > 0",
      );
      assert.match((await api(s.own.base).get('/readyz')).body.checks.migrations, /^pending: 001_init/);
      const logged = s.lines.find((l) => l.code === 'schema_not_migrated');
      assert.equal(logged?.pg_code, '42P01');
      assert.match(String(logged?.pg_message), /^relation ".*" does not exist$/);
    } finally {
      await s.close();
    }
  });

  void test('an unreachable Postgres or a statement timeout is logged with its code and message', async () => {
    // Setup: routes that meet real node-postgres errors, behind the API's error handler.
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino(
      { level: 'warn' },
      { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) },
    );
    const refused = makePgDb({ connectionString: 'postgres://postgres@127.0.0.1:1/x', max: 1 });
    const db = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    const app = express();
    app.get('/refused', async () => {
      await refused.query('SELECT 1');
    });
    app.get('/timeout', async () => {
      await db.transaction(async (tx) => {
        await tx.query("SET LOCAL statement_timeout = '10ms'");
        await tx.query('SELECT pg_sleep(1)');
      });
    });
    app.use(makeErrorHandler(logger));
    const server = app.listen(0, '127.0.0.1');
    await new Promise((resolve) => server.once('listening', resolve));
    const base = `http://127.0.0.1:${(server.address() as { port: number }).port}`;
    try {
      // Action
      const answers = [await fetch(`${base}/refused`), await fetch(`${base}/timeout`)];

      // Assert: 503s, and the log says why.
      assert.deepEqual(
        answers.map((r) => r.status),
        [503, 503],
      );
      const of = (path: string) => lines.find((l) => l.route === path);
      assert.equal(of('/refused')?.pg_code, 'ECONNREFUSED');
      assert.match(String(of('/refused')?.pg_message), /^connect ECONNREFUSED 127\.0\.0\.1:1$/);
      assert.equal(of('/timeout')?.pg_code, '57014');
      assert.equal(of('/timeout')?.pg_message, 'canceling statement due to statement timeout');
    } finally {
      server.close();
      await Promise.all([refused.close(), db.close()]);
    }
  });
});

void describe('logs during a Redis outage', () => {
  void test('a Redis that is gone is logged a few lines per 5 s, not a line per reconnect attempt and queue', async () => {
    const { startPrivateRedis } = await import('./support/private-redis.js');
    const redis = await startPrivateRedis();
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino(
      { level: 'warn' },
      { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) },
    );
    const own = await startTestService({ mode: 'api', env: { REDIS_URL: redis.url }, logger });
    try {
      await redis.kill();
      // Reconnect attempts every 200 ms to 2 s: several per queue in 6 s.
      await new Promise((r) => setTimeout(r, 6000));
      const queueLines = lines.filter((l) => l['msg'] === 'queue error');
      const perQueue = new Map<unknown, number>();
      for (const l of queueLines) perQueue.set(l['queue'], (perQueue.get(l['queue']) ?? 0) + 1);
      assert.ok(perQueue.size > 0, 'queue errors are logged');
      for (const [queue, n] of perQueue) assert.ok(n <= 2, `${String(queue)}: ${n} lines in 6 s`);
    } finally {
      await redis.start();
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
      await redis.stop();
    }
  });
});
