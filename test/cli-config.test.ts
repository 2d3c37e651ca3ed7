import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { closeSync, mkdirSync, mkdtempSync, openSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, describe, test } from 'node:test';
import { Redis } from 'ioredis';
import { loadMigrations, migrate } from '../db/migrate.js';
import { makePgDb } from '../db/pool.js';
import { ConfigError, loadConfig } from '../services/config.js';
import { embeddedBannerLines, FIRST_KEY_FILE } from '../services/runtime.js';
import { createTenant, keyList } from '../services/tenants.js';
import {
  ADMIN_URL,
  REDIS_URL,
  api,
  createTestDatabase,
  deleteRedisPrefix,
  dropTestDatabase,
  holdTransaction,
  startTestService,
  testPrefix,
} from './support/harness.js';
import type { TestService } from './support/harness.js';
import { waitExit } from './support/child-service.js';

/**
 * The file's own Redis prefix: commands that open the queues (export, tenant delete) write their
 * keys under it, never under the shared default `mnemos`. Deleted when the file ends.
 */
const filePrefix = testPrefix();
after(() => deleteRedisPrefix(filePrefix));

/** Runs a CLI command to its end, as an operator would (the test's environment plus `env`). */
const cli = (args: string[], env: Record<string, string>) =>
  spawnSync(process.execPath, ['bin/mnemos.js', ...args], {
    env: { ...process.env, LOG_LEVEL: '', MNEMOS_PREFIX: filePrefix, ...env },
    encoding: 'utf8',
    timeout: 60_000,
  });

/** A database of its own for one test, empty (no mnemos schema); dropped by the returned `drop`. */
async function emptyDatabase(): Promise<{ name: string; url: string; drop(): Promise<void> }> {
  const name = `mnemos_t_${process.env.MNEMOS_TEST_RUN ?? 'x'}_foreign_${randomBytes(4).toString('hex')}`;
  const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
  await admin.query(`CREATE DATABASE "${name}"`).finally(() => admin.close());
  const u = new URL(ADMIN_URL);
  u.pathname = `/${name}`;
  const url = u.toString();
  return { name, url, drop: () => dropTestDatabase(url) };
}

void describe('CLI commands and the database they are given', () => {
  void test("another tool's schema_migrations table is not taken for mnemos's, and a key given as a tenant is not printed", async () => {
    const other = await emptyDatabase();
    try {
      // Rails keeps its migrations in a table of the same name (one column, version).
      const db = makePgDb({ connectionString: other.url, max: 1 });
      await db.query(`CREATE TABLE schema_migrations (version varchar PRIMARY KEY)`);
      await db.query(`INSERT INTO schema_migrations VALUES ('20240101000000')`);
      await db.close();
      const listed = cli(['tenant', 'list'], { DATABASE_URL: other.url });
      assert.notEqual(listed.status, 0);
      assert.match(listed.stderr, /has no mnemos schema/);

      // A whole API key where a tenant belongs (`--tenant`): refused without printing it.
      const url = await createTestDatabase();
      const prefix = testPrefix();
      const secret = 'mn_abcdefghijkl_' + 'S'.repeat(40);
      const r = cli(['tenant', 'delete', secret], { DATABASE_URL: url, MNEMOS_PREFIX: prefix });
      assert.notEqual(r.status, 0);
      assert.doesNotMatch(r.stdout + r.stderr, /SSSS/);
      assert.match(r.stderr, /no tenant/);
      await deleteRedisPrefix(prefix);
      await dropTestDatabase(url);
    } finally {
      await other.drop();
    }
  });

  void test("refuse another application's database without touching it, and work once it is migrated", async () => {
    // Setup: another application's database, with a table of its own.
    const other = await emptyDatabase();
    try {
      const db = makePgDb({ connectionString: other.url, max: 1 });
      await db.query('CREATE TABLE invoices (id int PRIMARY KEY)');
      await db.close();
      const withPassword = new URL(other.url);
      withPassword.password = 'sekrit-pw';

      // Action: a read-only command through each way the CLI opens the database (tenant list:
      // the database alone; export: the runtime with Redis and the queues).
      const listed = cli(['tenant', 'list'], { DATABASE_URL: withPassword.toString() });
      const exported = cli(['export', 's1', '--tenant', 'nobody'], { DATABASE_URL: other.url });

      // Assert: refused, naming the database (not the password) and what to do; nothing created.
      for (const r of [listed, exported]) {
        assert.notEqual(r.status, 0, r.stderr);
        assert.match(
          r.stderr,
          new RegExp(`database "${other.name}" \\(.*\\) has no mnemos schema.*DATABASE_URL.*mnemos migrate`),
        );
        assert.equal(r.stdout, '');
      }
      assert.doesNotMatch(listed.stderr, /sekrit-pw/);
      const check = makePgDb({ connectionString: other.url, max: 1 });
      const tables = await check.query<{ t: string }>(
        `SELECT table_name AS t FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1`,
      );
      const extensions = await check.query<{ e: string }>(`SELECT extname AS e FROM pg_extension ORDER BY 1`);
      await check.close();
      assert.deepEqual(
        tables.rows.map((r) => r.t),
        ['invoices'],
      );
      assert.deepEqual(
        extensions.rows.map((r) => r.e),
        ['plpgsql'],
      );

      // Action / Assert: `mnemos migrate` installs the schema on purpose; then the command works.
      const migrated = cli(['migrate'], { DATABASE_URL: other.url });
      assert.equal(migrated.status, 0, migrated.stderr);
      assert.match(migrated.stdout, /^applied: 001_init/);
      const after = cli(['tenant', 'list'], { DATABASE_URL: other.url });
      assert.equal(after.status, 0, after.stderr);
      assert.equal(after.stdout, '');
    } finally {
      await other.drop();
    }
  });

  void test('a database with the schema and pending migrations is still brought up to date by any command', async () => {
    // Setup: a database migrated by an older build (its first three migrations only).
    const old = await emptyDatabase();
    try {
      const db = makePgDb({ connectionString: old.url, max: 1 });
      await migrate(db, (await loadMigrations()).slice(0, 3));

      // Action
      const r = cli(['tenant', 'create', 'upgraded'], { DATABASE_URL: old.url });

      // Assert: the tenant exists and every migration is applied.
      assert.equal(r.status, 0, r.stderr);
      assert.match(r.stdout, /^tenant_id: t_/);
      const ledger = await db.query<{ n: number }>('SELECT count(*)::int AS n FROM schema_migrations');
      await db.close();
      assert.equal(ledger.rows[0]!.n, (await loadMigrations()).length);
    } finally {
      await old.drop();
    }
  });

  void test('an export whose pending migration gives way to a long transaction says so on stderr, as migrate does', async () => {
    // Setup: a database one migration behind (018, an index on sessions, which needs a lock every
    // write of the table conflicts with), and a transaction holding a session row's write.
    const old = await emptyDatabase();
    const db = makePgDb({ connectionString: old.url, max: 1 });
    let holder: { release(): Promise<void> } | null = null;
    try {
      const all = await loadMigrations();
      await migrate(
        db,
        all.filter((m) => m.version < 18),
      );
      const { tenant_id } = await createTenant(db, 'behind');
      await db.query(`INSERT INTO sessions (tenant_id, id) VALUES ($1, 'held')`, [tenant_id]);
      await migrate(
        db,
        all.filter((m) => m.version !== 18),
      );
      holder = await holdTransaction(old.url, [`UPDATE sessions SET hot_bytes = 0 WHERE id = 'held'`]);

      // Action: an export, whose start applies 018; the transaction ends once the export has said
      // why it waits (or after 20 s, when it never says so).
      const child = spawn(process.execPath, ['bin/mnemos.js', 'export', 'held', '--tenant', tenant_id], {
        env: { ...process.env, LOG_LEVEL: '', MNEMOS_PREFIX: filePrefix, DATABASE_URL: old.url },
      });
      let stderr = '';
      child.stdout.resume();
      const told = new Promise<void>((resolve) => {
        child.stderr.on('data', (d: Buffer) => {
          stderr += d.toString();
          if (stderr.includes('gave way')) resolve();
        });
      });
      await Promise.race([told, new Promise((r) => setTimeout(r, 20_000))]);
      await holder.release();
      const code = await new Promise<number | null>((r) => child.on('exit', r));

      // Assert
      assert.match(
        stderr,
        /^mnemos: warning: migration 018_\w+ gave way to a transaction holding a lock it needs; trying again$/m,
      );
      assert.equal(code, 0, stderr);
      const ledger = await db.query('SELECT 1 FROM schema_migrations WHERE version = 18');
      assert.equal(ledger.rows.length, 1, 'applied once the transaction ended');
    } finally {
      await holder?.release();
      await db.close();
      await old.drop();
    }
  });

  void test('the configuration warnings are printed by every command, on stderr', async () => {
    // Setup
    const url = await createTestDatabase();
    try {
      // Action
      const r = cli(['migrate'], { DATABASE_URL: url, MNEMOS_PREFX: 'mine' });

      // Assert: stdout is the command's output only.
      assert.equal(r.status, 0, r.stderr);
      assert.equal(r.stdout, 'schema is up to date\n');
      assert.match(
        r.stderr,
        /^mnemos: warning: MNEMOS_PREFX is not a mnemos setting and is ignored \(did you mean MNEMOS_PREFIX\?\)$/m,
      );
    } finally {
      await dropTestDatabase(url);
    }
  });
});

void describe('key revoke', () => {
  void test('takes a whole API key, revokes it by its id and never prints its secret', async () => {
    // Setup
    const url = await createTestDatabase();
    const db = makePgDb({ connectionString: url, max: 1 });
    try {
      const { tenant_id, api_key } = await createTenant(db, 'revoker');
      const [, keyId, secret] = /^mn_([a-z2-7]{12})_(\w+)$/.exec(api_key)!;

      // Action
      const first = cli(['key', 'revoke', api_key], { DATABASE_URL: url });
      const again = cli(['key', 'revoke', api_key], { DATABASE_URL: url });
      const truncated = cli(['key', 'revoke', `mn_${secret!.slice(0, 20)}`], { DATABASE_URL: url });

      // Assert: revoked, named by its id; the second time an error naming the id only.
      assert.equal(first.status, 0, first.stderr);
      assert.equal(first.stdout, `revoked ${keyId}\n`);
      const keys = (await keyList(db, tenant_id)).items;
      assert.equal(keys.length, 1);
      assert.equal(keys[0]!.key_id, keyId);
      assert.ok(keys[0]!.revoked_at, 'the key is revoked');
      assert.notEqual(again.status, 0);
      assert.match(again.stderr, new RegExp(`no active key ${keyId}$`, 'm'));
      assert.notEqual(truncated.status, 0);
      assert.match(truncated.stderr, /not a key id/);
      for (const r of [first, again, truncated]) {
        assert.ok(!r.stdout.includes(secret!.slice(0, 20)), 'no part of the secret on stdout');
        assert.ok(!r.stderr.includes(secret!.slice(0, 20)), 'no part of the secret on stderr');
      }
    } finally {
      await db.close();
      await dropTestDatabase(url);
    }
  });
});

void describe('CLI output', () => {
  /** Runs a CLI command whose stdout goes to /dev/full (a full disk). */
  const toFullDisk = (args: string[], env: Record<string, string>) => {
    const full = openSync('/dev/full', 'w');
    try {
      return spawnSync(process.execPath, ['bin/mnemos.js', ...args], {
        env: { ...process.env, LOG_LEVEL: '', MNEMOS_PREFIX: filePrefix, ...env },
        stdio: ['ignore', full, 'pipe'],
        encoding: 'utf8',
        timeout: 60_000,
      });
    } finally {
      closeSync(full);
    }
  };
  /** Runs a CLI command whose reader has gone before it writes (`… | head` once head is done). */
  const toClosedPipe = async (args: string[], env: Record<string, string>) => {
    const child = spawn(process.execPath, ['bin/mnemos.js', ...args], {
      env: { ...process.env, LOG_LEVEL: '', MNEMOS_PREFIX: filePrefix, ...env },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    child.stdout.destroy();
    let stderr = '';
    child.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
    await waitExit(child);
    return { status: child.exitCode, stderr };
  };
  const noStackTrace = (stderr: string) => {
    assert.doesNotMatch(stderr, /Unhandled 'error' event|^\s+at /m);
    assert.ok(stderr.split('\n').length <= 2, `at most one line:\n${stderr}`);
  };

  void test('a failing stdout ends the command without a stack trace, and a key it could not show is named with the way on', async () => {
    // Setup: a tenant with a session to export.
    const url = await createTestDatabase();
    const db = makePgDb({ connectionString: url, max: 1 });
    const dir = mkdtempSync(path.join(tmpdir(), 'mnemos-out-'));
    try {
      const { tenant_id } = await createTenant(db, 'reader');
      const lines = Array.from({ length: 5 }, (_, i) =>
        JSON.stringify({ id: `m${i}`, role: 'user', content: `line ${i}` }),
      );
      writeFileSync(path.join(dir, 's.jsonl'), lines.join('\n') + '\n');
      const imported = cli(
        ['import', 'jsonl', path.join(dir, 's.jsonl'), '--tenant', tenant_id, '--session', 's'],
        {
          DATABASE_URL: url,
        },
      );
      assert.equal(imported.status, 0, imported.stderr);

      // Action and assert: export to a reader that is gone ends as SIGPIPE ends a Unix tool:
      // status 141, nothing on stderr.
      const piped = await toClosedPipe(['export', 's', '--tenant', tenant_id], { DATABASE_URL: url });
      assert.equal(piped.status, 141, piped.stderr);
      assert.equal(piped.stderr, '');

      // A full disk: one line, status 1; with --out too (it waited forever for a 'drain').
      const full = toFullDisk(['export', 's', '--tenant', tenant_id], { DATABASE_URL: url });
      assert.equal(full.status, 1, full.stderr);
      noStackTrace(full.stderr);
      assert.match(
        full.stderr,
        /^mnemos: cannot write to stdout \(ENOSPC: no space left on device, write\)$/m,
      );
      const out = cli(['export', 's', '--tenant', tenant_id, '--out', '/dev/full'], { DATABASE_URL: url });
      assert.equal(out.status, 1, out.stderr);
      noStackTrace(out.stderr);
      assert.match(out.stderr, /^mnemos: ENOSPC: no space left on device, write$/m);

      // tenant create and key create name what they created, and the way on from a key not shown.
      const created = toFullDisk(['tenant', 'create', 'unseen', '--json'], { DATABASE_URL: url });
      assert.equal(created.status, 1, created.stderr);
      noStackTrace(created.stderr);
      const [, newTenant, lostKey] =
        /^mnemos: cannot write to stdout \(ENOSPC[^)]*\): tenant (t_\w+) was created, but its API key \(key id (\w+)\) was not shown and cannot be shown again: run `mnemos key create --tenant \1` for a new key, and `mnemos key revoke \2` to revoke the unseen one$/m.exec(
          created.stderr,
        ) ?? assert.fail(created.stderr);
      const keys = (await keyList(db, newTenant)).items;
      assert.deepEqual(
        keys.map((k) => [k.key_id, k.revoked_at]),
        [[lostKey, null]],
      );
      const another = await toClosedPipe(['key', 'create', '--tenant', newTenant!], { DATABASE_URL: url });
      assert.equal(another.status, 141, another.stderr);
      noStackTrace(another.stderr);
      const [, anotherKey] =
        new RegExp(
          `^mnemos: cannot write to stdout \\(write EPIPE\\): key (\\w+) of tenant ${newTenant} was created, but it was not shown and cannot be shown again: run \`mnemos key create --tenant ${newTenant}\` for a new key, and \`mnemos key revoke \\1\` to revoke the unseen one$`,
          'm',
        ).exec(another.stderr) ?? assert.fail(another.stderr);
      assert.deepEqual(
        (await keyList(db, newTenant)).items.map((k) => k.key_id).sort(),
        [lostKey, anotherKey].sort(),
      );
      // The way on works as said.
      const revoked = cli(['key', 'revoke', lostKey!], { DATABASE_URL: url });
      assert.equal(revoked.status, 0, revoked.stderr);
    } finally {
      rmSync(dir, { recursive: true, force: true });
      await db.close();
      await dropTestDatabase(url);
    }
  });
});

void describe('CLI and Redis', () => {
  void test('an unreachable Redis is said in a few lines, ending with the one that names it', async () => {
    // Setup
    const url = await createTestDatabase();
    try {
      // Action
      const r = cli(['export', 's1', '--tenant', 'nobody'], {
        DATABASE_URL: url,
        REDIS_URL: 'redis://127.0.0.1:1',
        MNEMOS_PREFIX: testPrefix(),
      });

      // Assert
      assert.equal(r.status, 1, r.stderr);
      const lines = r.stderr.trimEnd().split('\n');
      assert.ok(lines.length <= 3, `at most a few lines:\n${r.stderr}`);
      assert.match(lines.at(-1)!, /^mnemos: cannot reach Redis at redis:\/\/127\.0\.0\.1:1/);
    } finally {
      await dropTestDatabase(url);
    }
  });
});

void describe('start-up configuration', () => {
  void test('a DATABASE_URL without a database name warns which database Postgres will use', () => {
    const warned = (env: Record<string, string>) =>
      loadConfig(env).warnings.filter((w) => w.startsWith('DATABASE_URL'));
    assert.match(
      warned({ DATABASE_URL: 'postgres://postgres@127.0.0.1:5432' })[0] ?? '',
      /DATABASE_URL names no database: Postgres will use database "postgres"/,
    );
    assert.match(
      warned({ DATABASE_URL: 'postgres://app:pw@db.internal/', PGDATABASE: 'other' })[0] ?? '',
      /will use database "other" \(PGDATABASE\)/,
    );
    assert.match(
      warned({ DATABASE_URL: 'postgres://@/?host=/run/postgresql', USER: 'alice' })[0] ?? '',
      /will use database "alice"/,
    );
    assert.deepEqual(warned({ DATABASE_URL: 'postgres://postgres@127.0.0.1:5432/mnemos' }), []);
    assert.deepEqual(warned({ DATABASE_URL: 'postgres://u@/mnemos?host=/run/postgresql' }), []);
  });

  void test('DATABASE_URL beside a data directory that holds an embedded database warns that it is not used', () => {
    const dir = mkdtempSync(path.join(tmpdir(), 'mnemos-datadir-'));
    try {
      const warned = (env: Record<string, string>) =>
        loadConfig({ MNEMOS_DATA_DIR: dir, ...env }).warnings.filter((w) => w.startsWith('MNEMOS_DATA_DIR'));
      const url = 'postgres://postgres@127.0.0.1:5432/mnemos';
      assert.deepEqual(warned({ DATABASE_URL: url }), [], 'no embedded database there yet');
      mkdirSync(path.join(dir, 'pgdata'));
      writeFileSync(path.join(dir, 'pgdata', 'PG_VERSION'), '17\n');
      assert.match(
        warned({ DATABASE_URL: url })[0] ?? '',
        /holds an embedded database, which is not used while DATABASE_URL is set: its tenants, API keys and sessions/,
      );
      assert.deepEqual(warned({}), [], 'embedded mode uses it');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  void test('an unknown MNEMOS_ variable is warned about, with the closest setting when it is a typo', () => {
    const c = loadConfig({ MNEMOS_PREFX: 'mine', MNEMOS_REDIS_URL: 'redis://r:6379', MNEMOS_COLOUR: 'blue' });
    assert.equal(c.prefix, 'mnemos');
    assert.deepEqual(c.warnings, [
      'MNEMOS_PREFX is not a mnemos setting and is ignored (did you mean MNEMOS_PREFIX?)',
      'MNEMOS_REDIS_URL is not a mnemos setting and is ignored (did you mean REDIS_URL?)',
      'MNEMOS_COLOUR is not a mnemos setting and is ignored (see README "Configuration")',
    ]);
    // Settings, and names read beside the service (the client's, docker-compose.yml's), are not.
    assert.deepEqual(
      loadConfig({
        MNEMOS_PREFIX: 'mine',
        MNEMOS_DATA_DIR: './d',
        MNEMOS_API_KEY: 'mn_x',
        MNEMOS_URL: 'http://127.0.0.1:8080',
        MNEMOS_PORT: '8081',
        MNEMOS_EMPTY: '',
      }).warnings,
      [],
    );
  });

  void test('MNEMOS_ADMIN_TOKEN with spaces, control characters or non-ASCII stops the start', () => {
    for (const token of [
      ' '.repeat(16),
      'a-good-token-0123 ',
      'tab\tinside-0123456',
      'ünïcode-token-0123456',
    ]) {
      assert.throws(
        () => loadConfig({ MNEMOS_ADMIN_TOKEN: token }),
        (err: unknown) =>
          err instanceof ConfigError &&
          /MNEMOS_ADMIN_TOKEN: must be printable ASCII without spaces: it is sent in an Authorization header/.test(
            err.message,
          ),
        JSON.stringify(token),
      );
    }
    assert.equal(
      loadConfig({ MNEMOS_ADMIN_TOKEN: 'Ab0-_.~+/=!#$%&*^|0123' }).adminToken,
      'Ab0-_.~+/=!#$%&*^|0123',
    );
    // The CLI exits 78 on it, like every configuration error.
    const r = cli(['tenant', 'list'], {
      MNEMOS_ADMIN_TOKEN: 'a-good-token-0123 ',
      DATABASE_URL: 'postgres://postgres@127.0.0.1:1/x',
    });
    assert.equal(r.status, 78, r.stderr);
    assert.match(r.stderr, /MNEMOS_ADMIN_TOKEN: must be printable ASCII/);
  });

  void test('the start banner shows the Redis prefix, and the admin API for keys when an admin token is set', async () => {
    // Setup
    const url = await createTestDatabase();
    const prefix = testPrefix();
    try {
      // Action
      const child = spawn(process.execPath, ['bin/mnemos.js', 'api'], {
        env: {
          ...process.env,
          DATABASE_URL: url,
          MNEMOS_PREFIX: prefix,
          PORT: '0',
          LOG_LEVEL: 'silent',
          MNEMOS_ADMIN_TOKEN: 'banner-admin-token-0123456789',
        },
        stdio: ['ignore', 'pipe', 'inherit'],
      });
      let out = '';
      const banner = await new Promise<string>((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`no banner within 60 s:\n${out}`)), 60_000);
        child.stdout.on('data', (d: Buffer) => {
          out += d.toString();
          if (/Health:/.test(out)) {
            clearTimeout(timer);
            resolve(out);
          }
        });
        child.once('exit', (code) => reject(new Error(`exited (${code}):\n${out}`)));
      });
      child.kill('SIGTERM');
      await waitExit(child);

      // Assert
      assert.match(banner, new RegExp(`^ {2}Prefix: +${prefix} +\\(MNEMOS_PREFIX`, 'm'));
      assert.match(banner, /^ {2}API keys: +curl -X POST http:\/\/\S+\/v1\/admin\/tenants /m);
    } finally {
      await deleteRedisPrefix(prefix);
      await dropTestDatabase(url);
    }
  });
});

void describe('the Redis namespace a database is used with', () => {
  void test('a start with another MNEMOS_PREFIX or Redis database is refused, saying how to move; the move works once the old prefix is drained', async () => {
    // Setup: an API-only process on prefix A accepts c1, which waits in A's inbox (no worker).
    const url = await createTestDatabase();
    const [a, b] = [testPrefix(), testPrefix()];
    const running: TestService[] = [];
    const start = async (
      prefix: string,
      mode: 'api' | 'serve' = 'serve',
      env: Record<string, string> = {},
    ) => {
      const svc = await startTestService({ databaseUrl: url, prefix, mode, env });
      running.push(svc);
      return svc;
    };
    try {
      const first = await start(a, 'api');
      const t = await first.newTenant();
      const post = (svc: TestService, id: string) =>
        api(svc.base, t.apiKey).post('/v1/sessions/s/messages?wait=true', {
          messages: [{ id, role: 'user', content: `text of ${id}` }],
        });
      assert.equal((await post(first, 'c1')).status, 202);
      await first.stop();

      // Action and assert: serve on prefix B, A in another Redis database, and a CLI command that
      // uses Redis, each refuse, naming both namespaces and the way to move on purpose.
      await assert.rejects(start(b), (err: Error) => {
        assert.match(
          err.message,
          new RegExp(
            `used with Redis prefix "${a}" in Redis database 0, but this process is configured with prefix "${b}" in Redis database 0`,
          ),
        );
        assert.match(err.message, /If the setting changed by mistake, set it back/);
        assert.match(err.message, /run `mnemos redis-namespace --accept` with the new settings/);
        return true;
      });
      await assert.rejects(
        start(a, 'serve', { REDIS_URL: `${REDIS_URL}/1` }),
        /configured with prefix "[^"]+" in Redis database 1/,
      );
      const cliB = (args: string[]) => cli(args, { DATABASE_URL: url, MNEMOS_PREFIX: b });
      const del = cliB(['tenant', 'delete', t.tenantId]);
      assert.equal(del.status, 1, del.stderr);
      assert.match(del.stderr, new RegExp(`^mnemos: this database is used with Redis prefix "${a}"`, 'm'));

      // The move: refused while c1 waits under A; recorded once A's worker archived it.
      const early = cliB(['redis-namespace', '--accept']);
      assert.equal(early.status, 1, early.stdout);
      assert.match(
        early.stderr,
        new RegExp(`1 accepted message still waits to be archived under prefix "${a}" in Redis database 0`),
      );
      const drain = await start(a);
      assert.equal((await post(drain, 'c1')).status, 201);
      await drain.stop();
      const moved = cliB(['redis-namespace', '--accept']);
      assert.equal(moved.status, 0, moved.stderr);
      assert.match(moved.stdout, new RegExp(`^recorded prefix "${b}" in Redis database 0$`, 'm'));

      // Under B the session goes on after c1; A is the one refused now.
      const next = await start(b);
      const d1 = await post(next, 'd1');
      assert.equal(d1.status, 201, d1.text);
      assert.deepEqual(d1.body.messages, [{ id: 'd1', seq: 2 }]);
      await next.stop();
      await assert.rejects(start(a), new RegExp(`used with Redis prefix "${b}"`));
    } finally {
      for (const svc of running) await svc.stop().catch(() => undefined);
      await deleteRedisPrefix(a);
      await deleteRedisPrefix(b);
      await dropTestDatabase(url);
    }
  });
  void test('a process or command refused for another MNEMOS_PREFIX leaves no key under that prefix', async () => {
    // Setup: a database whose first start recorded prefix A.
    const url = await createTestDatabase();
    const [a, b] = [testPrefix(), testPrefix()];
    try {
      await (await startTestService({ databaseUrl: url, prefix: a, mode: 'api' })).stop();

      // Action: a worker, a whole service and a CLI command that uses Redis, each on prefix B.
      for (const mode of ['worker', 'serve'] as const)
        await assert.rejects(
          startTestService({ databaseUrl: url, prefix: b, mode }),
          new RegExp(`used with Redis prefix "${a}"`),
        );
      const del = cli(['tenant', 'delete', 'nobody'], { DATABASE_URL: url, MNEMOS_PREFIX: b });
      assert.equal(del.status, 1, del.stderr);
      assert.match(del.stderr, new RegExp(`used with Redis prefix "${a}"`));

      // Assert: nothing under B (BullMQ wrote each queue's <prefix>:<queue>:meta before the refusal,
      // so a later look at that Redis showed a second deployment that never ran).
      const redis = new Redis(REDIS_URL);
      try {
        const [, keys] = await redis.scan('0', 'MATCH', `${b}:*`, 'COUNT', 100_000);
        assert.deepEqual(keys, []);
      } finally {
        redis.disconnect();
      }
    } finally {
      await deleteRedisPrefix(a);
      await deleteRedisPrefix(b);
      await dropTestDatabase(url);
    }
  });
});

void describe('start-up banner', () => {
  void test("the embedded banner's key command works pasted into a shell, also in a path with spaces and quotes", () => {
    const dir = mkdtempSync(path.join(tmpdir(), "mnemos banner's dir "));
    try {
      writeFileSync(path.join(dir, FIRST_KEY_FILE), 'mn_key_secret\n');
      const config = loadConfig({ MNEMOS_DATA_DIR: dir });
      const line = embeddedBannerLines(config, 'http://127.0.0.1:1').find((l) => l.includes('API key:'))!;
      const command = /API key:\s+(export .*?)\s{3}\(/.exec(line)?.[1];
      assert.ok(command, line);
      const r = spawnSync('sh', ['-c', `${command}; printf %s "$MNEMOS_API_KEY"`], { encoding: 'utf8' });
      assert.equal(r.stderr, '');
      assert.equal(r.stdout, 'mn_key_secret');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
