import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import express from 'express';
import { pino } from 'pino';
import type { Db } from '../db/pool.js';
import { makeErrorHandler } from '../services/http-errors.js';
import { makeKeyAuthenticator } from '../services/tenants.js';
import { ADMIN_TOKEN, api, deleteRedisPrefix, startTestService } from './support/harness.js';
import type { TestService } from './support/harness.js';

/** `depth` objects, each holding the next under "k", the innermost holding a string. */
const nestedObjects = (depth: number): unknown => {
  let v: unknown = 'leaf';
  for (let i = 0; i < depth; i++) v = { k: v };
  return v;
};

/** How deep a body may nest (services/app.ts MAX_BODY_DEPTH). */
const MAX_BODY_DEPTH = 128;

/** A POST /messages body whose brackets nest `depth` deep: body, messages, message, metadata, arrays. */
const bodyNested = (depth: number) =>
  `{"messages":[{"role":"user","content":"x","metadata":{"a":${'['.repeat(depth - 4)}${']'.repeat(depth - 4)}}}]}`;

void describe('security hardening', () => {
  let svc: TestService;
  before(async () => {
    svc = await startTestService();
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
  });

  void test('a body nested deeper than the limit is a 400 before it is parsed; metadata at its own limit is still accepted', async () => {
    // Setup
    const t = await svc.newTenant();
    const post = (sid: string, body: string) =>
      t.api.raw(`/v1/sessions/${sid}/messages?wait=true`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body,
      });

    // Action: 200 nested arrays in metadata, 100,000, and one level past the limit.
    const deep = await post('deep', bodyNested(200));
    const deeper = await post('deep', bodyNested(100_000));
    const past = await post('deep', bodyNested(MAX_BODY_DEPTH + 1));

    // Assert: each refused for its nesting, and nothing stored.
    for (const r of [deep, deeper, past]) {
      assert.equal(r.status, 400, r.text.slice(0, 200));
      assert.equal(r.body.error.code, 'body_too_deep');
      assert.equal(
        r.body.error.message,
        'request body is nested more than 128 levels deep (objects and arrays)',
      );
    }
    assert.equal((await t.api.get('/v1/sessions/deep')).status, 404, 'nothing was stored');

    // At the limit the body is parsed, and the metadata's own limit (64 levels) answers.
    const atLimit = await post('deep', bodyNested(MAX_BODY_DEPTH));
    assert.equal(atLimit.status, 400);
    assert.equal(atLimit.body.error.code, 'validation_failed');
    assert.match(atLimit.body.error.message, /nested more than 64 levels deep/);

    // The documented maximum (63 nested objects holding a string: 64 levels) is stored as sent,
    // and brackets and escaped quotes inside strings are text, not nesting.
    const text = `a \\" ${'['.repeat(300)} \\\\" ${'{'.repeat(300)}`;
    const ok = await t.api.post('/v1/sessions/ok/messages?wait=true', {
      messages: [{ role: 'user', content: text, metadata: nestedObjects(63) }],
    });
    assert.equal(ok.status, 201, ok.text.slice(0, 300));
    const stored = await t.api.get('/v1/sessions/ok/messages');
    assert.deepEqual(stored.body.messages[0].metadata, nestedObjects(63));
    assert.equal(stored.body.messages[0].content, text);
    const over = await t.api.post('/v1/sessions/ok/messages', {
      messages: [{ role: 'user', content: 'x', metadata: nestedObjects(64) }],
    });
    assert.equal(over.status, 400);
    assert.match(over.body.error.message, /nested more than 64 levels deep/);
  });

  void test('a JSON Lines import line nested deeper than the limit is a 400 naming the line, and nothing is imported', async () => {
    const t = await svc.newTenant();
    const deepLine = `{"role":"user","content":"x","metadata":{"a":${'['.repeat(100_000)}${']'.repeat(100_000)}}}`;
    const r = await t.api.raw('/v1/sessions/imp/import', {
      method: 'POST',
      headers: { 'content-type': 'application/x-ndjson' },
      body: `{"role":"user","content":"first"}\n${deepLine}\n`,
    });
    assert.equal(r.status, 400, r.text.slice(0, 200));
    assert.equal(r.body.error.code, 'body_too_deep');
    assert.equal(r.body.error.details.line, 2);
    assert.equal((await t.api.get('/v1/sessions/imp')).status, 404, 'nothing was imported');
  });

  void test('tool arguments sent as a JSON string are checked for depth before they are parsed', async () => {
    const t = await svc.newTenant();
    const deep = `{"keyword":"x","z":${'['.repeat(200)}${']'.repeat(200)}}`;
    const r = await t.api.post('/v1/sessions/s/tools/chat_history', JSON.stringify(deep));
    assert.equal(r.status, 200, r.text.slice(0, 200));
    assert.match(r.body.content, /^Invalid arguments for chat_history: nested more than 128 levels deep/);
    // At 127 levels the string is parsed and read as arguments, as before.
    const fine = `{"keyword":"x","z":${'['.repeat(126)}${']'.repeat(126)}}`;
    const ok = await t.api.post('/v1/sessions/s/tools/chat_history', JSON.stringify(fine));
    assert.match(ok.body.content, /unknown field/);
  });

  void test('the admin API takes the admin token as a bearer token only; Bull Board still takes Basic', async () => {
    // Setup: what a browser sends with remembered Basic credentials.
    const basic = `Basic ${Buffer.from(`admin:${ADMIN_TOKEN}`).toString('base64')}`;
    const bearer = api(svc.base, ADMIN_TOKEN);
    const name = `basic-${randomBytes(4).toString('hex')}`;
    const t = await svc.newTenant();
    const keyCount = async () =>
      (await bearer.get(`/v1/admin/tenants/${t.tenantId}/keys`)).body.keys.length as number;
    const keysBefore = await keyCount();

    // Action
    const created = await api(svc.base).post('/v1/admin/tenants', { name }, { authorization: basic });
    // A form another site's page posts: no fields, so no body.
    const formKey = await fetch(`${svc.base}/v1/admin/tenants/${t.tenantId}/keys`, {
      method: 'POST',
      headers: { authorization: basic, 'content-type': 'application/x-www-form-urlencoded' },
    });

    // Assert: 401s, and nothing was created.
    assert.equal(created.status, 401);
    assert.equal(created.body.error.code, 'unauthorized');
    assert.match(created.body.error.message, /Bearer/);
    assert.equal(formKey.status, 401);
    const tenants = (await bearer.get('/v1/admin/tenants')).body.tenants as Array<{ name: string }>;
    assert.ok(!tenants.some((x) => x.name === name), 'no tenant was created');
    assert.equal(await keyCount(), keysBefore, 'no key was created');

    // The bearer token still works, and the board still opens with Basic.
    assert.equal((await bearer.post('/v1/admin/tenants', { name })).status, 201);
    const board = await fetch(`${svc.base}/admin/queues`, { headers: { authorization: basic } });
    assert.equal(board.status, 200);
    assert.match(await board.text(), /<html/i);
  });

  void test('an unhandled error is logged with its type, message, code and stack, never its other fields', async () => {
    // Setup: a route that meets a Postgres error nothing maps (a check violation, whose DETAIL
    // quotes the row), and one that throws an error carrying a `detail`.
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino(
      { level: 'warn' },
      { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) },
    );
    const app = express();
    app.get('/check', async () => {
      await svc.deps.db.transaction(async (tx) => {
        await tx.query('CREATE TEMP TABLE notes (note text CHECK (length(note) < 5)) ON COMMIT DROP');
        await tx.query('INSERT INTO notes VALUES ($1)', ['private message text']);
      });
    });
    app.get('/thrown', () => {
      throw Object.assign(new Error('boom'), { code: 'E_BOOM', detail: 'private message text' });
    });
    app.use(makeErrorHandler(logger));
    const server = app.listen(0, '127.0.0.1');
    await new Promise((resolve) => server.once('listening', resolve));
    const base = `http://127.0.0.1:${(server.address() as { port: number }).port}`;
    try {
      // Action
      const answers = [await fetch(`${base}/check`), await fetch(`${base}/thrown`)];

      // Assert: generic 500s; the log lines say what failed and where, and quote no data.
      assert.deepEqual(
        answers.map((r) => r.status),
        [500, 500],
      );
      const of = (path: string) => lines.find((l) => l.route === path && l.msg === 'unhandled error');
      for (const path of ['/check', '/thrown']) {
        const line = of(path);
        assert.ok(line, `logged ${path}`);
        assert.ok(!JSON.stringify(line).includes('private message text'), JSON.stringify(line));
        const err = line.err as Record<string, unknown>;
        assert.deepEqual(
          Object.keys(err).filter((k) => !['type', 'name', 'message', 'code', 'stack'].includes(k)),
          [],
        );
        assert.match(String(err.stack), /^ {4}at /m);
      }
      const check = of('/check')!;
      assert.equal(check.pg_code, '23514');
      assert.match(String(check.pg_message), /violates check constraint "notes_note_check"/);
      assert.deepEqual(
        [(check.err as { type?: unknown }).type, (check.err as { code?: unknown }).code],
        ['error', '23514'],
      );
      const thrown = of('/thrown')!.err as Record<string, unknown>;
      assert.deepEqual([thrown.type, thrown.message, thrown.code], ['Error', 'boom', 'E_BOOM']);
    } finally {
      server.close();
    }
  });

  void test('a valid key stays cached while 10,001 unknown keys are looked up', async () => {
    // Setup: the key authenticator over a Db that counts key reads by id, on a clock that stands
    // still (no entry grows old).
    const t = await svc.newTenant();
    const reads = new Map<string, number>();
    const counting: Db = {
      ...svc.deps.db,
      query: (async (text: string, params?: unknown[], opts?: Parameters<Db['query']>[2]) => {
        if (text.includes('FROM api_keys WHERE id')) {
          const id = String(params?.[0]);
          reads.set(id, (reads.get(id) ?? 0) + 1);
        }
        return svc.deps.db.query(text, params, opts);
      }) as Db['query'],
    };
    const keys = makeKeyAuthenticator(counting, () => 1_000_000);
    const validId = t.apiKey.split('_')[1]!;
    const secret = t.apiKey.split('_')[2]!;
    const base32 = 'abcdefghijklmnopqrstuvwxyz234567';
    const unknownKey = (i: number) => {
      let id = '';
      for (let n = i, d = 0; d < 12; d++, n = Math.floor(n / 32)) id += base32[n % 32];
      return `mn_${id}_${secret}`;
    };
    assert.notEqual(await keys.authenticate(t.apiKey), null);

    // Action: 10,001 distinct well-formed keys that do not exist, 50 at a time.
    for (let i = 0; i < 10_001; i += 50) {
      const batch = Array.from({ length: Math.min(50, 10_001 - i) }, (_, j) => unknownKey(i + j));
      const answers = await Promise.all(batch.map((k) => keys.authenticate(k)));
      assert.ok(
        answers.every((a) => a === null),
        'answers.every((a) => a === null)',
      );
    }

    // Assert: the valid key is still answered from the cache, and so is a repeated unknown one.
    assert.equal((await keys.authenticate(t.apiKey))?.tenantId, t.tenantId);
    assert.equal(reads.get(validId), 1, 'the valid key was read from Postgres once');
    assert.equal(await keys.authenticate(unknownKey(10_000)), null);
    assert.equal(reads.get(unknownKey(10_000).split('_')[1]!), 1, 'a repeated unknown key is not read again');
    // A revocation here (clear) still forgets the valid key at once.
    keys.clear();
    assert.notEqual(await keys.authenticate(t.apiKey), null);
    assert.equal(reads.get(validId), 2);
  });
});
