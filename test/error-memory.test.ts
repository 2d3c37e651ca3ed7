import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { connect, createServer } from 'node:net';
import type { AddressInfo, Socket } from 'node:net';
import { after, before, describe, test } from 'node:test';
import express from 'express';
import { Redis } from 'ioredis';
import { pino } from 'pino';
import { CANDIDATES_PER_TERM, openErrorMemory } from '../services/error-memory/error-store.js';
import { normaliseSymptom, significantTerms } from '../services/error-memory/normalise.js';
import { buildQuery, indexTerms, relevance } from '../services/error-memory/ranking.js';
import type { ErrorMemory, ErrorRecord } from '../services/error-memory/types.js';
import { makeErrorHandler, notFoundHandler } from '../services/http-errors.js';
import { localEmbed } from '../services/llm/local-embedder.js';
import { makeLogger } from '../services/logger.js';
import { REDIS_TRANSIENT_REPLY, REDIS_WRITE_REFUSED, type AppError } from '../services/errors.js';
import { makeErrorRoutes } from '../services/routes/error-routes.js';
import { startPrivateRedis } from './support/private-redis.js';
import { startTcpProxy } from './support/tcp-proxy.js';

const REDIS_URL = 'redis://127.0.0.1:6379';
const PREFIX = `mnemos-test-${randomBytes(6).toString('hex')}`;
const DAY_MS = 86_400_000;
const TTL_MS = 90 * DAY_MS;

let redis: Redis;
let errors: ErrorMemory;
let server: { base: string; close: () => Promise<void> };
let baseUrl: string;
const extraStores: ErrorMemory[] = [];

const newTenant = () => `t-${randomBytes(5).toString('hex')}`;
const recKey = (tenant: string, id: string) => `${PREFIX}:err:${tenant}:rec:${id}`;

type Reply = { status: number; body: any; headers?: Headers };

async function call(
  tenant: string,
  method: string,
  path: string,
  body?: unknown,
  opts: { base?: string; timeoutMs?: number } = {},
): Promise<Reply> {
  const res = await fetch(`${opts.base ?? baseUrl}/v1/errors${path}`, {
    method,
    headers: {
      'x-test-tenant': tenant,
      ...(body === undefined ? {} : { 'content-type': 'application/json' }),
    },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(opts.timeoutMs ?? 60_000),
  });
  const raw = await res.text();
  return { status: res.status, body: raw === '' ? null : JSON.parse(raw), headers: res.headers };
}

/** The error routes over one store, as the service mounts them (the tenant comes from a header). */
async function serveStore(store: ErrorMemory): Promise<{ base: string; close: () => Promise<void> }> {
  const app = express();
  app.use(express.json());
  app.use((req, res, next) => {
    res.locals.tenantId = req.header('x-test-tenant');
    next();
  });
  app.use('/v1/errors', makeErrorRoutes({ errors: store }));
  app.use(notFoundHandler);
  app.use(makeErrorHandler(makeLogger('silent')));
  const srv = app.listen(0, '127.0.0.1');
  await new Promise<void>((resolve) => srv.once('listening', resolve));
  return {
    base: `http://127.0.0.1:${(srv.address() as AddressInfo).port}`,
    close: () =>
      new Promise<void>((resolve) => {
        srv.closeAllConnections();
        srv.close(() => resolve());
      }),
  };
}

/**
 * A TCP proxy in front of the shared Redis that can stop forwarding (a hung Redis: connections
 * stay open, nothing answers), delay traffic, cut the connection when the client sends a
 * command matching a pattern (a connection lost between two steps of a write), or count the
 * client's round trips: what it sends after an answer reached it (its health-check pings aside).
 */
async function startRedisProxy() {
  const sockets = new Set<Socket>();
  /** What each client sent since the cut was armed (a command may span two reads). */
  const sent = new Map<Socket, string>();
  let blackhole = false;
  let delayMs = 0;
  let cutOn: RegExp | null = null;
  let roundTrips = 0;
  let answered = true;
  const forward = (to: Socket, data: Buffer, answer: boolean) => {
    if (blackhole) return;
    const write = () => {
      if (!to.writable) return;
      to.write(data);
      if (answer) answered = true;
    };
    if (delayMs === 0) write();
    else setTimeout(write, delayMs);
  };
  const server = createServer((client) => {
    const upstream = connect(6379, '127.0.0.1');
    sockets.add(client).add(upstream);
    client.on('data', (data) => {
      if (answered && data.toString('latin1') !== '*1\r\n$4\r\nPING\r\n') {
        roundTrips++;
        answered = false;
      }
      const recent = ((sent.get(client) ?? '') + data.toString('latin1')).slice(-4096);
      sent.set(client, recent);
      if (cutOn?.test(recent)) {
        cutOn = null;
        client.destroy();
        upstream.destroy();
        return;
      }
      forward(upstream, data, false);
    });
    upstream.on('data', (data) => forward(client, data, true));
    for (const [a, b] of [
      [client, upstream],
      [upstream, client],
    ] as const) {
      a.on('error', () => b.destroy());
      a.on('close', () => {
        b.destroy();
        sockets.delete(a);
        sent.delete(a);
      });
    }
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    url: `redis://127.0.0.1:${(server.address() as AddressInfo).port}`,
    blackhole: () => {
      blackhole = true;
    },
    delay: (ms: number) => {
      delayMs = ms;
    },
    roundTrips: () => roundTrips,
    /** Cuts the connection (once) when what the client sent so far matches. */
    cutWhen: (pattern: RegExp) => {
      sent.clear();
      cutOn = pattern;
    },
    close: () =>
      new Promise<void>((resolve) => {
        for (const socket of sockets) socket.destroy();
        server.close(() => resolve());
      }),
  };
}

/** Closes a store whose proxy is gone (a hung client would wait forever for QUIT). */
async function closeBehindProxy(store: ErrorMemory, proxy: { close: () => Promise<void> }) {
  await proxy.close();
  await waitFor('the client to see its connection closed', async () => !(await store.ping()));
  await store.close();
}

/** Distinct words of letters only (no digit runs to mask, no stop words): zqa, zqb, … */
const word = (i: number) => {
  let s = '';
  do {
    s += String.fromCharCode(97 + (i % 26));
    i = Math.floor(i / 26);
  } while (i > 0);
  return `zq${s}`;
};

/** Writes through the store, a few at a time. */
async function writeMany(tenant: string, inputs: Array<Record<string, unknown>>): Promise<string[]> {
  const ids: string[] = [];
  let next = 0;
  await Promise.all(
    Array.from({ length: 8 }, async () => {
      while (next < inputs.length) {
        const i = next++;
        const input = {
          action: 'retry',
          outcome: 'resolved' as const,
          tool_name: 'x',
          symptom: 'x',
          ...inputs[i],
        };
        ids[i] = (await errors.write(tenant, input as Parameters<ErrorMemory['write']>[1])).id;
      }
    }),
  );
  return ids;
}

const write = (tenant: string, input: Record<string, unknown>) =>
  call(tenant, 'POST', '', { action: 'retry', outcome: 'resolved', ...input });

async function scanKeys(pattern: string, on: Redis = redis): Promise<string[]> {
  const found: string[] = [];
  let cursor = '0';
  do {
    const [next, keys] = await on.scan(cursor, 'MATCH', pattern, 'COUNT', 1000);
    found.push(...keys);
    cursor = next;
  } while (cursor !== '0');
  return found;
}

async function waitFor(what: string, check: () => Promise<boolean>, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** Every error-memory key of the tenant that still names the id (as member or value). */
async function keysNaming(tenant: string, id: string, on: Redis = redis): Promise<string[]> {
  const hits: string[] = [];
  for (const key of await scanKeys(`${PREFIX}:err:${tenant}:*`, on)) {
    if (key.includes(id)) hits.push(key);
    const type = await on.type(key);
    if (type === 'zset' && (await on.zscore(key, id)) !== null) hits.push(key);
    if (type === 'set' && (await on.sismember(key, id)) === 1) hits.push(key);
    if (type === 'string' && (await on.get(key)) === id) hits.push(key);
  }
  return hits;
}

// Every assert.ok here gives its message. Without one, Node 20 quotes the source at the call's
// position in the code tsx compiled (whitespace minified: line 1, a column in the thousands) and
// looks for it in this file by re-parsing it over and over: for a dedupe-key check below that
// took minutes of CPU that block the event loop, so no test timeout fired and the failing check
// looked like a hung file.
const near = (actual: number, expected: number, slack = 60_000) =>
  assert.ok(Math.abs(actual - expected) < slack, `${actual} is not within ${slack} ms of ${expected}`);

before(async () => {
  redis = new Redis(REDIS_URL);
  errors = await openErrorMemory({ redisUrl: REDIS_URL, prefix: PREFIX, ttlDays: 90 });
  server = await serveStore(errors);
  baseUrl = server.base;
});

after(async () => {
  await server.close();
  for (const store of [errors, ...extraStores]) await store.close();
  const leftovers = await scanKeys(`${PREFIX}:*`);
  if (leftovers.length > 0) await redis.del(...leftovers);
  redis.disconnect();
});

void describe('TTL', () => {
  void test('a new record and its dedupe key expire after 90 days', async () => {
    const tenant = newTenant();
    const res = await write(tenant, {
      tool_name: 'shell',
      symptom: 'make: *** No rule to make target build',
    });
    assert.equal(res.status, 201);
    assert.deepEqual(Object.keys(res.body), ['id', 'deduplicated']);
    assert.equal(res.body.deduplicated, false);
    assert.match(res.body.id, /^err_[a-z2-7]{20}$/);

    near(await redis.pttl(recKey(tenant, res.body.id)), TTL_MS);
    const [dedupeKey, ...more] = await scanKeys(`${PREFIX}:err:${tenant}:dedupe:*`);
    assert.ok(dedupeKey, 'the record has a dedupe key under its tenant');
    assert.equal(more.length, 0);
    assert.equal(await redis.get(dedupeKey), res.body.id);
    near(await redis.pttl(dedupeKey), TTL_MS);
  });

  void test('search, lookup and get renew the TTL; list does not', async () => {
    const tenant = newTenant();
    const { body } = await write(tenant, {
      tool_name: 'git',
      symptom: 'fatal: refusing to merge unrelated histories',
    });
    const key = recKey(tenant, body.id);
    const [dedupeKey] = await scanKeys(`${PREFIX}:err:${tenant}:dedupe:*`);
    assert.ok(dedupeKey, 'the record has a dedupe key under its tenant');
    const lower = async () => {
      await redis.pexpire(key, 60_000);
      await redis.pexpire(dedupeKey, 60_000);
    };

    await lower();
    const listed = await call(tenant, 'GET', '');
    assert.equal(listed.body.records.length, 1);
    assert.ok((await redis.pttl(key)) <= 60_000, 'list must not renew');

    const reads: Array<[string, () => Promise<Reply>]> = [
      ['search', () => call(tenant, 'POST', '/search', { query: 'unrelated histories' })],
      ['lookup', () => call(tenant, 'POST', '/lookup', { tool_name: 'git', error: 'refusing to merge' })],
      ['get', () => call(tenant, 'GET', `/${body.id}`)],
    ];
    for (const [name, read] of reads) {
      await lower();
      const before = Date.now();
      const res = await read();
      assert.equal(res.status, 200, name);
      near(await redis.pttl(key), TTL_MS);
      near(await redis.pttl(dedupeKey), TTL_MS);
      const record: ErrorRecord = res.body.records?.[0] ?? res.body;
      assert.equal(record.id, body.id, name);
      assert.ok(Date.parse(record.last_hit_at) >= before - 5, `${name} stamps last_hit_at`);
    }
  });

  void test("the sweep erases the records of a tenant the database no longer has (brought back by a Redis restore), and keeps the others'", async () => {
    const gone = newTenant();
    const kept = newTenant();
    const input = {
      tool_name: 'psql',
      symptom: 'FATAL: role "x" does not exist',
      action: 'createuser x',
      outcome: 'resolved' as const,
    };
    const a = await errors.write(gone, input);
    const b = await errors.write(kept, input);
    await errors.sweepExpired(async (ids) => new Set(ids.filter((id) => id !== gone)));
    assert.deepEqual(await errors.lookup(gone, { tool_name: 'psql', error: 'role does not exist' }), {
      related_errors: 'NONE',
      records: [],
    });
    assert.equal(await errors.get(gone, a.id), null);
    assert.deepEqual(await scanKeys(`${PREFIX}:err:${gone}:*`), []);
    assert.equal(await redis.sismember(`${PREFIX}:err:tenants`, gone), 0);
    assert.equal((await errors.get(kept, b.id))?.id, b.id);
    assert.equal(await redis.sismember(`${PREFIX}:err:tenants`, kept), 1);
  });

  void test('a connection gone silent (a partition, a proxy that keeps acknowledging) is replaced, and close does not wait on it', async () => {
    const proxy = await startTcpProxy(Number(new URL(REDIS_URL).port || 6379));
    const store = await openErrorMemory({
      redisUrl: `redis://127.0.0.1:${proxy.port}`,
      prefix: PREFIX,
      ttlDays: 1,
      opTimeoutMs: 1000,
    });
    try {
      const tenant = newTenant();
      const input = {
        tool_name: 'npm',
        symptom: 'ERESOLVE unable to resolve dependency tree',
        action: 'x',
        outcome: 'resolved' as const,
      };
      await store.write(tenant, input);
      proxy.hole();
      await assert.rejects(store.write(tenant, input), (err: AppError) => err.status === 503);
      // New connections pass again; the silent one stays silent until the client replaces it.
      proxy.heal();
      await waitFor(
        'a write through a new connection',
        async () =>
          await store.write(tenant, input).then(
            () => true,
            () => false,
          ),
        20_000,
      );
      assert.equal((await store.search(tenant, { query: 'ERESOLVE', limit: 4 })).length, 1);
      proxy.hole();
      // Before, QUIT waited for an answer that never came, and shutdown waited out its deadline.
      const closed = await Promise.race([
        store.close().then(() => 'closed'),
        new Promise((r) => setTimeout(() => r('still waiting'), 8000)),
      ]);
      assert.equal(closed, 'closed');
    } finally {
      proxy.heal();
      proxy.reset();
      await store.close().catch(() => undefined);
      await proxy.close();
    }
  });

  void test('a lowered ERROR_MEMORY_TTL_DAYS reaches records nobody hits at the next sweep', async () => {
    const tenant = newTenant();
    const rec = await errors.write(tenant, {
      tool_name: 'terraform',
      symptom: 'Error acquiring the state lock',
      action: 'terraform force-unlock',
      outcome: 'resolved',
    });
    assert.ok((await redis.pttl(recKey(tenant, rec.id))) > 89 * 86_400_000, 'written for 90 days');
    const [dedupeKey, ...others] = await redis.keys(`${PREFIX}:err:${tenant}:dedupe:*`);
    assert.ok(dedupeKey !== undefined && others.length === 0, `one dedupe key: ${dedupeKey}`);
    const shorter = await openErrorMemory({ redisUrl: REDIS_URL, prefix: PREFIX, ttlDays: 1 });
    extraStores.push(shorter);
    await shorter.sweepExpired();
    const pttl = await redis.pttl(recKey(tenant, rec.id));
    assert.ok(pttl > 0 && pttl <= 86_400_000, `ttl of ${pttl} ms after the sweep`);
    // Its dedupe key, which names the tool, does not outlive it by 89 days.
    const dedupePttl = await redis.pttl(dedupeKey);
    assert.ok(
      dedupePttl > 0 && dedupePttl <= 86_400_000,
      `dedupe key ttl of ${dedupePttl} ms after the sweep`,
    );
    // A longer lifetime is not pressed on a record by the sweep: only its next hit renews it.
    await errors.sweepExpired();
    assert.ok((await redis.pttl(recKey(tenant, rec.id))) <= 86_400_000, 'still at most a day');
    assert.equal((await errors.get(tenant, rec.id))?.id, rec.id);
  });

  void test('an expired record is gone from get, search, lookup, list and every index key', async () => {
    const shortLived = await openErrorMemory({ redisUrl: REDIS_URL, prefix: PREFIX, ttlDays: 1 / 86_400 });
    extraStores.push(shortLived);
    const swept = newTenant(); // nobody reads it before the sweep
    const lazy = newTenant(); // reads find it gone first, then the sweep finishes
    const input = {
      tool_name: 'curl',
      symptom: 'SSL certificate problem: unable to get local issuer',
      action: 'x',
      outcome: 'resolved' as const,
    };
    const a = await shortLived.write(swept, input);
    const b = await shortLived.write(lazy, input);
    const pttl = await redis.pttl(recKey(swept, a.id));
    assert.ok(pttl > 0 && pttl <= 1000, `ttl of ${pttl} ms`);
    assert.equal((await shortLived.search(lazy, { query: 'certificate', limit: 4 })).length, 1);

    await waitFor(
      'both records to expire',
      async () => (await redis.exists(recKey(swept, a.id), recKey(lazy, b.id))) === 0,
    );

    const reads = async (tenant: string, id: string) => {
      assert.deepEqual(await errors.search(tenant, { query: 'SSL certificate issuer', limit: 16 }), []);
      assert.deepEqual(await errors.lookup(tenant, { tool_name: 'curl', error: 'SSL certificate problem' }), {
        related_errors: 'NONE',
        records: [],
      });
      assert.deepEqual(await errors.list(tenant, { limit: 100 }), { records: [], next: null });
      assert.equal(await errors.get(tenant, id), null);
      assert.equal((await call(tenant, 'GET', `/${id}`)).status, 404);
    };
    await reads(lazy, b.id);
    assert.ok((await shortLived.sweepExpired()) >= 2, 'the sweep counts both expired records');
    await reads(swept, a.id);

    assert.deepEqual(await keysNaming(swept, a.id), []);
    assert.deepEqual(await keysNaming(lazy, b.id), []);
    assert.deepEqual(await scanKeys(`${PREFIX}:err:${swept}:*`), []);
    assert.equal(await redis.sismember(`${PREFIX}:err:tenants`, swept), 0);
  });
});

void describe('dedupe', () => {
  void test('symptoms differing only in numbers and paths merge into one record', async () => {
    const tenant = newTenant();
    const first = await write(tenant, {
      tool_name: 'run_tests',
      symptom: 'timeout after 30s on /var/tmp/a.txt',
      action: 'raise the timeout',
      outcome: 'failed',
      keywords: ['Timeout', 'slow'],
    });
    const second = await write(tenant, {
      tool_name: 'run_tests',
      symptom: 'timeout after 45s on /home/x/b.txt',
      action: 'run the suite with --runInBand',
      outcome: 'resolved',
      cause: 'parallel workers starve the CPU',
      keywords: [' SLOW ', 'cpu'],
    });
    assert.equal(first.status, 201);
    assert.equal(second.status, 200);
    assert.deepEqual(second.body, { id: first.body.id, deduplicated: true });

    const { body } = await call(tenant, 'GET', `/${first.body.id}`);
    assert.deepEqual(Object.keys(body), [
      'id',
      'tool_name',
      'symptom',
      'cause',
      'action',
      'outcome',
      'keywords',
      'hits',
      'created_at',
      'last_hit_at',
    ]);
    assert.equal(body.hits, 2);
    assert.equal(body.symptom, 'timeout after 30s on /var/tmp/a.txt');
    assert.equal(body.action, 'run the suite with --runInBand');
    assert.equal(body.outcome, 'resolved');
    assert.equal(body.cause, 'parallel workers starve the CPU');
    assert.deepEqual(body.keywords, ['timeout', 'slow', 'cpu']);
    assert.match(body.created_at, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);

    const otherTool = await write(tenant, {
      tool_name: 'build',
      symptom: 'timeout after 30s on /var/tmp/a.txt',
    });
    assert.equal(otherTool.status, 201);
    const quoted = await write(tenant, {
      tool_name: 'run_tests',
      symptom: "timeout after 5s on 'some file'",
    });
    assert.equal(quoted.status, 201, 'quoted text with spaces is a message, not a path');
  });

  void test('symptoms differing in a status or exit code, a quoted message or a numbered word stay apart', async () => {
    const tenant = newTenant();
    const pairs = [
      ['{"error":"rate limited","code":429}', '{"error":"invalid api key","code":401}'],
      ['{"error":"rate limited","code":429}', '{"error":"rate limited","code":503}'],
      ['request failed with status 404', 'request failed with status 503'],
      ['HTTP/1.1 502 Bad Gateway', 'HTTP/1.1 504 Bad Gateway'],
      ['process exited with exit code 127', 'process exited with exit code 1'],
      ['python3: command not found', 'python2: command not found'],
      ['request failed: error 404', 'request failed: error 500'],
      // Keys of pretty-printed (CRLF) JSON and Python dicts; string codes and one-word messages.
      [
        '{\r\n    "error": {\r\n        "code": 429\r\n    }\r\n}',
        '{\r\n    "error": {\r\n        "code": 500\r\n    }\r\n}',
      ],
      ["{'code': 404}", "{'code': 500}"],
      ['{"message":"Unauthorized"}', '{"message":"Forbidden"}'],
      ["code: 'ERR_MODULE_NOT_FOUND'", "code: 'ERR_REQUIRE_ESM'"],
      // Codes known by their reason phrase, their format or their word.
      ['HTTPError: 404 Client Error: Not Found for url', 'HTTPError: 403 Client Error: Not Found for url'],
      ['exitCode: 1', 'exitCode: 2'],
      ['curl: (7) Failed to connect', 'curl: (28) Failed to connect'],
      ['ORA-00942: table or view does not exist', 'ORA-01017: table or view does not exist'],
      ['ERROR 1045 (28000): Access denied', 'ERROR 1044 (28000): Access denied'],
      ['process killed by signal 9', 'process killed by signal 15'],
      ['错误代码 404', '错误代码 500'],
    ];
    for (const [n, [a, b]] of pairs.entries()) {
      const tool_name = `tool_${n}`;
      const first = await write(tenant, { tool_name, symptom: a, action: 'fix the first' });
      const second = await write(tenant, { tool_name, symptom: b, action: 'fix the second' });
      assert.equal(first.status, 201, a);
      assert.equal(second.status, 201, `${b} is not ${a}`);
      const kept = await call(tenant, 'GET', `/${first.body.id}`);
      assert.deepEqual([kept.body.symptom, kept.body.action, kept.body.hits], [a, 'fix the first', 1]);
      const lookup = await call(tenant, 'POST', '/lookup', { tool_name, error: b });
      const own = lookup.body.records.find((r: ErrorRecord) => r.symptom === b);
      assert.equal(own?.action, 'fix the second', `the fix of ${b} is its own`);
    }
  });

  void test('ports, addresses, line numbers, durations, uuids, hex ids, URLs and quoted values still merge', async () => {
    const tenant = newTenant();
    const pairs = [
      ['connect ECONNREFUSED 10.0.0.1:8080', 'connect ECONNREFUSED 127.0.0.1:5432'],
      ['SyntaxError at line 42 column 7 after 1500ms', 'SyntaxError at line 7 column 1 after 20ms'],
      [
        'job 123e4567-e89b-12d3-a456-426614174000 failed at commit deadbeef12',
        'job 00000000-0000-0000-0000-000000000001 failed at commit 0a1b2c3d4e',
      ],
      ['GET https://api.example.com/v1/users/42 failed', 'GET https://api.example.com/v1/users/77 failed'],
      ["KeyError: 'user_id'", "KeyError: 'session'"],
      [
        '{"error":"rate limited","code":429,"retry_in":30}',
        '{"error":"rate limited","code":429,"retry_in":7}',
      ],
      // A quoted value before `:` is not a JSON key (GNU coreutils, Go's %q).
      [
        "ls: cannot access 'build.log': No such file or directory",
        "ls: cannot access 'out.txt': No such file or directory",
      ],
      ['strconv.Atoi: parsing "12a": invalid syntax', 'strconv.Atoi: parsing "x9": invalid syntax'],
      // Timestamps and Go durations, whose letters would otherwise glue to their digits.
      ['2024-05-01T12:00:00Z ERROR connection refused', '2024-05-01T13:07:44Z ERROR connection refused'],
      ['context deadline exceeded after 1m30s', 'context deadline exceeded after 2m15s'],
      // After `error` only an HTTP status is a code: these are counts and addresses.
      ['Error 1 of 3: upload timed out', 'Error 2 of 3: upload timed out'],
      ['ERROR 10.0.0.5:5432 refused', 'ERROR 192.168.1.9:5432 refused'],
      ['fatal: bad object 3f9a2b1', 'fatal: bad object 8c4e7d2'],
      // CJK text has no spaces: a number beside a CJK character is still a number.
      ['第12行出错', '第345行出错'],
      // Typographic quotes, a quoted path with a space, syslog timestamps.
      ['error: ‘foo’ undeclared', 'error: ‘bar’ undeclared'],
      ["cp: cannot stat '/tmp/a b/c': No such file", "cp: cannot stat '/tmp/xyz': No such file"],
      ['Jan  1 12:00:00 host sshd: Connection closed', 'Feb 13 08:09:10 host sshd: Connection closed'],
    ];
    for (const [n, [a, b]] of pairs.entries()) {
      const first = await write(tenant, { tool_name: `tool_${n}`, symptom: a });
      const second = await write(tenant, { tool_name: `tool_${n}`, symptom: b });
      assert.equal(first.status, 201, a);
      assert.deepEqual(second.body, { id: first.body.id, deduplicated: true }, `${b} is ${a}`);
    }
  });

  void test('a record merged with ever new actions stays indexed under its current terms only', async () => {
    const tenant = newTenant();
    const symptom = 'pod crashlooping after rollout';
    const { body } = await write(tenant, { tool_name: 'kubectl', symptom, action: 'deleted pod zqfirst' });
    for (let i = 0; i < 30; i++) {
      const res = await write(tenant, { tool_name: 'kubectl', symptom, action: `deleted pod ${word(i)}` });
      assert.equal(res.status, 200);
    }
    const id: string = body.id;
    const termsIn = (kind: string, keys: string[]) =>
      keys
        .filter((key) => key.includes(`:${kind}:`))
        .map((key) => decodeURIComponent(key.slice(key.lastIndexOf(':') + 1)))
        .sort();
    const current = ['crashlooping', 'deleted', 'pod', 'rollout', word(29)].sort();
    const naming = await keysNaming(tenant, id);
    assert.deepEqual(termsIn('term', naming), current);
    assert.deepEqual(termsIn('tterm', naming), current);
    const registered = await redis.smembers(`${PREFIX}:err:${tenant}:ikeys`);
    // Its tool's key, the resolved records' key and two per term.
    assert.equal(registered.length, 2 + 2 * current.length, 'emptied term keys leave the registry');
    assert.equal(await redis.exists(`${PREFIX}:err:${tenant}:term:zqfirst`), 0);
    assert.deepEqual(
      (await call(tenant, 'POST', '/search', { query: word(29) })).body.records.map((r: ErrorRecord) => r.id),
      [id],
    );
  });

  void test('a failed attempt merged into a resolved record keeps the fix; a newer fix replaces it', async () => {
    const tenant = newTenant();
    const fixed = await write(tenant, {
      tool_name: 'psql',
      symptom: 'connection refused on 127.0.0.1:5432',
      action: 'pg_ctlcluster 15 main start',
      cause: 'postgres stopped',
    });
    const failed = await write(tenant, {
      tool_name: 'psql',
      symptom: 'connection refused on 127.0.0.1:5433',
      action: 'restart the container',
      outcome: 'failed',
      cause: 'unknown',
    });
    assert.deepEqual(failed.body, { id: fixed.body.id, deduplicated: true });
    let rec = (await call(tenant, 'GET', `/${fixed.body.id}`)).body;
    assert.deepEqual(
      [rec.action, rec.outcome, rec.cause, rec.hits],
      ['pg_ctlcluster 15 main start', 'resolved', 'postgres stopped', 2],
    );
    await write(tenant, {
      tool_name: 'psql',
      symptom: 'connection refused on 127.0.0.1:5432',
      action: 'systemctl start postgresql',
    });
    rec = (await call(tenant, 'GET', `/${fixed.body.id}`)).body;
    assert.deepEqual([rec.action, rec.outcome, rec.hits], ['systemctl start postgresql', 'resolved', 3]);
  });

  void test('a quoted code or value with digits in it is kept as written, so such errors stay apart', async () => {
    const tenant = newTenant();
    const pairs: Array<[string, string]> = [
      ['{"code":"ERR_HTTP2_STREAM_CANCEL"}', '{"code":"ERR_HTTP2_GOAWAY_SESSION"}'],
      ["code: 'ERR_HTTP2_STREAM_CANCEL'", "code: 'ERR_HTTP2_GOAWAY_SESSION'"],
      ['{"error":"sha256_checksum_mismatch"}', '{"error":"md5_checksum_mismatch_x"}'],
      ['{"reason":"s3_bucket_not_found_404"}', '{"reason":"s3_bucket_access_denied"}'],
      ['{"error":"quota_exceeded_2"}', '{"error":"quota_exceeded_3"}'],
    ];
    for (const [n, [a, b]] of pairs.entries()) {
      assert.notEqual(normaliseSymptom(a), normaliseSymptom(b), `${a} vs ${b}`);
      const first = await write(tenant, { tool_name: `tool_${n}`, symptom: a });
      const second = await write(tenant, { tool_name: `tool_${n}`, symptom: b });
      assert.equal(first.status, 201, a);
      assert.equal(second.status, 201, `${b} is not ${a}`);
    }
    assert.equal(normaliseSymptom('{"error":"ERR_HTTP2_X","line":12}'), '{"error":"err_http2_x","line":<n>}');
    // Private-use characters in the text itself are left as they are.
    assert.equal(normaliseSymptom('\uE000 {"code":"e1_x"} \uE001'), '\uE000 {"code":"e1_x"} \uE001');
  });

  void test('negative codes, codes in brackets and statuses after responded, status of or got stay apart', () => {
    const pairs: Array<[string, string]> = [
      ['Process exited with code -1073741819', 'Process exited with code -1073741515'],
      ['exited with exit code -11', 'exited with exit code -6'],
      ['{"code":-32601,"message":"Server error"}', '{"code":-32602,"message":"Server error"}'],
      ['SQLSTATE[08006]: connection failure', 'SQLSTATE[08001]: connection failure'],
      ['exit(1)', 'exit(2)'],
      ['upstream responded with 403', 'upstream responded with 404'],
      ['request failed with a status of 403', 'request failed with a status of 404'],
      ['got 403 from server', 'got 500 from server'],
    ];
    for (const [a, b] of pairs) assert.notEqual(normaliseSymptom(a), normaliseSymptom(b), `${a} vs ${b}`);
    // Counts and noise still merge.
    const same: Array<[string, string]> = [
      ['Error 1 of 3: upload timed out', 'Error 2 of 3: upload timed out'],
      ['got 3 rows from server', 'got 7 rows from server'],
      ['retry -1 of 5', 'retry -2 of 5'],
      ['index -1 out of bounds', 'index 5 out of bounds'],
      ['offset=-3 is invalid', 'offset=12 is invalid'],
      ['status (1 of 3) failed', 'status (2 of 3) failed'],
    ];
    for (const [a, b] of same) assert.equal(normaliseSymptom(a), normaliseSymptom(b), `${a} vs ${b}`);
  });

  void test('a version of three parts after its package stays as written; dates, addresses and decimals do not', () => {
    const apart: Array<[string, string]> = [
      ['numpy 1.24.0 is incompatible', 'numpy 2.0.0 is incompatible'],
      ['requires node >= 18.0.0', 'requires node >= 20.0.0'],
      ['pip install requests==2.31.0 failed', 'pip install requests==2.28.1 failed'],
      ['cannot resolve lodash@4.17.21', 'cannot resolve lodash@4.17.20'],
      ['node v18.0.0 is not supported', 'node v18.0.1 is not supported'],
      ['python3.12: module not found', 'python3.11: module not found'],
    ];
    for (const [a, b] of apart) assert.notEqual(normaliseSymptom(a), normaliseSymptom(b), `${a} vs ${b}`);
    const same: Array<[string, string]> = [
      ['backup on 12.05.2024 failed', 'backup on 01.06.2025 failed'],
      ['connect 10.0.0.1 refused', 'connect 192.168.1.20 refused'],
      ['load 1.5 over limit', 'load 2.75 over limit'],
      ['backup 2024.01.15 failed', 'backup 2024.02.15 failed'],
    ];
    for (const [a, b] of same) assert.equal(normaliseSymptom(a), normaliseSymptom(b), `${a} vs ${b}`);
  });

  void test('a merge replaces action, outcome and cause together, and recomputes the class and embedding', async () => {
    const tenant = newTenant();
    const symptom = 'request to upstream failed';
    const classOf = async (id: string) => redis.hget(recKey(tenant, id), 'error_class');
    const first = await write(tenant, {
      tool_name: 'http',
      symptom,
      action: 'a1',
      outcome: 'failed',
      cause: 'timed out waiting for the proxy',
    });
    const id: string = first.body.id;
    assert.equal(await classOf(id), 'timeout');
    await write(tenant, {
      tool_name: 'http',
      symptom,
      action: 'a2',
      outcome: 'abandoned',
      cause: 'permission denied',
    });
    let rec = (await call(tenant, 'GET', `/${id}`)).body;
    assert.deepEqual([rec.action, rec.outcome, rec.cause], ['a2', 'abandoned', 'permission denied']);
    assert.equal(await classOf(id), 'permission');
    await write(tenant, { tool_name: 'http', symptom, action: 'a3', outcome: 'resolved' });
    rec = (await call(tenant, 'GET', `/${id}`)).body;
    assert.deepEqual([rec.action, rec.outcome, rec.cause, rec.hits], ['a3', 'resolved', null, 3]);
    assert.equal(await classOf(id), 'other', 'the class is of the symptom and the resulting cause');
    // A failed attempt after the fix changes neither the fix, its cause nor the class.
    await write(tenant, { tool_name: 'http', symptom, action: 'a4', outcome: 'failed', cause: 'timed out' });
    rec = (await call(tenant, 'GET', `/${id}`)).body;
    assert.deepEqual([rec.action, rec.outcome, rec.cause, rec.hits], ['a3', 'resolved', null, 4]);
    assert.equal(await classOf(id), 'other');

    const embed = (text: string) => localEmbed(text, 64);
    const embedded = await openErrorMemory({ redisUrl: REDIS_URL, prefix: PREFIX, ttlDays: 90, embed });
    extraStores.push(embedded);
    const t = newTenant();
    const input = { tool_name: 'pip', symptom: 'No matching distribution found', action: 'pin' };
    const made = await embedded.write(t, { ...input, outcome: 'failed', cause: 'index offline' });
    await embedded.write(t, { ...input, outcome: 'resolved', cause: 'wrong python version' });
    const stored = JSON.parse((await redis.hget(recKey(t, made.id), 'embedding')) ?? 'null');
    const want = embed(`${input.symptom}\nwrong python version`).map((x) => Math.round(x * 1e5) / 1e5);
    assert.deepEqual(stored, want);
  });

  void test('8 concurrent identical writes create exactly one record', async () => {
    const tenant = newTenant();
    const replies = await Promise.all(
      Array.from({ length: 8 }, (_, i) =>
        write(tenant, {
          tool_name: 'http_get',
          symptom: 'ECONNRESET while reading body',
          keywords: [`k${i}`],
        }),
      ),
    );
    assert.deepEqual(replies.map((r) => r.status).sort(), [200, 200, 200, 200, 200, 200, 200, 201]);
    const ids = new Set(replies.map((r) => r.body.id));
    assert.equal(ids.size, 1);
    assert.equal((await scanKeys(`${PREFIX}:err:${tenant}:rec:*`)).length, 1);
    const listed = await call(tenant, 'GET', '');
    assert.equal(listed.body.records.length, 1);
    assert.equal(listed.body.records[0].hits, 8);
    assert.equal(listed.body.records[0].keywords.length, 8);
  });
});

void describe('search and lookup', () => {
  const tenant = newTenant();
  const ids: Record<string, string> = {};
  before(async () => {
    const records = {
      getFailed: {
        tool_name: 'http_get',
        symptom: 'connection refused by upstream proxy',
        outcome: 'failed',
      },
      fetchResolved: {
        tool_name: 'http_fetch',
        symptom: 'connection refused by upstream proxy',
        outcome: 'resolved',
      },
      headAbandoned: {
        tool_name: 'http_head',
        symptom: 'connection refused by upstream proxy',
        outcome: 'abandoned',
      },
      getGateway: {
        tool_name: 'http_get',
        symptom: 'upstream proxy returned 502 bad gateway',
        outcome: 'resolved',
      },
      deadlock: {
        tool_name: 'db_query',
        symptom: 'deadlock detected while updating rows',
        outcome: 'resolved',
      },
    };
    for (const [name, input] of Object.entries(records)) {
      const res = await write(tenant, { ...input, action: `fix for ${name}` });
      assert.equal(res.status, 201);
      ids[name] = res.body.id;
    }
  });
  const search = async (body: Record<string, unknown>) => {
    const res = await call(tenant, 'POST', '/search', body);
    assert.equal(res.status, 200);
    return (res.body.records as ErrorRecord[]).map((r) => r.id);
  };

  void test('ranks by term overlap, then resolved before failed before abandoned; records sharing no term are left out', async () => {
    assert.deepEqual(await search({ query: 'connection refused upstream proxy', limit: 16 }), [
      ids.fetchResolved,
      ids.getFailed,
      ids.headAbandoned,
      ids.getGateway,
    ]);
    assert.deepEqual(await search({ query: 'the rows were deadlocked? deadlock' }), [ids.deadlock]);
    assert.deepEqual(await search({ query: 'zebra unicorn' }), []);
    assert.deepEqual(await search({ query: 'the of and' }), [], 'stop words are not terms');
  });

  void test('tool_name filters, and limit caps', async () => {
    assert.deepEqual(await search({ tool_name: 'http_get', query: 'connection refused upstream proxy' }), [
      ids.getFailed,
      ids.getGateway,
    ]);
    assert.deepEqual(await search({ tool_name: 'db_query', query: 'connection refused upstream proxy' }), []);
    assert.equal((await search({ query: 'proxy', limit: 2 })).length, 2);
  });

  void test('lookup answers compact text for the agent, or NONE', async () => {
    const res = await call(tenant, 'POST', '/lookup', {
      tool_name: 'http_get',
      error: 'Error: connection refused (upstream proxy 10.0.0.1:8080)',
    });
    assert.equal(res.status, 200);
    assert.deepEqual(
      res.body.records.map((r: ErrorRecord) => r.id),
      [ids.getFailed, ids.getGateway],
    );
    assert.equal(
      res.body.related_errors,
      '- [failed] http_get: connection refused by upstream proxy → tried: fix for getFailed\n' +
        '- [resolved] http_get: upstream proxy returned 502 bad gateway → fix: fix for getGateway',
    );

    const none = await call(tenant, 'POST', '/lookup', {
      tool_name: 'http_get',
      error: 'disk quota exceeded',
    });
    assert.deepEqual(none.body, { related_errors: 'NONE', records: [] });
  });

  void test('lookup text stays within 4 records and 1,500 characters', async () => {
    const big = newTenant();
    for (let i = 0; i < 6; i++) {
      const res = await write(big, {
        tool_name: 'render',
        symptom: `template overflow variant ${'abcdefghij'.repeat(300)} ${i}${'q'.repeat(i + 1)}`,
        action: `shorten it ${'z'.repeat(3000)}`,
        cause: `c ${'y'.repeat(3000)}`,
      });
      assert.equal(res.status, 201);
    }
    const res = await call(big, 'POST', '/lookup', { tool_name: 'render', error: 'template overflow' });
    assert.equal(res.body.records.length, 4);
    const text: string = res.body.related_errors;
    assert.ok(text.length <= 1500, `${text.length} characters`);
    assert.equal(text.split('\n').length, 4, 'all four records fit, shortened');
    assert.match(text, /^- \[resolved\] render: template overflow variant/);
  });

  void test('lookup text of emoji and CJK records shows all four, within 1,500 code points', async () => {
    const wide = newTenant();
    for (let i = 0; i < 6; i++) {
      const res = await write(wide, {
        tool_name: 'render',
        symptom: `模板溢出 ${'界🎉'.repeat(150)} ${'q'.repeat(i + 1)}`,
        action: '修正🎉'.repeat(200),
        cause: '原因😀'.repeat(200),
      });
      assert.equal(res.status, 201);
    }
    const res = await call(wide, 'POST', '/lookup', { tool_name: 'render', error: '模板溢出' });
    assert.equal(res.body.records.length, 4);
    const text: string = res.body.related_errors;
    assert.ok(Array.from(text).length <= 1500, `${Array.from(text).length} code points`);
    assert.equal(text.split('\n').length, 4, 'one line per record');
  });

  void test('a lookup with a long Python traceback matches the message on its last line', async () => {
    const t = newTenant();
    const { body } = await write(t, {
      tool_name: 'python',
      symptom: "KeyError: 'user_id'",
      action: 'read the id with .get and a default',
    });
    const frames = Array.from(
      { length: 20 },
      (_, i) =>
        `  File "/srv/app/${word(i)}.py", line ${i + 10}, in handler_${word(i)}\n    result = step_${word(i)}(request)`,
    );
    const traceback = ['Traceback (most recent call last):', ...frames, "KeyError: 'user_id'"].join('\n');
    const found = await call(t, 'POST', '/lookup', { tool_name: 'python', error: traceback });
    assert.deepEqual(
      found.body.records.map((r: ErrorRecord) => r.id),
      [body.id],
    );
    const messageFirst = [`KeyError: 'user_id'`, ...frames].join('\n');
    const alsoFound = await call(t, 'POST', '/lookup', { tool_name: 'python', error: messageFirst });
    assert.deepEqual(
      alsoFound.body.records.map((r: ErrorRecord) => r.id),
      [body.id],
    );
  });

  void test('32 long keywords do not push the symptom out: the identical error is still found', async () => {
    const t = newTenant();
    const symptom = 'x509: certificate signed by unknown authority';
    const first = await write(t, { tool_name: 'curl', symptom, action: 'install the CA bundle' });
    const keywords = Array.from({ length: 32 }, (_, i) =>
      Array.from({ length: 8 }, (_, j) => word(1000 + i * 8 + j)).join(' '),
    );
    const merged = await write(t, { tool_name: 'curl', symptom, action: 'install the CA bundle', keywords });
    assert.deepEqual(merged.body, { id: first.body.id, deduplicated: true });
    const res = await call(t, 'POST', '/lookup', { tool_name: 'curl', error: symptom });
    assert.deepEqual(
      res.body.records.map((r: ErrorRecord) => r.id),
      [first.body.id],
    );
  });

  void test('keywords, cause and action stay searchable beside a 600-word symptom', async () => {
    const t = newTenant();
    const words = Array.from({ length: 600 }, (_, i) => `${word(i + 26 * 27)}`);
    const symptom = words.join(' ');
    assert.ok(symptom.length > 3000 && symptom.length <= 4000, `a symptom of ${symptom.length} characters`);
    const { body } = await write(t, {
      tool_name: 'node',
      symptom,
      keywords: ['heapdump'],
      cause: 'the worker leaks sockets',
      action: 'restart with a larger heap',
    });
    assert.equal(body.deduplicated, false);
    for (const query of ['heapdump', 'sockets', 'larger heap', words[0], words[599]]) {
      const res = await call(t, 'POST', '/search', { query });
      assert.deepEqual(
        res.body.records.map((r: ErrorRecord) => r.id),
        [body.id],
        query,
      );
    }
  });

  void test('a number is a term only where dedupe keeps it as a code: a shared line number finds nothing', async () => {
    const t = newTenant();
    assert.deepEqual(
      significantTerms('SyntaxError: unexpected token at line 12, port 5432, in 2024 on 10.0.0.1'),
      ['syntaxerror', 'unexpected', 'token', 'line', 'port'],
    );
    assert.deepEqual(
      significantTerms('ORA-12541; exit code 137; status 404; exit code -11; SQLSTATE[08006]'),
      ['ora', '12541', 'exit', 'code', '137', 'status', '404', '11', 'sqlstate', '08006'],
    );
    const worker = await write(t, {
      tool_name: 'node',
      symptom: 'segfault in worker 12',
      action: 'restart it',
    });
    const rec = (await call(t, 'GET', `/${worker.body.id}`)).body;
    assert.ok(
      !indexTerms({ ...rec, created_ms: 0, last_hit_ms: 0, error_class: 'other', embedding: null }).includes(
        '12',
      ),
      'the worker number is no term',
    );
    const lookup = await call(t, 'POST', '/lookup', {
      tool_name: 'node',
      error: 'SyntaxError: unexpected token at line 12',
    });
    assert.deepEqual([lookup.body.related_errors, lookup.body.records], ['NONE', []]);
    assert.deepEqual(buildQuery('failed at line 12', undefined, undefined).terms, ['failed', 'line']);
    // A code still finds its record by itself.
    const ora = await write(t, {
      tool_name: 'sqlplus',
      symptom: 'ORA-12541: TNS:no listener',
      action: 'start it',
    });
    const found = await call(t, 'POST', '/search', { query: 'ORA-12541' });
    assert.deepEqual(
      found.body.records.map((r: ErrorRecord) => r.id),
      [ora.body.id],
    );
    // A bare code of three or more digits in a query finds the records that hold it as a code.
    const killed = await write(t, { tool_name: 'docker', symptom: 'container exited with exit code 137' });
    for (const query of ['137', '12541']) {
      const bare = await call(t, 'POST', '/search', { query });
      assert.deepEqual(
        bare.body.records.map((r: ErrorRecord) => r.id),
        [query === '137' ? killed.body.id : ora.body.id],
        query,
      );
    }
  });

  void test('an embedder, when given, is stored with the record and used', async () => {
    const embedded = await openErrorMemory({
      redisUrl: REDIS_URL,
      prefix: PREFIX,
      ttlDays: 90,
      embed: (text) => localEmbed(text, 64),
    });
    extraStores.push(embedded);
    const t = newTenant();
    const { id } = await embedded.write(t, {
      tool_name: 'pip',
      symptom: 'No matching distribution found',
      action: 'pin',
      outcome: 'resolved',
    });
    const stored = JSON.parse((await redis.hget(recKey(t, id), 'embedding')) ?? 'null') as number[];
    assert.equal(stored.length, 64);
    assert.deepEqual(
      (await embedded.search(t, { query: 'matching distribution', limit: 4 })).map((r) => r.id),
      [id],
    );
  });
});

void test('a record indexed before per-tool term keys existed is still found by a lookup with its tool', async () => {
  const tenant = newTenant();
  const written = await write(tenant, {
    tool_name: 'kubectl',
    symptom: 'ImagePullBackOff for the api deployment',
    action: 'fix the registry secret',
  });
  assert.equal(written.status, 201);
  // What an older version wrote: only the tenant-wide term keys, and no layout mark.
  const perTool = await scanKeys(`${PREFIX}:err:${tenant}:tterm:*`);
  assert.ok(perTool.length > 0, 'the record was written under per-tool term keys');
  assert.equal(await redis.del(...perTool, `${PREFIX}:err:${tenant}:v`), perTool.length + 1);
  const lookup = async (tool: string) =>
    (await call(tenant, 'POST', '/lookup', { tool_name: tool, error: 'ImagePullBackOff again' })).body;
  assert.deepEqual(
    (await lookup('kubectl')).records.map((r: ErrorRecord) => r.id),
    [written.body.id],
  );
  assert.equal((await lookup('helm')).related_errors, 'NONE');
  // The sweep puts the tenant's records under their tools' keys and marks the tenant.
  await errors.sweepExpired();
  assert.equal(await redis.get(`${PREFIX}:err:${tenant}:v`), '3');
  assert.equal((await scanKeys(`${PREFIX}:err:${tenant}:tterm:*`)).length, perTool.length);
  assert.deepEqual(
    (await lookup('kubectl')).records.map((r: ErrorRecord) => r.id),
    [written.body.id],
  );
});

void describe('crowded terms', () => {
  // One psql record and one old http record, then more than CANDIDATES_PER_TERM newer http
  // records sharing their terms.
  const tenant = newTenant();
  let ids: string[] = [];
  before(async () => {
    ids = await writeMany(tenant, [
      { tool_name: 'psql', symptom: 'connection refused', action: 'start postgres' },
      { tool_name: 'http', symptom: 'connection refused while zqlone' },
    ]);
    await writeMany(
      tenant,
      Array.from({ length: CANDIDATES_PER_TERM + 1 }, (_, i) => ({
        tool_name: 'http',
        symptom: `connection refused by ${word(i)}`,
        outcome: 'failed',
      })),
    );
  });

  void test('a lookup by tool finds its record however many records of other tools share its terms', async () => {
    const res = await call(tenant, 'POST', '/lookup', { tool_name: 'psql', error: 'connection refused' });
    assert.deepEqual(
      res.body.records.map((r: ErrorRecord) => r.id),
      [ids[0]],
    );
    assert.equal(res.body.related_errors, '- [resolved] psql: connection refused → fix: start postgres');
  });

  void test('a hit moves a record up in its terms, so it stays among their newest candidates', async () => {
    const oldHttp = ids[1];
    const found = async (query: string) =>
      (await call(tenant, 'POST', '/search', { query, limit: 16 })).body.records.map(
        (r: ErrorRecord) => r.id,
      );
    assert.ok(!(await found('connection refused')).includes(oldHttp), 'crowded out before the hit');
    assert.deepEqual(await found('zqlone'), [oldHttp]);
    assert.equal((await found('connection refused'))[0], oldHttp);
  });
});

void describe('crowded by failed attempts', () => {
  // A known error (failed, 6 hits) and a fix of a longer form of it, then more newer failed
  // records of the same tool sharing every term of the error than a lookup reads (MAX_FETCHED).
  const tenant = newTenant();
  const symptom = 'permission denied writing cache directory';
  let known = '';
  let fix = '';
  before(async () => {
    for (let i = 0; i < 6; i++) {
      known = (
        await writeMany(tenant, [{ tool_name: 'shell', symptom, action: 'sudo', outcome: 'failed' }])
      )[0]!;
    }
    fix = (
      await writeMany(tenant, [
        { tool_name: 'shell', symptom: `${symptom} as root`, action: 'chown -R app /var/cache/app' },
      ])
    )[0]!;
    await writeMany(
      tenant,
      Array.from({ length: 300 }, (_, i) => ({
        tool_name: 'shell',
        symptom: `${symptom} ${word(i)}`,
        action: 'retried',
        outcome: 'failed',
      })),
    );
  });

  void test('a lookup still finds the fix and the record of exactly this error, and renews them', async () => {
    await redis.pexpire(recKey(tenant, known), DAY_MS);
    await redis.pexpire(recKey(tenant, fix), DAY_MS);
    const res = await call(tenant, 'POST', '/lookup', { tool_name: 'shell', error: symptom });
    assert.deepEqual(
      res.body.records.slice(0, 2).map((r: ErrorRecord) => [r.id, r.outcome, r.hits]),
      [
        [fix, 'resolved', 1],
        [known, 'failed', 6],
      ],
    );
    assert.match(
      res.body.related_errors,
      /^- \[resolved\] shell: permission denied writing cache directory as root → fix: chown/,
    );
    near(await redis.pttl(recKey(tenant, known)), TTL_MS);
    near(await redis.pttl(recKey(tenant, fix)), TTL_MS);
  });

  void test('a search by tool finds both; a search of every tool still finds the fix', async () => {
    const search = async (body: Record<string, unknown>) =>
      (await call(tenant, 'POST', '/search', { limit: 16, ...body })).body.records.map(
        (r: ErrorRecord) => r.id,
      );
    assert.deepEqual((await search({ tool_name: 'shell', query: symptom })).slice(0, 2), [fix, known]);
    assert.equal((await search({ query: 'permission denied cache' }))[0], fix);
  });
});

void test('an error of no significant term finds its own record by tool, and only that', async () => {
  // `127.0.0.1:5432` and `第12行` leave no term once numbers are masked: a lookup of the same
  // text answered NONE although the record of exactly it (its dedupe key) was there.
  const tenant = newTenant();
  const [addr, line] = await writeMany(tenant, [
    { tool_name: 'psql', symptom: '127.0.0.1:5432', action: 'start postgres' },
    { tool_name: 'lint', symptom: '第12行', action: '補上分號' },
  ]);
  const lookup = await call(tenant, 'POST', '/lookup', { tool_name: 'psql', error: '127.0.0.1:5432' });
  assert.deepEqual(
    lookup.body.records.map((r: ErrorRecord) => r.id),
    [addr],
  );
  assert.equal(lookup.body.related_errors, '- [resolved] psql: 127.0.0.1:5432 → fix: start postgres');
  // The same error at another address is the same record (numbers are masked).
  const other = await call(tenant, 'POST', '/search', { tool_name: 'psql', query: '10.0.0.7:6432' });
  assert.deepEqual(
    other.body.records.map((r: ErrorRecord) => r.id),
    [addr],
  );
  const cjk = await call(tenant, 'POST', '/search', { tool_name: 'lint', query: '第12行' });
  assert.deepEqual(
    cjk.body.records.map((r: ErrorRecord) => r.id),
    [line],
  );
  // Another tool's record of the same text, and a search without a tool, match nothing.
  const elsewhere = await call(tenant, 'POST', '/lookup', { tool_name: 'lint', error: '127.0.0.1:5432' });
  assert.equal(elsewhere.body.related_errors, 'NONE');
  const noTool = await call(tenant, 'POST', '/search', { query: '127.0.0.1:5432' });
  assert.deepEqual(noTool.body.records, []);
});

void test('a fix written before the resolved set existed joins it at the sweep and comes first again', async () => {
  // What the previous release left: the fix in the per-tool term keys, in no resolved set, and
  // the tenant marked "2". Then more failed attempts of the same error than a lookup reads.
  const tenant = newTenant();
  const symptom = 'rollout stalled canary pod flamingo unhealthy';
  const [fix] = await writeMany(tenant, [
    { tool_name: 'deployer', symptom, action: 'raise the readiness timeout of flamingo' },
  ]);
  assert.equal(await redis.zrem(`${PREFIX}:err:${tenant}:resolved`, fix!), 1);
  await redis.set(`${PREFIX}:err:${tenant}:v`, '2');
  await writeMany(
    tenant,
    Array.from({ length: 300 }, (_, i) => ({
      tool_name: 'deployer',
      symptom: `${symptom} ${word(i)}`,
      action: 'tried restart',
      outcome: 'failed',
    })),
  );
  const search = async () =>
    (
      await call(tenant, 'POST', '/search', {
        tool_name: 'deployer',
        query: 'canary flamingo unhealthy rollout stalled again',
        limit: 4,
      })
    ).body.records.map((r: ErrorRecord) => r.id);
  assert.ok(!(await search()).includes(fix), 'crowded out before the sweep (the reported state)');
  await errors.sweepExpired();
  assert.equal(await redis.get(`${PREFIX}:err:${tenant}:v`), '3');
  assert.equal((await search())[0], fix);
});

// Text chosen to make the masks and the tokeniser work hard. The work itself cannot be counted,
// so these check what bounds it: how much of the text is read, and where a scan stops.
void describe('bounded work on hostile text', () => {
  void test('an opening typographic or CJK quote left open ends at the next one: the value quoted after it still merges', async () => {
    const tenant = newTenant();
    const quotes = [
      ['‘', '’'],
      ['“', '”'],
      ['「', '」'],
      ['『', '』'],
    ];
    for (const [n, [open, close]] of quotes.entries()) {
      const symptom = (name: string) => `error: ${open}draft ${open}${name}${close} undeclared`;
      assert.equal(normaliseSymptom(symptom('foo')), `error: ${open}draft <q> undeclared`);
      const first = await write(tenant, { tool_name: `tool_${n}`, symptom: symptom('foo') });
      const second = await write(tenant, { tool_name: `tool_${n}`, symptom: symptom('bar') });
      assert.equal(first.status, 201);
      assert.deepEqual(second.body, { id: first.body.id, deduplicated: true }, symptom('bar'));
    }
    // What made every open quote scan to the end of the line, as the API takes it.
    const flood = `${'\u201c'.repeat(2000)}${'\ufdfa'.repeat(2000)}`;
    assert.equal((await write(tenant, { tool_name: 'flood', symptom: flood })).status, 201);
  });

  void test('dedupe reads at most 8,000 characters of a symptom after NFKC (twice what the API takes)', async () => {
    // NFKC makes U+FDFA 18 characters and `㏂` the four of `a.m.`.
    for (const symptom of ['\ufdfa'.repeat(4000), '\u33c2'.repeat(4000), 'a-'.repeat(8000)]) {
      const chars = Array.from(normaliseSymptom(symptom)).length;
      assert.ok(chars <= 8000, `${chars} characters of ${symptom.slice(0, 4)}…`);
    }
    // So symptoms that differ only past that point are the same error to dedupe.
    const tenant = newTenant();
    const head = '\ufdfa'.repeat(500);
    const first = await write(tenant, { tool_name: 'pray', symptom: `${head} first` });
    const second = await write(tenant, { tool_name: 'pray', symptom: `${head} second` });
    assert.equal(first.status, 201);
    assert.deepEqual(second.body, { id: first.body.id, deduplicated: true });
  });

  void test('the URL and long-token masks still start where a scan from every letter started', () => {
    const cases = [
      ['fetch x.https://a.io/b failed', 'fetch <url> failed'],
      ['fetch 1.https://a.io/b failed', 'fetch <n>.<url> failed'],
      ['fetch _https://a.io/b failed', 'fetch _https://a.io/b failed'],
      ['see git+ssh://git@host/repo.git', 'see <url>'],
      ['a.a.a.a.a.a no url', 'a.a.a.a.a.a no url'],
      ['request --req-k7m2p9x4w8q3z6t1-- done', 'request --<id>-- done'],
      ['run -_-a-b-c-d-e-f-g-h-1 x', 'run -<id> x'],
      [`x1-${'a-'.repeat(20)}`, '<id>-'],
      ['key my-long-config-name-without-digits here', 'key my-long-config-name-without-digits here'],
    ];
    for (const [symptom, expected] of cases) assert.equal(normaliseSymptom(symptom!), expected, symptom);
  });

  void test('ranking reads the first 256 terms of a field (of the symptom also the last 256) and 4,000 characters of it after NFKC', () => {
    const rec = (fields: Record<string, unknown>) =>
      ({
        id: 'err_aaaaaaaaaaaaaaaaaaaa',
        tool_name: 'node',
        symptom: 'zzz',
        cause: null,
        action: 'yyy',
        outcome: 'resolved',
        keywords: [],
        hits: 1,
        created_ms: 0,
        last_hit_ms: 0,
        error_class: 'other',
        embedding: null,
        ...fields,
      }) as Parameters<typeof relevance>[0];
    const matches = (r: Parameters<typeof relevance>[0], text: string) =>
      relevance(r, buildQuery(text, undefined, undefined)) !== null;
    const words = Array.from({ length: 600 }, (_, i) => word(i + 26 * 27));
    const text = words.join(' ');
    assert.ok(text.length <= 4000, `a text of ${text.length} characters`);

    const longSymptom = rec({ symptom: text });
    assert.deepEqual(
      [words[0], words[255], words[300], words[343], words[344], words[599]].map((w) =>
        matches(longSymptom, w!),
      ),
      [true, true, false, false, true, true],
    );
    const longAction = rec({ action: text });
    assert.deepEqual(
      [words[0], words[255], words[256], words[599]].map((w) => matches(longAction, w!)),
      [true, true, false, false],
    );
    // 18,000 characters of NFKC on either side of the word: only the ends of the cause are read.
    const expanded = rec({
      cause: `zqhead ${'\ufdfa'.repeat(1000)} zqmiddle ${'\ufdfa'.repeat(1000)} zqtail`,
    });
    assert.deepEqual(
      ['zqhead', 'zqmiddle', 'zqtail'].map((w) => matches(expanded, w)),
      [true, false, true],
    );
    // Every term a record is found through still counts in its ranking.
    for (const r of [
      longSymptom,
      longAction,
      expanded,
      rec({ symptom: text, action: text, keywords: words }),
    ]) {
      for (const term of indexTerms(r)) assert.ok(matches(r, term), term);
    }
  });

  void test('records of long CJK and NFKC-expanding text are still found by the words at their ends', async () => {
    const tenant = newTenant();
    const cjk = Array.from({ length: 3970 }, (_, i) =>
      String.fromCodePoint(0x4e00 + ((i * 7919) % 20000)),
    ).join('');
    const fields = (w: string) => `zq${w}head ${w === 'cjk' ? cjk : '\ufdfa'.repeat(3970)} zq${w}tail`;
    const ids: Record<string, string> = {};
    for (const w of ['cjk', 'nfkc']) {
      const res = await write(tenant, {
        tool_name: 'render',
        symptom: fields(w),
        cause: fields(w),
        action: fields(w),
      });
      assert.equal(res.status, 201);
      ids[w] = res.body.id;
    }
    for (const w of ['cjk', 'nfkc']) {
      for (const query of [`zq${w}head`, `zq${w}tail`]) {
        const res = await call(tenant, 'POST', '/lookup', { tool_name: 'render', error: query });
        assert.deepEqual(
          res.body.records.map((r: ErrorRecord) => r.id),
          [ids[w]],
          query,
        );
      }
    }
  });
});

void test('over a slow link a new write waits on Redis 4 times, a merge 3, a lookup 3 and a read by id once', async () => {
  // Error memory is all Redis, so each answer the store waits for is a round trip of the link: a
  // tester measured 637 ms per merge and 459 ms per lookup at 50 ms each way (6 and 4 of them;
  // a new record's write was 6 too).
  const proxy = await startRedisProxy();
  const store = await openErrorMemory({ redisUrl: proxy.url, prefix: PREFIX, ttlDays: 90 });
  const tenant = newTenant();
  const counted = async <T>(fn: () => Promise<T>) => {
    const from = proxy.roundTrips();
    const value = await fn();
    return { value, roundTrips: proxy.roundTrips() - from };
  };
  try {
    const input = { tool_name: 'zl', outcome: 'resolved' as const };
    proxy.delay(10);
    const created = await counted(() =>
      store.write(tenant, {
        ...input,
        symptom: 'zlib stream ended early at byte 1024',
        action: 'apt install zqold',
      }),
    );
    const first = created.value;
    // The costliest merge: its new action takes the record out of the old action's term keys.
    const merge = await counted(() =>
      store.write(tenant, {
        ...input,
        symptom: 'zlib stream ended early at byte 2048',
        action: 'pip install zqnew',
      }),
    );
    const lookup = await counted(() =>
      store.lookup(tenant, { tool_name: 'zl', error: 'zlib stream ended early' }),
    );
    const read = await counted(() => store.get(tenant, first.id));
    assert.deepEqual(
      {
        created: created.roundTrips,
        merge: merge.roundTrips,
        lookup: lookup.roundTrips,
        read: read.roundTrips,
      },
      { created: 4, merge: 3, lookup: 3, read: 1 },
    );

    // The answers are what they were: merged, found with the new fix, renewed by the hit.
    assert.equal(first.deduplicated, false);
    assert.deepEqual(merge.value, { id: first.id, deduplicated: true });
    assert.deepEqual(
      lookup.value.records.map((r) => [r.id, r.action, r.hits]),
      [[first.id, 'pip install zqnew', 2]],
    );
    assert.match(lookup.value.related_errors, /pip install zqnew/);
    assert.equal(read.value?.action, 'pip install zqnew');
    // The read answers the record as its own renewal left it.
    const stamped = Number(await redis.hget(recKey(tenant, first.id), 'last_hit_ms'));
    assert.equal(read.value?.last_hit_at, new Date(stamped).toISOString());
    assert.ok(stamped >= Date.parse(lookup.value.records[0]?.last_hit_at ?? ''), 'renewed by the read');
    proxy.delay(0);
    const found = async (query: string) => (await store.search(tenant, { query, limit: 4 })).map((r) => r.id);
    assert.deepEqual(await found('zqnew'), [first.id]);
    assert.deepEqual(await found('zqold'), [], 'the old action no longer finds it');
    assert.equal(await redis.exists(`${PREFIX}:err:${tenant}:term:zqold`), 0);
  } finally {
    await closeBehindProxy(store, proxy);
  }
});

void describe('listing', () => {
  void test('pages newest first with a cursor, each record exactly once', async () => {
    const tenant = newTenant();
    const written: string[] = [];
    for (let i = 0; i < 5; i++) {
      written.push((await write(tenant, { tool_name: `tool_${i}`, symptom: `failure number ${i}` })).body.id);
    }
    await write(newTenant(), { tool_name: 'tool_0', symptom: 'someone else' });
    const seen: string[] = [];
    let cursor: string | null = null;
    let pages = 0;
    do {
      const res: Reply = await call(tenant, 'GET', `?limit=2${cursor ? `&cursor=${cursor}` : ''}`);
      assert.equal(res.status, 200);
      assert.ok(res.body.records.length <= 2, `a page of ${res.body.records.length} records`);
      seen.push(...res.body.records.map((r: ErrorRecord) => r.id));
      cursor = res.body.next;
      pages++;
    } while (cursor !== null);
    assert.equal(pages, 3);
    assert.deepEqual([...seen].sort(), [...written].sort());
    const emptyCursor: Reply = await call(tenant, 'GET', '?limit=2&cursor=');
    assert.equal(emptyCursor.status, 200, 'an empty cursor is the first page');
    assert.deepEqual(emptyCursor.body, (await call(tenant, 'GET', '?limit=2')).body);
    const created = await Promise.all(
      seen.map(
        async (id) =>
          (await errors.list(tenant, { limit: 500 })).records.find((r) => r.id === id)?.created_at ?? '',
      ),
    );
    assert.deepEqual(created, [...created].sort().reverse(), 'newest first');
  });
});

void describe('tenant isolation', () => {
  void test('another tenant cannot find, read, delete or purge a record, even by id', async () => {
    const a = newTenant();
    const b = newTenant();
    const { body } = await write(a, {
      tool_name: 'kubectl',
      symptom: 'error: You must be logged in to the server',
    });
    const id: string = body.id;

    assert.deepEqual((await call(b, 'POST', '/search', { query: 'logged server' })).body.records, []);
    assert.deepEqual(
      (await call(b, 'POST', '/lookup', { tool_name: 'kubectl', error: 'logged in' })).body.related_errors,
      'NONE',
    );
    assert.deepEqual((await call(b, 'GET', '')).body.records, []);
    const notFound = await call(b, 'GET', `/${id}`);
    assert.equal(notFound.status, 404);
    assert.equal(notFound.body.error.code, 'not_found');
    assert.deepEqual(
      await call(b, 'GET', '/err_aaaaaaaaaaaaaaaaaaaa'),
      notFound,
      'unknown and foreign ids look alike',
    );
    assert.equal((await call(b, 'DELETE', `/${id}`)).status, 404);
    assert.deepEqual((await call(b, 'DELETE', '?tool_name=kubectl')).body, { deleted: 0 });
    assert.deepEqual((await call(b, 'DELETE', '')).body, { deleted: 0 });
    for (const bad of ['not-an-id', 'err_AAAAAAAAAAAAAAAAAAAA', `${a}:rec:${id}`, '*']) {
      assert.equal((await call(a, 'GET', `/${encodeURIComponent(bad)}`)).status, 404, bad);
    }

    assert.equal((await call(a, 'GET', `/${id}`)).status, 200);
    assert.equal((await call(a, 'DELETE', `/${id}`)).status, 204);
    assert.equal((await call(a, 'GET', `/${id}`)).status, 404);
    assert.equal((await call(a, 'DELETE', `/${id}`)).status, 404);
    assert.deepEqual((await call(a, 'POST', '/search', { query: 'logged server' })).body.records, []);
    assert.equal(
      (await write(a, { tool_name: 'kubectl', symptom: 'error: You must be logged in to the server' }))
        .status,
      201,
    );
  });

  void test('the same error written by two tenants is a record of each, and each merges its repeats into its own', async () => {
    // Dedupe is per tenant: a write must neither merge into another tenant's record nor take its
    // dedupe key over (that tenant's next repeat would then start a second record).
    const a = newTenant();
    const b = newTenant();
    const error = { tool_name: 'terraform', symptom: 'Error acquiring the state lock' };
    const firstA = await write(a, { ...error, action: 'wait for the other apply' });
    const firstB = await write(b, { ...error, action: 'terraform force-unlock' });
    assert.deepEqual([firstA.status, firstA.body.deduplicated], [201, false]);
    assert.deepEqual([firstB.status, firstB.body.deduplicated], [201, false]);
    assert.notEqual(firstB.body.id, firstA.body.id);

    const againA = await write(a, { ...error, action: 'wait for the other apply' });
    const againB = await write(b, { ...error, action: 'terraform force-unlock' });
    assert.deepEqual([againA.status, againA.body], [200, { id: firstA.body.id, deduplicated: true }]);
    assert.deepEqual([againB.status, againB.body], [200, { id: firstB.body.id, deduplicated: true }]);
    for (const [tenant, id, action] of [
      [a, firstA.body.id, 'wait for the other apply'],
      [b, firstB.body.id, 'terraform force-unlock'],
    ]) {
      const { body } = await call(tenant, 'GET', '');
      assert.deepEqual(
        body.records.map((r: ErrorRecord) => [r.id, r.action, r.hits]),
        [[id, action, 2]],
      );
    }
  });

  void test('deleting an id that does not exist answers 404 and leaves nothing behind', async () => {
    // A tenant without records: no key of it may appear, however many ids are tried.
    const empty = newTenant();
    for (let i = 0; i < 3; i++) {
      const res = await call(empty, 'DELETE', `/err_${'abcdefghijklmnopqrs'}${'a234567'[i]}`);
      assert.equal(res.status, 404);
    }
    assert.deepEqual(await scanKeys(`${PREFIX}:err:${empty}:*`), []);
    assert.equal(await redis.sismember(`${PREFIX}:err:tenants`, empty), 0);

    // A tenant with records: its keys are as they were, and its record is still there.
    const t = newTenant();
    const { body } = await write(t, { tool_name: 'git', symptom: 'fatal: not a git repository' });
    const before = await scanKeys(`${PREFIX}:err:${t}:*`);
    assert.equal((await call(t, 'DELETE', '/err_aaaaaaaaaaaaaaaaaaaa')).status, 404);
    assert.deepEqual((await scanKeys(`${PREFIX}:err:${t}:*`)).sort(), before.sort());
    assert.equal(await redis.exists(`${PREFIX}:err:${t}:dead`), 0);
    assert.equal((await call(t, 'GET', `/${body.id}`)).status, 200);
    // Deleting it twice: the second is a 404 that marks nothing more.
    assert.equal((await call(t, 'DELETE', `/${body.id}`)).status, 204);
    assert.deepEqual(await redis.smembers(`${PREFIX}:err:${t}:dead`), [body.id]);
    assert.equal((await call(t, 'DELETE', `/${body.id}`)).status, 404);
    assert.deepEqual(await redis.smembers(`${PREFIX}:err:${t}:dead`), [body.id]);
    await errors.sweepExpired();
    assert.deepEqual(await scanKeys(`${PREFIX}:err:${t}:*`), []);
  });

  void test('a deleted record leaves no key named by its words, and a kept record keeps its own', async () => {
    // Setup: a record whose every field has a word no other record has, and a second record of
    // the same tool sharing one term with it.
    const t = newTenant();
    const { body } = await write(t, {
      tool_name: 'curl',
      symptom: 'uniqueprivterm exploded while fetching',
      cause: 'causepriv broke',
      action: 'actionpriv applied',
      keywords: ['keywordpriv'],
    });
    const kept = await write(t, { tool_name: 'curl', symptom: 'fetching stalled forever' });
    const merged = await write(t, { tool_name: 'curl', symptom: 'uniqueprivterm exploded while fetching' });
    assert.equal(merged.body.id, body.id, 'a duplicate merged into it (hits 2)');
    const privWords = /uniqueprivterm|causepriv|actionpriv|keywordpriv|exploded/;
    assert.ok(
      (await scanKeys(`${PREFIX}:err:${t}:*`)).some((k) => privWords.test(k)),
      'its words name index keys before the delete',
    );

    // Action
    assert.equal((await call(t, 'DELETE', `/${body.id}`)).status, 204);

    // Assert: no key is named by its words, none but the sweep's mark holds its id, and the
    // registry of index keys names only keys that exist. The other record is still found.
    assert.deepEqual(
      (await scanKeys(`${PREFIX}:err:${t}:*`)).filter((k) => privWords.test(k)),
      [],
    );
    assert.deepEqual(await keysNaming(t, body.id), [`${PREFIX}:err:${t}:dead`]);
    for (const key of await redis.smembers(`${PREFIX}:err:${t}:ikeys`)) {
      assert.equal(await redis.exists(key), 1, `${key} is registered but gone`);
    }
    const found = await call(t, 'POST', '/search', { query: 'fetching', tool_name: 'curl' });
    assert.deepEqual(
      found.body.records.map((r: ErrorRecord) => r.id),
      [kept.body.id],
    );
  });

  void test('purge by tool deletes only that tool; purge without one deletes all', async () => {
    const t = newTenant();
    await write(t, { tool_name: 'npm', symptom: 'ERESOLVE unable to resolve dependency tree' });
    await write(t, { tool_name: 'npm', symptom: 'EACCES permission denied, mkdir' });
    const kept = (
      await write(t, { tool_name: 'yarn', symptom: 'Couldn\'t find package "x" on the "npm" registry' })
    ).body.id;
    assert.deepEqual((await call(t, 'DELETE', '?tool_name=npm')).body, { deleted: 2 });
    assert.deepEqual(
      (await call(t, 'GET', '')).body.records.map((r: ErrorRecord) => r.id),
      [kept],
    );
    assert.deepEqual(
      (await call(t, 'POST', '/search', { query: 'dependency tree permission' })).body.records,
      [],
    );
    // What a client sends for `DELETE /v1/errors/{id}` with an empty or "." id is no purge.
    for (const path of ['/', '/.', '/?tool_name=yarn']) {
      assert.equal((await call(t, 'DELETE', path)).status, 404, path);
    }
    // A filter in a body (not the query) is refused, not ignored for a purge of every record.
    const inBody = await call(t, 'DELETE', '', { tool_name: 'npm' });
    assert.equal(inBody.status, 400);
    assert.match(inBody.body.error.message, /\?tool_name=/);
    assert.equal((await call(t, 'GET', '')).body.records.length, 1);
    assert.deepEqual((await call(t, 'DELETE', '')).body, { deleted: 1 });
    assert.deepEqual((await call(t, 'GET', '')).body, { records: [], next: null });
    assert.equal((await errors.sweepExpired()) >= 3, true);
    assert.deepEqual(await scanKeys(`${PREFIX}:err:${t}:*`), []);
  });
});

void describe('validation', () => {
  const tenant = newTenant();
  const problemPath = (res: Reply) => {
    assert.equal(res.status, 400);
    assert.equal(res.body.error.code, 'validation_failed');
    return res.body.error.details.problems[0].path as string;
  };

  void test('bad bodies and queries get a 400 naming the field, and change nothing', async () => {
    const ok = { tool_name: 't', symptom: 's s', action: 'a', outcome: 'resolved' };
    assert.equal(problemPath(await call(tenant, 'POST', '', { ...ok, symptom: undefined })), 'symptom');
    assert.equal(problemPath(await call(tenant, 'POST', '', { ...ok, extra: 1 })), 'extra');
    assert.equal(problemPath(await call(tenant, 'POST', '', { ...ok, outcome: 'fixed' })), 'outcome');
    assert.equal(problemPath(await call(tenant, 'POST', '', { ...ok, tool_name: '   ' })), 'tool_name');
    assert.equal(
      problemPath(await call(tenant, 'POST', '', { ...ok, tool_name: 'x'.repeat(129) })),
      'tool_name',
    );
    assert.equal(
      problemPath(await call(tenant, 'POST', '', { ...ok, symptom: 'x'.repeat(4001) })),
      'symptom',
    );
    assert.equal(
      problemPath(await call(tenant, 'POST', '', { ...ok, keywords: ['k'.repeat(65)] })),
      'keywords[0]',
    );
    assert.equal(
      problemPath(await call(tenant, 'POST', '', { ...ok, keywords: Array(33).fill('k') })),
      'keywords',
    );
    assert.equal(problemPath(await call(tenant, 'POST', '', { ...ok, session_id: '..' })), 'session_id');
    assert.equal(problemPath(await call(tenant, 'POST', '', { ...ok, symptom: 'bad\u0000byte' })), 'symptom');
    assert.equal(problemPath(await call(tenant, 'POST', '', { ...ok, cause: 'half \ud800' })), 'cause');
    assert.equal(problemPath(await call(tenant, 'POST', '', { ...ok, keywords: ['\udc00'] })), 'keywords[0]');
    assert.equal(problemPath(await call(tenant, 'POST', '/search', { query: 'a\u0000b' })), 'query');
    assert.equal(problemPath(await call(tenant, 'POST', '/search', { query: 'x', limit: 17 })), 'limit');
    assert.equal(problemPath(await call(tenant, 'POST', '/search', { query: 'x', limit: 0 })), 'limit');
    assert.equal(
      problemPath(await call(tenant, 'POST', '/search', { query: 'x', toolname: 'a' })),
      'toolname',
    );
    assert.equal(problemPath(await call(tenant, 'POST', '/lookup', { error: 'x' })), 'tool_name');
    assert.equal(problemPath(await call(tenant, 'GET', '?limit=501')), 'limit');
    // As on every other list: a decimal integer, not what Number() reads.
    for (const limit of ['0x10', '1e2', '1.0', '%205']) {
      assert.equal(problemPath(await call(tenant, 'GET', `?limit=${limit}`)), 'limit', limit);
    }
    assert.equal(problemPath(await call(tenant, 'GET', '?cursor=abc')), 'cursor');
    assert.equal(problemPath(await call(tenant, 'DELETE', '?tool=npm')), 'tool');
    // Unknown query parameters on routes that take none (a write once stored despite ?dry_run).
    assert.equal(problemPath(await call(tenant, 'POST', '?dry_run=1', ok)), 'dry_run');
    assert.equal(problemPath(await call(tenant, 'POST', '/search?limit=3', { query: 'x' })), 'limit');
    assert.equal(problemPath(await call(tenant, 'POST', '/lookup?x=1', { tool_name: 't', error: 'e' })), 'x');
    assert.equal(problemPath(await call(tenant, 'GET', '/err_abc?x=1')), 'x');
    const malformed = await fetch(`${baseUrl}/v1/errors`, {
      method: 'POST',
      headers: { 'x-test-tenant': tenant, 'content-type': 'application/json' },
      body: '{"tool_name":',
    });
    assert.equal(malformed.status, 400);

    assert.deepEqual((await call(tenant, 'GET', '')).body, { records: [], next: null });
    assert.deepEqual(await scanKeys(`${PREFIX}:err:${tenant}:*`), []);
    assert.equal((await call(tenant, 'POST', '', ok)).status, 201, 'the service keeps serving');
  });
});

void describe('outages', () => {
  void test('an unreachable Redis gets 503 with retry-after, not a hang, and ping is false', async () => {
    const down = await openErrorMemory({
      redisUrl: 'redis://127.0.0.1:1',
      prefix: PREFIX,
      ttlDays: 90,
      connectWaitMs: 100,
    });
    try {
      assert.equal(await down.ping(), false);
      await assert.rejects(
        down.write(newTenant(), { tool_name: 'x', symptom: 'y', action: 'z', outcome: 'resolved' }),
        (err: any) =>
          err.status === 503 && err.code === 'unavailable' && err.headers['retry-after'] !== undefined,
      );
      await assert.rejects(
        down.search(newTenant(), { query: 'y', limit: 4 }),
        (err: any) => err.status === 503,
      );
    } finally {
      await down.close();
    }
    assert.equal(await errors.ping(), true);
  });

  void test('a purge answers 503 with retry-after while Redis hangs, and a slow purge that makes progress finishes', async () => {
    const opTimeoutMs = 1000;
    const proxy = await startRedisProxy();
    const store = await openErrorMemory({ redisUrl: proxy.url, prefix: PREFIX, ttlDays: 90, opTimeoutMs });
    const app = await serveStore(store);
    try {
      // Slow but answering: each batch of 500 takes about six round trips of 100 ms (reading the
      // records for their index keys is one), each step well within a deadline, and the four
      // batches take twice as long as one.
      const slow = newTenant();
      await writeMany(
        slow,
        Array.from({ length: 2000 }, (_, i) => ({ tool_name: 'bulk', symptom: `bulk failure ${word(i)}` })),
      );
      proxy.delay(50);
      const started = Date.now();
      const purged = await call(slow, 'DELETE', '?tool_name=bulk', undefined, { base: app.base });
      const took = Date.now() - started;
      assert.deepEqual([purged.status, purged.body], [200, { deleted: 2000 }]);
      assert.ok(took > opTimeoutMs, `the purge took ${took} ms, longer than one deadline`);
      proxy.delay(0);

      // Hung: the connection stays open and nothing answers.
      const hung = newTenant();
      await write(hung, { tool_name: 'npm', symptom: 'ERESOLVE unable to resolve dependency tree' });
      proxy.blackhole();
      for (const path of ['?tool_name=npm', '']) {
        const t0 = Date.now();
        const res = await call(hung, 'DELETE', path, undefined, {
          base: app.base,
          timeoutMs: opTimeoutMs + 5000,
        });
        assert.equal(res.status, 503, path);
        assert.equal(res.body.error.code, 'unavailable');
        assert.ok(res.headers?.get('retry-after'), 'retry-after');
        assert.ok(Date.now() - t0 < opTimeoutMs + 2000, `answered after ${Date.now() - t0} ms`);
      }
      await assert.rejects(store.purgeTenant(hung), (err: any) => err.status === 503);
      assert.equal((await call(hung, 'GET', '')).body.records.length, 1, 'nothing was purged');
    } finally {
      await app.close();
      await closeBehindProxy(store, proxy);
    }
  });

  void test('a Redis out of memory gets 503 with retry-after on a write, new or merged', async () => {
    const own = await startPrivateRedis();
    const admin = new Redis(own.url);
    const store = await openErrorMemory({ redisUrl: own.url, prefix: PREFIX, ttlDays: 90 });
    const app = await serveStore(store);
    try {
      const tenant = newTenant();
      const input = { action: 'retry', outcome: 'resolved' as const, tool_name: 'zl' };
      await store.write(tenant, { ...input, symptom: 'zlib stream ended early' });
      await admin.config('SET', 'maxmemory', '1');
      for (const symptom of ['zlib stream ended early', 'zlib header check failed']) {
        const r = await call(tenant, 'POST', '', { ...input, symptom }, { base: app.base });
        assert.equal(r.status, 503, `${symptom}: ${JSON.stringify(r.body)}`);
        assert.equal(r.body.error.code, 'unavailable');
        assert.ok(r.headers?.get('retry-after'), `${symptom}: retry-after`);
      }
      await admin.config('SET', 'maxmemory', '0');
      const merged = await call(
        tenant,
        'POST',
        '',
        { ...input, symptom: 'zlib stream ended early' },
        { base: app.base },
      );
      assert.deepEqual([merged.status, merged.body.deduplicated], [200, true]);
    } finally {
      await app.close();
      await store.close();
      admin.disconnect();
      await own.stop();
    }
  });

  void test('a Redis out of memory still answers the reads that find records; their renewal is skipped, logged once and counted', async () => {
    const own = await startPrivateRedis();
    const admin = new Redis(own.url);
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino({ level: 'info' }, { write: (line: string) => void lines.push(JSON.parse(line)) });
    const skipped: string[] = [];
    let clock = Date.now();
    const store = await openErrorMemory({
      redisUrl: own.url,
      prefix: PREFIX,
      ttlDays: 90,
      logger,
      now: () => clock,
      onSkipped: (step) => void skipped.push(step),
    });
    const app = await serveStore(store);
    const tenant = newTenant();
    const ask = (method: string, path: string, body?: unknown) =>
      call(tenant, method, path, body, { base: app.base });
    try {
      const input = { action: 'pip install zstandard', outcome: 'resolved' as const, tool_name: 'zl' };
      const written = clock;
      const rec = await store.write(tenant, { ...input, symptom: 'zlib stream ended early' });
      const gone = await store.write(tenant, { ...input, symptom: 'zlib header check failed' });
      // A record whose key expired: a read that finds its id drops it from the index keys, which
      // is a write too.
      await admin.del(recKey(tenant, gone.id));
      clock += DAY_MS;
      await admin.config('SET', 'maxmemory', '1');

      const lookup = await ask('POST', '/lookup', { tool_name: 'zl', error: 'zlib stream ended early' });
      assert.equal(lookup.status, 200, JSON.stringify(lookup.body));
      assert.deepEqual(
        lookup.body.records.map((r: ErrorRecord) => r.id),
        [rec.id],
      );
      assert.match(lookup.body.related_errors, /pip install zstandard/);
      const search = await ask('POST', '/search', { query: 'zlib' });
      assert.equal(search.status, 200, JSON.stringify(search.body));
      assert.deepEqual(
        search.body.records.map((r: ErrorRecord) => r.id),
        [rec.id],
      );
      const got = await ask('GET', `/${rec.id}`);
      assert.equal(got.status, 200, JSON.stringify(got.body));
      assert.equal((await ask('GET', `/${gone.id}`)).status, 404);
      const listed = await ask('GET', '');
      assert.equal(listed.status, 200, JSON.stringify(listed.body));
      assert.deepEqual(
        listed.body.records.map((r: ErrorRecord) => r.id),
        [rec.id],
      );
      // Answered as read: not renewed, its last hit still the write's.
      for (const r of [lookup.body.records[0], search.body.records[0], got.body])
        assert.equal(r.last_hit_at, new Date(written).toISOString());
      assert.equal(await admin.hget(recKey(tenant, rec.id), 'last_hit_ms'), String(written));
      // One line for them all; each skipped step counted.
      const warned = lines.filter((l) => l.msg === 'error-memory redis refused a write: upkeep skipped');
      assert.equal(warned.length, 1, JSON.stringify(lines));
      assert.ok(skipped.includes('renew') && skipped.includes('forget'), skipped.join());

      // Once Redis takes writes again, a hit renews the record.
      await admin.config('SET', 'maxmemory', '0');
      const again = await ask('POST', '/lookup', { tool_name: 'zl', error: 'zlib stream ended early' });
      assert.equal(again.body.records[0].last_hit_at, new Date(clock).toISOString());
      assert.equal(await admin.hget(recKey(tenant, rec.id), 'last_hit_ms'), String(clock));
    } finally {
      await app.close();
      await store.close();
      admin.disconnect();
      await own.stop();
    }
  });

  void test('a read whose renewal loses its connection still answers 503', async () => {
    const proxy = await startRedisProxy();
    const store = await openErrorMemory({ redisUrl: proxy.url, prefix: PREFIX, ttlDays: 90 });
    const app = await serveStore(store);
    try {
      const tenant = newTenant();
      const input = { action: 'retry', outcome: 'resolved' as const, tool_name: 'zl' };
      await store.write(tenant, { ...input, symptom: 'zlib stream ended early' });
      // RENEW_SCRIPT's EVAL (a merge also stamps last_hit_ms, but goes on otherwise).
      proxy.cutWhen(/'last_hit_ms', ARGV\[3\]\)\nredis\.call\('PEXPIRE'/);
      const body = { tool_name: 'zl', error: 'zlib stream ended early' };
      const r = await call(tenant, 'POST', '/lookup', body, { base: app.base });
      assert.equal(r.status, 503, JSON.stringify(r.body));
      assert.equal(r.body.error.code, 'unavailable');
    } finally {
      await app.close();
      await closeBehindProxy(store, proxy);
    }
  });

  void test('a Redis out of memory still deletes records, whole, and the answer says so', async () => {
    const own = await startPrivateRedis();
    const admin = new Redis(own.url);
    const store = await openErrorMemory({ redisUrl: own.url, prefix: PREFIX, ttlDays: 90 });
    const app = await serveStore(store);
    const tenant = newTenant();
    const ask = (method: string, path: string, body?: unknown) =>
      call(tenant, method, path, body, { base: app.base });
    try {
      const input = { action: 'retry', outcome: 'resolved' as const, tool_name: 'zl' };
      const doomed = await store.write(tenant, { ...input, symptom: 'zlib stream ended early' });
      const purged = await store.write(tenant, { ...input, symptom: 'zlib header check failed' });
      const kept = await store.write(tenant, { ...input, tool_name: 'gz', symptom: 'gzip crc error' });
      await admin.config('SET', 'maxmemory', '1');

      const removed = await ask('DELETE', `/${doomed.id}`);
      assert.equal(removed.status, 204, JSON.stringify(removed.body));
      // Whole: record, dedupe key and every index entry (the sweep's dead set aside).
      const left = (await keysNaming(tenant, doomed.id, admin)).filter((k) => !k.endsWith(':dead'));
      assert.deepEqual(left, []);
      assert.equal((await ask('GET', `/${doomed.id}`)).status, 404);
      assert.equal((await ask('DELETE', `/${doomed.id}`)).status, 404);
      const purge = await ask('DELETE', '?tool_name=zl');
      assert.deepEqual([purge.status, purge.body], [200, { deleted: 1 }]);
      const leftOfPurged = (await keysNaming(tenant, purged.id, admin)).filter((k) => !k.endsWith(':dead'));
      assert.deepEqual(leftOfPurged, []);
      const listed = await ask('GET', '');
      assert.deepEqual(
        listed.body.records.map((r: ErrorRecord) => r.id),
        [kept.id],
      );

      // The dedupe key went with the record: the same error is a new record.
      await admin.config('SET', 'maxmemory', '0');
      const again = await ask('POST', '', { ...input, symptom: 'zlib stream ended early' });
      assert.deepEqual([again.status, again.body.deduplicated], [201, false]);
    } finally {
      await app.close();
      await store.close();
      admin.disconnect();
      await own.stop();
    }
  });

  void test('a refused write is recognised as Redis 7 and Redis 6.2 word it from a script', () => {
    // Redis 7 (what the tests run) answers with the refusal; 6.2 wraps it in the script's error,
    // which neither pattern matched: a read on a full 6.2 was a 500 where 7 answers it.
    const v7 = "OOM command not allowed when used memory > 'maxmemory'. script: 9f2c, on @user_script:3.";
    const v62 =
      "ERR Error running script (call to f_9f2c): @user_script:3: @user_script: 3: -OOM command not allowed when used memory > 'maxmemory'.";
    for (const m of [v7, v62, "READONLY You can't write against a read only replica."]) {
      assert.ok(REDIS_WRITE_REFUSED.test(m), m);
      assert.ok(REDIS_TRANSIENT_REPLY.test(m), m);
    }
    assert.equal(REDIS_WRITE_REFUSED.test('ERR wrong number of arguments for OOMKILL'), false);
  });

  void test('a purge on a full Redis leaves the id of a record expired before it where the sweep cleans its index entries', async () => {
    const own = await startPrivateRedis();
    const admin = new Redis(own.url);
    const store = await openErrorMemory({ redisUrl: own.url, prefix: PREFIX, ttlDays: 90 });
    const app = await serveStore(store);
    const tenant = newTenant();
    try {
      const input = { action: 'git init', outcome: 'resolved' as const, tool_name: 'git' };
      const rec = await store.write(tenant, { ...input, symptom: 'fatal: not a git repository' });
      // Its record and dedupe key (one TTL) expire before any sweep or read drops it: only its
      // index entries are left.
      await admin.pexpire(`${PREFIX}:err:${tenant}:rec:${rec.id}`, 1);
      for (const key of await scanKeys(`${PREFIX}:err:${tenant}:dedupe:*`, admin))
        await admin.pexpire(key, 1);
      await new Promise((r) => setTimeout(r, 20));
      await admin.config('SET', 'maxmemory', '1');

      const purge = await call(tenant, 'DELETE', '', undefined, { base: app.base });
      assert.deepEqual([purge.status, purge.body], [200, { deleted: 0 }]);

      // Memory back: the sweep finds the id (before, the purge had taken it out of every index the
      // sweep reads, unmarked, and its term entries stayed for good, with no expiry).
      await admin.config('SET', 'maxmemory', '0');
      await store.sweepExpired();
      assert.deepEqual(await keysNaming(tenant, rec.id, admin), []);
    } finally {
      await app.close();
      await store.close();
      admin.disconnect();
      await own.stop();
    }
  });

  void test('a record whose connection dropped between saving it and setting its expiry is purged and swept', async () => {
    const proxy = await startRedisProxy();
    // The writer's clock runs two minutes behind, so its pending entries are already old.
    const store = await openErrorMemory({
      redisUrl: proxy.url,
      prefix: PREFIX,
      ttlDays: 90,
      now: () => Date.now() - 120_000,
    });
    const recs = async (tenant: string) => scanKeys(`${PREFIX}:err:${tenant}:rec:*`);
    /** A write whose connection is cut when it sends the command matching `at`. */
    const crash = async (tenant: string, at: RegExp, input: { tool_name: string; symptom: string }) => {
      const before = await recs(tenant);
      proxy.cutWhen(at);
      await assert.rejects(store.write(tenant, { ...input, action: 'fix', outcome: 'resolved' }));
      await waitFor('the writer to reconnect', () => store.ping());
      const [key, ...more] = (await recs(tenant)).filter((k) => !before.includes(k));
      assert.ok(key !== undefined && more.length === 0, 'the write left its record behind');
      return key;
    };
    const beforeExpiry = /PEXPIRE\r\n\$\d+\r\n[^\r]*:rec:err_/;
    try {
      // Left without an expiry, in no index: a purge of all, or of its tool, deletes it.
      for (const path of ['', '?tool_name=bash']) {
        const t = newTenant();
        const key = await crash(t, beforeExpiry, { tool_name: 'bash', symptom: 'orphan test error' });
        assert.equal(await redis.pttl(key), -1, 'the crash left a record without an expiry');
        assert.deepEqual((await call(t, 'DELETE', path)).body, { deleted: 1 }, path);
        assert.deepEqual(await recs(t), [], path);
      }
      const other = newTenant();
      await crash(other, beforeExpiry, { tool_name: 'bash', symptom: 'orphan test error' });
      assert.deepEqual((await call(other, 'DELETE', '?tool_name=zsh')).body, { deleted: 0 });
      assert.equal((await recs(other)).length, 1, 'a purge of another tool keeps it');

      // The sweep deletes the one without an expiry, and indexes the one its dedupe key names.
      const swept = newTenant();
      await crash(swept, beforeExpiry, { tool_name: 'bash', symptom: 'orphan test error' });
      const healed = await crash(swept, /:ikeys/, { tool_name: 'bash', symptom: 'unindexed test error' });
      assert.ok((await redis.pttl(healed)) > 0, 'the healed record has its expiry');
      assert.deepEqual((await call(swept, 'GET', '')).body.records, [], 'in no index yet');
      await errors.sweepExpired();
      assert.deepEqual(await recs(swept), [healed]);
      const listed = (await call(swept, 'GET', '')).body.records.map((r: ErrorRecord) => r.symptom);
      assert.deepEqual(listed, ['unindexed test error']);
      const found = await call(swept, 'POST', '/search', { query: 'unindexed' });
      assert.equal(found.body.records.length, 1);
      assert.deepEqual((await call(swept, 'DELETE', '')).body, { deleted: 1 });
    } finally {
      await closeBehindProxy(store, proxy);
    }
  });
});
