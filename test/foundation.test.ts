import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { after, before, describe, test } from 'node:test';
import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { request } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pino } from 'pino';
import { Redis } from 'ioredis';
import { MIGRATION_LOCK_KEY, loadMigrations, migrate } from '../db/migrate.js';
import { makePgDb } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import { loadConfig, ConfigError, shownUrl } from '../services/config.js';
import { listRoutes } from '../services/openapi.js';
import { makeKeyAuthenticator } from '../services/tenants.js';
import {
  ADMIN_TOKEN,
  ADMIN_URL,
  api,
  createTestDatabase,
  deleteRedisPrefix,
  dropTestDatabase,
  eventually,
  startTestService,
  testPrefix,
} from './support/harness.js';
import type { Res, TestService } from './support/harness.js';
import { freePort, startPrivateRedis } from './support/private-redis.js';

void describe('configuration', () => {
  void test('names every bad variable and how to fix it', () => {
    let err: unknown;
    try {
      loadConfig({
        PORT: 'eighty',
        REDIS_URL: 'localhost:6379',
        SUMMARY_CRON: 'often',
        EMBED_ROLES: 'user,robot',
        EMBED_CONCURRENCY: '0',
        PG_POOL_SIZE: 'many',
        REPLY_LANG: 'xx_YY',
      });
    } catch (e) {
      err = e;
    }
    assert.ok(err instanceof ConfigError, 'err instanceof ConfigError');
    const text = err.message;
    for (const name of [
      'PORT',
      'REDIS_URL',
      'SUMMARY_CRON',
      'EMBED_ROLES',
      'EMBED_CONCURRENCY',
      'PG_POOL_SIZE',
      'REPLY_LANG',
    ])
      assert.match(text, new RegExp(`${name}:`));
    // Tags as Intl reads them: canonical case, extensions allowed; a Chinese other than Taiwan's
    // is said to be written as zh-TW (SPEC §2), not silently.
    assert.equal(loadConfig({ REPLY_LANG: 'EN-gb' }).replyLang, 'en-GB');
    assert.equal(loadConfig({ REPLY_LANG: 'ja-JP-u-ca-japanese' }).replyLang, 'ja-JP-u-ca-japanese');
    assert.equal(loadConfig({ REPLY_LANG: '' }).replyLang, 'auto');
    assert.match(loadConfig({ REPLY_LANG: 'zh-CN' }).warnings.join('\n'), /REPLY_LANG=zh-CN: .*zh-TW/);
    assert.deepEqual(loadConfig({ REPLY_LANG: 'zh-TW' }).warnings, []);
    assert.deepEqual(loadConfig({ REPLY_LANG: 'zh-TW-u-nu-hanidec' }).warnings, []);
    assert.equal(loadConfig({ REPLY_LANG: 'AUTO' }).replyLang, 'auto');
    // Intl takes any word of 5–8 letters as a language; the prompt would say "Write in chinese".
    for (const word of ['chinese', 'english', 'und']) {
      assert.throws(() => loadConfig({ REPLY_LANG: word }), /REPLY_LANG: must be "auto" or a BCP-47 tag/);
    }
    // POSIX's colon forms of TZ, which Node reads (AWS Lambda sets `:UTC`).
    assert.equal(loadConfig({ TZ: ':UTC' }).timeZone, 'UTC');
    assert.equal(loadConfig({ TZ: ':Asia/Taipei' }).timeZone, 'Asia/Taipei');
    // A Redis database that is not a number, a broken percent-escape: named, not a stack trace.
    assert.throws(
      () => loadConfig({ REDIS_URL: 'redis://127.0.0.1:6379/abc' }),
      /REDIS_URL: the path is the database number/,
    );
    assert.throws(
      () => loadConfig({ REDIS_URL: 'redis://u:a%ZZb@127.0.0.1:6379' }),
      /REDIS_URL: has a malformed percent-escape/,
    );
    // A query, which ioredis reads and error memory's client does not (`?db=5` split one
    // deployment across databases 5 and 0): refused, saying where the database and password go.
    for (const query of ['?db=5', '/0?password=s3cret', '?username=app&password=s3cret', '?family=6']) {
      assert.throws(
        () => loadConfig({ REDIS_URL: `redis://127.0.0.1:6379${query}` }),
        (err: unknown) =>
          err instanceof ConfigError &&
          /REDIS_URL: has a \?query, .*the database number in the path \(redis:\/\/127\.0\.0\.1:6379\/5\) and the user name and password before the host/.test(
            err.message,
          ) &&
          !err.message.includes('s3cret'),
        query,
      );
    }
    assert.equal(
      loadConfig({ REDIS_URL: 'redis://app:pw@127.0.0.1:6379/5' }).redisUrl,
      'redis://app:pw@127.0.0.1:6379/5',
    );
    // A password in the query (ioredis reads `?password=`) is masked too.
    assert.equal(
      shownUrl('redis://127.0.0.1:1/0?password=s3cret&db=1'),
      'redis://127.0.0.1:1/0?password=***&db=1',
    );
    assert.match(text, /redis:\/\//);
    // A pattern of the right shape with values the scheduler would reject stops the start too.
    for (const pattern of ['99 * * * *', 'a b c d e', '0 0 32 * *', '0 0 * 13 *']) {
      assert.throws(
        () => loadConfig({ SUMMARY_CRON: pattern }),
        /SUMMARY_CRON: must be a cron pattern/,
        pattern,
      );
    }
    for (const pattern of ['0 */2 * * MON-FRI', '*/10 * * * * *', '0 0 L * *']) {
      assert.equal(loadConfig({ SUMMARY_CRON: pattern }).summaryCron, pattern);
    }
  });

  void test('DECISION_MODEL without an LLM is disabled with a warning, defaults follow SPEC §2', () => {
    const ignored = loadConfig({ DECISION_MODEL: 'gpt-4o-mini' });
    assert.equal(ignored.decisionModel, undefined);
    assert.match(ignored.warnings.join('\n'), /DECISION_MODEL is ignored without OPENAI_API_KEY/);
    assert.equal(
      loadConfig({ DECISION_MODEL: 'm', OPENAI_BASE_URL: 'http://127.0.0.1:1/v1' }).decisionModel,
      'm',
    );
    const c = loadConfig({});
    assert.deepEqual(c.warnings, []);
    assert.equal(c.port, 8080);
    assert.equal(c.host, '127.0.0.1');
    assert.equal(c.prefix, 'mnemos');
    assert.equal(c.maxHistoryMessages, 16);
    assert.equal(c.maxHistoryBytes, 4194304);
    assert.equal(c.summaryRunes, 32000);
    assert.equal(c.errorMemoryTtlDays, 90);
    assert.equal(c.usageRetentionDays, 35);
    // Shorter than the longest usage window would make GET /v1/usage?window=28d lose rows.
    assert.throws(
      () => loadConfig({ USAGE_RETENTION_DAYS: '27' }),
      /USAGE_RETENTION_DAYS: must be at least 28/,
    );
    assert.equal(loadConfig({ USAGE_RETENTION_DAYS: '400' }).usageRetentionDays, 400);
    assert.equal(c.workerConcurrency, 8);
    assert.equal(c.embedConcurrency, 2);
    assert.equal(c.pgPoolSize, 16);
    assert.deepEqual(c.embedding, { model: 'local-hash', dimensions: 384, local: true });
    assert.equal(c.llm.configured, false);
    const withLlm = loadConfig({ OPENAI_API_KEY: 'sk-x', SUMMARY_CRON: '*/5 * * * * *' });
    assert.deepEqual(withLlm.embedding, { model: 'text-embedding-3-small', dimensions: 1536, local: false });
    // local-hash is 384 by default whether or not an LLM is configured.
    assert.deepEqual(loadConfig({ OPENAI_API_KEY: 'sk-x', EMBEDDING_MODEL: 'local-hash' }).embedding, {
      model: 'local-hash',
      dimensions: 384,
      local: true,
    });
    assert.equal(
      loadConfig({ OPENAI_API_KEY: 'sk-x', EMBEDDING_MODEL: 'local-hash', EMBEDDING_DIMENSIONS: '256' })
        .embedding.dimensions,
      256,
    );
    assert.equal(withLlm.summaryCron, '*/5 * * * * *');
  });

  void test('a DATABASE_URL with a Unix socket directory and no host is taken, and connects', async () => {
    // Setup: where the machine's Postgres has its socket (none: only the parsing is checked).
    const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    const dirs = await admin
      .query<{ d: string }>(`SELECT current_setting('unix_socket_directories') AS d`)
      .finally(() => admin.close());
    const dir = dirs.rows[0]!.d.split(',')[0]!.trim();
    const port = new URL(ADMIN_URL).port || '5432';

    // Action / Assert: the forms node-postgres and libpq take are accepted as written.
    for (const url of [
      `postgres://postgres@/postgres?host=${dir}&port=${port}`,
      `postgresql://postgres:secret@/postgres?host=${dir}`,
      'postgres:///postgres?host=/var/run/postgresql',
    ]) {
      assert.equal(loadConfig({ DATABASE_URL: url }).databaseUrl, url);
    }
    // Junk is still refused, with how to fix it.
    assert.throws(
      () => loadConfig({ DATABASE_URL: 'postgres://u:a/b@/db?host=/tmp' }),
      /DATABASE_URL: is not a valid URL: percent-encode/,
    );
    assert.throws(
      () => loadConfig({ DATABASE_URL: 'postgres://u@h:99999/db' }),
      /DATABASE_URL: is not a valid URL/,
    );
    assert.throws(
      () => loadConfig({ DATABASE_URL: '/tmp mnemos' }),
      /DATABASE_URL: must be a URL starting with/,
    );
    if (!dir) return;
    // The CLI reaches a test database through the socket (it migrates what it opens).
    const url = await createTestDatabase();
    try {
      const database = new URL(url).pathname.slice(1);
      const viaSocket = spawnSync(process.execPath, ['bin/mnemos.js', 'tenant', 'create', 'over-socket'], {
        env: { ...process.env, DATABASE_URL: `postgres://postgres@/${database}?host=${dir}&port=${port}` },
        encoding: 'utf8',
        timeout: 30_000,
      });
      assert.equal(viaSocket.status, 0, viaSocket.stderr);
      const db = makePgDb({ connectionString: url, max: 1 });
      const names = await db.query('SELECT name FROM tenants').finally(() => db.close());
      assert.deepEqual(names.rows, [{ name: 'over-socket' }]);
    } finally {
      await dropTestDatabase(url);
    }
  });

  void test('the CLI stops at start-up with the variable name and a non-zero exit', () => {
    const r = spawnSync(process.execPath, ['bin/mnemos.js', 'serve'], {
      env: { ...process.env, PORT: 'abc', MNEMOS_PREFIX: 'has:colon' },
      encoding: 'utf8',
      timeout: 30_000,
    });
    assert.notEqual(r.status, 0);
    assert.match(r.stderr, /PORT: must be a whole number/);
    assert.match(r.stderr, /MNEMOS_PREFIX:/);
    // A password that breaks the URL says how to write it.
    const slash = spawnSync(process.execPath, ['bin/mnemos.js', 'migrate'], {
      env: { ...process.env, DATABASE_URL: 'postgres://mnemos:ab/cd+ef=@postgres:5432/mnemos' },
      encoding: 'utf8',
      timeout: 30_000,
    });
    assert.notEqual(slash.status, 0);
    assert.match(slash.stderr, /DATABASE_URL: is not a valid URL: percent-encode .*\(\/ as %2F/);
    // A Postgres that cannot be reached names the setting to check.
    for (const url of [
      'postgres://postgres@127.0.0.1:1/x',
      'postgres://postgres@nohost.invalid/x',
      // A socket directory without Postgres's socket (ENOENT).
      'postgres://postgres@/x?host=/nonexistent-socket-dir',
    ]) {
      const down = spawnSync(process.execPath, ['bin/mnemos.js', 'tenant', 'list'], {
        env: { ...process.env, DATABASE_URL: url },
        encoding: 'utf8',
        timeout: 30_000,
      });
      assert.equal(down.status, 1, down.stderr);
      assert.match(down.stderr, /^mnemos: cannot reach Postgres \(DATABASE_URL\): /);
    }
    // An empty TZ (docker-compose.yml passes `TZ: ${TZ:-}` when none is set) is the process's own
    // zone, UTC: ICU names it `Etc/Unknown`, and every start stopped on "unknown time zone".
    const noZone = spawnSync(process.execPath, ['bin/mnemos.js', 'tenant', 'list'], {
      env: { ...process.env, TZ: '', DATABASE_URL: 'postgres://postgres@127.0.0.1:1/x' },
      encoding: 'utf8',
      timeout: 30_000,
    });
    assert.equal(noZone.status, 1, noZone.stderr);
    assert.match(noZone.stderr, /^mnemos: cannot reach Postgres \(DATABASE_URL\): /);
  });
});

void describe('migrations', () => {
  let url: string;
  before(async () => {
    const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    const name = `mnemos_t_${process.env.MNEMOS_TEST_RUN ?? `${Math.floor(Date.now() / 1000)}_x`}_mig${Date.now() % 100000}`;
    await admin.query(`CREATE DATABASE "${name}"`);
    await admin.close();
    const u = new URL(ADMIN_URL);
    u.pathname = `/${name}`;
    url = u.toString();
  });
  after(() => dropTestDatabase(url));

  void test('apply once when several processes start at the same time, and are idempotent', async () => {
    const dbs = Array.from({ length: 4 }, () => makePgDb({ connectionString: url, max: 1 }));
    const results = await Promise.all(dbs.map((db) => migrate(db)));
    const applied = results.flat();
    const all = (await loadMigrations()).map((m) => m.name);
    assert.deepEqual(applied, all, 'every migration applied exactly once, by one of the processes');
    assert.deepEqual(await migrate(dbs[0]!), []);
    const ledger = await dbs[0]!.query<{ n: number }>('SELECT count(*)::int AS n FROM schema_migrations');
    assert.equal(ledger.rows[0]!.n, all.length);
    const tables = await dbs[0]!.query<{ t: string }>(
      `SELECT table_name AS t FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1`,
    );
    for (const t of [
      'api_keys',
      'llm_usage',
      'message_vectors',
      'messages',
      'sessions',
      'summaries',
      'tenants',
    ]) {
      assert.ok(
        tables.rows.some((r) => r.t === t),
        `table ${t} exists`,
      );
    }
    await Promise.all(dbs.map((d) => d.close()));
  });

  void test('a migration waiting for a lock that a long transaction holds lets other writes to the table through', async () => {
    // Setup: a schema as an old process sees it, and an old process's long reset holding a row
    // of `sessions`; the new build brings a migration that needs a lock on the whole table.
    const db = makePgDb({ connectionString: url, max: 4 });
    await migrate(db);
    await db.query(`INSERT INTO tenants (id, name) VALUES ('t_lockwait', 'lockwait') ON CONFLICT DO NOTHING`);
    await db.query(
      `INSERT INTO sessions (tenant_id, id) VALUES ('t_lockwait', 'held'), ('t_lockwait', 'other')
       ON CONFLICT DO NOTHING`,
    );
    const withIndex = [
      ...(await loadMigrations()),
      {
        version: 900,
        name: '900_sessions_by_count',
        sql: 'CREATE INDEX sessions_by_count ON sessions (message_count)',
      },
    ];
    let release!: () => void;
    const released = new Promise<void>((r) => (release = r));
    let holding!: () => void;
    const held = new Promise<void>((r) => (holding = r));
    const blocker = db.transaction(async (tx) => {
      await tx.query(
        `UPDATE sessions SET message_count = message_count + 1 WHERE tenant_id = 't_lockwait' AND id = 'held'`,
      );
      holding();
      await released;
    });
    await held;
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino(
      { level: 'warn' },
      { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) },
    );
    try {
      // Action: migrate, and once its lock request on sessions is queued, write another session.
      // (This database's: pg_locks is cluster-wide, and the test databases share their oids.)
      const migrating = migrate(db, withIndex, { logger });
      await eventually(
        async () =>
          (
            await db.query(
              `SELECT 1 FROM pg_locks WHERE relation = 'sessions'::regclass AND NOT granted AND mode = 'ShareLock'
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`,
            )
          ).rows.length > 0,
        15_000,
        'the migration waiting for its lock on sessions',
      );
      const written = await Promise.race([
        db
          .query(`UPDATE sessions SET message_count = 7 WHERE tenant_id = 't_lockwait' AND id = 'other'`)
          .then(() => 'written'),
        new Promise<string>((r) => setTimeout(() => r('still waiting after 30 s'), 30_000).unref()),
      ]);
      assert.equal(written, 'written', "another session's write is not queued behind the migration");
      // Past its deadline, a migration that keeps giving way fails, naming itself and the cause.
      const gaveUp = await migrate(db, withIndex, { lockWaitMs: 2000 }).then(
        () => null,
        (err: Error & { code?: string }) => err,
      );
      release();
      await blocker;
      const applied = await migrating;

      // Assert
      assert.equal(gaveUp?.code, '55P03');
      assert.match(
        gaveUp?.message ?? '',
        /^migration 900_sessions_by_count could not take a lock it needs in 2 s of trying: a long transaction holds a lock/,
      );
      assert.deepEqual(applied, ['900_sessions_by_count'], 'applied once the long transaction ended');
      const ledger = await db.query<{ n: number }>(
        'SELECT count(*)::int AS n FROM schema_migrations WHERE version = 900',
      );
      assert.equal(ledger.rows[0]!.n, 1);
      const index = await db.query(`SELECT 1 FROM pg_indexes WHERE indexname = 'sessions_by_count'`);
      assert.equal(index.rows.length, 1);
      assert.ok(
        lines.some(
          (l) =>
            l.msg ===
            'migration 900_sessions_by_count gave way to a transaction holding a lock it needs; trying again',
        ),
        JSON.stringify(lines),
      );
    } finally {
      release();
      await blocker.catch(() => undefined);
      await db.close();
    }
  });

  void test("a role's statement_timeout does not cut the wait for another process's migration", async () => {
    // Setup: connections whose statement_timeout is 300 ms (as a role or database may set), and
    // another process holding the migration lock for longer.
    const timed = new URL(url);
    timed.searchParams.set('options', '-c statement_timeout=300');
    const db = makePgDb({ connectionString: timed.toString(), max: 2 });
    const other = makePgDb({ connectionString: url, max: 1 });
    await migrate(db);
    const withTable = [
      ...(await loadMigrations()),
      { version: 901, name: '901_waits_its_turn', sql: 'CREATE TABLE waits_its_turn (id int)' },
    ];
    let release!: () => void;
    let holding!: () => void;
    const held = new Promise<void>((r) => (holding = r));
    const migrating = other.transaction(async (tx) => {
      await tx.query('SELECT pg_advisory_xact_lock($1)', [MIGRATION_LOCK_KEY]);
      holding();
      await new Promise<void>((r) => (release = r));
    });
    try {
      await held;
      // Action: this process migrates while the other holds the lock for 1.5 s.
      const applying = migrate(db, withTable);
      setTimeout(() => release(), 1500).unref();
      const applied = await applying.catch((err: Error) => err.message);

      // Assert: it waited (before, "canceling statement due to statement timeout" after 300 ms).
      assert.deepEqual(applied, ['901_waits_its_turn']);
    } finally {
      release?.();
      await migrating.catch(() => undefined);
      await other.close();
      await db.close();
    }
  });

  void test('the CLI migrate command names what it applied, then reports an up-to-date schema, or one ahead of it', async () => {
    const fresh = new URL(url);
    fresh.pathname = `${fresh.pathname}_cli`;
    const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    await admin.query(`CREATE DATABASE "${fresh.pathname.slice(1)}"`);
    await admin.close();
    try {
      const run = () =>
        spawnSync(process.execPath, ['bin/mnemos.js', 'migrate'], {
          env: { ...process.env, DATABASE_URL: fresh.toString() },
          encoding: 'utf8',
          timeout: 30_000,
        });
      const first = run();
      assert.equal(first.status, 0, first.stderr);
      const names = (await loadMigrations()).map((m) => m.name);
      assert.equal(first.stdout.trim(), `applied: ${names.join(', ')}`);
      const second = run();
      assert.equal(second.status, 0, second.stderr);
      assert.match(second.stdout, /schema is up to date/);
      assert.equal(second.stderr, '');
      // A newer mnemos migrated it (a rollback): said so, not "up to date".
      const db = makePgDb({ connectionString: fresh.toString(), max: 1 });
      await db.query(`INSERT INTO schema_migrations (version, name) VALUES (999, '999_from_the_future')`);
      await db.close();
      const third = run();
      assert.equal(third.status, 0, third.stderr);
      assert.match(third.stdout, /schema is ahead of this build/);
      assert.match(third.stderr, /does not know \(999_from_the_future\): a newer mnemos migrated it/);
    } finally {
      await dropTestDatabase(fresh.toString());
    }
  });
});

void describe('tenants, keys and the admin API', () => {
  let svc: TestService;
  before(async () => {
    svc = await startTestService({ mode: 'api' });
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
  });
  const admin = () => api(svc.base, ADMIN_TOKEN);

  void test('a process that cannot listen or reach Redis says why and exits non-zero, never "listening"', async () => {
    const run = (env: Record<string, string>) =>
      new Promise<{ code: number | null; out: string }>((resolve) => {
        const child = spawn(process.execPath, ['bin/mnemos.js', 'api'], {
          env: {
            ...process.env,
            DATABASE_URL: svc.config.databaseUrl!,
            // The database's own prefix: another one is refused before any of this is tried.
            MNEMOS_PREFIX: svc.config.prefix,
            LOG_LEVEL: 'silent',
            ...env,
          },
        });
        let out = '';
        child.stdout.on('data', (d: Buffer) => (out += d.toString()));
        child.stderr.on('data', (d: Buffer) => (out += d.toString()));
        const timer = setTimeout(() => child.kill('SIGKILL'), 60_000);
        child.on('exit', (code) => {
          clearTimeout(timer);
          resolve({ code, out });
        });
      });
    // This service's own port is taken.
    const taken = await run({ PORT: new URL(svc.base).port });
    assert.equal(taken.code, 1, taken.out);
    assert.match(taken.out, /cannot listen on .*the port is in use \(PORT\)/);
    assert.doesNotMatch(taken.out, /listening on/);
    // A HOST that is no address or host name at all is a configuration error (exit 78) before
    // anything is reached; a host name that does not resolve fails at the listen, naming HOST.
    const badHost = await run({ PORT: '0', HOST: 'not a host!!' });
    assert.equal(badHost.code, 78, badHost.out);
    assert.match(badHost.out, /HOST: must be an IP address .* or a host name/);
    assert.doesNotMatch(badHost.out, /listening on|cannot listen/);
    const unknownHost = await run({ PORT: '0', HOST: 'no-such-host.invalid' });
    assert.equal(unknownHost.code, 1, unknownHost.out);
    assert.match(unknownHost.out, /cannot listen on no-such-host\.invalid:0: HOST/);
    assert.doesNotMatch(unknownHost.out, /listening on/);
    // A Redis that cannot be reached is named without its password (SPEC §8).
    const noRedis = await run({ PORT: '0', REDIS_URL: 'redis://ops:s3cretRedisPw@127.0.0.1:1/0' });
    assert.equal(noRedis.code, 1, noRedis.out);
    assert.match(noRedis.out, /cannot reach Redis at redis:\/\/ops:\*\*\*@127\.0\.0\.1:1\/0 /);
    assert.doesNotMatch(noRedis.out, /s3cretRedisPw/);
  });

  void test('a tenant created by the admin API gets a working key shown once; keys list without secrets', async () => {
    const created = await admin().post('/v1/admin/tenants', { name: 'acme' });
    assert.equal(created.status, 201);
    assert.match(created.body.tenant_id, /^t_[a-z2-7]{16}$/);
    assert.match(created.body.api_key, /^mn_[a-z2-7]{12}_[A-Za-z0-9]{40}$/);
    const tenantApi = api(svc.base, created.body.api_key);
    assert.equal((await tenantApi.get('/v1/sessions')).status, 200);

    const dup = await admin().post('/v1/admin/tenants', { name: 'acme' });
    assert.equal(dup.status, 409);

    const second = await admin().post(`/v1/admin/tenants/${created.body.tenant_id}/keys`, { name: 'ci' });
    assert.equal(second.status, 201);
    const keys = await admin().get(`/v1/admin/tenants/${created.body.tenant_id}/keys`);
    assert.equal(keys.status, 200);
    assert.equal(keys.body.keys.length, 2);
    assert.ok(
      !JSON.stringify(keys.body).includes(created.body.api_key.split('_')[2]),
      'no secret in listings',
    );
    const listed = await admin().get('/v1/admin/tenants');
    assert.ok(
      listed.body.tenants.some((t: { name: string }) => t.name === 'acme'),
      "listed.body.tenants.some((t: { name: string }) => t.name === 'acme')",
    );

    // Revocation takes effect on the next request, also for a key in use: its verification is
    // cached (KEY_CACHE_MS), and a revocation in this process drops that cache at once.
    const secondApi = api(svc.base, second.body.api_key);
    assert.equal((await secondApi.get('/v1/sessions')).status, 200);
    assert.equal((await admin().del(`/v1/admin/keys/${second.body.key_id}`)).status, 204);
    assert.equal(
      (await secondApi.get('/v1/sessions')).status,
      401,
      'a revoked key in use is refused at once',
    );
    assert.equal((await tenantApi.get('/v1/sessions')).status, 200, 'other keys keep working');
    assert.equal((await admin().del(`/v1/admin/keys/${second.body.key_id}`)).status, 404);
  });

  void test('a key read from the database before its revocation here is not cached after it', async () => {
    const created = await admin().post('/v1/admin/tenants', { name: 'revoke-race' });
    const keyId = (created.body.api_key as string).split('_')[1]!;
    // The key's row is read, then its answer is held back while the key is revoked.
    let hold: Promise<void> | null = null;
    let release!: () => void;
    let read!: () => void;
    // Revoked once the row is read (a fixed 100 ms pause let a slow read see the revocation).
    const wasRead = new Promise<void>((r) => (read = r));
    const gated: Db = {
      ...svc.deps.db,
      query: (async (text: string, params?: unknown[], opts?: Parameters<Db['query']>[2]) => {
        const r = await svc.deps.db.query(text, params, opts);
        if (hold && text.includes('FROM api_keys WHERE id')) {
          read();
          await hold;
        }
        return r;
      }) as Db['query'],
    };
    const keys = makeKeyAuthenticator(gated);
    hold = new Promise<void>((r) => (release = r));
    const before = keys.authenticate(created.body.api_key);
    await wasRead;
    await svc.deps.db.query('UPDATE api_keys SET revoked_at = now() WHERE id = $1', [keyId]);
    keys.clear();
    release();
    hold = null;
    assert.notEqual(await before, null, 'the read that began before answers its own request');
    assert.equal(await keys.authenticate(created.body.api_key), null, 'and is not trusted afterwards');
  });

  void test('admin routes refuse query parameters they do not know; a tenant is erased by id or name', async () => {
    const made = await admin().post('/v1/admin/tenants?dry_run=1', { name: 'query-probe' });
    assert.equal(made.status, 400);
    assert.equal(made.body.error.details.problems[0].path, 'dry_run');
    const t = await admin().post('/v1/admin/tenants', { name: 'query-probe' });
    assert.equal(t.status, 201);
    assert.equal((await admin().post(`/v1/admin/tenants/${t.body.tenant_id}/keys?x=1`, {})).status, 400);
    assert.equal((await admin().del(`/v1/admin/tenants/query-probe?force=true`)).status, 400);
    const listed = async () =>
      (await admin().get('/v1/admin/tenants?limit=500')).body.tenants.map((x: { name: string }) => x.name);
    assert.ok((await listed()).includes('query-probe'), 'the refused requests changed nothing');
    // By name, as the key routes and the CLI take it: then the id is gone too.
    assert.equal((await admin().del('/v1/admin/tenants/query-probe')).status, 204);
    assert.equal((await admin().del(`/v1/admin/tenants/${t.body.tenant_id}`)).status, 404);
    assert.ok(!(await listed()).includes('query-probe'), "!(await listed()).includes('query-probe')");
  });

  void test('admin lists page with cursor and limit, oldest first; names are never blank or id-shaped', async () => {
    const made: string[] = [];
    for (let i = 0; i < 5; i++)
      made.push((await admin().post('/v1/admin/tenants', { name: `pager-${i}` })).body.tenant_id);
    const all = (await admin().get('/v1/admin/tenants?limit=500')).body.tenants.map(
      (t: { tenant_id: string }) => t.tenant_id,
    );
    const seen: string[] = [];
    let cursor: string | null = null;
    for (let pages = 0; pages < 100; pages++) {
      const r: Res = await admin().get(`/v1/admin/tenants?limit=2${cursor ? `&cursor=${cursor}` : ''}`);
      assert.equal(r.status, 200);
      assert.ok(r.body.tenants.length <= 2, 'r.body.tenants.length <= 2');
      seen.push(...r.body.tenants.map((t: { tenant_id: string }) => t.tenant_id));
      cursor = r.body.next;
      if (!cursor) break;
    }
    assert.deepEqual(seen, all, 'every tenant once, in the same order as one big page');
    assert.deepEqual(
      all.filter((id: string) => made.includes(id)),
      made,
      'oldest first',
    );
    // A cursor's time past what Postgres's bigint and interval hold is bad input too, not a 500.
    const huge = Buffer.from('9999999999999999999:x').toString('base64url');
    for (const bad of ['limit=0', 'limit=501', 'limit=x', 'cursor=bm9wZQ', `cursor=${huge}`, 'colour=red']) {
      const r = await admin().get(`/v1/admin/tenants?${bad}`);
      assert.equal(r.status, 400, bad);
      assert.equal(r.body.error.code, 'validation_failed');
    }
    // The parameter is named as on every other list.
    const notCursor = await admin().get('/v1/admin/tenants?cursor=bm9wZQ');
    assert.deepEqual(notCursor.body.error.details.problems, [
      { path: 'cursor', message: 'not a cursor of this list' },
    ]);
    assert.equal(notCursor.body.error.message, 'cursor: not a cursor of this list');
    // Keys page the same way, by tenant id or name.
    for (let i = 0; i < 2; i++) await admin().post(`/v1/admin/tenants/${made[0]}/keys`, { name: `k${i}` });
    const first = await admin().get('/v1/admin/tenants/pager-0/keys?limit=2');
    assert.deepEqual(
      first.body.keys.map((k: { name: string }) => k.name),
      ['default', 'k0'],
    );
    const rest = await admin().get(`/v1/admin/tenants/${made[0]}/keys?limit=2&cursor=${first.body.next}`);
    assert.deepEqual(
      rest.body.keys.map((k: { name: string }) => k.name),
      ['k1'],
    );
    assert.equal(rest.body.next, null);
    const whole = await admin().get(`/v1/admin/tenants/${made[0]}/keys?limit=3`);
    assert.equal(whole.body.keys.length, 3);
    assert.equal(whole.body.next, null, 'a full last page has no next');
    assert.equal((await admin().get('/v1/admin/tenants/nobody/keys')).status, 404);
    // Names are what --tenant <id|name> resolves.
    for (const name of ['', '   ', made[1]]) {
      const r = await admin().post('/v1/admin/tenants', { name });
      assert.equal(r.status, 400, JSON.stringify(name));
    }
    // The same rules as the CLI's `tenant create`: nothing altered, nothing stored, never a 500.
    const before = (await admin().get('/v1/admin/tenants?limit=500')).body.tenants.length;
    for (const [name, problem] of [
      ['a\u0000b', /control characters/],
      ['a\ud800b', /lone surrogates/],
      ['line\nbreak', /control characters/],
      // Names that would show as another in a list.
      ['ac\u200bme', /invisible characters/],
      ['acme\u00ad', /invisible characters/],
      ['acme\u202egnp', /direction overrides/],
      ['\u2066acme\u2069', /direction overrides/],
      [' lead', /start or end with spaces/],
      ['trail ', /start or end with spaces/],
      ['x'.repeat(129), /at most 128 characters/],
    ] as const) {
      const r = await admin().post('/v1/admin/tenants', { name });
      assert.equal(r.status, 400, JSON.stringify(name));
      assert.match(r.body.error.message, problem, JSON.stringify(name));
    }
    // 128 characters are code points: 128 emoji (256 UTF-16 units) are a valid name.
    const emoji = await admin().post('/v1/admin/tenants', { name: '😀'.repeat(128) });
    assert.equal(emoji.status, 201, emoji.text);
    // Key names too: 128 emoji are a valid key name, 129 are not.
    const emojiKey = await admin().post(`/v1/admin/tenants/${emoji.body.tenant_id}/keys`, {
      name: '😀'.repeat(128),
    });
    assert.equal(emojiKey.status, 201, emojiKey.text);
    const longKey = await admin().post(`/v1/admin/tenants/${emoji.body.tenant_id}/keys`, {
      name: '😀'.repeat(129),
    });
    assert.equal(longKey.status, 400, longKey.text);
    // Joiners are parts of words and emoji: a family emoji and a Persian word are names.
    for (const name of ['👩\u200d👩\u200d👧 team', 'می\u200cخواهم']) {
      const joined = await admin().post('/v1/admin/tenants', { name });
      assert.equal(joined.status, 201, joined.text);
      const listed = await admin().get(`/v1/admin/tenants/${encodeURIComponent(name)}/keys`);
      assert.equal(listed.status, 200, `the name resolves: ${listed.text}`);
    }
    const bad = await admin().post(`/v1/admin/tenants/${made[0]}/keys`, { name: 'k\u0000' });
    assert.equal(bad.status, 400);
    assert.equal(bad.body.error.code, 'validation_failed');
    const hidden = await admin().post(`/v1/admin/tenants/${made[0]}/keys`, { name: 'ci\u202e' });
    assert.equal(hidden.status, 400);
    assert.match(hidden.body.error.message, /direction overrides/);
    // A blank key name, or one with spaces around it, lists like another or like none.
    for (const name of ['  ', ' ci', 'ci ']) {
      const r = await admin().post(`/v1/admin/tenants/${made[0]}/keys`, { name });
      assert.equal(r.status, 400, JSON.stringify(name));
      assert.match(r.body.error.message, /^name: must not (be blank|start or end with spaces)/);
    }
    // A JSON null is not an object (no body at all is): no key is made from it.
    const nullBody = await admin().raw(`/v1/admin/tenants/${made[0]}/keys`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: 'null',
    });
    assert.equal(nullBody.status, 400);
    assert.equal((await admin().get(`/v1/admin/tenants/a%00b/keys`)).status, 400);
    assert.equal((await admin().get('/v1/admin/tenants?limit=500')).body.tenants.length, before + 3);
    assert.equal((await admin().get(`/v1/admin/tenants/${made[0]}/keys?limit=500`)).body.keys.length, 3);
    // An empty cursor is the first page, on every list.
    const firstPage = await admin().get('/v1/admin/tenants?cursor=&limit=1');
    assert.equal(firstPage.status, 200);
    assert.deepEqual(firstPage.body, (await admin().get('/v1/admin/tenants?limit=1')).body);
    // README's `?cursor=&limit=` as written: both empty, the first page of the default size.
    const asWritten = await admin().get('/v1/admin/tenants?cursor=&limit=');
    assert.equal(asWritten.status, 200);
    assert.deepEqual(asWritten.body, (await admin().get('/v1/admin/tenants')).body);
    assert.equal((await admin().get('/v1/admin/tenants?limit=0')).status, 400);
  });

  void test('rejects missing, malformed, wrong-secret and unknown keys with 401', async () => {
    const t = await svc.newTenant();
    const [, id, secret] = t.apiKey.split('_') as [string, string, string];
    const wrongSecret = `mn_${id}_${secret.slice(0, -1)}${secret.endsWith('A') ? 'B' : 'A'}`;
    const unknownId = `mn_${'a'.repeat(12)}_${secret}`;
    for (const key of [undefined, 'garbage', wrongSecret, unknownId, `${t.apiKey}x`]) {
      const r = await api(svc.base, key).get('/v1/sessions');
      assert.equal(r.status, 401, `key ${key}`);
      assert.equal(r.body.error.code, 'unauthorized');
      // The challenge RFC 9110 asks of a 401: which scheme to authenticate with.
      assert.equal(r.headers.get('www-authenticate'), 'Bearer', `key ${key}`);
    }
  });

  void test('admin routes: 401 with a wrong token, 403 for a tenant key; Basic auth opens Bull Board', async () => {
    const t = await svc.newTenant();
    for (const r of [
      await api(svc.base, 'wrong-token-wrong-token').get('/v1/admin/tenants'),
      await api(svc.base).get('/v1/admin/tenants'),
    ]) {
      assert.equal(r.status, 401);
      assert.equal(r.headers.get('www-authenticate'), 'Bearer');
    }
    const asTenant = await api(svc.base, t.apiKey).get('/v1/admin/tenants');
    assert.equal(asTenant.status, 403);
    assert.equal(asTenant.body.error.code, 'forbidden');
    // Told by its form: a made-up key gets the same answer, which says what to send instead.
    const madeUp = await api(svc.base, 'mn_not_a_real_key').get('/v1/admin/tenants');
    assert.equal(madeUp.status, 403);
    assert.match(madeUp.body.error.message, /live or not.*send the admin token \(MNEMOS_ADMIN_TOKEN\)/);
    const basic = Buffer.from(`admin:${ADMIN_TOKEN}`).toString('base64');
    const board = await fetch(`${svc.base}/admin/queues`, { headers: { authorization: `Basic ${basic}` } });
    assert.equal(board.status, 200);
    assert.match(await board.text(), /<html/i);
    // Its pages change the queues: no other site may frame them.
    assert.equal(board.headers.get('x-frame-options'), 'DENY');
    assert.equal(board.headers.get('content-security-policy'), "frame-ancestors 'none'");
    const noAuth = await fetch(`${svc.base}/admin/queues`);
    assert.equal(noAuth.status, 401);
    assert.match(noAuth.headers.get('www-authenticate') ?? '', /Basic/);
  });

  void test('without MNEMOS_ADMIN_TOKEN the admin surface answers 404', async () => {
    const bare = await startTestService({ mode: 'api', env: { MNEMOS_ADMIN_TOKEN: undefined } });
    try {
      for (const path of ['/v1/admin/tenants', '/admin/queues']) {
        const r = await api(bare.base, ADMIN_TOKEN).get(path);
        assert.equal(r.status, 404, path);
        assert.equal(r.body.error.code, 'not_found');
        assert.equal(r.body.error.message, `no route for GET ${path}`);
      }
      const doc = (await api(bare.base).get('/openapi.json')).body;
      assert.deepEqual(
        Object.keys(doc.paths).filter((p) => p.startsWith('/v1/admin')),
        [],
        'not documented either',
      );
    } finally {
      await bare.stop();
      await deleteRedisPrefix(bare.config.prefix);
    }
  });

  void test('errors have one shape: malformed JSON 400, wrong content type 415, oversized 413, unknown route 404', async () => {
    const t = await svc.newTenant();
    const bad = await t.api.post('/v1/sessions/s/messages', '{"messages": [', {});
    assert.equal(bad.status, 400);
    assert.equal(bad.body.error.code, 'malformed_json');
    const text = await t.api.raw('/v1/sessions/s/messages', {
      method: 'POST',
      headers: { 'content-type': 'text/plain' },
      body: 'hello',
    });
    assert.equal(text.status, 415);
    assert.equal(text.body.error.code, 'unsupported_media_type');
    const huge = await t.api.post('/v1/sessions/s/messages', {
      messages: [{ role: 'user', content: 'x'.repeat(9 * 1024 * 1024) }],
    });
    assert.equal(huge.status, 413);
    assert.equal(huge.body.error.code, 'body_too_large');
    const unknown = await t.api.get('/v1/nope');
    assert.equal(unknown.status, 404);
    assert.deepEqual(Object.keys(unknown.body), ['error']);
    assert.equal(typeof unknown.body.error.message, 'string');
    assert.match(unknown.headers.get('x-request-id') ?? '', /.+/);
    // Nothing of those requests was stored.
    assert.equal((await t.api.get('/v1/sessions/s')).status, 404);
    // `details` is part of the shape even when there is nothing to add.
    assert.deepEqual(Object.keys(unknown.body.error), ['code', 'message', 'details']);
    assert.equal(unknown.body.error.details, null);
    assert.ok(
      bad.body.error.details === null && text.body.error.details === null,
      'bad.body.error.details === null && text.body.error.details === null',
    );
    // What Node refuses before any route runs has the same shape.
    const headers = await t.api.raw('/v1/sessions', {
      headers: { authorization: `Bearer ${'x'.repeat(20_000)}` },
    });
    assert.equal(headers.status, 431);
    assert.equal(headers.headers.get('cache-control'), 'no-store');
    assert.deepEqual(headers.body, {
      error: { code: 'headers_too_large', message: 'request headers are larger than 16 KB', details: null },
    });
    const { connect } = await import('node:net');
    const raw = await new Promise<string>((resolve, reject) => {
      const socket = connect(Number(new URL(svc.base).port), '127.0.0.1', () =>
        socket.write('NOT HTTP\r\n\r\n'),
      );
      let data = '';
      socket.on('data', (d) => (data += d.toString()));
      socket.on('end', () => resolve(data));
      socket.on('error', reject);
    });
    assert.match(raw, /^HTTP\/1\.1 400 Bad Request\r\n/);
    assert.match(raw, /content-type: application\/json/);
    assert.deepEqual(JSON.parse(raw.slice(raw.indexOf('\r\n\r\n') + 4)).error.code, 'bad_request');
  });

  void test('bodies are read after authentication, must be UTF-8, and may use a +json type', async () => {
    const t = await svc.newTenant();
    const anonymous = api(svc.base);
    // Without a valid key the answer is 401 whatever the body: it is never parsed.
    for (const [headers, body] of [
      [{ 'content-type': 'application/json' }, '{"messages": ['],
      [{ 'content-type': 'text/plain' }, 'hello'],
      [{ 'content-type': 'application/json' }, 'x'.repeat(9 * 1024 * 1024)],
    ] as const) {
      for (const authorization of [undefined, `Bearer ${t.apiKey}x`]) {
        const r = await anonymous.raw('/v1/sessions/s/messages', {
          method: 'POST',
          headers: { ...headers, ...(authorization ? { authorization } : {}) },
          body,
        });
        assert.equal(r.status, 401, `${headers['content-type']} ${body.slice(0, 12)}`);
        assert.equal(r.body.error.code, 'unauthorized');
      }
    }
    // Bytes that are not UTF-8 are a 400, not text silently altered to U+FFFD.
    const invalid = Buffer.concat([
      Buffer.from('{"messages":[{"id":"u1","role":"user","content":"bad '),
      Buffer.from([0xff, 0xfe]),
      Buffer.from(' utf8"}]}'),
    ]);
    for (const contentType of ['application/json', 'application/json; charset=utf-8']) {
      const r = await t.api.raw('/v1/sessions/s/messages', {
        method: 'POST',
        headers: { 'content-type': contentType },
        body: invalid,
      });
      assert.equal(r.status, 400);
      assert.equal(r.body.error.code, 'invalid_utf8');
    }
    // Another UTF charset is a 415: body-parser would decode it, with U+FFFD for what it cannot,
    // however it is spelled (body-parser allows spaces around `=` and reads the last charset).
    for (const param of [
      'charset=utf-7',
      'charset=utf-16',
      'charset=UTF-32LE',
      'charset = utf-7',
      'charset=utf-8; charset=utf-7',
    ]) {
      const r = await t.api.raw('/v1/sessions/s/messages', {
        method: 'POST',
        headers: { 'content-type': `application/json; ${param}` },
        body: invalid,
      });
      assert.equal(r.status, 415, param);
      assert.equal(r.body.error.code, 'unsupported_encoding');
    }
    // UTF-7 bytes are ASCII: stored decoded, `a+AGE-b` would read `aab`.
    const utf7 = await t.api.raw('/v1/sessions/s/messages', {
      method: 'POST',
      headers: { 'content-type': 'application/json; charset = utf-7' },
      body: JSON.stringify({ messages: [{ id: 'u7', role: 'user', content: 'a+AGE-b' }] }),
    });
    assert.equal(utf7.status, 415);
    // Nothing was accepted: the id is still free (a taken one with other content would be a 409).
    const fresh = await t.api.post('/v1/sessions/s/messages', {
      messages: [{ id: 'u1', role: 'user', content: 'fine utf8' }],
    });
    assert.equal(fresh.status, 202);
    assert.equal(fresh.body.accepted, 1);
    // application/*+json is JSON (requireJson let it through; the parser must read it too).
    const vnd = await t.api.post(
      '/v1/sessions/s/messages',
      { messages: [{ id: 'v1', role: 'user', content: 'über 記憶 ✓' }] },
      { 'content-type': 'application/vnd.api+json' },
    );
    assert.equal(vnd.status, 202);
    assert.deepEqual(vnd.body.messages, [{ id: 'v1', seq: 2 }]);
    // `utf8` is UTF-8's common alias (body-parser knew only `utf-8`: a 415).
    for (const [n, charset] of ['utf8', '"UTF8"'].entries()) {
      const r = await t.api.raw('/v1/sessions/s/messages', {
        method: 'POST',
        headers: { 'content-type': `application/json; charset=${charset}` },
        body: JSON.stringify({ messages: [{ id: `w${n}`, role: 'user', content: 'alias ✓' }] }),
      });
      assert.equal(r.status, 202, charset);
      assert.deepEqual(r.body.messages, [{ id: `w${n}`, seq: 3 + n }]);
    }
  });

  void test('Node-level refusals answer in the JSON shape, and 100-continue waits for a valid key', async () => {
    const t = await svc.newTenant();
    const { connect } = await import('node:net');
    const port = Number(new URL(svc.base).port);
    /** Sends `head`, then `body` once the server said `100 Continue` (if given); resolves with all it read. */
    const exchange = (head: string, body?: string) =>
      new Promise<string>((resolve, reject) => {
        const socket = connect(port, '127.0.0.1', () => socket.write(head));
        let data = '';
        socket.on('data', (d) => {
          data += d.toString();
          if (
            body !== undefined &&
            data.startsWith('HTTP/1.1 100 Continue\r\n\r\n') &&
            !data.includes('\r\n\r\nHTTP')
          ) {
            socket.write(body);
            body = undefined;
          }
          if (/\r\n\r\n\{.*\}$/s.test(data.replace(/^HTTP\/1\.1 100 Continue\r\n\r\n/, ''))) socket.end();
        });
        socket.on('end', () => resolve(data));
        socket.on('error', reject);
        // Every exchange here is answered at once; one that is not would wait for the body.
        socket.setTimeout(10_000, () => {
          socket.destroy();
          reject(new Error(`no answer within 10 s; read: ${JSON.stringify(data)}`));
        });
      });
    const jsonOf = (raw: string) => JSON.parse(raw.slice(raw.lastIndexOf('\r\n\r\n') + 4));
    const body = JSON.stringify({ messages: [{ id: 'c1', role: 'user', content: 'continue' }] });
    const post = (headers: string) =>
      `POST /v1/sessions/s100/messages HTTP/1.1\r\n${headers}content-type: application/json\r\n` +
      `content-length: ${body.length}\r\n\r\n`;
    const host = `host: 127.0.0.1:${port}\r\n`;
    const auth = `authorization: Bearer ${t.apiKey}\r\n`;

    const noHost = await exchange(`GET /healthz HTTP/1.1\r\n\r\n`);
    assert.match(noHost, /^HTTP\/1\.1 400 Bad Request\r\n/);
    assert.equal(jsonOf(noHost).error.code, 'missing_host');
    const twoHosts = await exchange(`GET /healthz HTTP/1.1\r\n${host}host: other.example\r\n\r\n`);
    assert.match(twoHosts, /^HTTP\/1\.1 400 Bad Request\r\n/);
    assert.equal(jsonOf(twoHosts).error.code, 'duplicate_host');
    const expectation = await exchange(post(`${host}${auth}expect: something-else\r\n`));
    assert.match(expectation, /^HTTP\/1\.1 417 /);
    // Answered before the path is read, and no-store as every answer under /v1.
    for (const answer of [noHost, twoHosts, expectation])
      assert.match(answer.split('\r\n\r\n')[0]!, /\r\ncache-control: no-store\r\n/i);
    assert.equal(jsonOf(expectation).error.code, 'expectation_failed');
    // A bad key is refused before the client is invited to send its body.
    const refused = await exchange(post(`${host}authorization: Bearer nope\r\nexpect: 100-continue\r\n`));
    assert.match(refused, /^HTTP\/1\.1 401 /);
    // …and the connection closes: the body it might still send is not read as a next request.
    assert.match(refused, /\r\nconnection: close\r\n/i);
    assert.equal(jsonOf(refused).error.code, 'unauthorized');
    // A valid key gets the invitation, then the answer to the body it sent after it.
    const accepted = await exchange(post(`${host}${auth}expect: 100-continue\r\n`), body);
    assert.match(accepted, /^HTTP\/1\.1 100 Continue\r\n\r\nHTTP\/1\.1 202 /);
    // None of the refusals (all to this session) accepted anything: c1 is its first message.
    assert.deepEqual(jsonOf(accepted).messages, [{ id: 'c1', seq: 1 }]);

    // A declared length over 8 MiB is a 413 before the body arrives (only 10 bytes of it are sent).
    const tooLong = await exchange(
      `POST /v1/sessions/s100/messages HTTP/1.1\r\n${host}${auth}content-type: application/json\r\n` +
        `content-length: ${9 * 1024 * 1024}\r\n\r\n{"message`,
    );
    assert.match(tooLong, /^HTTP\/1\.1 413 /);
    // …also for a client that asked to be invited first: it is not.
    const tooLongExpect = await exchange(
      `POST /v1/sessions/s100/messages HTTP/1.1\r\n${host}${auth}content-type: application/json\r\n` +
        `expect: 100-continue\r\ncontent-length: ${9 * 1024 * 1024}\r\n\r\n`,
    );
    assert.match(tooLongExpect, /^HTTP\/1\.1 413 /);
    assert.match(tooLong, /\r\nconnection: close\r\n/i);
    assert.equal(jsonOf(tooLong).error.code, 'body_too_large');
    // Two Authorization headers are refused: a proxy in front might take the other one.
    const other = await svc.newTenant();
    const twoKeys = await exchange(
      `GET /v1/sessions HTTP/1.1\r\n${host}${auth}authorization: Bearer ${other.apiKey}\r\n\r\n`,
    );
    assert.match(twoKeys, /^HTTP\/1\.1 401 /);
    assert.match(jsonOf(twoKeys).error.message, /more than one Authorization header/);
    const extra = await exchange(
      `GET /v1/sessions HTTP/1.1\r\n${host}authorization: Bearer ${t.apiKey} x\r\n\r\n`,
    );
    assert.match(jsonOf(extra).error.message, /^malformed Authorization header/);
  });

  void test('HEAD and OPTIONS have no route under /v1 and /admin (HEAD ran GET handlers); probes keep HEAD', async () => {
    const t = await svc.newTenant();
    assert.equal(
      (await t.api.post('/v1/sessions/h/messages', { messages: [{ role: 'user', content: 'x' }] })).status,
      202,
    );
    for (const path of [
      '/v1/sessions',
      '/v1/sessions/h',
      '/v1/sessions/h/export',
      '/v1/errors',
      '/admin/queues',
    ]) {
      const r = await t.api.raw(path, { method: 'HEAD' });
      assert.equal(r.status, 404, path);
      // Express answered OPTIONS itself, in plain text, offering HEAD.
      const o = await t.api.raw(path, { method: 'OPTIONS' });
      assert.equal(o.status, 404, `OPTIONS ${path}`);
      assert.match(o.headers.get('content-type') ?? '', /json/);
      // Under /v1, no-store as every answer there.
      if (path.startsWith('/v1/'))
        for (const a of [r, o]) assert.equal(a.headers.get('cache-control'), 'no-store', path);
    }
    // A DELETE with options the client believes it sends is refused, and deletes nothing.
    const del = await t.api.raw('/v1/sessions/h', {
      method: 'DELETE',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ keep_archive: true }),
    });
    assert.equal(del.status, 400);
    // `{}` too: it is what a client sends for {tool_name: undefined}, and a purge then took all.
    const empty = await t.api.raw('/v1/sessions/h', {
      method: 'DELETE',
      headers: { 'content-type': 'application/json' },
      body: '{}',
    });
    assert.equal(empty.status, 400);
    assert.equal((await t.api.raw('/v1/sessions/h', { method: 'GET' })).status, 200);
    // Every piece of a query string is read: Node's parser dropped what came after 1,000 of them.
    const padded = `/v1/sessions/h/messages?${'&'.repeat(1000)}bogus=1`;
    assert.equal((await t.api.raw(padded, { method: 'GET' })).status, 400);
    // No body at all (what clients send for a DELETE) still deletes.
    const none = await t.api.raw('/v1/sessions/h', {
      method: 'DELETE',
      headers: { 'content-type': 'application/json', 'content-length': '0' },
    });
    assert.equal(none.status, 204);
    assert.equal((await t.api.raw('/v1/sessions/h', { method: 'GET' })).status, 404);
    // Nor does a body of zero bytes with a JSON content-type, as HTTP wrappers send on every
    // call (fetch above sent no content-length at all; body-parser reads zero bytes as `{}`).
    const zeroBytes = (path: string, contentType = 'application/json') =>
      new Promise<number>((resolve, reject) => {
        const req = request(`${svc.base}${path}`, {
          method: 'DELETE',
          headers: {
            authorization: `Bearer ${t.apiKey}`,
            'content-type': contentType,
            'content-length': '0',
          },
        });
        req.on('response', (res) => {
          res.resume();
          resolve(res.statusCode ?? 0);
        });
        req.on('error', reject);
        req.end();
      });
    await t.api.post('/v1/sessions/h2/messages?wait=true', { messages: [{ role: 'user', content: 'x' }] });
    assert.equal(await zeroBytes('/v1/sessions/h2'), 204);
    // Whatever its charset says (body-parser refused `utf8` and `latin1` on zero bytes).
    for (const [n, charset] of ['utf8', 'latin1'].entries()) {
      await t.api.post(`/v1/sessions/h${n + 3}/messages?wait=true`, {
        messages: [{ role: 'user', content: 'x' }],
      });
      assert.equal(
        await zeroBytes(`/v1/sessions/h${n + 3}`, `application/json; charset=${charset}`),
        204,
        charset,
      );
    }
    assert.equal((await t.api.raw('/v1/sessions/h2', { method: 'GET' })).status, 404);
    assert.equal(await zeroBytes('/v1/errors?tool_name=none'), 200);
    assert.equal((await api(svc.base).raw('/healthz', { method: 'HEAD' })).status, 200);
  });

  void test('a client that goes away mid-import, or a NUL in an admin path, is not logged as an outage or a gap', async () => {
    const warnings: string[] = [];
    const logger = pino({ level: 'warn' }, { write: (line: string) => void warnings.push(line) });
    const own = await startTestService({ mode: 'api', logger });
    try {
      const t = await own.newTenant();
      // A JSON Lines import whose client drops the connection after one line.
      await new Promise<void>((resolve) => {
        const req = request(`${own.base}/v1/sessions/gone/import`, {
          method: 'POST',
          headers: { authorization: `Bearer ${t.apiKey}`, 'content-type': 'application/x-ndjson' },
        });
        req.on('error', () => resolve());
        req.on('response', () => resolve());
        req.write('{"type":"message","role":"user","content":"one"}\n');
        setTimeout(() => req.destroy(), 200);
      });
      // Admin paths holding a NUL: refused before any statement.
      const admin = api(own.base, ADMIN_TOKEN);
      for (const [method, path] of [
        ['GET', '/v1/admin/tenants/%00/keys'],
        ['POST', '/v1/admin/tenants/%00/keys'],
        ['DELETE', '/v1/admin/tenants/%00'],
        ['DELETE', '/v1/admin/keys/%00'],
      ] as const) {
        const r = await admin.raw(path, { method });
        assert.equal(r.status, 400, `${method} ${path}`);
        assert.equal(r.body.error.code, 'invalid_characters');
      }
      // The import was not half-stored, and the service still answers.
      assert.equal((await t.api.get('/v1/sessions/gone')).status, 404);
      await new Promise((r) => setTimeout(r, 200));
      assert.deepEqual(
        warnings.filter((w) => /postgres is unavailable|unvalidated NUL/.test(w)),
        [],
      );
    } finally {
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
    }
  });

  void test('OpenAPI documents every mounted route, and every documented route answers', async () => {
    const doc = (await api(svc.base).get('/openapi.json')).body;
    assert.equal(doc.openapi, '3.1.0');
    const queryParams = (path: string, method: string) =>
      (doc.paths[path][method].parameters as Array<{ name: string; in: string }>)
        .filter((p) => p.in === 'query')
        .map((p) => p.name);
    assert.deepEqual(queryParams('/v1/errors', 'get'), ['cursor', 'limit']);
    assert.deepEqual(queryParams('/v1/errors', 'delete'), ['tool_name']);
    assert.deepEqual(queryParams('/v1/admin/tenants', 'get'), ['cursor', 'limit']);
    assert.deepEqual(Object.keys(doc.paths['/v1/errors'].post.responses).sort(), ['200', '201', 'default']);
    // ?wait=true answers: 201 once durable, 200 with the new summary; import also reads JSON Lines.
    const statuses = (path: string) => Object.keys(doc.paths[path].post.responses).sort();
    assert.deepEqual(statuses('/v1/sessions/{sid}/messages'), ['201', '202', 'default']);
    assert.deepEqual(statuses('/v1/sessions/{sid}/summarize'), ['200', '202', 'default']);
    assert.deepEqual(statuses('/v1/sessions/{sid}/import'), ['201', '202', 'default']);
    assert.deepEqual(Object.keys(doc.paths['/v1/sessions/{sid}/import'].post.requestBody.content).sort(), [
      'application/json',
      'application/jsonl',
      'application/x-ndjson',
    ]);
    // A context call without a body is valid (the docs' minimal request): the schema says so.
    assert.equal(doc.paths['/v1/sessions/{sid}/context'].post.requestBody.required, false);
    // The header a context answer carries when its min_seq wait timed out (clients read it).
    assert.deepEqual(
      doc.paths['/v1/sessions/{sid}/context'].post.responses['200'].headers['x-mnemos-min-seq'].schema,
      {
        type: 'string',
        enum: ['timeout'],
      },
    );
    assert.equal(doc.paths['/v1/sessions/{sid}/messages'].post.requestBody.required, true);
    const posted = doc.paths['/v1/sessions/{sid}/messages'].post;
    const messagesSchema = posted.requestBody.content['application/json'].schema.properties.messages;
    assert.deepEqual([messagesSchema.minItems, messagesSchema.maxItems], [1, 1000]);
    assert.deepEqual(posted.parameters.find((p: { name: string }) => p.name === 'sid').schema, {
      type: 'string',
      pattern: '^[A-Za-z0-9._:@-]{1,256}$',
      not: { enum: ['.', '..'] },
    });
    // What the server refuses, the schema says: an empty import, unknown keys; content's bound.
    const imported =
      doc.paths['/v1/sessions/{sid}/import'].post.requestBody.content['application/json'].schema;
    assert.deepEqual([imported.properties.messages.minItems, imported.additionalProperties], [1, false]);
    assert.match(messagesSchema.items.properties.content.description, /at most 1 MiB of UTF-8/);
    // Every success that has a body documents it: a JSON schema (which `npm test` holds every
    // answer to, services/response-check.ts) or the media type of a text answer.
    const media = (path: string, method: string, code: string) =>
      Object.keys(doc.paths[path][method].responses[code].content ?? {});
    for (const [path, ops] of Object.entries(
      doc.paths as Record<string, Record<string, { responses: Record<string, unknown> }>>,
    )) {
      for (const [method, op] of Object.entries(ops)) {
        for (const code of Object.keys(op.responses).filter((c) => c !== 'default' && c !== '204')) {
          assert.equal(
            media(path, method, code).length,
            1,
            `${method.toUpperCase()} ${path} ${code} has no body schema`,
          );
        }
      }
    }
    assert.deepEqual(media('/metrics', 'get', '200'), ['text/plain; version=0.0.4']);
    assert.deepEqual(media('/v1/sessions/{sid}/export', 'get', '200'), ['application/x-ndjson']);
    assert.deepEqual(media('/readyz', 'get', '503'), ['application/json']);
    const hit =
      doc.paths['/v1/sessions/{sid}/search'].post.responses['200'].content['application/json'].schema;
    assert.deepEqual(hit.required, ['hits']);
    assert.equal(hit.additionalProperties, false);
    const t = await svc.newTenant();
    for (const [path, ops] of Object.entries(
      doc.paths as Record<string, Record<string, { summary: string }>>,
    )) {
      for (const [method, op] of Object.entries(ops)) {
        assert.notEqual(op.summary, 'undocumented', `${method.toUpperCase()} ${path} has no summary`);
        const concrete = path.replace(/\{[^}]+\}/g, 'x');
        const r = await api(svc.base, path.startsWith('/v1/admin') ? ADMIN_TOKEN : t.apiKey).raw(concrete, {
          method: method.toUpperCase(),
          headers: { 'content-type': 'application/json' },
          ...(method === 'get' || method === 'delete' ? {} : { body: '{}' }),
        });
        const noRoute = r.status === 404 && /no route for/.test(r.body?.error?.message ?? '');
        assert.ok(!noRoute, `${method.toUpperCase()} ${path} is documented but has no route`);
      }
    }
    assert.ok(listRoutes([]).length === 0, 'listRoutes([]).length === 0');
  });
});

void describe('the Postgres pool', () => {
  const pid = async (db: Db, name?: string) =>
    (await db.query<{ p: number }>('SELECT pg_backend_pid() AS p', [], name ? { name } : undefined)).rows[0]!
      .p;

  void test('a statement that fails, named or not, or a transaction that throws keeps its connection', async () => {
    const db = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    try {
      const before = await pid(db);
      await assert.rejects(db.query('SELECT 1 / $1::int', [0]), /division by zero/);
      await assert.rejects(
        db.transaction(async (tx) => {
          await tx.query('SELECT 1');
          throw new Error('no, thanks');
        }),
        /no, thanks/,
      );
      assert.equal(await pid(db), before, 'the same backend answers after both errors');
      const named = await pid(db, 'pid');
      await assert.rejects(db.query('SELECT 1 / $1::int', [0], { name: 'div' }), /division by zero/);
      assert.equal(await pid(db, 'pid'), named, 'and on the connections of named statements');
    } finally {
      await db.close();
    }
  });

  void test('a connection dropped under a transaction or a query fails that call, not the process', async () => {
    const db = makePgDb({ connectionString: ADMIN_URL, max: 2 });
    const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    const kill = (p: number) => admin.query('SELECT pg_terminate_backend($1)', [p]);
    try {
      let inTx = 0;
      await assert.rejects(
        db.transaction(async (tx) => {
          inTx = (await tx.query<{ p: number }>('SELECT pg_backend_pid() AS p')).rows[0]!.p;
          setTimeout(() => void kill(inTx), 100);
          await tx.query('SELECT pg_sleep(5)');
        }),
        /terminat/i,
      );
      // A text no other run on the shared server sends, so that only this query's backend is found.
      const sleep = `SELECT pg_sleep(5) AS ${testPrefix()}`;
      // Its rejection is expected from here on: a handler attached only after the kill races it.
      const busyFails = assert.rejects(db.query(sleep), /terminat/i);
      const busyPid = await eventually(async () => {
        const r = await admin.query<{ p: number }>(
          'SELECT pid AS p FROM pg_stat_activity WHERE query = $1 AND pid <> $2',
          [sleep, inTx],
        );
        return r.rows[0]?.p;
      });
      await kill(busyPid);
      await busyFails;
      const after = await pid(db);
      assert.notEqual(after, inTx, 'the broken connection went back as closed, not reused');
      assert.equal((await db.query<{ x: number }>('SELECT 1 AS x')).rows[0]!.x, 1);
    } finally {
      await Promise.all([db.close(), admin.close()]);
    }
  });
});

void describe('readiness', () => {
  void test('/readyz reflects a stopped Redis and recovers; writes get 503 with retry-after meanwhile', async () => {
    const redis = await startPrivateRedis();
    const prefix = testPrefix();
    const svc = await startTestService({ mode: 'api', env: { REDIS_URL: redis.url }, prefix });
    try {
      const ready = await api(svc.base).get('/readyz');
      assert.equal(ready.status, 200);
      assert.deepEqual(ready.body.checks, { postgres: 'ok', redis: 'ok', migrations: 'ok', llm: 'disabled' });
      assert.equal((await api(svc.base).get('/healthz')).status, 200);
      const t = await svc.newTenant();

      await redis.kill();
      const down = await eventually(
        async () => {
          const r = await api(svc.base).get('/readyz');
          return r.status === 503 ? r : null;
        },
        10_000,
        'readyz 503',
      );
      assert.equal(down.body.checks.redis, 'down');
      assert.equal(down.body.checks.postgres, 'ok');
      const write = await t.api.post('/v1/sessions/s1/messages', {
        messages: [{ role: 'user', content: 'hi' }],
      });
      assert.equal(write.status, 503);
      assert.equal(write.body.error.code, 'unavailable');
      assert.ok(Number(write.headers.get('retry-after')) > 0, "Number(write.headers.get('retry-after')) > 0");

      await redis.start();
      await eventually(
        async () => (await api(svc.base).get('/readyz')).status === 200,
        15_000,
        'readyz 200 again',
      );
      // The failed request left nothing behind.
      assert.equal((await t.api.get('/v1/sessions/s1')).status, 404);
    } finally {
      await svc.stop();
      await redis.stop();
    }
  });

  void test('/readyz is 503 naming why a Redis that answers takes no writes (full, replica, failing snapshot)', async () => {
    // Setup: a Redis of its own whose snapshots go to a directory where they cannot be written.
    const dir = mkdtempSync(join(tmpdir(), 'mnemos-readyz-'));
    const redis = await startPrivateRedis({ dir });
    const admin = new Redis(redis.url);
    const svc = await startTestService({ mode: 'api', env: { REDIS_URL: redis.url } });
    const t = await svc.newTenant();
    const post = () =>
      t.api.post('/v1/sessions/s1/messages', { messages: [{ role: 'user', content: 'hi' }] });
    const refused = async (state: string) => {
      const r = await api(svc.base).get('/readyz');
      assert.equal(r.status, 503, JSON.stringify(r.body));
      assert.deepEqual(r.body.checks, { postgres: 'ok', redis: state, migrations: 'ok', llm: 'disabled' });
      assert.equal(r.headers.get('retry-after'), '5');
      assert.equal((await post()).status, 503, `a post while redis is ${state}`);
    };
    const ready = async () => {
      const r = await api(svc.base).get('/readyz');
      assert.equal(r.status, 200, JSON.stringify(r.body));
      assert.equal(r.body.checks.redis, 'ok');
    };
    try {
      await ready();

      // Full: used memory over maxmemory under noeviction (OOM command not allowed).
      await admin.config('SET', 'maxmemory', '1');
      await refused('full');
      await admin.config('SET', 'maxmemory', '0');
      await ready();

      // A replica, as the old primary's address may lead to after a failover (READONLY).
      await admin.replicaof('127.0.0.1', String(await freePort()));
      await refused('read_only');
      await admin.replicaof('NO', 'ONE');
      await ready();

      // A snapshot that failed, with stop-writes-on-bgsave-error (MISCONF).
      mkdirSync(join(dir, 'dump.rdb'));
      await admin.config('SET', 'save', '3600 1');
      await admin.bgsave();
      await eventually(async () => /rdb_last_bgsave_status:err/.test(await admin.info('persistence')));
      await refused('misconf');
      await admin.config('SET', 'save', '');
      await ready();
      assert.equal((await post()).status, 202);
    } finally {
      await svc.stop();
      admin.disconnect();
      await redis.stop();
      rmSync(dir, { recursive: true, force: true });
    }
  });

  void test('/readyz is 503 while migrations are pending', async () => {
    const url = await createTestDatabase();
    const db = makePgDb({ connectionString: url, max: 1 });
    const svc = await startTestService({ mode: 'api', databaseUrl: url });
    try {
      await db.query('DELETE FROM schema_migrations');
      const r = await api(svc.base).get('/readyz');
      assert.equal(r.status, 503);
      assert.match(r.body.checks.migrations, /pending: 001_init/);
    } finally {
      await svc.stop();
      await db.close();
      await deleteRedisPrefix(svc.config.prefix);
    }
  });
});

void describe('dependency errors', () => {
  void test("ioredis's MaxRetriesPerRequestError is a 503 with retry-after, not a 500", async () => {
    const { asDependencyError, AppError } = await import('../services/errors.js');
    const { MaxRetriesPerRequestError } = await import('ioredis/built/errors/index.js');
    const mapped = asDependencyError(new MaxRetriesPerRequestError(20));
    assert.ok(mapped instanceof AppError, 'mapped instanceof AppError');
    assert.equal(mapped.status, 503);
    assert.equal(mapped.headers?.['retry-after'], '2');
    const other = new Error('something else');
    assert.equal(asDependencyError(other), other);
  });

  void test('Postgres states that pass and Redis refusals are 503s with retry-after, not 500s', async () => {
    const { asDependencyError, AppError } = await import('../services/errors.js');
    const is503 = (err: unknown, dependency: string) => {
      const mapped = asDependencyError(err);
      assert.ok(mapped instanceof AppError, `${String(err)} stays a 500`);
      assert.equal(mapped.status, 503);
      assert.deepEqual(mapped.details, { dependency });
      assert.ok(mapped.headers?.['retry-after'], "mapped.headers?.['retry-after']");
    };
    // Real errors from a real Postgres: a read-only database (a standby after a failover) and a
    // statement timeout set on the role or database.
    const db = makePgDb({ connectionString: ADMIN_URL, max: 1 });
    try {
      const readOnly = await db
        .transaction(async (tx) => {
          await tx.query('SET TRANSACTION READ ONLY');
          await tx.query('CREATE TEMP TABLE t (x int)');
        })
        .catch((e: unknown) => e);
      is503(readOnly, 'postgres');
      const timedOut = await db
        .transaction(async (tx) => {
          await tx.query("SET LOCAL statement_timeout = '10ms'");
          await tx.query('SELECT pg_sleep(1)');
        })
        .catch((e: unknown) => e);
      is503(timedOut, 'postgres');
      const bug = await db.query('SELECT nope').catch((e: unknown) => e);
      assert.equal(asDependencyError(bug), bug, 'a bug stays a 500');
      // A pool with no connection free in time (5 s): Postgres may be fine, and the answer says so.
      const busy = makePgDb({ connectionString: ADMIN_URL, max: 1 });
      try {
        const waited = await busy.transaction(() => busy.query('SELECT 1')).catch((e: unknown) => e);
        is503(waited, 'postgres');
        assert.match((asDependencyError(waited) as Error).message, /connections are all busy/);
      } finally {
        await busy.close();
      }
      const refused = makePgDb({ connectionString: 'postgres://postgres@127.0.0.1:1/x', max: 1 });
      try {
        const down = await refused.query('SELECT 1').catch((e: unknown) => e);
        assert.equal((asDependencyError(down) as Error).message, 'postgres is unavailable, retry later');
      } finally {
        await refused.close();
      }
    } finally {
      await db.close();
    }
    // A real Redis out of memory under noeviction.
    const redis = await startPrivateRedis();
    const client = new Redis(redis.url);
    try {
      await client.config('SET', 'maxmemory', '1');
      is503(await client.set('k', 'v').catch((e: unknown) => e), 'redis');
    } finally {
      client.disconnect();
      await redis.stop();
    }
  });
});
