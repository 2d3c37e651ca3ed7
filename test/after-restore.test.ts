import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import path from 'node:path';
import { after, describe, test } from 'node:test';
import { Redis } from 'ioredis';
import { makePgDb } from '../db/pool.js';
import {
  ADMIN_URL,
  REDIS_URL,
  api,
  createTestDatabase,
  deleteRedisPrefix,
  dropTestDatabase,
  eventually,
  startTestService,
  testPrefix,
} from './support/harness.js';
import type { Api, TestService } from './support/harness.js';
import { startPrivateRedis } from './support/private-redis.js';

/**
 * `mnemos after-restore`: Postgres restored from a backup behind a Redis that kept its newer
 * state. Each test makes its own backup: a database that a service wrote to, copied, then written
 * to further through the same Redis prefix; "restoring" is starting a service on the copy.
 */

const cli = path.resolve(import.meta.dirname, '..', 'bin', 'mnemos.js');
const cleanups: Array<() => Promise<void>> = [];
after(async () => {
  for (const c of cleanups.reverse()) await c().catch(() => undefined);
});

const msg = (id: string) => ({ id, role: 'user', content: `the text of ${id}` });

async function runAfterRestore(
  prefix: string,
  ...args: string[]
): Promise<{ status: number | null; stdout: string; stderr: string }> {
  return runAfterRestoreOn(REDIS_URL, prefix, ...args);
}

async function runAfterRestoreOn(
  redisUrl: string,
  prefix: string,
  ...args: string[]
): Promise<{ status: number | null; stdout: string; stderr: string }> {
  // An unreachable database: the command must not need one.
  const env = {
    ...process.env,
    REDIS_URL: redisUrl,
    MNEMOS_PREFIX: prefix,
    DATABASE_URL: 'postgres://postgres@127.0.0.1:1/none',
    LOG_LEVEL: 'silent',
  };
  const child = spawn(process.execPath, [cli, 'after-restore', ...args], { env });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
  child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
  const status = await new Promise<number | null>((resolve) => child.on('close', resolve));
  return { status, stdout, stderr };
}

async function start(databaseUrl: string, prefix: string, mode?: 'api' | 'worker'): Promise<TestService> {
  const svc = await startTestService({ databaseUrl, prefix, ...(mode ? { mode } : {}) });
  cleanups.push(() => svc.stop());
  return svc;
}

/** A copy of the database (the backup), taken while no service is connected to it. */
async function copyDatabase(url: string): Promise<string> {
  const name = `${new URL(url).pathname.slice(1)}_bak`;
  const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
  try {
    await admin.query(`CREATE DATABASE "${name}" TEMPLATE "${new URL(url).pathname.slice(1)}"`);
  } finally {
    await admin.close();
  }
  const copy = new URL(url);
  copy.pathname = `/${name}`;
  cleanups.push(() => dropTestDatabase(copy.toString()));
  return copy.toString();
}

async function archive(t: Api, session: string, ids: string[]) {
  const r = await t.post(`/v1/sessions/${session}/messages?wait=true`, { messages: ids.map(msg) });
  assert.equal(r.status, 201, JSON.stringify(r.body));
  return r.body as { accepted: number; messages: Array<{ id: string; seq: number }> };
}

async function stored(t: Api, session: string): Promise<Array<{ id: string; seq: number }>> {
  const r = await t.get(`/v1/sessions/${session}/messages?limit=500`);
  if (r.status === 404) return [];
  assert.equal(r.status, 200);
  return r.body.messages.map((m: { id: string; seq: number }) => ({ id: m.id, seq: m.seq }));
}

/**
 * Before the backup: s1 holds a1, a2 (seqs 1-2) and the tenant has an error record. After it,
 * through the same Redis: s1 is reset and gets b1, b2 (seqs 3-4, generation 1), and an API-only
 * process accepts c1 in s2, which no worker archives before everything stops.
 */
async function backupThenMoveOn() {
  const prefix = testPrefix();
  cleanups.push(() => deleteRedisPrefix(prefix));
  const live = await createTestDatabase();
  cleanups.push(() => dropTestDatabase(live));

  let svc = await start(live, prefix);
  const tenant = await svc.newTenant();
  assert.deepEqual((await archive(tenant.api, 's1', ['a1', 'a2'])).messages, [
    { id: 'a1', seq: 1 },
    { id: 'a2', seq: 2 },
  ]);
  const e = await tenant.api.post('/v1/errors', {
    tool_name: 'psql',
    symptom: 'connection refused on 127.0.0.1:5432',
    action: 'pg_ctlcluster 15 main start',
    outcome: 'resolved',
  });
  assert.equal(e.status, 201, JSON.stringify(e.body));
  await svc.stop();
  const backup = await copyDatabase(live);

  svc = await start(live, prefix);
  let t = api(svc.base, tenant.apiKey);
  assert.equal((await t.post('/v1/sessions/s1/reset')).status, 200);
  assert.deepEqual((await archive(t, 's1', ['b1', 'b2'])).messages, [
    { id: 'b1', seq: 3 },
    { id: 'b2', seq: 4 },
  ]);
  await svc.stop();
  const apiOnly = await start(live, prefix, 'api');
  t = api(apiOnly.base, tenant.apiKey);
  assert.equal((await t.post('/v1/sessions/s2/messages', { messages: [msg('c1')] })).status, 202);
  await apiOnly.stop();
  return { prefix, backup, apiKey: tenant.apiKey, tenantId: tenant.tenantId, errorId: e.body.id as string };
}

void describe('mnemos after-restore', () => {
  void test('after a restore, a reset clears a new id and its re-post is stored again at a new seq', async () => {
    const b = await backupThenMoveOn();
    const r = await runAfterRestore(b.prefix);
    assert.equal(r.status, 0, r.stderr);

    const svc = await start(b.backup, b.prefix);
    const t = api(svc.base, b.apiKey);
    const first = await archive(t, 's1', ['n1']);
    assert.equal(first.accepted, 1);
    const firstSeq = first.messages[0]!.seq;
    assert.equal((await t.post('/v1/sessions/s1/reset')).status, 200);
    // Without after-restore, Redis (at generation 1 already) skipped this reset's Redis step and
    // kept n1's id: the re-post was taken for a duplicate of the message the reset removed (409
    // session_cleared with ?wait=true, 202 `accepted: 0` without), and nothing was stored.
    const again = await archive(t, 's1', ['n1']);
    assert.equal(again.accepted, 1);
    assert.ok(again.messages[0]!.seq > firstSeq, JSON.stringify(again));
    assert.deepEqual(await stored(t, 's1'), again.messages);
  });

  void test('after a restore, archived ids keep their seqs, later ids are stored again, error memory and dead letters stay', async () => {
    const b = await backupThenMoveOn();
    const redis = new Redis(REDIS_URL);
    cleanups.push(async () => redis.disconnect());
    const p = b.prefix;
    const s1 = `${b.tenantId}:s1`;
    // Per-session keys the service writes only in some paths, planted: a relevance judgement and
    // a staged import. What must stay: a dead letter, a rate-limit counter, another prefix's state.
    await redis
      .multi()
      .hset(`${p}:ctxrel:${s1}`, '1:abc', '{}')
      .rpush(`${p}:impstage:${s1}:n0`, 'x')
      .hset(`${p}:impids:${s1}:n0`, 'x', '1 fp 0')
      .rpush(`${p}:dead:${s1}`, 'unreadable')
      .set(`${p}:rl:key1:1`, '3', 'EX', 120)
      .hset(`${p}x:sess:${s1}`, 'seq', '9')
      .exec();
    cleanups.push(async () => void (await redis.del(`${p}x:sess:${s1}`)));

    const r = await runAfterRestore(p, '--json');
    assert.equal(r.status, 0, r.stderr);
    assert.deepEqual(JSON.parse(r.stdout), {
      prefix: p,
      removed: { sess: 2, ids: 2, inbox: 1, armed: 1, ctxrel: 1, impstage: 1, impids: 1 },
      // c1, accepted by the API-only process and never archived.
      dropped_messages: 1,
    });
    const left = async (k: string) => (await redis.exists(k)) === 1;
    assert.equal(await left(`${p}:dead:${s1}`), true);
    assert.equal(await left(`${p}:rl:key1:1`), true);
    assert.equal(await left(`${p}x:sess:${s1}`), true);
    assert.equal(await left(`${p}:ingest:meta`), true);
    assert.equal(await left(`${p}:sess:${s1}`), false);

    const svc = await start(b.backup, p);
    const t = api(svc.base, b.apiKey);
    // Error memory lives only in Redis: the record written before the backup is still there.
    const e = await t.get(`/v1/errors/${b.errorId}`);
    assert.equal(e.status, 200, JSON.stringify(e.body));
    assert.equal(e.body.tool_name, 'psql');
    // An id the restored archive holds answers its archived seq.
    assert.deepEqual(await archive(t, 's1', ['a1']), {
      session_id: 's1',
      accepted: 0,
      messages: [{ id: 'a1', seq: 1 }],
    });
    // b1 was accepted after the backup: Redis remembered it at seq 3, and every `?wait=true`
    // re-post answered 503 "lost". Now it is stored, after the restored archive.
    assert.deepEqual(await archive(t, 's1', ['b1', 'n1']), {
      session_id: 's1',
      accepted: 2,
      messages: [
        { id: 'b1', seq: 3 },
        { id: 'n1', seq: 4 },
      ],
    });
    assert.deepEqual(await stored(t, 's1'), [
      { id: 'a1', seq: 1 },
      { id: 'a2', seq: 2 },
      { id: 'b1', seq: 3 },
      { id: 'n1', seq: 4 },
    ]);
    // c1 was dropped with its inbox: posted again, it is stored.
    assert.deepEqual(await stored(t, 's2'), []);
    assert.deepEqual((await archive(t, 's2', ['c1'])).messages, [{ id: 'c1', seq: 1 }]);
  });

  void test('refuses while a worker is connected, names it and exits non-zero; --force runs', async () => {
    const prefix = testPrefix();
    cleanups.push(() => deleteRedisPrefix(prefix));
    const db = await createTestDatabase();
    cleanups.push(() => dropTestDatabase(db));
    const redis = new Redis(REDIS_URL);
    cleanups.push(async () => redis.disconnect());
    await redis.hset(`${prefix}:sess:t1:s1`, 'seq', '5', 'gen', '0');

    const worker = await start(db, prefix, 'worker');
    const refused = await runAfterRestore(prefix);
    assert.equal(refused.status, 1, refused.stdout);
    assert.match(refused.stderr, /mnemos workers are connected to this Redis under prefix/);
    assert.match(refused.stderr, /queues ingest, .*maintenance/);
    assert.match(refused.stderr, /--force/);
    assert.equal(refused.stdout, '');
    assert.equal(await redis.exists(`${prefix}:sess:t1:s1`), 1);

    const forced = await runAfterRestore(prefix, '--force', '--json');
    assert.equal(forced.status, 0, forced.stderr);
    assert.equal(JSON.parse(forced.stdout).removed.sess, 1);
    assert.equal(await redis.exists(`${prefix}:sess:t1:s1`), 0);

    // Once the worker has stopped, its connections are gone and the check passes.
    await worker.stop();
    await redis.hset(`${prefix}:sess:t1:s1`, 'seq', '5', 'gen', '0');
    const r = await eventually(async () => {
      const run = await runAfterRestore(prefix);
      return run.status === 0 ? run : null;
    }, 10_000);
    assert.match(r.stdout, /removed the Redis state of 1 sessions/);
    assert.match(r.stdout, /no accepted message was waiting to be archived/);
  });

  void test('refuses when Redis does not list its clients (no CLIENT for its user); --force runs', async () => {
    // A private Redis: the shared one's users are left alone.
    const server = await startPrivateRedis();
    cleanups.push(() => server.stop());
    const admin = new Redis(server.url);
    cleanups.push(async () => admin.disconnect());
    await admin.call('ACL', 'SETUSER', 'restore', 'on', 'nopass', '~*', '&*', '+@all', '-client');
    await admin.hset('p1:sess:t1:s1', 'seq', '5', 'gen', '0');
    const url = `redis://restore@127.0.0.1:${server.port}`;

    const refused = await runAfterRestoreOn(url, 'p1');
    assert.equal(refused.status, 1, refused.stdout);
    assert.match(refused.stderr, /cannot tell whether mnemos workers are running: .*NOPERM/);
    assert.match(refused.stderr, /--force/);
    assert.equal(await admin.exists('p1:sess:t1:s1'), 1);

    const forced = await runAfterRestoreOn(url, 'p1', '--force');
    assert.equal(forced.status, 0, forced.stderr);
    assert.equal(await admin.exists('p1:sess:t1:s1'), 0);
  });
});
