// Behind a pooler in transaction mode (PgBouncer), server connections are shared by every client:
// nothing mnemos sets may outlive its own transaction there. A real PgBouncer, two server
// connections, in front of this file's database.
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import { pino } from 'pino';
import { makePgDb } from '../db/pool.js';
import { createTenant, keyList, makeKeyAuthenticator, revokeKey } from '../services/tenants.js';
import { asDependencyError, type AppError } from '../services/errors.js';
import {
  ADMIN_TOKEN,
  api,
  createTestDatabase,
  dropTestDatabase,
  startTestService,
} from './support/harness.js';
import type { Api, TestService } from './support/harness.js';
import { startPgBouncer } from './support/pgbouncer.js';
import type { PgBouncer } from './support/pgbouncer.js';

const SEARCH_TIMEOUT_MS = 300;

/** What a session of another client sees on the server connections, two at once (all of them). */
async function settingsSeenByOthers(url: string): Promise<Array<Record<string, string | null>>> {
  const clients = [new pg.Client({ connectionString: url }), new pg.Client({ connectionString: url })];
  await Promise.all(clients.map((c) => c.connect()));
  try {
    // Both inside a transaction at once: each holds one of the pooler's two server connections.
    await Promise.all(clients.map((c) => c.query('BEGIN')));
    const rows = await Promise.all(
      clients.map(async (c) => {
        const r = await c.query<Record<string, string | null>>(
          `SELECT current_setting('statement_timeout') AS statement_timeout,
                  current_setting('plan_cache_mode') AS plan_cache_mode,
                  current_setting('idle_in_transaction_session_timeout') AS idle_in_transaction,
                  current_setting('hnsw.ef_search', true) AS ef_search,
                  current_setting('default_transaction_isolation') AS isolation,
                  pg_backend_pid()::text AS pid`,
        );
        return r.rows[0]!;
      }),
    );
    await Promise.all(clients.map((c) => c.query('COMMIT')));
    return rows;
  } finally {
    await Promise.all(clients.map((c) => c.end()));
  }
}

void describe('behind PgBouncer in transaction mode (PG_POOLER=transaction)', () => {
  let dbUrl: string;
  let bouncer: PgBouncer;
  let svc: TestService;
  let api: Api;
  let defaults: Array<Record<string, string | null>>;

  before(async () => {
    dbUrl = await createTestDatabase();
    bouncer = await startPgBouncer(dbUrl, 2);
    defaults = await settingsSeenByOthers(bouncer.urlOf(dbUrl));
    svc = await startTestService({
      databaseUrl: bouncer.urlOf(dbUrl),
      env: {
        PG_POOLER: 'transaction',
        SEARCH_TIMEOUT_MS: String(SEARCH_TIMEOUT_MS),
        PG_IDLE_IN_TRANSACTION_TIMEOUT_MS: '60000',
      },
    });
    ({ api } = await svc.newTenant());
  });

  after(async () => {
    await svc?.stop();
    await bouncer?.stop();
    await dropTestDatabase(dbUrl);
  });

  void test('ingest and every kind of search work, and no setting of mnemos reaches other clients', async () => {
    assert.equal(defaults.length, 2);
    assert.notEqual(defaults[0]!.pid, defaults[1]!.pid, 'two server connections');
    const sid = `pooled-${randomBytes(3).toString('hex')}`;
    const r = await api.post(`/v1/sessions/${sid}/messages?wait=true`, {
      messages: [
        { role: 'user', content: 'the connection pool is exhausted again' },
        { role: 'assistant', content: 'raise the pool size and add a timeout' },
      ],
    });
    assert.equal(r.status, 201, r.text);
    for (let i = 0; i < 20; i++) {
      for (const match of ['keyword', 'semantic', 'hybrid']) {
        const s = await api.post(`/v1/sessions/${sid}/search`, { query: 'pool timeout', match });
        assert.equal(s.status, 200, s.text);
      }
    }
    const k = await api.post(`/v1/sessions/${sid}/search`, { query: 'exhausted', match: 'keyword' });
    assert.deepEqual(
      k.body.hits.map((h: { seq: number }) => h.seq),
      [r.body.messages[0].seq],
    );
    const ctx = await api.post(`/v1/sessions/${sid}/context`, {});
    assert.equal(ctx.status, 200, ctx.text);
    // The server connections the searches ran on, as the next client finds them.
    const seen = await settingsSeenByOthers(bouncer.urlOf(dbUrl));
    // pgvector's default (40) once a connection has loaded it; unset before, or '' on a connection
    // where a keyword search's SET LOCAL made a placeholder that no vector query then loaded
    // (its value goes back to '' at the transaction's end: nothing of the search stays).
    const normal = ({ pid: _pid, ...settings }: Record<string, string | null>) => ({
      ...settings,
      ef_search: settings.ef_search || '40',
    });
    for (const s of seen) assert.deepEqual(normal(s), normal(defaults[0]!), `connection ${s.pid}`);
    // And a long statement of another client is not cancelled at the search timeout.
    const other = new pg.Client({ connectionString: bouncer.urlOf(dbUrl) });
    await other.connect();
    try {
      await other.query(`SELECT pg_sleep(${(SEARCH_TIMEOUT_MS * 2) / 1000})`);
    } finally {
      await other.end();
    }
  });

  void test('a search keeps its own settings: the search timeout and the HNSW options, for its transaction', async () => {
    const db = svc.deps.db;
    const r = await db.query<{ ef: string; timeout: string; isolation: string }>(
      `SELECT current_setting('hnsw.ef_search') AS ef, current_setting('statement_timeout') AS timeout,
              current_setting('transaction_isolation') AS isolation`,
      [],
      { search: true },
    );
    assert.deepEqual(r.rows[0], {
      ef: '100',
      timeout: `${SEARCH_TIMEOUT_MS}ms`,
      isolation: 'read committed',
    });
    await assert.rejects(
      db.query('SELECT pg_sleep(2)', [], { search: true }),
      (err: { code?: string }) => err.code === '57014',
    );
    // The connection is usable after the cancelled transaction.
    const again = await db.query<{ one: number }>('SELECT 1 AS one', [], { search: true });
    assert.equal(again.rows[0]!.one, 1);
    const plain = await db.query<{ timeout: string }>(
      `SELECT current_setting('statement_timeout') AS timeout`,
    );
    assert.equal(plain.rows[0]!.timeout, '0');
  });
});

/** A database of this run whose transactions default to serializable. */
const serializableDatabase = () => databaseWith(`default_transaction_isolation = 'serializable'`);

/** A database of this run with these settings (`name = value`) as its defaults. */
async function databaseWith(...settings: string[]): Promise<string> {
  const url = await createTestDatabase();
  const admin = makePgDb({ connectionString: url, max: 1 });
  try {
    const name = new URL(url).pathname.slice(1);
    for (const setting of settings) await admin.query(`ALTER DATABASE "${name}" SET ${setting}`);
  } finally {
    await admin.close();
  }
  return url;
}

void test('behind a pooler, a database defaulting to serializable is reported at start', async () => {
  const url = await serializableDatabase();
  const bouncer = await startPgBouncer(url, 2);
  const lines: Array<{ level: number; msg: string }> = [];
  const logger = pino({ level: 'warn' }, { write: (line: string) => void lines.push(JSON.parse(line)) });
  try {
    const svc = await startTestService({
      databaseUrl: bouncer.urlOf(url),
      env: { PG_POOLER: 'transaction' },
      logger,
    });
    await svc.stop();
    const warned = lines.find((l) => /default_transaction_isolation is serializable/.test(l.msg));
    assert.ok(warned, JSON.stringify(lines));
    assert.match(warned.msg, /ALTER ROLE <role> SET default_transaction_isolation = 'read committed'/);
  } finally {
    await bouncer.stop();
    await dropTestDatabase(url);
  }
});

void test('transactions are read committed whatever the database defaults to', async () => {
  const url = await serializableDatabase();
  const bouncer = await startPgBouncer(url, 2);
  try {
    for (const [what, db] of [
      ['direct', makePgDb({ connectionString: url, max: 2 })],
      ['pooled', makePgDb({ connectionString: bouncer.urlOf(url), max: 2, transactionPooler: true })],
    ] as const) {
      try {
        const inTx = await db.transaction((q) =>
          q.query<{ level: string }>(`SELECT current_setting('transaction_isolation') AS level`),
        );
        assert.equal(inTx.rows[0]!.level, 'read committed', what);
        if (what === 'direct') {
          const single = await db.query<{ level: string }>(
            `SELECT current_setting('transaction_isolation') AS level`,
          );
          assert.equal(single.rows[0]!.level, 'read committed', `${what}, a single statement`);
        }
      } finally {
        await db.close();
      }
    }
  } finally {
    await bouncer.stop();
    await dropTestDatabase(url);
  }
});

void test('a database printing dates as SQL, DMY and floats to 3 digits: timestamps, revocation and scores read right', async () => {
  const url = await databaseWith(`DateStyle = 'SQL, DMY'`, 'extra_float_digits = -3');
  const svc = await startTestService({ databaseUrl: url });
  try {
    const { api: user, apiKey } = await svc.newTenant();
    const admin = api(svc.base, ADMIN_TOKEN);
    const iso = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/;
    const posted = await user.post('/v1/sessions/s1/messages?wait=true', {
      messages: [{ role: 'user', content: 'the solar panels on the roof, the solar inverter in the shed' }],
    });
    assert.equal(posted.status, 201, posted.text);

    const session = await user.get('/v1/sessions/s1');
    assert.equal(session.status, 200, session.text);
    assert.match(session.body.created_at, iso);
    assert.match(session.body.last_message_at, iso);
    const sessions = await user.get('/v1/sessions');
    assert.equal(sessions.status, 200, sessions.text);
    assert.match(sessions.body.sessions[0].created_at, iso);
    const tenants = await admin.get('/v1/admin/tenants');
    assert.equal(tenants.status, 200, tenants.text);
    assert.match(tenants.body.tenants[0].created_at, iso);

    // The rank in the score (ts_rank_cd's float4, 0.16976744) as Postgres prints it by default,
    // not cut to 4 decimals (1.1698).
    const search = await user.post('/v1/sessions/s1/search', { query: 'solar roof', match: 'keyword' });
    assert.equal(search.status, 200, search.text);
    assert.equal(search.body.hits.length, 1, search.text);
    const score: number = search.body.hits[0].score;
    assert.ok(Math.abs(score - Number(score.toFixed(4))) > 1e-7, `score ${score}`);

    const keyId = apiKey.split('_')[1]!;
    assert.equal((await admin.del(`/v1/admin/keys/${keyId}`)).status, 204);
    assert.equal((await user.get('/v1/sessions/s1/messages')).status, 401);
    const [key] = (await keyList(svc.deps.db)).items.filter((k) => k.key_id === keyId);
    assert.match(key!.revoked_at ?? 'null', iso);
    assert.match(key!.created_at, iso);
  } finally {
    await svc.stop();
    await dropTestDatabase(url);
  }
});

void test('behind a pooler, a database printing dates as SQL, DMY is refused at start, and no timestamp reads as null', async () => {
  const url = await databaseWith(`DateStyle = 'SQL, DMY'`);
  const bouncer = await startPgBouncer(url, 2);
  try {
    await assert.rejects(
      startTestService({ databaseUrl: bouncer.urlOf(url), env: { PG_POOLER: 'transaction' } }),
      /DateStyle \(from the role's or the database's settings\) is 'SQL, DMY'.*ALTER ROLE <role> SET DateStyle = 'ISO, MDY', then make the pooler open new server connections/,
    );
    // Should it change after the start: a statement reading a timestamp fails; a revoked key
    // stays refused, since revocation is no timestamp read.
    const direct = makePgDb({ connectionString: url, max: 1 });
    const db = makePgDb({ connectionString: bouncer.urlOf(url), max: 1, transactionPooler: true });
    try {
      const { api_key: key } = await createTenant(direct, 'revoked');
      await revokeKey(direct, key.split('_')[1]!);
      assert.equal(await makeKeyAuthenticator(db).authenticate(key), null);
      const err: unknown = await db.query('SELECT now() AS at').then(
        () => null,
        (e: unknown) => e,
      );
      assert.match(String(err), /cannot read the timestamp .*DateStyle must be ISO/);
      // Answered as a 503 naming the setting, not a 500 "internal" beside a ready /readyz.
      const answered = asDependencyError(err) as AppError;
      assert.deepEqual([answered.status, answered.code], [503, 'unavailable']);
      assert.match(answered.message, /DateStyle.*ALTER ROLE/);
    } finally {
      await Promise.all([db.close(), direct.close()]);
    }
  } finally {
    await bouncer.stop();
    await dropTestDatabase(url);
  }
});
