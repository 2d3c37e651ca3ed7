import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { once } from 'node:events';
import { readdirSync } from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import { randomBytes } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { brotliCompressSync, createGzip, deflateSync, gzipSync } from 'node:zlib';
import pg from 'pg';
import { makePgDb } from '../db/pool.js';
import { MAX_BODY_BYTES } from '../services/app.js';
import { defaultExtensions } from '../services/extensions.js';
import { makeLogger } from '../services/logger.js';
import { startService } from '../services/main.js';
import type { RunningService } from '../services/main.js';
import { createTenant } from '../services/tenants.js';
import {
  ADMIN_TOKEN,
  api,
  createTestDatabase,
  deleteRedisPrefix,
  dropTestDatabase,
  eventually,
  spawnService,
  testConfig,
  testPrefix,
} from './support/harness.js';
import type { Api, Res } from './support/harness.js';

/** How long a write may stall here before its connection is cut (WRITE_STALL_MS in production). */
const STALL_MS = 1000;

let svc: RunningService;
let dbUrl: string;
let prefix: string;
let port: number;
/** The server's side of each connection, by the client's port. */
const serverSockets = new Map<number, net.Socket>();

const sid = (what: string) => `${what}-${randomBytes(3).toString('hex')}`;

async function newTenant(): Promise<{ key: string; tenantId: string; api: Api }> {
  const t = await createTenant(svc.deps.db, `http-${randomBytes(4).toString('hex')}`);
  return { key: t.api_key, tenantId: t.tenant_id, api: api(svc.url!, t.api_key) };
}

before(async () => {
  dbUrl = await createTestDatabase();
  prefix = testPrefix();
  // A statement waits 8 s for Postgres: past the 5 s an export waits for a slot.
  const config = testConfig({ DATABASE_URL: dbUrl, MNEMOS_PREFIX: prefix, PG_REQUEST_TIMEOUT_MS: '8000' });
  svc = await startService('serve', config, {
    logger: makeLogger(config.logLevel),
    extensions: defaultExtensions,
    writeStallMs: STALL_MS,
    worker: {
      lockDurationMs: 5000,
      stalledIntervalMs: 2000,
      ingestSweepAfterMs: 2000,
      ingestSweepEveryMs: 1000,
    },
  });
  port = Number(new URL(svc.url!).port);
  svc.server!.on('connection', (s: net.Socket) => serverSockets.set(s.remotePort!, s));
});

after(async () => {
  await svc.stop();
  await dropTestDatabase(dbUrl);
  await deleteRedisPrefix(prefix);
});

interface RawAnswer {
  status: number;
  headers: Record<string, string>;
  body: Buffer;
  json: any;
}

/** Parses whole HTTP/1.1 answers off the front of `buf` (content-length or chunked bodies). */
function parseAnswers(buf: Buffer): { answers: RawAnswer[]; rest: Buffer } {
  const answers: RawAnswer[] = [];
  for (;;) {
    const end = buf.indexOf('\r\n\r\n');
    if (end < 0) break;
    const [statusLine, ...lines] = buf.subarray(0, end).toString('latin1').split('\r\n');
    const headers: Record<string, string> = {};
    for (const l of lines)
      headers[l.slice(0, l.indexOf(':')).toLowerCase()] = l.slice(l.indexOf(':') + 1).trim();
    let at = end + 4;
    let body: Buffer;
    if (headers['transfer-encoding'] === 'chunked') {
      const parts: Buffer[] = [];
      for (;;) {
        const eol = buf.indexOf('\r\n', at);
        if (eol < 0) return { answers, rest: buf };
        const size = parseInt(buf.subarray(at, eol).toString('latin1'), 16);
        if (buf.length < eol + 2 + size + 2) return { answers, rest: buf };
        parts.push(buf.subarray(eol + 2, eol + 2 + size));
        at = eol + 2 + size + 2;
        if (size === 0) break;
      }
      body = Buffer.concat(parts);
    } else {
      const length = Number(headers['content-length'] ?? 0);
      if (buf.length < at + length) break;
      body = buf.subarray(at, at + length);
      at += length;
    }
    let json: unknown = null;
    try {
      json = JSON.parse(body.toString('utf8'));
    } catch {
      /* not JSON */
    }
    answers.push({ status: Number(statusLine!.split(' ')[1]), headers, body, json });
    buf = buf.subarray(at);
  }
  return { answers, rest: buf };
}

/** Writes `raw` in one go on a new connection and collects `count` answers. */
async function rawExchange(raw: string | Buffer, count = 1): Promise<RawAnswer[]> {
  const socket = net.connect(port, '127.0.0.1');
  let buf: Buffer = Buffer.alloc(0);
  const answers: RawAnswer[] = [];
  try {
    await once(socket, 'connect');
    socket.write(raw);
    await new Promise<void>((resolve, reject) => {
      socket.on('data', (d: Buffer) => {
        const parsed = parseAnswers(Buffer.concat([buf, d]));
        answers.push(...parsed.answers);
        buf = parsed.rest;
        if (answers.length >= count) resolve();
      });
      socket.on('error', reject);
      socket.on('close', () => resolve());
    });
  } finally {
    socket.destroy();
  }
  return answers;
}

function request(
  method: string,
  path: string,
  key: string,
  body = '',
  headers: Record<string, string> = {},
): string {
  const h = { host: `127.0.0.1:${port}`, authorization: `Bearer ${key}`, ...headers };
  if (body !== '' && !Object.keys(h).some((k) => k.toLowerCase() === 'transfer-encoding'))
    Object.assign(h, { 'content-length': String(Buffer.byteLength(body)) });
  const lines = Object.entries(h).map(([k, v]) => `${k}: ${v}\r\n`);
  return `${method} ${path} HTTP/1.1\r\n${lines.join('')}\r\n${body}`;
}

const jsonHeaders = { 'content-type': 'application/json' };

/** A request whose body is sent in chunks (`transfer-encoding: chunked`, no declared length). */
function chunkedRequest(method: string, path: string, key: string, chunks: Buffer[], headers = {}): Buffer {
  const head = request(method, path, key, '', { ...jsonHeaders, 'transfer-encoding': 'chunked', ...headers });
  return Buffer.concat([
    Buffer.from(head),
    ...chunks.flatMap((c) => [Buffer.from(`${c.length.toString(16)}\r\n`), c, Buffer.from('\r\n')]),
    Buffer.from('0\r\n\r\n'),
  ]);
}

/** Archives `n` messages of about 1 MiB each (ASCII), seven to a post. */
/** The contents of a session's messages once `n` are archived, in seq order. */
async function archivedContents(api: Api, session: string, n: number): Promise<string[]> {
  await eventually(
    async () => (await api.get(`/v1/sessions/${session}/messages`)).body.messages?.length === n,
    15000,
    `the ${n} messages archived`,
  );
  const got = await api.get(`/v1/sessions/${session}/messages`);
  return got.body.messages.map((m: { content: string }) => m.content);
}

async function archiveBig(t: Api, session: string, n: number): Promise<void> {
  for (let i = 0; i < n; i += 7) {
    const messages = Array.from({ length: Math.min(7, n - i) }, (_, j) => ({
      role: 'user',
      content: `${i + j} ${'x'.repeat(1_000_000)}`,
    }));
    const r = await t.post(`/v1/sessions/${session}/messages?wait=true`, { messages });
    assert.equal(r.status, 201, r.text.slice(0, 300));
  }
}

/**
 * Sends `raw` and stops reading at once; resolves once the server has closed its side, then
 * reads what the kernel still held for the client, to the end.
 */
async function stallReading(raw: string): Promise<{ serverClosed: boolean; received: Buffer }> {
  const socket = net.connect(port, '127.0.0.1');
  await once(socket, 'connect');
  socket.pause();
  const server = await eventually(
    async () => serverSockets.get(socket.localPort!),
    5000,
    'the server socket',
  );
  socket.write(raw);
  const closed = once(server, 'close').then(() => true);
  const deadline = new Promise<boolean>((r) => setTimeout(() => r(false), STALL_MS * 20).unref());
  const serverClosed = await Promise.race([closed, deadline]);
  const parts: Buffer[] = [];
  socket.on('data', (d: Buffer) => parts.push(d));
  socket.resume();
  await Promise.race([once(socket, 'close'), new Promise((r) => setTimeout(r, 10_000).unref())]);
  socket.destroy();
  return { serverClosed, received: Buffer.concat(parts) };
}

void describe('clients that stop reading', () => {
  let t: { key: string; api: Api };
  const big = sid('big');
  before(async () => {
    t = await newTenant();
    // 21 messages of 1 MB: an export (and a page of them) far bigger than the socket buffers.
    await archiveBig(t.api, big, 21);
  });

  void test('a streamed export whose client stops reading is cut; one read to the end is whole', async () => {
    const r = await stallReading(request('GET', `/v1/sessions/${big}/export`, t.key));
    assert.ok(r.serverClosed, 'the server closed the connection');
    const text = r.received.toString('latin1');
    assert.match(text, /^HTTP\/1\.1 200 /);
    assert.ok(!text.endsWith('0\r\n\r\n'), 'the body is cut short, never complete');

    // A client that reads is not cut.
    const whole = await t.api.get(`/v1/sessions/${big}/export`);
    assert.equal(whole.status, 200);
    assert.equal(whole.text.trim().split('\n').length, 21);
  });

  void test("stalled exports are cut and give their slots back: the tenant's next export runs", async () => {
    // Its 2 slots (its share of the process's 4), each held by a client that stops reading.
    const stalled = await Promise.all(
      [1, 2].map(() => stallReading(request('GET', `/v1/sessions/${big}/export`, t.key))),
    );
    for (const r of stalled) assert.ok(r.serverClosed, 'the server closed the connection');
    const next = await t.api.get(`/v1/sessions/${big}/export`);
    assert.equal(next.status, 200, next.text.slice(0, 300));
    assert.equal(next.text.trim().split('\n').length, 21);
  });

  void test('one big JSON answer whose client stops reading is cut', async () => {
    const r = await stallReading(request('GET', `/v1/sessions/${big}/messages?limit=500`, t.key));
    assert.ok(r.serverClosed, 'the server closed the connection');
    const text = r.received.toString('latin1');
    const length = Number(/content-length: (\d+)/i.exec(text)?.[1]);
    assert.ok(length > 20_000_000, text.slice(0, 300));
    assert.ok(r.received.length - text.indexOf('\r\n\r\n') - 4 < length, 'the body is cut short');
  });

  void test('a long-poll that writes nothing while it waits is not cut', async () => {
    // A context call waiting for a seq not archived waits 5 s (MIN_SEQ_WAIT_MS), five stall bounds.
    const started = Date.now();
    const r = await t.api.post(`/v1/sessions/${big}/context`, { min_seq: 1_000_000 });
    assert.equal(r.status, 200);
    assert.equal(r.headers.get('x-mnemos-min-seq'), 'timeout');
    assert.ok(Date.now() - started >= 4000, 'it waited');
  });
});

void describe('pipelining', () => {
  void test('requests pipelined on one connection run in order: seqs follow the request order', async () => {
    const t = await newTenant();
    const s = sid('pipe');
    const raw = Array.from({ length: 20 }, (_, i) =>
      request(
        'POST',
        `/v1/sessions/${s}/messages`,
        t.key,
        JSON.stringify({ messages: [{ id: `m${i}`, role: 'user', content: `n${i}` }] }),
        jsonHeaders,
      ),
    ).join('');
    const answers = await rawExchange(raw, 20);
    assert.equal(answers.length, 20);
    const seqs = answers.map((a) => {
      assert.equal(a.status, 202, a.body.toString());
      return [a.json.messages[0].id, a.json.messages[0].seq];
    });
    assert.deepEqual(
      seqs,
      Array.from({ length: 20 }, (_, i) => [`m${i}`, i + 1]),
    );
  });

  void test('a GET pipelined after a ?wait=true post sees what the post archived', async () => {
    const t = await newTenant();
    const s = sid('pipe-wait');
    const raw =
      request(
        'POST',
        `/v1/sessions/${s}/messages?wait=true`,
        t.key,
        JSON.stringify({ messages: [{ id: 'a', role: 'user', content: 'hello' }] }),
        jsonHeaders,
      ) + request('GET', `/v1/sessions/${s}/messages`, t.key);
    const [post, get] = await rawExchange(raw, 2);
    assert.equal(post!.status, 201, post!.body.toString());
    assert.equal(get!.status, 200, get!.body.toString());
    assert.deepEqual(
      get!.json.messages.map((m: { id: string }) => m.id),
      ['a'],
    );
  });
});

void describe('request framing and headers', () => {
  const filler = Array.from({ length: 1000 }, (_, i) => `x-f${i}: y\r\n`).join('');

  void test('a second Authorization or Host behind 1,000 filler headers is still seen', async () => {
    const a = await newTenant();
    const b = await newTenant();
    const auth = await rawExchange(
      `GET /v1/sessions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer ${a.key}\r\n${filler}` +
        `authorization: Bearer ${b.key}\r\nconnection: close\r\n\r\n`,
    );
    assert.equal(auth[0]!.status, 401, auth[0]!.body.toString());
    const host = await rawExchange(
      `GET /healthz HTTP/1.1\r\nhost: x\r\n${filler}host: y\r\nconnection: close\r\n\r\n`,
    );
    assert.equal(host[0]!.status, 400);
    assert.equal(host[0]!.json.error.code, 'duplicate_host');
  });

  void test('a transfer coding other than chunked is a 501 in the error shape', async () => {
    const t = await newTenant();
    const gz = gzipSync(JSON.stringify({ messages: [{ role: 'user', content: 'zipped' }] }));
    const chunked = Buffer.concat([
      Buffer.from(`${gz.length.toString(16)}\r\n`),
      gz,
      Buffer.from('\r\n0\r\n\r\n'),
    ]);
    const s = sid('te');
    const head = request('POST', `/v1/sessions/${s}/messages`, t.key, '', {
      ...jsonHeaders,
      'transfer-encoding': 'gzip, chunked',
    });
    const [r] = await rawExchange(Buffer.concat([Buffer.from(head), chunked]));
    assert.equal(r!.status, 501, r!.body.toString());
    assert.equal(r!.json.error.code, 'unsupported_transfer_coding');
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404, 'nothing stored');
  });

  void test('an absolute-form request line imports JSON Lines like its path', async () => {
    const t = await newTenant();
    const s = sid('abs');
    const body = `${JSON.stringify({ role: 'user', content: 'one', id: 'a1' })}\n`;
    const [r] = await rawExchange(
      request('POST', `http://127.0.0.1:${port}/v1/sessions/${s}/import`, t.key, body, {
        'content-type': 'application/x-ndjson',
        connection: 'close',
      }),
    );
    assert.equal(r!.status, 201, r!.body.toString());
    assert.equal(r!.json.imported, 1);
  });

  void test('a JSON Lines import declaring more than 64 MiB is a 413 before its client is invited to send it', async () => {
    const t = await newTenant();
    const s = sid('big-lines');
    const [r] = await rawExchange(
      request('POST', `/v1/sessions/${s}/import`, t.key, '', {
        'content-type': 'application/x-ndjson',
        'content-length': String(64 * 1024 * 1024 + 1),
        expect: '100-continue',
      }),
    );
    // It was invited (100 Continue), and 64 MiB of it read before the 413.
    assert.equal(r!.status, 413, r!.body.toString());
    assert.equal(r!.json.error.code, 'body_too_large');
    assert.equal(r!.headers.connection, 'close');
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404, 'nothing stored');
  });

  void test('a chunked JSON body past 8 MiB is a 413 that closes the connection, the rest unread', async () => {
    const t = await newTenant();
    const s = sid('big-chunked');
    const socket = net.connect(port, '127.0.0.1');
    try {
      await once(socket, 'connect');
      const server = await eventually(
        async () => serverSockets.get(socket.localPort!),
        5000,
        'the server socket',
      );
      const closed = once(server, 'close');
      // (The server stops reading: what the client still writes is refused.)
      socket.on('error', () => undefined);
      const mib = Buffer.alloc(1024 * 1024, 'x');
      const raw = chunkedRequest('POST', `/v1/sessions/${s}/messages`, t.key, [
        Buffer.from('{"messages":[{"role":"user","content":"'),
        ...Array.from({ length: 40 }, () => mib),
        Buffer.from('"}]}'),
      ]);
      let got = Buffer.alloc(0);
      const answered = new Promise<RawAnswer | undefined>((resolve) => {
        socket.on('data', (d: Buffer) => {
          got = Buffer.concat([got, d]);
          const [first] = parseAnswers(got).answers;
          if (first) resolve(first);
        });
        socket.on('close', () => resolve(undefined));
      });
      socket.write(raw);
      const r = await answered;
      assert.equal(r?.status, 413, got.toString('latin1').slice(0, 300));
      assert.equal(r.json.error.code, 'body_too_large');
      // body-parser read all 40 MiB before its 413, and kept the connection open.
      assert.equal(r.headers.connection, 'close');
      await closed;
      assert.ok(
        server.bytesRead < raw.length / 2,
        `the server read ${server.bytesRead} of ${raw.length} bytes`,
      );
    } finally {
      socket.destroy();
    }
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404, 'nothing stored');
  });

  void test('a body refused before it was read to its end closes its connection: a request after it is not left hanging', async () => {
    const t = await newTenant();
    const junk = Buffer.alloc(1024 * 1024, 'a');
    const gz = gzipSync(JSON.stringify({ messages: [{ role: 'user', content: 'first' }] }));
    const next = Buffer.from(request('GET', `/v1/sessions/${sid('next')}/messages`, t.key));
    for (const [what, raw, code] of [
      [
        'not gzip, with a length',
        Buffer.concat([
          Buffer.from(
            request('POST', `/v1/sessions/${sid('gz')}/messages`, t.key, '', {
              ...jsonHeaders,
              'content-encoding': 'gzip',
              'content-length': String(junk.length),
            }),
          ),
          junk,
        ]),
        'malformed_body',
      ],
      [
        'not br, chunked',
        chunkedRequest('POST', `/v1/sessions/${sid('br')}/messages`, t.key, [junk], {
          'content-encoding': 'br',
        }),
        'malformed_body',
      ],
      [
        'data after the end of the gzip data, chunked',
        chunkedRequest('POST', `/v1/sessions/${sid('after')}/messages`, t.key, [gz, junk], {
          'content-encoding': 'gzip',
        }),
        'malformed_body',
      ],
      [
        'a JSON Lines import whose first line is no JSON, chunked',
        chunkedRequest(
          'POST',
          `/v1/sessions/${sid('lines')}/import`,
          t.key,
          [Buffer.from('no json\n'), junk],
          {
            'content-type': 'application/x-ndjson',
          },
        ),
        'malformed_json',
      ],
    ] as const) {
      const socket = net.connect(port, '127.0.0.1');
      let got: Buffer = Buffer.alloc(0);
      try {
        await once(socket, 'connect');
        socket.on('error', () => undefined);
        socket.on('data', (d: Buffer) => (got = Buffer.concat([got, d])));
        // The keep-alive timeout (65 s) is far past this wait: the connection stuck behind the
        // rest of the body was reset only then.
        const closed = Promise.race([
          once(socket, 'close').then(() => true),
          new Promise<boolean>((r) => setTimeout(() => r(false), 10_000).unref()),
        ]);
        socket.write(Buffer.concat([raw, next]));
        assert.ok(await closed, `${what}: the connection is closed, not left waiting`);
      } finally {
        socket.destroy();
      }
      const [r] = parseAnswers(got).answers;
      assert.equal(r?.status, 400, `${what}: ${got.toString('latin1').slice(0, 300)}`);
      assert.equal(r.json.error.code, code, what);
      assert.equal(r.headers.connection, 'close', `${what}: the answer says the connection closes`);
    }
  });

  void test('a refusal that closes the connection before the body is read reaches a client still sending, with no reset', async () => {
    const t = await newTenant();
    const mib = Buffer.alloc(1024 * 1024, ' ');
    for (const [what, headers, status] of [
      ['a declared length past 8 MiB', { 'content-length': String(20 * 1024 * 1024) }, 413],
      [
        'a body that is not gzip',
        { 'content-encoding': 'gzip', 'content-length': String(20 * 1024 * 1024) },
        400,
      ],
    ] as const) {
      // A client that writes its body before it reads the answer (curl, an SDK's upload).
      const socket = net.connect({ port, host: '127.0.0.1', allowHalfOpen: true });
      let got: Buffer = Buffer.alloc(0);
      let failed: string | undefined;
      try {
        await once(socket, 'connect');
        socket.on('error', (err: NodeJS.ErrnoException) => (failed = err.code));
        socket.on('data', (d: Buffer) => (got = Buffer.concat([got, d])));
        const ended = once(socket, 'end');
        socket.write(
          request('POST', `/v1/sessions/${sid('rst')}/messages`, t.key, '', { ...jsonHeaders, ...headers }),
        );
        socket.write(mib);
        await eventually(
          async () => parseAnswers(got).answers.length > 0 || failed !== undefined,
          10_000,
          'the answer',
        );
        for (let i = 0; i < 2 && failed === undefined; i++) {
          socket.write(mib);
          await new Promise((r) => setTimeout(r, 50));
        }
        socket.end();
        await Promise.race([ended, new Promise((r) => setTimeout(r, 10_000).unref())]);
        // Closed at once with the client's bytes unread, the server's kernel answered them with
        // a reset: EPIPE, often before the answer was read.
        assert.equal(failed, undefined, `${what}: the connection was reset`);
      } finally {
        socket.destroy();
      }
      const [r] = parseAnswers(got).answers;
      assert.equal(r?.status, status, `${what}: ${got.toString('latin1').slice(0, 300)}`);
      assert.equal(r.headers.connection, 'close', what);
    }
  });

  void test('charset us-ascii is UTF-8 enough; a charset inside a quoted parameter is no charset', async () => {
    const t = await newTenant();
    const s = sid('cs');
    for (const [i, type] of [
      'application/json; charset=us-ascii',
      'application/json; x="a;charset=utf-16"',
    ].entries()) {
      const r = await t.api.post(
        `/v1/sessions/${s}/messages`,
        { messages: [{ id: `c${i}`, role: 'user', content: 'plain' }] },
        { 'content-type': type },
      );
      assert.equal(r.status, 202, `${type}: ${r.text}`);
    }
    const utf16 = await t.api.post(
      `/v1/sessions/${s}/messages`,
      { messages: [{ role: 'user', content: 'x' }] },
      { 'content-type': 'application/json; x="a"; charset=utf-16' },
    );
    assert.equal(utf16.status, 415);
  });

  void test("a tenant's answers are not kept by caches: no-store, no ETag, and If-None-Match gets the answer, not a 304", async () => {
    // Setup: a session with a message, read once.
    const t = await newTenant();
    const s = sid('cache');
    assert.equal(
      (
        await t.api.post(`/v1/sessions/${s}/messages?wait=true`, {
          messages: [{ role: 'user', content: 'one' }],
        })
      ).status,
      201,
    );
    const first = await t.api.get(`/v1/sessions/${s}/messages`);

    // Action: the same read with the validator a cache would send, and an error answer.
    const again = await t.api.raw(`/v1/sessions/${s}/messages`, {
      method: 'GET',
      headers: { 'if-none-match': first.headers.get('etag') ?? '*' },
    });
    // A wildcard matches any answer by RFC 9110: Express answered it with an empty 304. (On a
    // socket of its own: fetch adds `cache-control: no-cache` to a conditional request, which
    // Express honours.)
    const wildcard = await rawExchange(
      [`/v1/sessions/${s}/messages`, `/v1/sessions/${s}`, '/v1/sessions']
        .map((path) => request('GET', path, t.key, '', { 'if-none-match': '*' }))
        .join(''),
      3,
    );
    const missing = await t.api.get(`/v1/sessions/${sid('none')}`);
    const admin = await api(svc.url!, ADMIN_TOKEN).get('/v1/admin/tenants');

    // Assert
    assert.equal(again.status, 200);
    assert.equal(again.body.messages[0].content, 'one');
    assert.deepEqual(
      wildcard.map((r) => r.status),
      [200, 200, 200],
    );
    assert.equal(wildcard[0]!.json.messages[0].content, 'one');
    for (const r of wildcard) assert.equal(r.headers['cache-control'], 'no-store');
    for (const r of [first, again, missing, admin]) {
      assert.equal(r.headers.get('cache-control'), 'no-store');
      assert.equal(r.headers.get('etag'), null);
    }
  });
});

void describe('JSON Lines import encodings', () => {
  const lines = (tag: string) =>
    [1, 2].map((i) => JSON.stringify({ id: `${tag}-${i}`, role: 'user', content: `${tag} ${i}` })).join('\n');
  const importWith = (t: Api, session: string, body: Buffer | string, encoding: string) =>
    t.raw(`/v1/sessions/${session}/import`, {
      method: 'POST',
      headers: { 'content-type': 'application/x-ndjson', 'content-encoding': encoding },
      body,
    });

  void test('Identity in any case, gzip, deflate and br are read; an unknown coding is a 415', async () => {
    const t = await newTenant();
    const plain = await importWith(t.api, sid('id'), lines('id'), 'Identity');
    assert.equal(plain.status, 201, plain.text);
    const gz = sid('gz');
    const gzipped = await importWith(t.api, gz, gzipSync(lines('gz')), 'GZip');
    assert.equal(gzipped.status, 201, gzipped.text);
    const got = await t.api.get(`/v1/sessions/${gz}/messages`);
    assert.deepEqual(
      got.body.messages.map((m: { content: string }) => m.content),
      ['gz 1', 'gz 2'],
    );
    const br = await importWith(t.api, sid('br'), brotliCompressSync(lines('br')), 'br');
    assert.equal(br.status, 201, br.text);
    const deflated = await importWith(t.api, sid('df'), deflateSync(lines('df')), 'deflate');
    assert.equal(deflated.status, 201, deflated.text);
    const bad = await importWith(t.api, sid('bad'), Buffer.from('not gzip at all'), 'gzip');
    assert.equal(bad.status, 400, bad.text);
    assert.equal(bad.body.error.code, 'malformed_body');
    // Data after a deflate or br stream's end is refused, not dropped (two gzip members are one body).
    for (const [coding, body] of [
      ['deflate', Buffer.concat([deflateSync(lines('d1')), deflateSync(lines('d2'))])],
      ['br', Buffer.concat([brotliCompressSync(lines('b1')), Buffer.from('trailing garbage')])],
    ] as const) {
      const after = await importWith(t.api, sid('after'), body, coding);
      assert.equal(after.status, 400, `${coding}: ${after.text}`);
      assert.equal(after.body.error.code, 'malformed_body');
    }
    const gz2 = sid('gz2');
    const twoMembers = Buffer.concat([gzipSync(`${lines('m1')}\n`), gzipSync(lines('m2'))]);
    assert.equal((await importWith(t.api, gz2, twoMembers, 'gzip')).status, 201);
    const all = await t.api.get(`/v1/sessions/${gz2}/messages`);
    assert.deepEqual(
      all.body.messages.map((m: { content: string }) => m.content),
      ['m1 1', 'm1 2', 'm2 1', 'm2 2'],
    );
    const unknown = await importWith(t.api, sid('zz'), lines('zz'), 'compress');
    assert.equal(unknown.status, 415, unknown.text);
  });

  void test('a gzip body that inflates past 64 MiB is a 413, counted on the decoded bytes', async () => {
    const t = await newTenant();
    // 100 MiB of blank lines (1 MiB each), about 100 KB compressed.
    const gzip = createGzip();
    const parts: Buffer[] = [];
    gzip.on('data', (d: Buffer) => parts.push(d));
    const line = Buffer.alloc(1024 * 1024, ' ');
    line[line.length - 1] = 10;
    for (let i = 0; i < 100; i++) gzip.write(line);
    gzip.end();
    await once(gzip, 'end');
    const bomb = Buffer.concat(parts);
    assert.ok(bomb.length < 1_000_000, 'bomb.length < 1_000_000');
    const s = sid('bomb');
    const r = await importWith(t.api, s, bomb, 'gzip');
    assert.equal(r.status, 413, r.text);
    assert.equal(r.body.error.code, 'body_too_large');
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404);
  });
});

void describe('JSON body encodings', () => {
  const post = (t: Api, session: string, body: Buffer, encoding: string) =>
    t.raw(`/v1/sessions/${session}/messages`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'content-encoding': encoding },
      body,
    });
  const json = (content: string) => Buffer.from(JSON.stringify({ messages: [{ role: 'user', content }] }));

  void test('gzip, deflate and br bodies are read; data after the end of a stream is a 400 and stores nothing', async () => {
    const t = await newTenant();
    const s = sid('enc');
    for (const [coding, body] of [
      ['gzip', gzipSync(json('gz'))],
      ['Deflate', deflateSync(json('df'))],
      ['br', brotliCompressSync(json('br'))],
    ] as const) {
      const r = await post(t.api, s, body, coding);
      assert.equal(r.status, 202, `${coding}: ${r.text}`);
    }
    assert.deepEqual(await archivedContents(t.api, s, 3), ['gz', 'df', 'br']);
    // body-parser's decoder stopped at a stream's end and dropped the rest: these were stored, 202.
    const other = sid('after');
    for (const [coding, body] of [
      ['deflate', Buffer.concat([deflateSync(json('d1')), deflateSync(json('d2'))])],
      ['br', Buffer.concat([brotliCompressSync(json('b1')), Buffer.from('trailing garbage')])],
      ['gzip', Buffer.from('not gzip at all')],
    ] as const) {
      const r = await post(t.api, other, body, coding);
      assert.equal(r.status, 400, `${coding}: ${r.text}`);
      assert.equal(r.body.error.code, 'malformed_body', r.text);
    }
    assert.equal((await t.api.get(`/v1/sessions/${other}`)).status, 404, 'nothing stored');
    const unknown = await post(t.api, other, json('zz'), 'compress');
    assert.equal(unknown.status, 415, unknown.text);
  });

  void test('every route reads a compressed body, once; an empty Content-Encoding is identity', async () => {
    const t = await newTenant();
    const s = sid('routes');
    const send = (path: string, body: unknown, encoding = 'gzip') =>
      t.api.raw(path, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'content-encoding': encoding },
        body: encoding === 'gzip' ? gzipSync(JSON.stringify(body)) : JSON.stringify(body),
      });
    const plain = await send(
      `/v1/sessions/${s}/messages?wait=true`,
      { messages: [{ role: 'user', content: 'zebra' }] },
      '',
    );
    assert.equal(plain.status, 201, plain.text);
    // Each is a router of its own at /v1/sessions, after the one of messages: a second decoding
    // of the body already read was a 400, and a body of unknown length charged 8 MiB per router.
    for (const [path, body, status] of [
      [`/v1/sessions/${s}/context`, { input: 'zebra' }, 200],
      [`/v1/sessions/${s}/search`, { query: 'zebra', match: 'keyword' }, 200],
      [`/v1/sessions/${s}/tools/chat_history`, { keyword: 'zebra' }, 200],
      [`/v1/sessions/${sid('imported')}/import`, { messages: [{ role: 'user', content: 'one' }] }, 201],
    ] as const) {
      const r = await send(path, body);
      assert.equal(r.status, status, `${path}: ${r.text}`);
    }
  });

  void test('a compressed body is checked on its decoded bytes: size, depth, UTF-8 and JSON', async () => {
    const t = await newTenant();
    const s = sid('dec');
    const big = gzipSync(json('x'.repeat(9 * 1024 * 1024)));
    const tooBig = await post(t.api, s, big, 'gzip');
    assert.equal(tooBig.status, 413, tooBig.text);
    const deep = await post(t.api, s, gzipSync(Buffer.from(`${'['.repeat(200)}${']'.repeat(200)}`)), 'gzip');
    assert.equal(deep.status, 400, deep.text);
    assert.equal(deep.body.error.code, 'body_too_deep');
    const latin1 = Buffer.from('{"messages":[{"role":"user","content":"caf\xe9"}]}', 'latin1');
    const notUtf8 = await post(t.api, s, gzipSync(latin1), 'gzip');
    assert.equal(notUtf8.status, 400, notUtf8.text);
    assert.equal(notUtf8.body.error.code, 'invalid_utf8');
    const notJson = await post(t.api, s, gzipSync(Buffer.from('{"messages": [')), 'gzip');
    assert.equal(notJson.status, 400, notJson.text);
    assert.equal(notJson.body.error.code, 'malformed_json');
    assert.equal((await t.api.get(`/v1/sessions/${s}`)).status, 404, 'nothing stored');
  });

  void test('a UTF-8 BOM before a compressed or chunked body is dropped, as before a plain one', async () => {
    const t = await newTenant();
    const s = sid('bom');
    const bom = (content: string) => Buffer.concat([Buffer.from([0xef, 0xbb, 0xbf]), json(content)]);
    const plain = await post(t.api, s, bom('plain'), 'identity');
    assert.equal(plain.status, 202, plain.text);
    const gzipped = await post(t.api, s, gzipSync(bom('gzip')), 'gzip');
    assert.equal(gzipped.status, 202, gzipped.text);
    const [chunked] = await rawExchange(
      chunkedRequest('POST', `/v1/sessions/${s}/messages`, t.key, [bom('chunked')], { connection: 'close' }),
    );
    assert.equal(chunked!.status, 202, chunked!.body.toString());
    assert.deepEqual(await archivedContents(t.api, s, 3), ['plain', 'gzip', 'chunked']);
  });

  void test('a body that is only a BOM is an empty body on every path: 400 validation_failed', async () => {
    const t = await newTenant();
    const s = sid('bom-only');
    const bom = Buffer.from([0xef, 0xbb, 0xbf]);
    const plain = await post(t.api, s, bom, 'identity');
    const gzipped = await post(t.api, s, gzipSync(bom), 'gzip');
    const [chunked] = await rawExchange(
      chunkedRequest('POST', `/v1/sessions/${s}/messages`, t.key, [bom], { connection: 'close' }),
    );
    for (const [what, status, body] of [
      ['plain', plain.status, plain.body],
      ['gzip', gzipped.status, gzipped.body],
      ['chunked', chunked!.status, chunked!.json],
    ] as const) {
      assert.equal(status, 400, `${what}: ${JSON.stringify(body)}`);
      assert.equal(body.error.code, 'validation_failed', `${what}: ${JSON.stringify(body)}`);
    }
  });
});

void describe('request body memory', () => {
  /** A post of a body just under the limit, invited (100-continue) and left half sent: it holds its room. */
  const heldBody = async (key: string, session: string, method = 'POST'): Promise<net.Socket> => {
    const socket = net.connect(port, '127.0.0.1');
    await once(socket, 'connect');
    socket.write(
      request(method, `/v1/sessions/${session}/messages`, key, '', {
        ...jsonHeaders,
        'content-length': String(MAX_BODY_BYTES - 1),
        expect: '100-continue',
      }),
    );
    // (Not `for await`: leaving its loop destroys the socket.)
    let got = '';
    const signal = AbortSignal.timeout(15_000);
    while (!got.includes('\r\n\r\n')) got += String((await once(socket, 'data', { signal }))[0]);
    assert.match(got, /^HTTP\/1\.1 100 Continue/, got);
    socket.write('{"messages":[');
    return socket;
  };
  const busy = async (t: Api, session: string, scope: string) => {
    const r = await t.post(`/v1/sessions/${session}/messages`, {
      messages: [{ role: 'user', content: 'x' }],
    });
    assert.equal(r.status, 503, r.text);
    assert.equal(r.body.error.code, 'body_busy');
    assert.equal(r.body.error.details.scope, scope);
    assert.ok(r.headers.get('retry-after'), 'retry-after');
  };

  void test("bodies being read hold a tenant's share and the process's: the next one waits, then 503 body_busy; room comes back", async () => {
    const [a, b, c] = [await newTenant(), await newTenant(), await newTenant()];
    const s = sid('mem');
    const held: net.Socket[] = [];
    try {
      // Four bodies of 8 MiB are one tenant's share (32 MiB): its next request finds none. GET
      // bodies count too: body-parser reads them.
      for (let i = 0; i < 4; i++) held.push(await heldBody(a.key, s, i % 2 ? 'GET' : 'POST'));
      await busy(a.api, s, 'tenant');
      const other = await b.api.post(`/v1/sessions/${s}/messages`, {
        messages: [{ role: 'user', content: 'b' }],
      });
      assert.equal(other.status, 202, `another tenant goes on: ${other.text}`);
      // Four more of another tenant fill the process's 64 MiB.
      for (let i = 0; i < 4; i++) held.push(await heldBody(b.key, s));
      await busy(c.api, s, 'process');
    } finally {
      for (const socket of held) socket.destroy();
    }
    await eventually(
      async () =>
        (await c.api.post(`/v1/sessions/${s}/messages`, { messages: [{ role: 'user', content: 'c' }] }))
          .status === 202,
      15_000,
      'room back once the held bodies are gone',
    );
    assert.equal(
      (await a.api.get(`/v1/sessions/${s}`)).status,
      404,
      "none of the tenant's held posts was stored",
    );
  });
  void test('a pipelined request whose connection dies while its answer waits behind another gives its room back', async () => {
    const [a, b] = [await newTenant(), await newTenant()];
    const s = sid('pipe');
    const held: net.Socket[] = [];
    let socket: net.Socket | undefined;
    try {
      // B's share is held: B's next post waits for room, and what is pipelined behind it waits
      // for its answer.
      for (let i = 0; i < 4; i++) held.push(await heldBody(b.key, s));
      socket = net.connect(port, '127.0.0.1');
      await once(socket, 'connect', { signal: AbortSignal.timeout(15_000) });
      const small = JSON.stringify({ messages: [{ role: 'user', content: 'x' }] });
      socket.write(request('POST', `/v1/sessions/${s}/messages`, b.key, small, jsonHeaders));
      // Four compressed posts of A (each counted as 8 MiB: A's whole share), answered behind it.
      let written = Buffer.byteLength(
        request('POST', `/v1/sessions/${s}/messages`, b.key, small, jsonHeaders),
      );
      for (let i = 0; i < 4; i++) {
        const gz = gzipSync(JSON.stringify({ messages: [{ role: 'user', content: `a${i}` }] }));
        const head = request('POST', `/v1/sessions/${s}/messages`, a.key, '', {
          ...jsonHeaders,
          'content-encoding': 'gzip',
          'content-length': String(gz.length),
        });
        const bytes = Buffer.concat([Buffer.from(head), gz]);
        written += bytes.length;
        socket.write(bytes);
      }
      // The server has read them all; the client goes before A's posts are handled (so they reach
      // the body's reservation with their connection closed) or while their answers wait.
      const client = socket;
      await eventually(
        async () => (serverSockets.get(client.localPort!)?.bytesRead ?? 0) >= written,
        10_000,
        'the pipelined requests read by the server',
      );
    } finally {
      socket?.destroy();
      for (const h of held) h.destroy();
    }
    // A's whole share is free again: four more bodies of 8 MiB are each invited at once.
    const again: net.Socket[] = [];
    try {
      for (let i = 0; i < 4; i++) again.push(await heldBody(a.key, s));
    } finally {
      for (const h of again) h.destroy();
    }
  });
  void test('a compressed or chunked body, once read, holds its decoded size while its route waits: the tenant goes on', async () => {
    const a = await newTenant();
    const queue = svc.deps.queues.ingest;
    const sessions = [0, 1, 2, 3].map((i) => sid(`hold${i}`));
    const body = (i: number) =>
      Buffer.from(JSON.stringify({ messages: [{ role: 'user', content: `tiny ${i}` }] }));
    // No worker drains: each ?wait=true post waits its 10 s for its messages to be archived.
    await queue.pause();
    let waits: Array<Promise<number | undefined>> = [];
    try {
      // Four posts of unknown length, each counted as 8 MiB while it is read: the tenant's share.
      waits = sessions.map((s, i) => {
        const path = `/v1/sessions/${s}/messages?wait=true`;
        const raw =
          i % 2 === 0
            ? Buffer.concat([
                Buffer.from(
                  request('POST', path, a.key, '', {
                    ...jsonHeaders,
                    'content-encoding': 'gzip',
                    'content-length': String(gzipSync(body(i)).length),
                  }),
                ),
                gzipSync(body(i)),
              ])
            : chunkedRequest('POST', path, a.key, [body(i)]);
        return rawExchange(raw).then(([r]) => r?.status);
      });
      await eventually(
        async () =>
          (await queue.getJobs(['wait', 'prioritized'])).filter((j) =>
            sessions.includes((j.data as { sessionId: string }).sessionId),
          ).length === 4,
        15_000,
        'the four posts accepted, waiting',
      );
      // Counted as 8 MiB each until their answers, they held the share: this waited, then 503.
      const r = await a.api.post(`/v1/sessions/${sid('next')}/messages`, {
        messages: [{ role: 'user', content: 'next' }],
      });
      assert.equal(r.status, 202, r.text);
      // And three bodies of 8 MiB are each invited at once: the four hold their few bytes alone.
      const held: net.Socket[] = [];
      try {
        for (let i = 0; i < 3; i++) held.push(await heldBody(a.key, sid('big')));
      } finally {
        for (const h of held) h.destroy();
      }
    } finally {
      await queue.resume();
    }
    assert.deepEqual(await Promise.all(waits), [201, 201, 201, 201]);
  });
});

void describe('export under load and faults', () => {
  /** A new tenant's session holding one archived message. */
  async function sessionWithOneMessage(tag: string) {
    const t = await newTenant();
    const s = sid(tag);
    const r = await t.api.post(`/v1/sessions/${s}/messages?wait=true`, {
      messages: [{ role: 'user', content: 'hello' }],
    });
    assert.equal(r.status, 201);
    return { t, s };
  }

  /**
   * Until `n` statements wait on the lock `locker` holds on the messages table. Of this database
   * only: pg_locks is cluster-wide, and every test database, a clone of one template, has the same
   * oid for `messages` (another file's waits counted, and the fifth export went before the four).
   */
  const waitingOnLock = (locker: pg.Client, n: number, what: string) =>
    eventually(
      async () =>
        Number(
          (
            await locker.query(
              `SELECT count(*) AS n FROM pg_locks WHERE relation = 'messages'::regclass AND NOT granted
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`,
            )
          ).rows[0].n,
        ) >= n,
      5000,
      what,
    );

  void test("while the archive is locked: a tenant's third export, or any export past the process's four, answers 503 export_busy; one whose first page times out, or a delete, a 503 that says Postgres gave no answer", async () => {
    const { t, s } = await sessionWithOneMessage('locked');
    const other = await sessionWithOneMessage('locked-other');
    const third = await sessionWithOneMessage('locked-third');
    const locker = new pg.Client({ connectionString: dbUrl });
    await locker.connect();
    try {
      await locker.query('BEGIN');
      await locker.query('LOCK TABLE messages IN ACCESS EXCLUSIVE MODE');
      // Two tenants' exports take the four slots and wait on the lock (PG_REQUEST_TIMEOUT_MS is 8 s
      // here), and so does a delete of the session, as one of a huge session's runs past the bound.
      const held = [
        ...Array.from({ length: 2 }, () => t.api.get(`/v1/sessions/${s}/export`)),
        ...Array.from({ length: 2 }, () => other.t.api.get(`/v1/sessions/${other.s}/export`)),
      ];
      const deleted = t.api.del(`/v1/sessions/${s}`);
      await waitingOnLock(locker, 5, 'four exports and a delete waiting on the lock');
      // Both wait for a slot at once, and give up before the held exports time out.
      const [own, fifth] = await Promise.all([
        t.api.get(`/v1/sessions/${s}/export`),
        third.t.api.get(`/v1/sessions/${third.s}/export`),
      ]);
      for (const [r, scope, limit] of [
        [own, 'tenant', 2],
        [fifth, 'process', 4],
      ] as const) {
        assert.equal(r.status, 503, r.text);
        assert.equal(r.body.error.code, 'export_busy');
        assert.deepEqual(r.body.error.details, { limit, scope });
        assert.equal(r.headers.get('retry-after'), '5');
      }
      for (const h of [...(await Promise.all(held)), await deleted]) {
        assert.equal(h.status, 503, h.text);
        assert.equal(h.body.error.code, 'unavailable', h.text);
        assert.deepEqual(h.body.error.details, { dependency: 'postgres' });
        // Not "postgres is unavailable": /readyz says it is fine, and it is.
        assert.match(
          h.body.error.message,
          /^Postgres gave no answer within 8000 ms \(PG_REQUEST_TIMEOUT_MS\)/,
        );
        assert.ok(h.headers.get('retry-after'), "h.headers.get('retry-after')");
        assert.match(h.headers.get('content-type') ?? '', /^application\/json/);
      }
    } finally {
      await locker.query('ROLLBACK').catch(() => undefined);
      await locker.end();
    }
    const after = await other.t.api.get(`/v1/sessions/${other.s}/export`);
    assert.equal(after.status, 200);
    assert.equal(after.text.trim().split('\n').length, 1);
  });

  void test("one tenant's exports that run past its share leave other tenants' exports a slot", async () => {
    // Setup: tenant A's four exports, waiting on the locked archive as slow readers wait on
    // their clients.
    const a = await sessionWithOneMessage('hog');
    const b = await sessionWithOneMessage('fair');
    const locker = new pg.Client({ connectionString: dbUrl });
    await locker.connect();
    const answered: Res[] = [];
    let hogs: Res[];
    let fair: Res;
    try {
      await locker.query('BEGIN');
      await locker.query('LOCK TABLE messages IN ACCESS EXCLUSIVE MODE');
      const held = Array.from({ length: 4 }, () =>
        a.t.api.get(`/v1/sessions/${a.s}/export`).then((r) => (answered.push(r), r)),
      );
      await waitingOnLock(locker, 2, "A's exports reading the archive");

      // Action: B exports while A's hold their slots; the archive comes back once A's exports
      // past its share have been answered.
      const pending = b.t.api.get(`/v1/sessions/${b.s}/export`);
      await waitingOnLock(locker, 3, 'three exports reading the archive');
      await eventually(async () => answered.length >= 2, 10_000, "A's exports past its share answered");
      await locker.query('ROLLBACK');
      [hogs, fair] = await Promise.all([Promise.all(held), pending]);
    } finally {
      await locker.query('ROLLBACK').catch(() => undefined);
      await locker.end();
    }

    // Assert: B's export is whole; A's past its share were told to wait for its own to end.
    assert.equal(fair.status, 200, fair.text);
    assert.equal(JSON.parse(fair.text.trim()).content, 'hello');
    assert.deepEqual(hogs.map((r) => r.status).sort(), [200, 200, 503, 503]);
    for (const r of hogs.filter((h) => h.status === 503)) {
      assert.equal(r.body.error.code, 'export_busy');
      assert.deepEqual(r.body.error.details, { limit: 2, scope: 'tenant' });
    }
  });

  void test('a reset that lands while the first page is read answers 409 session_changed, not a 500', async () => {
    const { t, s } = await sessionWithOneMessage('raced');
    const locker = new pg.Client({ connectionString: dbUrl });
    await locker.connect();
    try {
      // The worker embeds the message after archiving it: that transaction would wait on the lock
      // below while holding the session row the reset updates.
      await eventually(
        async () =>
          (
            await locker.query('SELECT 1 FROM message_vectors WHERE tenant_id = $1 AND session_id = $2', [
              t.tenantId,
              s,
            ])
          ).rowCount === 1,
        10000,
        'the message embedded',
      );
      await locker.query('BEGIN');
      await locker.query('LOCK TABLE messages IN ACCESS EXCLUSIVE MODE');
      // The export has read the session (its generation) and waits on its first page.
      const exported = t.api.get(`/v1/sessions/${s}/export`);
      await waitingOnLock(locker, 1, 'the export waiting on the lock');
      // What a reset does to the row the export checks after its page, committed as the lock goes.
      const bumped = await locker.query(
        'UPDATE sessions SET generation = generation + 1 WHERE tenant_id = $1 AND id = $2',
        [t.tenantId, s],
      );
      assert.equal(bumped.rowCount, 1);
      await locker.query('COMMIT');
      const r = await exported;
      assert.equal(r.status, 409, r.text);
      assert.equal(r.body.error.code, 'session_changed');
    } finally {
      await locker.query('ROLLBACK').catch(() => undefined);
      await locker.end();
    }
  });
});

void describe('out of file descriptors', () => {
  void test("a process's first JSON body read while it has no file descriptor left is not refused as a bad charset", async () => {
    // Setup: an API in a process of its own, one keep-alive connection, warmed by a GET (its key
    // cached, its Postgres and Redis connections open); no JSON body has been read yet.
    const url = await createTestDatabase();
    const ownPrefix = testPrefix();
    const child = await spawnService('api', { DATABASE_URL: url, MNEMOS_PREFIX: ownPrefix });
    const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
    let soft = '';
    try {
      // The tenant is made in the database: an admin call would read a JSON body first.
      const db = makePgDb({ connectionString: url, max: 1 });
      const key = (await createTenant(db, 'fd').finally(() => db.close())).api_key;
      const request = (method: string, path: string, body?: unknown) =>
        new Promise<{ status: number; body: string; retryAfter?: string }>((resolve, reject) => {
          const req = http.request(
            `${child.url}${path}`,
            {
              method,
              agent,
              headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
            },
            (res) => {
              let text = '';
              res.on('data', (d: Buffer) => (text += d.toString()));
              res.on('end', () =>
                resolve({ status: res.statusCode!, body: text, retryAfter: res.headers['retry-after'] }),
              );
            },
          );
          req.on('error', reject);
          req.end(body === undefined ? undefined : JSON.stringify(body));
        });
      assert.equal((await request('GET', '/v1/sessions')).status, 200);

      // Action: the process may open no more files (as at its `ulimit -n`), then reads its
      // first JSON body on the open connection.
      // A new descriptor takes the lowest free number, which must be under the limit.
      const used = new Set(readdirSync(`/proc/${child.pid}/fd`).map(Number));
      let lowestFree = 0;
      while (used.has(lowestFree)) lowestFree++;
      soft = execFileSync('prlimit', [`--pid=${child.pid}`, '--nofile', '--noheadings', '--output=SOFT'])
        .toString()
        .trim();
      execFileSync('prlimit', [`--pid=${child.pid}`, `--nofile=${lowestFree}:`]);
      const posted = await request('POST', '/v1/sessions/s/messages', {
        messages: [{ role: 'user', content: 'hello' }],
      });

      // Assert: accepted (before, 415 "unsupported charset UTF-8": the charset tables load from
      // disk on first use, and the client library does not retry a 415).
      assert.equal(posted.status, 202, posted.body);
      // A search needs a connection of the search pool, never opened: Postgres cannot be
      // reached now, a 503 to retry (before, a 500 "internal").
      const searched = await request('POST', '/v1/sessions/s/search', { query: 'hello' });
      assert.deepEqual([searched.status, searched.retryAfter], [503, '2'], searched.body);
    } finally {
      if (soft) execFileSync('prlimit', [`--pid=${child.pid}`, `--nofile=${soft}:`]);
      agent.destroy();
      await child.stop();
      await deleteRedisPrefix(ownPrefix);
      await dropTestDatabase(url);
    }
  });
});
