// What managed Postgres and Redis refuse a service: a role that may not create extensions, an
// extension in a schema off the search_path, a Redis user without CONFIG.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { once } from 'node:events';
import { randomBytes } from 'node:crypto';
import { test } from 'node:test';
import { Redis } from 'ioredis';
import { pino } from 'pino';
import { migrate } from '../db/migrate.js';
import { makePgDb } from '../db/pool.js';
import { makeRedis, redisDurabilityWarnings, waitForRedis } from '../services/redis.js';
import {
  ADMIN_URL,
  createTestDatabase,
  dropTestDatabase,
  eventually,
  startTestService,
  testPrefix,
} from './support/harness.js';
import { startPrivateRedis } from './support/private-redis.js';

const runId = process.env.MNEMOS_TEST_RUN ?? 'local';

/** An empty database (no extension) owned by a new role that is no superuser, as on RDS. */
async function managedDatabase(setup?: string): Promise<{ url: string; cleanup(): Promise<void> }> {
  const name = `mnemos_t_${runId}_${randomBytes(4).toString('hex')}`;
  const role = `${name}_owner`;
  const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
  await admin.query(`CREATE ROLE "${role}" LOGIN NOSUPERUSER`);
  await admin.query(`CREATE DATABASE "${name}" OWNER "${role}" TEMPLATE template0`);
  await admin.close();
  const asAdmin = new URL(ADMIN_URL);
  asAdmin.pathname = `/${name}`;
  if (setup) {
    const db = makePgDb({ connectionString: asAdmin.toString(), max: 1 });
    await db.query(setup);
    await db.close();
  }
  const url = new URL(asAdmin);
  url.username = role;
  return {
    url: url.toString(),
    async cleanup() {
      await dropTestDatabase(asAdmin.toString());
      const a = makePgDb({ connectionString: ADMIN_URL, max: 1 });
      await a.query(`DROP ROLE IF EXISTS "${role}"`).catch(() => undefined);
      await a.close();
    },
  };
}

void test('a role that may not create the vector extension is told to have an admin create it', async () => {
  const m = await managedDatabase();
  const db = makePgDb({ connectionString: m.url, max: 1 });
  try {
    await assert.rejects(migrate(db), (err: Error & { code?: string }) => {
      assert.match(err.message, /permission denied to create extension "vector"/);
      assert.match(err.message, /migration 001_init/);
      assert.match(err.message, /have an admin run CREATE EXTENSION vector/);
      assert.equal(err.code, '42501');
      return true;
    });
  } finally {
    await db.close();
    await m.cleanup();
  }
});

void test('vector in a schema off the search_path: the error names the schema fix; with it, migrations run', async () => {
  const m = await managedDatabase(
    `CREATE SCHEMA extensions; GRANT USAGE ON SCHEMA extensions TO PUBLIC; CREATE EXTENSION vector SCHEMA extensions`,
  );
  const db = makePgDb({ connectionString: m.url, max: 1 });
  try {
    await assert.rejects(migrate(db), (err: Error) => {
      assert.match(err.message, /type "vector" does not exist/);
      assert.match(err.message, /search_path/);
      return true;
    });
    // As the error says (URLSearchParams would encode the space as `+`, which stays a `+`).
    const ok = makePgDb({
      connectionString: `${m.url}?options=-c%20search_path%3Dpublic,extensions`,
      max: 1,
    });
    try {
      const applied = await migrate(ok);
      assert.ok(applied.length > 10, applied.join());
    } finally {
      await ok.close();
    }
  } finally {
    await db.close();
    await m.cleanup();
  }
});

void test('a database not encoded in UTF8 is refused before any migration, saying how to make one', async () => {
  for (const encoding of ['LATIN1', 'SQL_ASCII']) {
    const name = `mnemos_t_${runId}_${randomBytes(4).toString('hex')}`;
    const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    await admin.query(
      `CREATE DATABASE "${name}" ENCODING '${encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0`,
    );
    await admin.close();
    const url = new URL(ADMIN_URL);
    url.pathname = `/${name}`;
    const db = makePgDb({ connectionString: url.toString(), max: 1 });
    try {
      await assert.rejects(migrate(db), (err: Error) => {
        assert.match(
          err.message,
          new RegExp(`database "${name}" is encoded in ${encoding}; mnemos needs UTF8`),
        );
        assert.match(err.message, /CREATE DATABASE <name> ENCODING 'UTF8' TEMPLATE template0/);
        return true;
      });
      const tables = await db.query(`SELECT 1 FROM pg_tables WHERE schemaname = 'public'`);
      assert.equal(tables.rows.length, 0, `${encoding}: nothing created`);
    } finally {
      await db.close();
      await dropTestDatabase(url.toString());
    }
  }
});

void test('a Redis user refused CONFIG still gets the persistence and eviction warnings (from INFO)', async () => {
  const r = await startPrivateRedis();
  const admin = new Redis(r.url);
  try {
    await admin.config('SET', 'maxmemory-policy', 'allkeys-lru');
    await admin.call('ACL', 'SETUSER', 'app', 'on', '>pw-0123456789', '~*', '&*', '+@all', '-config');
    const user = new Redis(`redis://app:pw-0123456789@127.0.0.1:${r.port}`);
    try {
      await assert.rejects(user.config('GET', 'appendonly'), /NOPERM/);
      const warnings = await redisDurabilityWarnings(user);
      assert.equal(warnings.length, 2, warnings.join('\n'));
      assert.match(warnings[0]!, /without AOF/);
      assert.match(warnings[1]!, /maxmemory-policy is allkeys-lru/);
    } finally {
      user.disconnect();
    }
  } finally {
    admin.disconnect();
    await r.stop();
  }
});

void test('a database Redis refuses in REDIS_URL stops the start, naming it, and nothing goes to database 0', async () => {
  // Setup: a Redis with the default 16 databases (0-15).
  const r = await startPrivateRedis();
  const url = await createTestDatabase();
  try {
    // Action
    const run = spawnSync(process.execPath, ['bin/mnemos.js', 'serve'], {
      env: {
        ...process.env,
        DATABASE_URL: url,
        REDIS_URL: `${r.url}/16`,
        MNEMOS_PREFIX: testPrefix(),
        PORT: '0',
        LOG_LEVEL: 'silent',
      },
      encoding: 'utf8',
      timeout: 60_000,
    });

    // Assert: it exits with the reason, before its banner (it ran in database 0, ready).
    assert.equal(run.status, 1, run.stdout + run.stderr);
    assert.match(
      run.stderr,
      /Redis refused to select database 16 of REDIS_URL \(ERR DB index is out of range\)/,
    );
    assert.doesNotMatch(run.stdout, /listening/);
    const admin = new Redis(r.url);
    try {
      assert.equal(await admin.dbsize(), 0);
    } finally {
      admin.disconnect();
    }
  } finally {
    await r.stop();
    await dropTestDatabase(url);
  }
});

void test('waiting for Redis names the database it refuses, refused before the wait or during it', async () => {
  // Setup: a Redis with the default 16 databases (0-15), and a REDIS_URL naming database 16.
  const r = await startPrivateRedis();
  const url = `${r.url}/16`;
  const refused = /Redis refused to select database 16 of REDIS_URL \(ERR DB index is out of range\)/;
  const during = makeRedis(url, 'producer');
  const before = makeRedis(url, 'producer');
  try {
    // Refused while waiting: at once, not after the wait as an unreachable Redis.
    await assert.rejects(waitForRedis(during, 30_000), refused);
    // Refused twice before the wait (the next reconnect is 400 ms away): at once, not after it.
    await once(before, 'error');
    await once(before, 'error');
    await assert.rejects(waitForRedis(before, 100), refused);
  } finally {
    during.disconnect();
    before.disconnect();
    await r.stop();
  }
});

void test('waiting for Redis says at once that it refused the login, not that it cannot be reached', async () => {
  // Setup: a Redis that wants a password.
  const r = await startPrivateRedis();
  const admin = new Redis(r.url);
  await admin.config('SET', 'requirepass', 'right-0123456789');
  admin.disconnect();
  const wrong = makeRedis(`redis://:wrong-0123456789@127.0.0.1:${r.port}`, 'producer');
  const none = makeRedis(r.url, 'producer');
  try {
    // Action and assert: refused, long before the wait's end ("cannot reach Redis (is it running?)").
    const started = Date.now();
    await assert.rejects(waitForRedis(wrong, 30_000), /^Error: Redis refused mnemos's login \(WRONGPASS/);
    await assert.rejects(waitForRedis(none, 30_000), /Redis refused mnemos's login \(NOAUTH/);
    assert.ok(Date.now() - started < 15_000, `${Date.now() - started} ms`);
  } finally {
    wrong.disconnect();
    none.disconnect();
    const admin2 = new Redis(r.url, { password: 'right-0123456789' });
    await admin2.config('SET', 'requirepass', '');
    admin2.disconnect();
    await r.stop();
  }
});

void test('a connection that comes back refused its database writes nothing to database 0, and goes on once allowed', async () => {
  // Setup: a user whose connections (the API's, a worker's and BullMQ's copy of it) use database 5.
  const r = await startPrivateRedis();
  const admin = new Redis(r.url);
  const userUrl = `redis://app:pw-0123456789@127.0.0.1:${r.port}/5`;
  await admin.call('ACL', 'SETUSER', 'app', 'on', '>pw-0123456789', '~*', '&*', '+@all');
  const producer = makeRedis(userUrl, 'producer');
  const worker = makeRedis(userUrl, 'worker');
  const copy = worker.duplicate();
  const clients = { producer, worker, copy };
  try {
    for (const c of Object.values(clients)) await eventually(async () => c.status === 'ready', 10_000);

    // Action: SELECT taken away, and every connection cut.
    await admin.call('ACL', 'SETUSER', 'app', '-select');
    await admin.call('CLIENT', 'KILL', 'USER', 'app');

    // Assert: reconnects fail their SELECT; nothing they are asked lands in database 0 (it did,
    // on connections that ioredis reported restored).
    await new Promise((resolve) => setTimeout(resolve, 1500));
    for (const [name, c] of Object.entries(clients)) {
      await Promise.race([
        c.set(`refused:${name}`, '1').catch(() => undefined),
        new Promise((resolve) => setTimeout(resolve, 1000)),
      ]);
    }
    assert.equal(await admin.dbsize(), 0);

    // Once SELECT is allowed again, each connection reconnects into database 5.
    await admin.call('ACL', 'SETUSER', 'app', '+select');
    for (const [name, c] of Object.entries(clients)) {
      await eventually(
        async () => (await c.set(`allowed:${name}`, '1').catch(() => null)) === 'OK',
        15_000,
        name,
      );
    }
    await admin.select(5);
    assert.deepEqual((await admin.keys('allowed:*')).sort(), [
      'allowed:copy',
      'allowed:producer',
      'allowed:worker',
    ]);
    await admin.select(0);
    assert.equal(await admin.dbsize(), 0);
  } finally {
    for (const c of Object.values(clients)) c.disconnect();
    admin.disconnect();
    await r.stop();
  }
});

void test('a Redis user without EVAL is refused at start, naming it; losing it later makes posts a 503, the log naming it', async () => {
  // Setup: a user with every command but EVAL, which ioredis, BullMQ and error memory fall back to
  // when Redis has lost their scripts.
  const r = await startPrivateRedis();
  const admin = new Redis(r.url);
  await admin.call('ACL', 'SETUSER', 'app', 'on', '>pw-0123456789', '~*', '&*', '+@all', '-eval');
  const env = { REDIS_URL: `redis://app:pw-0123456789@127.0.0.1:${r.port}` };
  try {
    // Action and Assert: the start stops, naming the command and the README's list.
    await assert.rejects(startTestService({ mode: 'api', env }), (err: Error) => {
      assert.match(err.message, /Redis refused mnemos's user the command EVAL \(NOPERM [^)]*'eval'/);
      assert.match(err.message, /README/);
      return true;
    });

    // Setup: allowed at start, refused once running, and Redis's scripts gone (a restart, a flush).
    await admin.call('ACL', 'SETUSER', 'app', '+eval');
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino({ level: 'warn' }, { write: (line: string) => void lines.push(JSON.parse(line)) });
    const svc = await startTestService({ mode: 'api', env, logger });
    try {
      const t = await svc.newTenant();
      const post = () =>
        t.api.post('/v1/sessions/s1/messages', { messages: [{ role: 'user', content: 'hi' }] });
      assert.equal((await post()).status, 202);
      await admin.call('ACL', 'SETUSER', 'app', '-eval');
      await admin.script('FLUSH');

      // Action
      const refused = await post();

      // Assert: a dependency refusing (503, retry-after), not a server fault (it was a 500). The
      // client is told what other Redis 503s tell it, not Redis's commands and users (it was); the
      // log names the command.
      assertRedisRefusal(refused, lines, /NOPERM .*'eval'/);
    } finally {
      await svc.stop();
    }
  } finally {
    admin.disconnect();
    await r.stop();
  }
});

/**
 * A Redis refusal answered as a dependency refusing (503 with retry-after, as other Redis 503s:
 * not naming Redis's commands or users), with what Redis refused in the log line's redis_error.
 */
function assertRedisRefusal(
  refused: { status: number; body: any; headers: Headers },
  lines: Array<Record<string, unknown>>,
  logged: RegExp,
): void {
  assert.equal(refused.status, 503, JSON.stringify(refused.body));
  assert.deepEqual(refused.body.error, {
    code: 'unavailable',
    message: 'redis is unavailable, retry later',
    details: { dependency: 'redis' },
  });
  assert.ok(Number(refused.headers.get('retry-after')) > 0, 'retry-after');
  const line = lines.find((l) => l.code === 'unavailable');
  assert.match(String(line?.redis_error), logged, JSON.stringify(lines));
}

void test("a Redis user refused a command mnemos's scripts call makes posts a 503, not a 500", async () => {
  // Setup: a user with everything but RPUSH and LPUSH, which the scripts queueing a post call
  // (Redis 7.0 refuses them inside a script without the NOPERM word: "ERR The user executing the
  // script can't run this command"); the start checks only EVAL and EVALSHA, and lets it start.
  const r = await startPrivateRedis();
  const admin = new Redis(r.url);
  await admin.call('ACL', 'SETUSER', 'app', 'on', '>pw-0123456789', '~*', '&*', '+@all', '-rpush', '-lpush');
  const lines: Array<Record<string, unknown>> = [];
  const logger = pino({ level: 'warn' }, { write: (line: string) => void lines.push(JSON.parse(line)) });
  const env = { REDIS_URL: `redis://app:pw-0123456789@127.0.0.1:${r.port}` };
  const svc = await startTestService({ mode: 'api', env, logger });
  try {
    const t = await svc.newTenant();

    // Action
    const refused = await t.api.post('/v1/sessions/s1/messages', {
      messages: [{ role: 'user', content: 'hi' }],
    });

    // Assert: a dependency refusing (it was a 500 internal); the log says what Redis refused.
    assertRedisRefusal(refused, lines, /can't run this command|ACL failure in script/);
  } finally {
    await svc.stop();
    admin.disconnect();
    await r.stop();
  }
});

for (const command of ['EVAL', 'EVALSHA']) {
  void test(`a Redis with ${command} disabled for everyone (rename-command) is refused at start, saying so`, async () => {
    // Setup: as some managed Redis do; every post answered 500 ("ERR unknown command 'eval'").
    const r = await startPrivateRedis({ args: ['--rename-command', command, ''] });
    try {
      // Action and Assert
      await assert.rejects(startTestService({ mode: 'api', env: { REDIS_URL: r.url } }), (err: Error) => {
        assert.match(err.message, new RegExp(`^Redis has no command ${command} \\(ERR unknown command`));
        assert.match(err.message, /disabled or renamed/);
        return true;
      });
    } finally {
      await r.stop();
    }
  });
}
