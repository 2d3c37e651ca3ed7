import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { chown, mkdir, mkdtemp, readdir, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { hostname, tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import {
  EmbeddedLockedError,
  EmbeddedOpenError,
  EmbeddedReentryError,
  PGLITE_PG_MAJOR,
  openPgliteDb,
} from '../db/embedded.js';
import type { EmbeddedDb } from '../db/embedded.js';
import { migrate } from '../db/migrate.js';
import { makePgDb } from '../db/pool.js';
import { initVectorIndex, insertSessionVectors } from '../db/queries/vectors.js';
import { ReembedBusyError, reembed, reembedCommand } from '../services/recent-index/reembed.js';
import { makeEmbedder } from '../services/recent-index/embedder.js';
import { ftsDocument } from '../services/text/fts-text.js';
import {
  ADMIN_TOKEN,
  REDIS_URL,
  api,
  deleteRedisPrefix,
  eventually,
  testConfig,
  testPrefix,
} from './support/harness.js';
import type { Api, Res } from './support/harness.js';
import { freePort } from './support/private-redis.js';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const bin = path.join(root, 'bin', 'mnemos.js');

/** The environment of a user with only Redis: no DATABASE_URL, no LLM. */
function embeddedEnv(extra: Record<string, string>): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...process.env, LOG_LEVEL: 'warn', REDIS_URL, ...extra };
  for (const k of ['DATABASE_URL', 'OPENAI_API_KEY', 'OPENAI_BASE_URL', 'DECISION_MODEL', 'EMBEDDING_MODEL'])
    delete env[k];
  return env;
}

interface Child {
  proc: ChildProcess;
  output: () => string;
  exited: Promise<number | null>;
}

/** After a suite: its server killed if still running, its data dir and Redis keys removed. */
async function cleanUp(server: Child | null, dataDir: string, prefix: string): Promise<void> {
  if (server?.proc.exitCode === null) {
    server.proc.kill('SIGKILL');
    await server.exited;
  }
  await rm(dataDir, { recursive: true, force: true });
  await deleteRedisPrefix(prefix);
}

function startChild(args: string[], env: NodeJS.ProcessEnv): Child {
  const proc = spawn(process.execPath, [bin, ...args], { cwd: root, env, stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  proc.stdout!.on('data', (d: Buffer) => (out += d.toString()));
  proc.stderr!.on('data', (d: Buffer) => (out += d.toString()));
  const exited = new Promise<number | null>((resolve) => proc.once('exit', (code) => resolve(code)));
  return { proc, output: () => out, exited };
}

function runCli(args: string[], env: NodeJS.ProcessEnv) {
  const r = spawnSync(process.execPath, [bin, ...args], {
    cwd: root,
    env,
    encoding: 'utf8',
    // A CLI start (tsx, PGlite) is seconds; on a loaded machine one took over 60 s (status null).
    timeout: 180_000,
  });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

/** A data dir, Redis prefix, port and environment of its own for an embedded `mnemos serve`. */
async function embeddedSetup(tmpName: string) {
  const dataDir = await mkdtemp(path.join(tmpdir(), tmpName));
  const prefix = testPrefix();
  const base = `http://127.0.0.1:${await freePort()}`;
  const env = embeddedEnv({
    MNEMOS_DATA_DIR: dataDir,
    MNEMOS_PREFIX: prefix,
    MNEMOS_ADMIN_TOKEN: ADMIN_TOKEN,
    PORT: new URL(base).port,
    HOST: '127.0.0.1',
  });
  return { dataDir, prefix, base, env };
}

/**
 * Starts `mnemos serve` and waits until it is ready (failing at once if it exits); one that never
 * gets ready is killed before the error is thrown, so that no suite leaves it running.
 */
async function startServe(env: NodeJS.ProcessEnv, base: string): Promise<Child> {
  const child = startChild(['serve'], env);
  await eventually(
    async () => {
      if (child.proc.exitCode !== null) throw new Error(`mnemos serve exited early:\n${child.output()}`);
      return (await fetch(`${base}/readyz`).catch(() => null))?.status === 200;
    },
    90_000,
    'embedded mnemos serve to be ready',
  ).catch(async (err: unknown) => {
    if (child.proc.exitCode === null) {
      child.proc.kill('SIGKILL');
      await child.exited;
    }
    throw err;
  });
  return child;
}

/** True when the app answered with its catch-all 404 ("no route for …"): the route is not built yet. */
const routeMissing = (r: Res) =>
  r.status === 404 &&
  /no route/i.test(String((r.body as { error?: { message?: string } })?.error?.message ?? ''));

void describe('mnemos serve without DATABASE_URL (embedded PGlite)', () => {
  let dataDir: string;
  let prefix: string;
  let env: NodeJS.ProcessEnv;
  let base: string;
  let server: Child | null = null;
  let firstKey: string;
  let user: Api;
  const SID = 'embedded-1';
  const texts = [
    'the zeppelin landed near the harbour',
    'noted: zeppelin at the harbour',
    'what about trains?',
  ];

  const startServer = async () => {
    server = await startServe(env, base);
    return server;
  };

  const stopServer = async () => {
    const child = server;
    if (!child) return null;
    server = null;
    child.proc.kill('SIGTERM');
    return child.exited;
  };

  before(async () => {
    ({ dataDir, prefix, base, env } = await embeddedSetup('mnemos-embedded-'));
    await startServer();
  });

  after(() => cleanUp(server, dataDir, prefix));

  void it('creates tenant "default" on first start and leaves its key in a 0600 file, not on stdout', async () => {
    const keyFile = path.join(dataDir, 'first-api-key.txt');
    firstKey = (await readFile(keyFile, 'utf8')).trim();
    assert.match(firstKey, /^mn_[a-z2-7]{12}_[A-Za-z0-9]{40}$/);
    assert.equal((await stat(keyFile)).mode & 0o777, 0o600);
    assert.ok(server!.output().includes(keyFile), 'the banner names the key file');
    assert.ok(!server!.output().includes(firstKey), 'the key itself is never printed');
    const r = await api(base, firstKey).get('/v1/sessions');
    assert.equal(r.status, 200);
    assert.deepEqual(r.body.sessions, []);
  });

  void it('creates a tenant through the admin API and stores messages durably with ?wait=true', async () => {
    const t = await api(base, ADMIN_TOKEN).post('/v1/admin/tenants', { name: 'embedded-user' });
    assert.equal(t.status, 201, t.text);
    user = api(base, t.body.api_key as string);
    const posted = await user.post(`/v1/sessions/${SID}/messages?wait=true`, {
      messages: texts.map((content, i) => ({ id: `m${i + 1}`, role: i % 2 ? 'assistant' : 'user', content })),
    });
    assert.equal(posted.status, 201, posted.text);
    assert.deepEqual(
      posted.body.messages.map((m: { id: string; seq: number }) => m.id),
      ['m1', 'm2', 'm3'],
    );
    const list = await user.get(`/v1/sessions/${SID}/messages`);
    assert.equal(list.status, 200);
    assert.deepEqual(
      list.body.messages.map((m: { content: string }) => m.content),
      texts,
    );
    assert.equal(list.body.messages[0].sent_at_ns.constructor, String);
    // The first tenant cannot see it.
    assert.equal((await api(base, firstKey).get(`/v1/sessions/${SID}/messages`)).status, 404);
  });

  void it('serves keyword search from the embedded archive', async (t) => {
    const r = await user.post(`/v1/sessions/${SID}/search`, { query: 'zeppelin', match: 'keyword' });
    if (routeMissing(r)) return t.skip('POST /v1/sessions/:sid/search is not built yet');
    assert.equal(r.status, 200, r.text);
    const hits = (r.body.hits as Array<{ id: string; context?: Array<{ id: string }> }>).flatMap((h) => [
      h.id,
      ...(h.context ?? []).map((c) => c.id),
    ]);
    assert.ok(hits.includes('m1') && hits.includes('m2'), `both zeppelin messages found: ${r.text}`);
    assert.ok(!(r.body.hits as Array<{ id: string }>).some((h) => h.id === 'm3'), 'm3 is not a hit');
  });

  void it('answers 10,000-character queries of CJK or many words, and keeps serving', async () => {
    // PGlite's WASM stack: a 7,000-bigram phrase once returned no rows (a false 404) and the next
    // statement hung the whole process. Each request gets a deadline so a hang fails, not stalls.
    const cjk = Array.from({ length: 9_000 }, (_, i) => String.fromCodePoint(0x4e00 + ((i * 7919) % 20_000)));
    const queries = [
      '記'.repeat(10_000),
      cjk.join(''),
      'x記'.repeat(5_000),
      Array.from({ length: 1_500 }, (_, i) => `w${i}`).join('-'),
      `"${Array.from({ length: 1_500 }, (_, i) => `w${i}`).join(' ')}"`,
      // A phrase of many CJK runs is one chain of them (parse-query.ts cjkRunsPhrase).
      `"${'記憶 記、'.repeat(1_600)}"`,
      `zeppelin -"${'記'.repeat(9_000)}"`,
    ];
    for (const query of queries) {
      for (const match of ['keyword', 'hybrid']) {
        const r = await user.raw(`/v1/sessions/${SID}/search`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ query, match }),
          signal: AbortSignal.timeout(20_000),
        });
        assert.equal(r.status, 200, `${match} ${query.slice(0, 12)}…: ${r.text.slice(0, 200)}`);
      }
    }
    const after = await user.post(`/v1/sessions/${SID}/search`, { query: 'zeppelin', match: 'keyword' });
    assert.ok(
      after.body.hits.some((h: { id: string }) => h.id === 'm1' || h.id === 'm2'),
      after.text,
    );
  });

  void it('serves semantic and hybrid search with exclusions and a time range', async () => {
    const hitIds = async (query: string, match: string) => {
      const r = await user.post(`/v1/sessions/${SID}/search`, { query, match, time_range: '1d' });
      assert.equal(r.status, 200, r.text);
      return (r.body.hits as Array<{ id: string }>).map((h) => h.id);
    };
    // The embed job runs in the same process, shortly after archiving. The shorter m2 is nearest;
    // its context then shows m1, which is no hit of its own.
    await eventually(
      async () => (await hitIds('zeppelin harbour', 'semantic'))[0] === 'm2',
      15_000,
      'm2 first',
    );
    for (const match of ['semantic', 'hybrid']) {
      const ids = await hitIds('zeppelin harbour -noted', match);
      assert.equal(ids[0], 'm1', `${match}: ${ids.join()}`);
      assert.ok(!ids.includes('m2'), `${match}: ${ids.join()}`);
    }
  });

  void it('serves the context window from the embedded archive', async (t) => {
    const r = await user.post(`/v1/sessions/${SID}/context`, {});
    if (routeMissing(r)) return t.skip('POST /v1/sessions/:sid/context is not built yet');
    assert.equal(r.status, 200, r.text);
    assert.deepEqual(
      (r.body.messages as Array<{ content: unknown }>).slice(0, 3).map((m) => m.content),
      texts,
    );
    assert.equal(r.body.summary_version, 0);
  });

  void it('refuses a second process on the data dir while serve runs, pointing to the admin API', () => {
    const r = runCli(['tenant', 'list'], env);
    assert.notEqual(r.status, 0);
    assert.match(r.stderr, /in use by process \d+/);
    assert.match(r.stderr, /admin API/);
  });

  void it('stops on SIGTERM, releases the data dir, and the CLI then opens it directly', async () => {
    assert.equal(await stopServer(), 0);
    assert.ok(!existsSync(path.join(dataDir, 'mnemos.lock')), 'lock file removed');
    const r = runCli(['tenant', 'list', '--json'], env);
    assert.equal(r.status, 0, r.stderr);
    const names = (JSON.parse(r.stdout) as Array<{ name: string }>).map((x) => x.name).sort();
    assert.deepEqual(names, ['default', 'embedded-user']);
    // --tenant takes a name as well as an id; an unknown one or a blank new name is an error.
    const keys = runCli(['key', 'list', '--tenant', 'default', '--json'], env);
    assert.equal(keys.status, 0, keys.stderr);
    assert.deepEqual(
      (JSON.parse(keys.stdout) as Array<{ name: string }>).map((k) => k.name),
      ['default'],
    );
    assert.notEqual(runCli(['key', 'list', '--tenant', 'nobody'], env).status, 0);
    const blank = runCli(['tenant', 'create', ' '], env);
    assert.notEqual(blank.status, 0);
    assert.match(blank.stderr, /name: must not be blank/);
  });

  void it('restarts on the same data dir with every message and key intact', async () => {
    await startServer();
    const list = await user.get(`/v1/sessions/${SID}/messages`);
    assert.equal(list.status, 200);
    assert.deepEqual(
      list.body.messages.map((m: { id: string; content: string }) => [m.id, m.content]),
      texts.map((c, i) => [`m${i + 1}`, c]),
    );
    // Seq continues after a restart (never reused).
    const more = await user.post(`/v1/sessions/${SID}/messages?wait=true`, {
      messages: [{ id: 'm4', role: 'user', content: 'after restart' }],
    });
    assert.equal(more.status, 201, more.text);
    assert.ok(
      more.body.messages[0].seq > Math.max(...list.body.messages.map((m: { seq: number }) => m.seq)),
      'more.body.messages[0].seq > Math.max(...list.body.messages.map((m: { seq: number }) => m.seq))',
    );
    // No second "default" tenant on restart.
    const tenants = await api(base, ADMIN_TOKEN).get('/v1/admin/tenants');
    assert.equal(tenants.body.tenants.filter((x: { name: string }) => x.name === 'default').length, 1);
    assert.equal((await api(base, firstKey).get('/v1/sessions')).status, 200);
    assert.equal(await stopServer(), 0);
  });

  void it('with LOG_LEVEL=info, CLI logs go to stderr: an export to stdout imports back', async () => {
    const info = { ...env, LOG_LEVEL: 'info' };
    const exported = runCli(['export', SID, '--tenant', 'embedded-user'], info);
    assert.equal(exported.status, 0, exported.stderr);
    assert.match(exported.stderr, /PGlite\) opened/, 'the info log is written, to stderr');
    const lines = exported.stdout.trimEnd().split('\n');
    for (const line of lines) {
      const row = JSON.parse(line) as Record<string, unknown>;
      assert.ok(!('level' in row) && !('msg' in row), `a log line on stdout: ${line}`);
    }
    const file = path.join(dataDir, 'export.jsonl');
    await writeFile(file, exported.stdout);
    const imported = runCli(
      ['import', 'jsonl', file, '--tenant', 'embedded-user', '--session', 'embedded-copy'],
      info,
    );
    assert.equal(imported.status, 0, imported.stderr);
    assert.match(imported.stdout, /^embedded-copy: imported 4 messages/);
    const key = runCli(['key', 'create', '--tenant', 'embedded-user', '--json'], info);
    assert.equal(key.status, 0, key.stderr);
    assert.match((JSON.parse(key.stdout) as { api_key: string }).api_key, /^mn_/);
  });

  for (const mode of ['api', 'worker']) {
    void it(`"mnemos ${mode}" without DATABASE_URL exits non-zero with a message naming DATABASE_URL`, () => {
      const r = runCli([mode], env);
      assert.notEqual(r.status, 0);
      assert.match(r.stderr, /DATABASE_URL/);
      assert.match(r.stderr, /mnemos serve/);
    });
  }
});

void describe('an embedded data directory across starts', () => {
  let dataDir: string;
  let prefix: string;
  let env: NodeJS.ProcessEnv;
  let base: string;
  let server: Child | null = null;

  const start = async () => {
    server = await startServe(env, base);
  };
  const stop = async () => {
    const child = server;
    server = null;
    child?.proc.kill('SIGTERM');
    return child?.exited;
  };

  before(async () => {
    ({ dataDir, prefix, base, env } = await embeddedSetup('mnemos-embedded-starts-'));
  });

  after(() => cleanUp(server, dataDir, prefix));

  void it('creates tenant "default" on the first start only: not again once every tenant is erased', async () => {
    const keyFile = path.join(dataDir, 'first-api-key.txt');
    await start();
    const admin = api(base, ADMIN_TOKEN);
    const first = await admin.get('/v1/admin/tenants');
    assert.deepEqual(
      first.body.tenants.map((t: { name: string }) => t.name),
      ['default'],
    );
    assert.ok(existsSync(keyFile), 'existsSync(keyFile)');
    assert.equal((await admin.del(`/v1/admin/tenants/${first.body.tenants[0].tenant_id}`)).status, 204);
    assert.equal(await stop(), 0);
    await rm(keyFile);
    await start();
    assert.deepEqual((await admin.get('/v1/admin/tenants')).body.tenants, []);
    assert.ok(!existsSync(keyFile), 'no new key file');
    assert.equal(await stop(), 0);
  });

  void it('a data dir of another Postgres version stops the CLI and serve, naming the directory and version', async () => {
    const pgdata = path.join(dataDir, 'pgdata');
    assert.equal((await readFile(path.join(pgdata, 'PG_VERSION'), 'utf8')).trim(), PGLITE_PG_MAJOR);
    await writeFile(path.join(pgdata, 'PG_VERSION'), '15\n');
    const cli = runCli(['tenant', 'list'], env);
    const serve = runCli(['serve'], env);
    for (const r of [cli, serve]) {
      assert.notEqual(r.status, 0);
      assert.ok(r.stderr.includes(`the data directory ${pgdata} could not be opened`), r.stderr);
      assert.match(r.stderr, /PG_VERSION says "15"/);
      assert.match(r.stderr, /restore it from a backup/i);
    }
  });
});

void describe('openPgliteDb (the embedded Db adapter)', () => {
  let dir: string;
  let db: EmbeddedDb;

  before(async () => {
    dir = await mkdtemp(path.join(tmpdir(), 'mnemos-pglite-'));
    db = await openPgliteDb(dir);
    await migrate(db);
  });

  after(async () => {
    await db?.close();
    await rm(dir, { recursive: true, force: true });
  });

  void it('applies the migrations, with pgvector, on PostgreSQL 18', async () => {
    const v = await db.query<{ v: string }>(`SELECT current_setting('server_version') AS v`);
    assert.match(v.rows[0]!.v, /^18\./);
    const ext = await db.query<{ extversion: string }>(
      `SELECT extversion FROM pg_extension WHERE extname = 'vector'`,
    );
    assert.equal(ext.rows.length, 1);
    const tables = await db.query<{ tablename: string }>(
      `SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename`,
    );
    for (const t of [
      'api_keys',
      'message_vectors',
      'messages',
      'schema_migrations',
      'sessions',
      'summaries',
      'tenants',
    ]) {
      assert.ok(
        tables.rows.some((r) => r.tablename === t),
        `table ${t}`,
      );
    }
    assert.deepEqual(await migrate(db), [], 'a second run applies nothing');
  });

  void it('returns values typed like node-postgres: int8 as string, bytea as Buffer, timestamptz as Date', async () => {
    const r = await db.query<{ a: unknown; arr: unknown; b: unknown; c: unknown; j: unknown; n: unknown }>(
      `SELECT 9007199254740993::int8 AS a, ARRAY[1, 2]::int8[] AS arr, '\\x0102ff'::bytea AS b,
              '2024-01-02T03:04:05Z'::timestamptz AS c, '{"k":[1]}'::jsonb AS j, 3::int AS n`,
    );
    const row = r.rows[0]!;
    assert.equal(row.a, '9007199254740993');
    assert.deepEqual(row.arr, ['1', '2']);
    assert.ok(Buffer.isBuffer(row.b), 'Buffer.isBuffer(row.b)');
    assert.deepEqual([...(row.b as Buffer)], [1, 2, 255]);
    assert.ok(row.c instanceof Date, 'row.c instanceof Date');
    assert.equal((row.c as Date).toISOString(), '2024-01-02T03:04:05.000Z');
    assert.deepEqual(row.j, { k: [1] });
    assert.equal(row.n, 3);
    assert.equal(r.rowCount, 1);
    const ins = await db.query(`INSERT INTO tenants (id, name) VALUES ('t_a', 'a'), ('t_b', 'b')`);
    assert.equal(ins.rowCount, 2);
  });

  void it('indexes text with invisible format characters as Postgres 15 does', async () => {
    // Every format character (Unicode category Cf) between two words, and two texts as users write them.
    const formats: string[] = [];
    for (let c = 0x80; c < 0x110000; c++) {
      if ((c < 0xd800 || c > 0xdfff) && /\p{Cf}/u.test(String.fromCodePoint(c)))
        formats.push(String.fromCodePoint(c));
    }
    assert.ok(formats.length > 100, `${formats.length} format characters`);
    const texts = [
      ...formats.map((f) => `soft${f}ware`),
      'the soft\u00adware ships',
      '\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 a new deploy',
    ];
    const sql = `SELECT t, mnemos_archive_tsvector(t, '')::text AS v FROM unnest($1::text[]) t`;
    const ens = texts.map((t) => ftsDocument(t).en);
    const embedded = (await db.query<{ v: string }>(sql, [ens])).rows.map((r) => r.v);
    const server = makePgDb({ connectionString: process.env.TEST_DATABASE_ADMIN_URL!, max: 1 });
    try {
      // The server's own parser on the same folded text (the migration's function is not there).
      const onPostgres = await server.query<{ v: string }>(
        `SELECT to_tsvector('english', t)::text AS v FROM unnest($1::text[]) t`,
        [ens],
      );
      assert.deepEqual(
        embedded,
        onPostgres.rows.map((r) => r.v),
      );
    } finally {
      await server.close();
    }
    assert.equal(embedded.at(-2), "'ship':3 'softwar':2");
    assert.match(embedded.at(-1)!, /'\u062e\u0648\u0627\u0647\u0645':2/);
  });

  void it('writes vectors through the flat float4[] parameter (plain JS arrays here, not binary)', async () => {
    await db.query(`INSERT INTO tenants (id, name) VALUES ('t_vec', 'vec')`);
    await db.query(`INSERT INTO sessions (tenant_id, id) VALUES ('t_vec', 's1')`);
    await db.query(
      `INSERT INTO messages (tenant_id, session_id, seq, id, role, content, sent_at_ns, sent_at_given, bytes,
                             fingerprint, search_tsv)
       SELECT 't_vec', 's1', g, 'm' || g, 'user', 'x', 0, false, 1, '', ''::tsvector FROM generate_series(1, 3) g`,
    );
    await initVectorIndex(db, 'local-hash', 3);
    const written = await db.transaction((tx) =>
      insertSessionVectors(tx, {
        tenantId: 't_vec',
        sessionId: 's1',
        startSeq: '0',
        model: 'local-hash',
        dimensions: 3,
        items: [
          { seq: '1', embedding: [0.5, -0.25, 1] },
          { seq: '3', embedding: [0, 0.125, -2] },
        ],
      }),
    );
    assert.equal(written, 2);
    const r = await db.query<{ seq: string; v: string }>(
      `SELECT seq, embedding::text AS v FROM message_vectors WHERE tenant_id = 't_vec' ORDER BY seq`,
    );
    assert.deepEqual(
      r.rows.map((x) => [x.seq, x.v]),
      [
        ['1', '[0.5,-0.25,1]'],
        ['3', '[0,0.125,-2]'],
      ],
    );
  });

  void it('maps constraint violations to SQLSTATE codes', async () => {
    await db.query(`INSERT INTO tenants (id, name) VALUES ('t_dup', 'dup')`);
    await assert.rejects(db.query(`INSERT INTO tenants (id, name) VALUES ($1, $2)`, ['t_dup', 'dup2']), {
      code: '23505',
    });
  });

  void it('runs advisory transaction locks and FOR UPDATE inside a transaction, and rolls back on throw', async () => {
    const got = await db.transaction(async (tx) => {
      await tx.query('SELECT pg_advisory_xact_lock($1)', [42]);
      await tx.query(`SET LOCAL enable_seqscan = off`);
      return (await tx.query<{ id: string }>(`SELECT id FROM tenants WHERE id = $1 FOR UPDATE`, ['t_a']))
        .rows;
    });
    assert.deepEqual(got, [{ id: 't_a' }]);
    await assert.rejects(
      db.transaction(async (tx) => {
        await tx.query(`INSERT INTO tenants (id, name) VALUES ('t_rolled', 'rolled')`);
        throw new Error('boom');
      }),
      /boom/,
    );
    const left = await db.query(`SELECT 1 FROM tenants WHERE id = 't_rolled'`);
    assert.equal(left.rows.length, 0);
  });

  void it('makes a query from outside wait for an open transaction instead of interleaving', async () => {
    const seen: string[] = [];
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const tx = db.transaction(async (t) => {
      await t.query(`INSERT INTO tenants (id, name) VALUES ('t_wait', 'wait')`);
      seen.push('tx inserted');
      await gate;
      seen.push('tx commits');
    });
    await eventually(async () => seen.includes('tx inserted'), 10_000, 'the transaction to insert');
    const outside = db
      .query<{ n: number }>(`SELECT count(*)::int AS n FROM tenants WHERE id = 't_wait'`)
      .then((r) => {
        seen.push('outside ran');
        return r.rows[0]!.n;
      });
    // Give the outside query every chance to overtake: it must not.
    await new Promise((r) => setImmediate(r));
    assert.deepEqual(seen, ['tx inserted']);
    release();
    await tx;
    assert.equal(await outside, 1, 'the outside query sees the committed row');
    assert.deepEqual(seen, ['tx inserted', 'tx commits', 'outside ran']);
  });

  void it('fails fast (instead of deadlocking) on a db query issued from inside its own transaction', async () => {
    await assert.rejects(
      db.transaction(async () => {
        await db.query('SELECT 1');
      }),
      EmbeddedReentryError,
    );
    const still = await db.query<{ one: number }>('SELECT 1 AS one');
    assert.equal(still.rows[0]!.one, 1, 'the database is still usable');
  });

  void it('refuses a second opener of the same data dir while it is open', async () => {
    await assert.rejects(openPgliteDb(dir), EmbeddedLockedError);
  });

  void it('takes over a lock left by a dead process, or naming a live one started after it, but not one held by a live process', async () => {
    await db.close();
    const lock = path.join(dir, 'mnemos.lock');
    const dead = spawnSync(process.execPath, ['-e', '0']).pid!;
    await writeFile(lock, JSON.stringify({ pid: dead, host: hostname() }));
    db = await openPgliteDb(dir);
    assert.equal((JSON.parse(await readFile(lock, 'utf8')) as { pid: number }).pid, process.pid);
    await db.close();
    // A pid reused by a live process that started after the lock was taken (after a reboot, pids
    // start over): on Linux /proc tells. It refused every start.
    const yearAgo = new Date(Date.now() - 365 * 86_400_000).toISOString();
    await writeFile(lock, JSON.stringify({ pid: process.ppid, host: hostname(), started_at: yearAgo }));
    if (process.platform === 'linux') {
      db = await openPgliteDb(dir);
      assert.equal((JSON.parse(await readFile(lock, 'utf8')) as { pid: number }).pid, process.pid);
      await db.close();
    }
    // The same live pid with a lock taken after it started, or one that does not say when: its own.
    for (const lockAt of [new Date().toISOString(), undefined]) {
      await writeFile(lock, JSON.stringify({ pid: process.ppid, host: hostname(), started_at: lockAt }));
      await assert.rejects(openPgliteDb(dir), EmbeddedLockedError, `lock taken at ${lockAt}`);
    }
    await rm(lock);
    // A live process that holds the directory is never passed over.
    const holder = lockStarter();
    try {
      assert.deepEqual(await holder.next(), { ready: true });
      holder.proc.send({ at: Date.now(), dir });
      assert.deepEqual(await holder.next(), { ok: true });
      await assert.rejects(openPgliteDb(dir), (err: unknown) => {
        assert.ok(err instanceof EmbeddedLockedError, 'err instanceof EmbeddedLockedError');
        assert.match(err.message, new RegExp(`in use by process ${holder.proc.pid}`));
        return true;
      });
      holder.proc.send({ release: true });
      assert.deepEqual(await holder.next(), { released: true });
    } finally {
      holder.proc.send({});
    }
    db = await openPgliteDb(dir);
  });

  void it('mnemos reembed resumes a run killed mid-way without --force: the lock proves it is gone', async () => {
    // What a reembed killed with -9 leaves: its lease, taken a moment ago.
    await db.query('DELETE FROM vector_index');
    await initVectorIndex(db, 'local-hash', 256);
    await db.query(
      `UPDATE vector_index SET state = 'reembedding', target_model = 'local-hash', target_dimensions = 384,
         reembed_id = 'killed', reembed_started_at = now(), updated_at = now()`,
    );
    const config = testConfig({ MNEMOS_DATA_DIR: dir });
    const embedder = makeEmbedder(config, null);
    // Against Postgres the same lease means another process may be at work.
    await assert.rejects(reembed(db, config, embedder), ReembedBusyError);
    const lines: string[] = [];
    const result = await reembedCommand(db, config, { print: (l) => lines.push(l) });
    assert.equal(result.status, 'rebuilt', lines.join('\n'));
    const index = await db.query<{ model: string; dimensions: number; state: string }>(
      'SELECT model, dimensions, state FROM vector_index',
    );
    assert.deepEqual(index.rows, [{ model: 'local-hash', dimensions: 384, state: 'ready' }]);
  });

  void it('persists across close and reopen', async () => {
    const name = `persist-${randomBytes(3).toString('hex')}`;
    await db.query(`INSERT INTO tenants (id, name) VALUES ($1, $2)`, [`t_${name}`, name]);
    await db.close();
    db = await openPgliteDb(dir);
    const r = await db.query<{ name: string }>(`SELECT name FROM tenants WHERE id = $1`, [`t_${name}`]);
    assert.deepEqual(r.rows, [{ name }]);
  });
});

/** One process that locks a data dir when told, at a given instant, and releases it when told. */
function lockStarter() {
  const code = `
    import { lockDataDir } from ${JSON.stringify(path.join(root, 'db', 'embedded.ts'))};
    let release = null;
    process.on('message', async (m) => {
      if (m.at) {
        while (Date.now() < m.at);
        try {
          release = await lockDataDir(m.dir);
          process.send({ ok: true });
        } catch (e) {
          process.send({ ok: false, name: e.name, message: e.message });
        }
      } else if (m.release) {
        await release();
        process.send({ released: true });
      } else process.disconnect();
    });
    process.send({ ready: true });`;
  const proc = spawn(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', code], {
    cwd: root,
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
  });
  const inbox: Array<Record<string, unknown>> = [];
  const waiting: Array<(m: Record<string, unknown>) => void> = [];
  proc.on('message', (m: Record<string, unknown>) => {
    const w = waiting.shift();
    if (w) w(m);
    else inbox.push(m);
  });
  const next = () =>
    new Promise<Record<string, unknown>>((resolve) => {
      const m = inbox.shift();
      if (m) resolve(m);
      else waiting.push(resolve);
    });
  return { proc, next };
}

void describe('embedded data directory edge cases', () => {
  let scratch: string;

  before(async () => {
    scratch = await mkdtemp(path.join(tmpdir(), 'mnemos-embedded-edges-'));
  });

  after(() => rm(scratch, { recursive: true, force: true }));

  void it('gives a stale lock to exactly one of several starters at the same instant; the others are told who has it', async () => {
    const dir = await mkdtemp(path.join(scratch, 'race-'));
    const lock = path.join(dir, 'mnemos.lock');
    const dead = spawnSync(process.execPath, ['-e', '0']).pid!;
    const starters = Array.from({ length: 4 }, lockStarter);
    try {
      for (const s of starters) assert.deepEqual(await s.next(), { ready: true });
      for (let round = 0; round < 40; round++) {
        // What a kill -9 leaves, then four starts at one instant.
        await writeFile(lock, JSON.stringify({ pid: dead, host: hostname() }));
        const at = Date.now() + 50;
        for (const s of starters) s.proc.send({ at, dir });
        const results = await Promise.all(starters.map((s) => s.next()));
        const winners = starters.filter((_, i) => results[i]!.ok);
        assert.equal(winners.length, 1, `round ${round}: ${JSON.stringify(results)}`);
        const owner = winners[0]!.proc.pid!;
        assert.equal((JSON.parse(await readFile(lock, 'utf8')) as { pid: number }).pid, owner);
        for (const r of results.filter((x) => !x.ok)) {
          assert.equal(r.name, 'EmbeddedLockedError', `round ${round}: ${String(r.message)}`);
          assert.match(String(r.message), new RegExp(`in use by process ${owner}\\b`));
        }
        winners[0]!.proc.send({ release: true });
        assert.deepEqual(await winners[0]!.next(), { released: true });
        assert.ok(!existsSync(lock), 'the release removes the lock');
      }
    } finally {
      for (const s of starters) if (s.proc.connected) s.proc.disconnect();
      await Promise.all(
        starters.map((s) =>
          s.proc.exitCode !== null ? null : new Promise((resolve) => s.proc.once('exit', resolve)),
        ),
      );
    }
  });

  void it('runs with a TMPDIR it cannot write (tsx compiles without its cache)', () => {
    // A path below a regular file: unusable even for root, who ignores permissions.
    const r = runCli(['--help'], embeddedEnv({ TMPDIR: '/etc/hostname/x' }));
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.stdout, /Usage: mnemos/);
    assert.doesNotMatch(r.stderr, /ENOTDIR: not a directory, mkdir|\n\s+at /);
    assert.ok(r.stderr.trim().split('\n').length <= 1, r.stderr);
  });

  void it('refuses read-only commands on a directory without a database, creating nothing', async () => {
    const cwd = await mkdtemp(path.join(scratch, 'cwd-'));
    const env = embeddedEnv({ MNEMOS_PREFIX: testPrefix() });
    delete env.MNEMOS_DATA_DIR;
    const commands: Array<[string, string[]]> = [
      ['tenant list', []],
      ['tenant delete', ['default']],
      ['key list', []],
      ['key create', ['--tenant', 'default']],
      ['key revoke', ['aaaaaaaaaaaa']],
      ['export', ['some-session', '--tenant', 'default']],
      ['reembed', []],
    ];
    const runs = await Promise.all(
      commands.map(
        ([name, args]) =>
          new Promise<{ status: number | null; stderr: string }>((resolve) => {
            const proc = spawn(process.execPath, [bin, ...name.split(' '), ...args], {
              cwd,
              env,
              stdio: ['ignore', 'ignore', 'pipe'],
            });
            let stderr = '';
            proc.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
            proc.once('exit', (status) => resolve({ status, stderr }));
          }),
      ),
    );
    runs.forEach((r, i) => {
      const name = commands[i]![0];
      assert.equal(r.status, 1, `${name}: ${r.stderr}`);
      assert.equal(
        r.stderr.trim(),
        `mnemos: no embedded database in ${path.join(cwd, 'data')} (MNEMOS_DATA_DIR, default ./data of the current ` +
          `directory), and "${name}" does not create one: set MNEMOS_DATA_DIR to your data directory (or ` +
          'DATABASE_URL for Postgres); "mnemos serve" or "mnemos tenant create <name>" creates a new database',
      );
    });
    assert.deepEqual(await readdir(cwd), [], 'nothing created');
    // An empty pgdata/ (what a failed first start leaves) is no database either.
    const dataDir = path.join(cwd, 'data');
    await mkdir(path.join(dataDir, 'pgdata'), { recursive: true });
    const list = runCli(['tenant', 'list'], { ...env, MNEMOS_DATA_DIR: dataDir });
    assert.equal(list.status, 1);
    assert.match(list.stderr, /^mnemos: no embedded database in /);
    assert.deepEqual(await readdir(path.join(dataDir, 'pgdata')), []);
    // `tenant create` still starts a new database (README Quick start), and then `tenant list` reads it.
    const created = runCli(['tenant', 'create', 'me', '--json'], { ...env, MNEMOS_DATA_DIR: dataDir });
    assert.equal(created.status, 0, created.stderr);
    const listed = runCli(['tenant', 'list', '--json'], { ...env, MNEMOS_DATA_DIR: dataDir });
    assert.equal(listed.status, 0, listed.stderr);
    assert.deepEqual(
      (JSON.parse(listed.stdout) as Array<{ name: string }>).map((t) => t.name),
      ['me'],
    );
  });

  void it('says a data dir left owned by another user is not writable, not damaged', async (t) => {
    if (process.getuid?.() !== 0) return t.skip('needs root, to leave files owned by another user');
    const nobody = 65534;
    const dataDir = await mkdtemp(path.join(scratch, 'owned-'));
    await (await openPgliteDb(dataDir)).close();
    // What `sudo mnemos ...` leaves for its user: the directories are theirs, PGlite's files root's.
    await chown(scratch, nobody, nobody);
    await chown(dataDir, nobody, nobody);
    await chown(path.join(dataDir, 'pgdata'), nobody, nobody);
    const r = spawnSync(process.execPath, [bin, 'tenant', 'list'], {
      cwd: root,
      env: embeddedEnv({ MNEMOS_DATA_DIR: dataDir }),
      encoding: 'utf8',
      uid: nobody,
      gid: nobody,
      timeout: 60_000,
    });
    assert.equal(r.status, 1, r.stderr);
    assert.match(
      r.stderr,
      new RegExp(
        `^mnemos: the data directory ${dataDir} is not writable by this user \\(uid ${nobody}\\): ${dataDir}/pgdata/\\S+ \\(EACCES\\)\\. Fix the ownership \\(chown -R ${nobody} ${dataDir}, as root\\)`,
      ),
    );
    assert.doesNotMatch(r.stderr, /damaged|backup|move .* away/);
    assert.ok(existsSync(path.join(dataDir, 'pgdata', 'PG_VERSION')), 'nothing moved or removed');
  });

  void it('prints a non-Error cause from PGlite readably', () => {
    const err = new EmbeddedOpenError('/x/pgdata', PGLITE_PG_MAJOR, '0.5.14', {
      name: 'ErrnoError',
      errno: 63,
    });
    assert.doesNotMatch(err.message, /\[object Object\]/);
    assert.match(err.message, /PGlite said: name: ErrnoError, errno: 63\)$/);
  });
});
