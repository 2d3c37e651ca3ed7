// What managed Postgres and Redis refuse a service: a role that may not create extensions, an
// extension in a schema off the search_path, a Redis user without CONFIG.
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { test } from 'node:test';
import { Redis } from 'ioredis';
import { migrate } from '../db/migrate.js';
import { makePgDb } from '../db/pool.js';
import { redisDurabilityWarnings } from '../services/redis.js';
import { ADMIN_URL, dropTestDatabase } from './support/harness.js';
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
