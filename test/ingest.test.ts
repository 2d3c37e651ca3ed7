import assert from 'node:assert/strict';
import { request } from 'node:http';
import { after, before, describe, test } from 'node:test';
import { makePgDb } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import { drainSession } from '../workers/ingest.js';
import { runIngestSweep } from '../workers/ingest-sweep.js';
import { inboxKeys } from '../services/messages/inbox.js';
import { UNSTORABLE } from '../services/text/unstorable.js';
import { fairKey, nextFairPriority } from '../services/fair-priority.js';
import { ADMIN_TOKEN, api, deleteRedisPrefix, eventually, startTestService } from './support/harness.js';
import type { Api, TestService } from './support/harness.js';

const user = (content: string, extra: Record<string, unknown> = {}) => ({ role: 'user', content, ...extra });

async function deadLetterTotal(base: string): Promise<number> {
  const metrics = await (await fetch(`${base}/metrics`)).text();
  return Number(/^mnemos_ingest_dead_letter_total (\d+)$/m.exec(metrics)?.[1] ?? 0);
}

async function archived(
  t: Api,
  sid: string,
): Promise<Array<{ seq: number; id: string; content: unknown; sent_at_ns: string }>> {
  const out: Array<{ seq: number; id: string; content: unknown; sent_at_ns: string }> = [];
  let after: number | null = null;
  for (;;) {
    const r: { status: number; body: any } = await t.get(
      `/v1/sessions/${sid}/messages?limit=500${after !== null ? `&after_seq=${after}` : ''}`,
    );
    if (r.status === 404) return out;
    assert.equal(r.status, 200);
    out.push(...r.body.messages);
    if (r.body.next === null) return out;
    after = r.body.next;
  }
}

/** An inbox entry as the API writes it ("<seq> <gen> <json>"), to make a corrupt inbox by hand. */
const inboxEntry = (seq: number, gen: string | null, content: string, extra: Record<string, unknown> = {}) =>
  `${seq} ${gen} ${JSON.stringify({
    id: `hand-${seq}-${Math.random()}`,
    cid: false,
    role: 'user',
    content,
    parts: null,
    name: null,
    tool_call_id: null,
    tool_calls: null,
    metadata: null,
    sent_at_ns: `${Date.now()}000000`,
    sent_at_given: false,
    bytes: Buffer.byteLength(content),
    fp: 'hand',
    ...extra,
  })}`;

void describe('ingestion', () => {
  let svc: TestService;
  before(async () => {
    svc = await startTestService({ env: { TZ: 'Asia/Taipei' } });
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
  });
  /** Inbox entries dropped so far (mnemos_messages_dropped_total). */
  const droppedTotal = async () => (await svc.deps.metrics.messagesDropped.get()).values[0]?.value ?? 0;

  void test('accepts a batch with 202, archives it in order, and ?wait=true answers 201 once durable', async () => {
    const t = await svc.newTenant();
    const r = await t.api.post('/v1/sessions/chat-1/messages', {
      messages: [user('first', { id: 'm1' }), { role: 'assistant', content: 'second' }, user('third')],
    });
    assert.equal(r.status, 202);
    assert.equal(r.body.session_id, 'chat-1');
    assert.equal(r.body.accepted, 3);
    assert.deepEqual(
      r.body.messages.map((m: { seq: number }) => m.seq),
      [1, 2, 3],
    );
    assert.equal(r.body.messages[0].id, 'm1');
    assert.match(r.body.messages[1].id, /^[0-9a-f-]{36}$/);

    const w = await t.api.post('/v1/sessions/chat-1/messages?wait=true', { messages: [user('fourth')] });
    assert.equal(w.status, 201);
    const rows = await archived(t.api, 'chat-1');
    assert.deepEqual(
      rows.map((m) => [m.seq, m.content]),
      [
        [1, 'first'],
        [2, 'second'],
        [3, 'third'],
        [4, 'fourth'],
      ],
    );
    const s = await t.api.get('/v1/sessions/chat-1');
    assert.equal(s.body.message_count, 4);
    assert.ok(s.body.hot_bytes > 0, 's.body.hot_bytes > 0');
    assert.equal(s.body.pending_jobs, 0);
    assert.equal(s.body.summary, null);
  });

  void test('stores structured content, tool calls and metadata as given, in all three sent_at forms', async () => {
    const t = await svc.newTenant();
    const messages = [
      { role: 'system', content: 'be brief', sent_at: '2026-01-02T03:04:05.123456789Z' },
      { role: 'developer', content: [{ type: 'text', text: 'dev note' }], sent_at: '1767323045000000001' },
      user('naive time', { sent_at: '2026-01-02 11:04:05', metadata: { agent: 'a1', n: 1 } }),
      {
        role: 'assistant',
        content: null,
        tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'ls', arguments: '{"path":"/"}' } }],
      },
      { role: 'tool', tool_call_id: 'call_1', content: 'bin etc', name: 'ls' },
    ];
    assert.equal((await t.api.post('/v1/sessions/s/messages?wait=true', { messages })).status, 201);
    const rows = await archived(t.api, 's');
    assert.equal(rows.length, 5);
    const [sys, dev, naive, call, tool] = rows as any[];
    assert.equal(sys.sent_at, '2026-01-02T03:04:05.123456789Z');
    assert.equal(sys.sent_at_ns, '1767323045123456789');
    assert.deepEqual(dev.content, [{ type: 'text', text: 'dev note' }]);
    assert.equal(dev.sent_at_ns, '1767323045000000001');
    // 11:04:05 in Taipei (UTC+8) is 03:04:05 UTC.
    assert.equal(naive.sent_at, '2026-01-02T03:04:05.000000000Z');
    assert.deepEqual(naive.metadata, { agent: 'a1', n: 1 });
    assert.equal(call.content, null);
    assert.equal(call.tool_calls[0].function.name, 'ls');
    assert.equal(tool.tool_call_id, 'call_1');
    assert.equal(tool.name, 'ls');

    // RFC 3339 allows more fractional digits than nanoseconds: the rest are dropped.
    const fine = await t.api.post('/v1/sessions/fine/messages?wait=true', {
      messages: [user('fine', { sent_at: '2026-01-02T03:04:05.1234567891Z' })],
    });
    assert.equal(fine.status, 201, fine.text);
    assert.equal(((await archived(t.api, 'fine')) as any[])[0].sent_at_ns, '1767323045123456789');
    const finer = await t.api.post('/v1/sessions/fine/messages', {
      messages: [user('finer', { sent_at: `2026-01-02T03:04:05.${'9'.repeat(80)}Z` })],
    });
    assert.equal(finer.status, 202, finer.text);

    // The last representable instant is accepted and read back exactly.
    const edge = await t.api.post('/v1/sessions/edge/messages?wait=true', {
      messages: [user('edge', { sent_at: '2262-04-11T23:47:16.854775807Z' })],
    });
    assert.equal(edge.status, 201);
    const [last] = (await archived(t.api, 'edge')) as any[];
    assert.equal(last.sent_at, '2262-04-11T23:47:16.854775807Z');
    assert.equal(last.sent_at_ns, '9223372036854775807');

    // Metadata keys are data: an own "__proto__" key is stored, and part of the message's identity.
    const proto = (v: number) =>
      JSON.parse(
        `{"messages":[{"id":"p1","role":"user","content":"x","metadata":{"__proto__":{"v":${v}},"keep":1}}]}`,
      );
    assert.equal((await t.api.post('/v1/sessions/proto/messages?wait=true', proto(1))).status, 201);
    const [stored] = (await archived(t.api, 'proto')) as any[];
    assert.deepEqual(
      JSON.parse(JSON.stringify(stored.metadata), (_k, v: unknown) => v),
      proto(1).messages[0].metadata,
    );
    assert.match(JSON.stringify(stored.metadata), /"__proto__":\{"v":1\}/);
    assert.equal((await t.api.post('/v1/sessions/proto/messages', proto(1))).body.accepted, 0);
    const other = await t.api.post('/v1/sessions/proto/messages', proto(2));
    assert.equal(other.status, 409);
    assert.equal(other.body.error.code, 'id_conflict');
  });

  void test('last_message_at is the newest sent_at cut to microseconds, never after it', async () => {
    const t = await svc.newTenant();
    for (const [sid, sentAt, want] of [
      ['lm1', '2026-03-04T05:06:07.123999999Z', '2026-03-04T05:06:07.123Z'],
      ['lm2', '2026-01-02T03:04:05.999999999Z', '2026-01-02T03:04:05.999Z'],
    ] as const) {
      const r = await t.api.post(`/v1/sessions/${sid}/messages?wait=true`, {
        messages: [user('x', { sent_at: sentAt })],
      });
      assert.equal(r.status, 201);
      const at = (await t.api.get(`/v1/sessions/${sid}`)).body.last_message_at as string;
      // JSON dates have milliseconds: .123999 shows as .123 (it was rounded up to .124, and
      // .999999999 to the next second).
      assert.equal(at, want, sid);
    }
    // The newest of one drain's batch, not its last or first: sent_at need not follow seq order.
    const batch = await t.api.post('/v1/sessions/lm3/messages?wait=true', {
      messages: ['2026-01-01T00:00:00Z', '2026-02-01T00:00:00Z', '2025-06-01T00:00:00Z'].map((sentAt) =>
        user('x', { sent_at: sentAt }),
      ),
    });
    assert.equal(batch.status, 201);
    assert.equal((await t.api.get('/v1/sessions/lm3')).body.last_message_at, '2026-02-01T00:00:00.000Z');
  });

  void test('no answer repeats a refused NUL or lone surrogate: unknown keys, admin bodies, query names, tool texts', async () => {
    // Setup: keys holding a NUL, a lone high and a lone low surrogate, in places no message-key
    // check looks at.
    const t = await svc.newTenant();
    const admin = api(svc.base, ADMIN_TOKEN);
    const unstorable = UNSTORABLE;
    const strings = (v: unknown): string[] =>
      typeof v === 'string'
        ? [v]
        : Array.isArray(v)
          ? v.flatMap(strings)
          : v !== null && typeof v === 'object'
            ? Object.entries(v).flatMap(([k, x]) => [k, ...strings(x)])
            : [];
    for (const bad of ['k\u0000x', 'k\ud800x', '\udc00k']) {
      // Action
      const answers = [
        await t.api.post('/v1/sessions/u1/messages', { messages: [user('x')], [bad]: 1 }),
        await t.api.post('/v1/sessions/u1/search', { query: 'x', [bad]: 1 }),
        await admin.post('/v1/admin/tenants', { name: 'n', [bad]: 1 }),
        await t.api.get('/v1/sessions/u1/messages?k%00x=1'),
        await t.api.post('/v1/sessions/u1/tools/chat_history', { mode: 'list', [bad]: 1 }),
      ];

      // Assert: refused (the tool in its text, to the model), the refused key named, and nothing
      // in any answer that a strict JSON decoder would refuse.
      assert.deepEqual(
        answers.map((r) => r.status),
        [400, 400, 400, 400, 200],
        JSON.stringify(bad),
      );
      for (const r of answers) {
        const found = strings(r.body).filter((x) => unstorable.test(x));
        assert.deepEqual(found, [], `${JSON.stringify(bad)}: ${r.text}`);
        assert.match(r.text, /\\\\u(0000|d800|dc00)/, r.text);
      }
    }
  });

  void test('every validation path is a 4xx naming the field, and stores nothing', async () => {
    const t = await svc.newTenant();
    const cases: Array<[unknown, number, string, RegExp?]> = [
      [{ messages: [{ role: 'robot', content: 'x' }] }, 400, 'validation_failed', /messages\[0\]\.role/],
      [
        { messages: [user('ok'), { role: 'user', content: null }] },
        400,
        'validation_failed',
        /messages\[1\]\.content/,
      ],
      [{ messages: [{ role: 'user' }] }, 400, 'validation_failed', /messages\[0\]\.content/],
      [{ messages: [user('x', { colour: 'red' })] }, 400, 'validation_failed', /colour/],
      [{ messages: [user('x')], extra: 1 }, 400, 'validation_failed', /extra/],
      [{ messages: [user('nul \u0000 here')] }, 400, 'invalid_characters', /messages\[0\]\.content/],
      [{ messages: [user('lone \ud800 surrogate')] }, 400, 'invalid_characters'],
      [{ messages: [user('x', { metadata: { k: 'a\u0000b' } })] }, 400, 'invalid_characters', /metadata\.k/],
      // In a key too, at any depth: Postgres's jsonb refuses \u0000 in a key as in a value, and the
      // drain would fail on it for ever.
      [
        { messages: [user('x', { metadata: { 'a\u0000b': 1 } })] },
        400,
        'invalid_characters',
        /messages\[0\]\.metadata/,
      ],
      [
        { messages: [user('x', { metadata: { n: { 'a\ud800': 1 } } })] },
        400,
        'invalid_characters',
        /metadata\.n/,
      ],
      // A number JSON.parse reads as Infinity would have been stored as null.
      [
        '{"messages":[{"role":"user","content":"x","metadata":{"n":[1,-1e400]}}]}',
        400,
        'validation_failed',
        /metadata\.n\[1\].*range of a double/,
      ],
      [
        { messages: [user('x', { id: 'a' }), user('y', { id: 'a' })] },
        400,
        'duplicate_id',
        /messages\[1\]\.id/,
      ],
      [{ messages: [user('x', { sent_at: 1767323045000000000 })] }, 400, 'validation_failed', /sent_at/],
      [{ messages: [user('x', { sent_at: 'yesterday' })] }, 400, 'validation_failed', /sent_at/],
      [{ messages: [user('x', { sent_at: '2026-02-30T00:00:00Z' })] }, 400, 'validation_failed', /sent_at/],
      [
        { messages: [user('x', { sent_at: '2026-01-02T03:04:05+24:00' })] },
        400,
        'validation_failed',
        /offset/,
      ],
      [
        { messages: [user('x', { sent_at: '2026-01-02T03:04:05-05:60' })] },
        400,
        'validation_failed',
        /offset/,
      ],
      // Past int64 nanoseconds (2262-04-11T23:47:16.854775807Z) in every form: a 400, never an
      // accepted message that no drain can store (it would hold the session's later ones back).
      [{ messages: [user('x', { sent_at: '2262-04-12T00:00:00Z' })] }, 400, 'validation_failed', /2262/],
      [{ messages: [user('x', { sent_at: '9999-12-31T23:59:59Z' })] }, 400, 'validation_failed', /sent_at/],
      // Years 0–99: Date.UTC reads them as 1900–1999, and 0070 was stored as 1970.
      [
        { messages: [user('x', { sent_at: '0070-01-01T00:00:00Z' })] },
        400,
        'validation_failed',
        /before 1970/,
      ],
      [
        { messages: [user('x', { sent_at: '0099-06-15 12:00:00' })] },
        400,
        'validation_failed',
        /before 1970/,
      ],
      [
        { messages: [user('x', { sent_at: '2262-04-11T23:47:16-00:01' })] },
        400,
        'validation_failed',
        /sent_at/,
      ],
      [{ messages: [user('x', { sent_at: '2262-04-13 00:00:00' })] }, 400, 'validation_failed', /sent_at/],
      [{ messages: [user('x', { sent_at: '9223372036854775808' })] }, 400, 'validation_failed', /sent_at/],
      [{ messages: [user('x', { metadata: ['a'] })] }, 400, 'validation_failed', /metadata/],
      [
        { messages: [user('x', { metadata: { big: 'x'.repeat(17 * 1024) } })] },
        400,
        'validation_failed',
        /metadata/,
      ],
      // Under 16 KiB by a count of characters, over it in UTF-8 (3 bytes a character) and in JSON's
      // escapes (6 bytes a control character): the exact check measures the JSON as stored.
      [
        { messages: [user('x', { metadata: { k: '中'.repeat(6000) } })] },
        400,
        'validation_failed',
        /messages\[0\]\.metadata: must be at most 16 KiB/,
      ],
      [
        { messages: [user('x', { metadata: { k: '\u0001'.repeat(6000) } })] },
        400,
        'validation_failed',
        /messages\[0\]\.metadata: must be at most 16 KiB/,
      ],
      [{ messages: [user('x', { id: 'i'.repeat(129) })] }, 400, 'validation_failed', /messages\[0\]\.id/],
      [{ messages: [] }, 400, 'validation_failed'],
      [{ messages: Array.from({ length: 1001 }, () => user('x')) }, 400, 'validation_failed'],
      [{ messages: [{ role: 'tool', content: 'no id' }] }, 400, 'validation_failed', /tool_call_id/],
      [
        { messages: [{ role: 'user', content: 'x', tool_call_id: 'c1' }] },
        400,
        'validation_failed',
        /messages\[0\]\.tool_call_id.*only tool messages/,
      ],
      [
        { messages: [{ role: 'user', content: 'x', tool_calls: [] }] },
        400,
        'validation_failed',
        /tool_calls/,
      ],
      [[user('not an object')], 400, 'validation_failed'],
      // A union's failure names the place inside it, and what the SDK's response adds is named.
      [
        { messages: [{ role: 'user', content: [{ type: 'text', text: 'a' }, { type: 'input_audio' }] }] },
        400,
        'validation_failed',
        /messages\[0\]\.content\[1\]\.type.*'text' \| 'image_url'/,
      ],
      [
        {
          messages: [
            { role: 'user', content: [{ type: 'image_url', image_url: { url: 'x', detail: 'original' } }] },
          ],
        },
        400,
        'validation_failed',
        /messages\[0\]\.content\[0\]\.image_url\.detail/,
      ],
      [
        { messages: [{ role: 'user', content: 5 }] },
        400,
        'validation_failed',
        /expected string or null or array/,
      ],
      [
        { messages: [{ role: 'assistant', content: 'hi', refusal: null, annotations: [] }] },
        400,
        'validation_failed',
        /messages\[0\]\.refusal.*of the chat completion response, not of a message/,
      ],
      [
        { messages: [{ role: 'assistant', content: 'hi', foo: 1, refusal: null }] },
        400,
        'validation_failed',
        /\\"foo\\", \\"refusal\\" \(\\"refusal\\": of the chat completion response/,
      ],
      // Python's model_dump() writes null for unset fields: the answer says to leave them out.
      ...(['name', 'tool_call_id', 'tool_calls', 'id', 'sent_at', 'metadata'] as const).map(
        (field) =>
          [
            { messages: [{ role: 'assistant', content: 'hi', [field]: null }] },
            400,
            'validation_failed',
            new RegExp(
              `messages\\[0\\]\\.${field}: must not be null: leave the field out .*exclude_none=True`,
            ),
          ] as [unknown, number, string, RegExp],
      ),
    ];
    for (const [body, status, code, detail] of cases) {
      const r = await t.api.post('/v1/sessions/v/messages', body);
      assert.equal(r.status, status, JSON.stringify(body).slice(0, 120));
      assert.equal(r.body.error.code, code, JSON.stringify(r.body));
      if (detail) assert.match(JSON.stringify(r.body.error), detail);
    }
    // A key holding a NUL or a lone surrogate is named with that character as a \u escape: sent
    // back as itself, it made the answer JSON that strict decoders refuse.
    for (const [key, shown] of [
      ['a\u0000b', 'a\\u0000b'],
      ['a\ud800', 'a\\ud800'],
      ['\udc00z', '\\udc00z'],
    ] as const) {
      const r = await t.api.post('/v1/sessions/v/messages', {
        messages: [user('x', { metadata: { n: { [key]: 1 } } })],
      });
      assert.equal(r.status, 400, shown);
      assert.equal(r.body.error.code, 'invalid_characters');
      const path = `messages[0].metadata.n.${shown}`;
      assert.equal(r.body.error.details.problems[0].path, path);
      assert.equal(r.body.error.message, `${path}: NUL characters and lone surrogates are not allowed`);
      assert.doesNotMatch(r.text, /(?<!\\)\\u(0000|d[89a-f])/i, 'no NUL or lone surrogate in the JSON');
    }
    // Nesting past the limit: a 400 naming the path, not a 500. (A body nested deeper than 128
    // levels is refused before it is parsed: body_too_deep, in security-hardening.test.ts.)
    for (const [field, depth] of [
      ['metadata', 65],
      ['metadata', 120],
      ['colour', 120],
    ] as const) {
      const nested = `${'['.repeat(depth)}1${']'.repeat(depth)}`;
      const r = await t.api.raw('/v1/sessions/v/messages', {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: `{"messages":[{"role":"user","content":"x","${field}":{"k":${nested}}}]}`,
      });
      assert.equal(r.status, 400, `${field} ${depth}: ${r.text.slice(0, 200)}`);
      assert.equal(r.body.error.code, 'validation_failed');
      assert.match(
        r.body.error.message,
        new RegExp(`^messages\\[0\\]\\.${field}\\.k(\\[0\\])+: nested more than 64`),
      );
    }
    // The metadata's size is checked before any walk over the message (a walk over 8 MiB of nested
    // arrays held the event loop for seconds before this 400): metadata both too large and too
    // deep is refused for its size.
    const hugeAndDeep = await t.api.raw('/v1/sessions/v/messages', {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: `{"messages":[{"role":"user","content":"x","metadata":{"k":${'['.repeat(70)}${'[0],'.repeat(1.5 * 1024 * 1024)}0${']'.repeat(70)}}}]}`,
    });
    assert.equal(hugeAndDeep.status, 400, hugeAndDeep.text.slice(0, 200));
    assert.equal(hugeAndDeep.body.error.message, 'messages[0].metadata: must be at most 16 KiB of JSON');
    const tooBig = await t.api.post('/v1/sessions/v/messages', {
      messages: [user('ok'), user('é'.repeat(512 * 1024 + 1))],
    });
    assert.equal(tooBig.status, 413);
    assert.equal(tooBig.body.error.code, 'message_too_large');
    assert.equal(tooBig.body.error.details.index, 1);
    const justFits = await t.api.post('/v1/sessions/w/messages?wait=true', {
      messages: [user('é'.repeat(512 * 1024))],
    });
    assert.equal(justFits.status, 201, 'exactly 1 MiB of UTF-8 is accepted and indexed');

    for (const sid of ['has space', 'x'.repeat(257), 'semi;colon', 'a/b']) {
      const r = await t.api.post(`/v1/sessions/${encodeURIComponent(sid)}/messages`, {
        messages: [user('x')],
      });
      assert.equal(r.status, 400, sid);
      assert.equal(r.body.error.code, 'invalid_session_id');
    }
    // '.' and '..' (plain or percent-encoded) reach the route when a client sends the path as it
    // is: a URL parser (fetch's) would resolve them as dot segments; a raw request path is not.
    const { hostname, port } = new URL(svc.base);
    for (const sid of ['.', '..', '%2E', '%2E%2E', '%2e%2e']) {
      const r = await new Promise<{ status: number; body: string }>((resolve, reject) => {
        const req = request({
          hostname,
          port,
          path: `/v1/sessions/${sid}/messages`,
          method: 'POST',
          headers: { authorization: `Bearer ${t.apiKey}`, 'content-type': 'application/json' },
        });
        req.on('response', (res) => {
          let body = '';
          res.on('data', (d) => (body += d));
          res.on('end', () => resolve({ status: res.statusCode!, body }));
        });
        req.on('error', reject);
        req.end(JSON.stringify({ messages: [user('x')] }));
      });
      assert.equal(r.status, 400, `${sid}: ${r.body}`);
      assert.equal(JSON.parse(r.body).error.code, 'invalid_session_id', sid);
    }
    assert.equal(
      (await t.api.get('/v1/sessions/v')).status,
      404,
      'no session was created by rejected requests',
    );
  });

  void test('idempotent re-posts return the original seq; a changed body is a 409 that stores none of its batch', async () => {
    const t = await svc.newTenant();
    const first = await t.api.post('/v1/sessions/idem/messages', {
      messages: [user('a', { id: 'x1' }), user('b', { id: 'x2', metadata: { k: 1, j: 2 } })],
    });
    assert.equal(first.status, 202);
    // Same ids, same content (metadata keys reordered): original seqs, nothing new.
    const again = await t.api.post('/v1/sessions/idem/messages?wait=true', {
      messages: [
        user('a', { id: 'x1' }),
        user('b', { id: 'x2', metadata: { j: 2, k: 1 } }),
        user('c', { id: 'x3' }),
      ],
    });
    assert.equal(again.status, 201);
    assert.equal(again.body.accepted, 1);
    assert.deepEqual(
      again.body.messages.map((m: { seq: number }) => m.seq),
      [1, 2, 3],
    );
    // After archival the check runs against Postgres too.
    const archivedAgain = await t.api.post('/v1/sessions/idem/messages', {
      messages: [user('a', { id: 'x1' })],
    });
    assert.deepEqual(archivedAgain.body.messages, [{ id: 'x1', seq: 1 }]);

    for (const changed of [
      user('A', { id: 'x1' }),
      { role: 'assistant', content: 'a', id: 'x1' },
      user('a', { id: 'x1', metadata: { k: 2 } }),
      user('a', { id: 'x1', name: 'bob' }),
    ]) {
      const r = await t.api.post('/v1/sessions/idem/messages', {
        messages: [user('new', { id: 'x9' }), changed],
      });
      assert.equal(r.status, 409);
      assert.equal(r.body.error.code, 'id_conflict');
      assert.match(r.body.error.message, /messages\[1\]\.id/);
    }
    // A client-given sent_at is part of the identity.
    await t.api.post('/v1/sessions/idem/messages?wait=true', {
      messages: [user('t', { id: 't1', sent_at: '2026-01-01T00:00:00Z' })],
    });
    const otherTime = await t.api.post('/v1/sessions/idem/messages', {
      messages: [user('t', { id: 't1', sent_at: '2026-01-01T00:00:01Z' })],
    });
    assert.equal(otherTime.status, 409);
    // So are an assistant's tool calls (their arguments) and the call a tool message answers: a
    // retry that changed them is another message, not a duplicate to answer with the old seq.
    const call = (args: string) => ({
      id: 'c1',
      role: 'assistant',
      content: null,
      tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'ls', arguments: args } }],
    });
    const answer = (callId: string) => ({ id: 'r1', role: 'tool', content: 'bin etc', tool_call_id: callId });
    const tools = await t.api.post('/v1/sessions/idem/messages?wait=true', {
      messages: [call('{"path":"/"}'), answer('call_1')],
    });
    assert.equal(tools.status, 201);
    const toolsAgain = await t.api.post('/v1/sessions/idem/messages', {
      messages: [call('{"path":"/"}'), answer('call_1')],
    });
    assert.equal(toolsAgain.body.accepted, 0);
    assert.deepEqual(toolsAgain.body.messages, tools.body.messages);
    for (const changed of [call('{"path":"/etc"}'), answer('call_2')]) {
      const r = await t.api.post('/v1/sessions/idem/messages', {
        messages: [user('new', { id: 'x9' }), changed],
      });
      assert.equal(r.status, 409, JSON.stringify(changed));
      assert.equal(r.body.error.code, 'id_conflict');
      assert.match(r.body.error.message, /messages\[1\]\.id/);
    }
    const rows = await archived(t.api, 'idem');
    assert.deepEqual(
      rows.map((m) => m.id),
      ['x1', 'x2', 'x3', 't1', 'c1', 'r1'],
      'conflicting batches stored nothing (x9 absent)',
    );
  });

  void test('a retry storm of the same ids archives each message exactly once', async () => {
    const t = await svc.newTenant();
    const batch = { messages: Array.from({ length: 10 }, (_, i) => user(`storm ${i}`, { id: `s${i}` })) };
    const responses = await Promise.all(
      Array.from({ length: 25 }, () => t.api.post('/v1/sessions/storm/messages', batch)),
    );
    for (const r of responses) assert.equal(r.status, 202);
    const seqs = responses.map((r) => JSON.stringify(r.body.messages));
    assert.equal(new Set(seqs).size, 1, 'every retry got the same ids and seqs');
    assert.equal(
      responses.reduce((n, r) => n + r.body.accepted, 0),
      10,
      'exactly one request accepted the messages',
    );
    const rows = await eventually(async () => {
      const r = await archived(t.api, 'storm');
      return r.length === 10 ? r : null;
    });
    assert.deepEqual(
      rows.map((m) => m.id),
      batch.messages.map((_, i) => `s${i}`),
    );
  });

  void test("a post's retries get one flush per session, and the queue's event stream never names the session", async () => {
    // Setup: the ingest queue paused, so the first post's flush waits and its session stays armed.
    const t = await svc.newTenant();
    const sid = 'erin@example.com';
    const queue = svc.deps.queues.ingest;
    const post = () => t.api.post(`/v1/sessions/${sid}/messages`, { messages: [user('hi', { id: 'm1' })] });
    await queue.pause();
    try {
      assert.equal((await post()).status, 202);

      // Action: the client retries twice (as after answers it did not get).
      for (let i = 0; i < 2; i++) assert.equal((await post()).body.accepted, 0);

      // Assert: the post's flush and one for its retries; BullMQ's events (kept after a delete
      // and a tenant's erasure) hold no session id: the second retry's `deduplicated` event named it.
      const jobs = await queue.getJobs(['wait', 'prioritized']);
      assert.equal(jobs.filter((j) => (j.data as { sessionId: string }).sessionId === sid).length, 2);
      const events = JSON.stringify(await svc.deps.redis.xrange(queue.toKey('events'), '-', '+'));
      assert.ok(events.includes('deduplicated'), events);
      assert.ok(!events.includes(sid), events);
    } finally {
      await queue.resume();
    }
    await eventually(async () => (await archived(t.api, sid)).length === 1, 15_000, 'the message archived');
  });

  void test('concurrent writers to one session: each batch contiguous, seq strictly increasing, readers see only gap-free prefixes', async () => {
    const t = await svc.newTenant();
    const sid = 'busy';
    let stop = false;
    const violations: string[] = [];
    const reader = (async () => {
      while (!stop) {
        const r = await t.api.get(`/v1/sessions/${sid}/messages?limit=500&order=asc`);
        if (r.status === 200) {
          const seqs = r.body.messages.map((m: { seq: number }) => m.seq) as number[];
          seqs.forEach((s, i) => {
            if (s !== i + 1) violations.push(`saw ${seqs.slice(0, i + 1).join(',')}`);
          });
        }
      }
    })();
    const writers = Array.from({ length: 8 }, (_, w) =>
      (async () => {
        const got: number[][] = [];
        for (let b = 0; b < 8; b++) {
          const r = await t.api.post(`/v1/sessions/${sid}/messages`, {
            messages: Array.from({ length: 5 }, (_, i) => user(`w${w} b${b} m${i}`)),
          });
          assert.equal(r.status, 202);
          got.push(r.body.messages.map((m: { seq: number }) => m.seq));
        }
        return got;
      })(),
    );
    const batches = (await Promise.all(writers)).flat();
    const rows = await eventually(async () => {
      const r = await archived(t.api, sid);
      return r.length === 320 ? r : null;
    });
    stop = true;
    await reader;
    assert.deepEqual(violations, []);
    for (const b of batches) assert.deepEqual(b, [b[0]!, b[0]! + 1, b[0]! + 2, b[0]! + 3, b[0]! + 4]);
    assert.deepEqual(
      rows.map((m) => m.seq),
      Array.from({ length: 320 }, (_, i) => i + 1),
    );
    // Each batch's contents are in order at its seqs.
    const bySeq = new Map(rows.map((m) => [m.seq, m.content]));
    for (const b of batches) {
      const contents = b.map((s) => bySeq.get(s) as string);
      const prefix = contents[0]!.replace(/ m0$/, '');
      assert.deepEqual(
        contents,
        [0, 1, 2, 3, 4].map((i) => `${prefix} m${i}`),
      );
    }
  });

  void test('listing, paging both ways and session listing', async () => {
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/p/messages?wait=true', {
      messages: Array.from({ length: 7 }, (_, i) => user(`m${i + 1}`)),
    });
    await t.api.post('/v1/sessions/q/messages?wait=true', { messages: [user('q')] });
    const page1 = await t.api.get('/v1/sessions/p/messages?limit=3');
    assert.deepEqual(
      page1.body.messages.map((m: { seq: number }) => m.seq),
      [1, 2, 3],
    );
    assert.equal(page1.body.next, 3);
    const page3 = await t.api.get('/v1/sessions/p/messages?limit=3&after_seq=6');
    assert.deepEqual(
      page3.body.messages.map((m: { seq: number }) => m.seq),
      [7],
    );
    assert.equal(page3.body.next, null);
    const desc = await t.api.get('/v1/sessions/p/messages?limit=3&order=desc');
    assert.deepEqual(
      desc.body.messages.map((m: { seq: number }) => m.seq),
      [7, 6, 5],
    );
    assert.equal(desc.body.next, 5);
    const desc2 = await t.api.get('/v1/sessions/p/messages?limit=3&order=desc&before_seq=5');
    assert.deepEqual(
      desc2.body.messages.map((m: { seq: number }) => m.seq),
      [4, 3, 2],
    );
    // A full last page says there is nothing more, both ways: no extra empty round trip.
    const lastFull = await t.api.get('/v1/sessions/p/messages?limit=3&after_seq=4');
    assert.deepEqual(
      lastFull.body.messages.map((m: { seq: number }) => m.seq),
      [5, 6, 7],
    );
    assert.equal(lastFull.body.next, null);
    const descLast = await t.api.get('/v1/sessions/p/messages?limit=4&order=desc&before_seq=5');
    assert.equal(descLast.body.messages.length, 4);
    assert.equal(descLast.body.next, null);
    for (const q of [
      'limit=0',
      'limit=501',
      'after_seq=-1',
      'order=up',
      'bogus=1',
      'generation=x',
      'generation=-1',
      'generation=1.5',
    ]) {
      const r = await t.api.get(`/v1/sessions/p/messages?${q}`);
      assert.equal(r.status, 400, q);
    }
    // The message names the real bound, not a number type's.
    const huge = await t.api.get('/v1/sessions/p/messages?limit=99999999999999999999999');
    assert.equal(huge.body.error.message, 'limit: must be at most 500');
    const longSeq = await t.api.get('/v1/sessions/p/messages?after_seq=1000000000000000');
    assert.match(longSeq.body.error.message, /^after_seq: .*at most 15 digits/);
    const badGeneration = await t.api.get('/v1/sessions/p/messages?generation=one');
    assert.equal(badGeneration.body.error.code, 'validation_failed');
    assert.match(badGeneration.body.error.message, /^generation: .*non-negative integer/);
    const context = await t.api.post('/v1/sessions/p/context', { max_messages: 1e308 });
    assert.equal(context.status, 400);
    assert.match(context.body.error.message, /max_messages: .*1000/);
    // README's `?after_seq=&before_seq=&limit=&order=` as written: empty is the default.
    const asWritten = await t.api.get('/v1/sessions/p/messages?after_seq=&before_seq=&limit=&order=');
    assert.equal(asWritten.status, 200, asWritten.text);
    assert.deepEqual(asWritten.body, (await t.api.get('/v1/sessions/p/messages')).body);
    assert.equal((await t.api.get('/v1/sessions/p/messages?limit=00003')).body.messages.length, 3);
    const sessions = await t.api.get('/v1/sessions?limit=1');
    assert.equal(sessions.body.sessions.length, 1);
    assert.equal(sessions.body.sessions[0].id, 'p');
    assert.equal(sessions.body.next, 'p');
    const rest = await t.api.get(`/v1/sessions?cursor=${sessions.body.next}`);
    assert.deepEqual(
      rest.body.sessions.map((s: { id: string }) => s.id),
      ['q'],
    );
    assert.equal(rest.body.next, null);
    const both = await t.api.get('/v1/sessions?limit=2');
    assert.equal(both.body.sessions.length, 2);
    assert.equal(both.body.next, null);
    // A cursor is the id of the previous page's last session; anything else is a 400.
    for (const cursor of ['a%20b', '%FF', 'x'.repeat(257), '..%2F']) {
      const r = await t.api.get(`/v1/sessions?cursor=${cursor}`);
      assert.equal(r.status, 400, cursor);
      assert.match(JSON.stringify(r.body.error), /cursor/);
    }
  });

  void test('no route reads or changes another tenant’s session or job', async () => {
    const a = await svc.newTenant();
    const b = await svc.newTenant();
    await a.api.post('/v1/sessions/shared-name/messages?wait=true', {
      messages: [user('secret of A', { id: 'k' })],
    });
    assert.equal((await b.api.get('/v1/sessions/shared-name')).status, 404);
    assert.equal((await b.api.get('/v1/sessions/shared-name/messages')).status, 404);
    assert.deepEqual((await b.api.get('/v1/sessions')).body.sessions, []);
    // The same session id in B is a separate session; the same message id is not a conflict.
    const bPost = await b.api.post('/v1/sessions/shared-name/messages?wait=true', {
      messages: [user('B text', { id: 'k' })],
    });
    assert.equal(bPost.status, 201);
    assert.deepEqual(bPost.body.messages, [{ id: 'k', seq: 1 }]);
    assert.deepEqual(
      (await archived(a.api, 'shared-name')).map((m) => m.content),
      ['secret of A'],
    );
    // Jobs: only the owner can read one.
    const job = await svc.deps.queues.summary.add('summarize', {
      v: 1,
      kind: 'summarize',
      tenantId: a.tenantId,
      sessionId: 'shared-name',
      reason: 'api',
    });
    await job.remove().catch(() => undefined);
    const job2 = await svc.deps.queues.maintenance.add(
      'probe',
      { v: 1, kind: 'noop-probe' },
      { delay: 3_600_000 },
    );
    assert.equal(
      (await a.api.get(`/v1/jobs/maintenance.${job2.id}`)).status,
      404,
      'jobs without a tenant are nobody’s',
    );
    await job2.remove();
    assert.equal((await a.api.get('/v1/jobs/summary.999999')).status, 404);
    assert.equal((await a.api.get('/v1/jobs/bogus')).status, 404);
  });

  void test('a job of a tenant is readable by that tenant only', async () => {
    const a = await svc.newTenant();
    const b = await svc.newTenant();
    const job = await svc.deps.queues.ingest.add(
      'flush',
      { v: 1, tenantId: a.tenantId, sessionId: 'none' },
      { delay: 3_600_000 },
    );
    const mine = await a.api.get(`/v1/jobs/ingest.${job.id}`);
    assert.equal(mine.status, 200);
    assert.equal(mine.body.state, 'delayed');
    assert.equal((await b.api.get(`/v1/jobs/ingest.${job.id}`)).status, 404);
    await job.remove();
  });

  void test('an unreadable inbox entry is dead-lettered, counted, and does not stall the session', async () => {
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/poison/messages?wait=true', { messages: [user('before')] });
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'poison');
    const gen = await svc.deps.redis.hget(keys.sess, 'gen');
    const seq = await svc.deps.redis.hincrby(keys.sess, 'seq', 1);
    await svc.deps.redis.rpush(keys.inbox, `${seq} ${gen} {not json`);
    const r = await t.api.post('/v1/sessions/poison/messages?wait=true', { messages: [user('after')] });
    assert.equal(r.status, 201);
    const rows = await archived(t.api, 'poison');
    assert.deepEqual(
      rows.map((m) => m.content),
      ['before', 'after'],
    );
    assert.equal(await svc.deps.redis.llen(`${svc.config.prefix}:dead:${t.tenantId}:poison`), 1);
    const metrics = await (await fetch(`${svc.base}/metrics`)).text();
    assert.match(metrics, /mnemos_ingest_dead_letter_total 1/);
  });

  void test('an inbox entry without its seq and generation (written by hand) is dead-lettered, not looped on', async () => {
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/garbage/messages?wait=true', { messages: [user('before')] });
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'garbage');
    // At the head, as LPUSH puts it, and one at the tail, as RPUSH does.
    await svc.deps.redis.lpush(keys.inbox, 'not json at all {');
    await svc.deps.redis.rpush(keys.inbox, '');
    const r = await t.api.post('/v1/sessions/garbage/messages?wait=true', { messages: [user('after')] });
    assert.equal(r.status, 201, r.text);
    assert.deepEqual(
      (await archived(t.api, 'garbage')).map((m) => m.content),
      ['before', 'after'],
    );
    assert.deepEqual(await svc.deps.redis.lrange(`${svc.config.prefix}:dead:${t.tenantId}:garbage`, 0, -1), [
      'not json at all {',
      '',
    ]);
    assert.equal(await svc.deps.redis.llen(keys.inbox), 0);
  });

  void test('an unreadable entry ahead of the seqs after it is dead-lettered once, and the inbox empties', async () => {
    // Setup: a session archived up to seq 1, and a corrupt inbox: an entry that is no message at
    // seq 3, before the message the next post puts at seq 2.
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/ahead/messages?wait=true', { messages: [user('before')] });
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'ahead');
    const entry = `3 ${await svc.deps.redis.hget(keys.sess, 'gen')} {"garbage`;
    await svc.deps.redis.rpush(keys.inbox, entry);
    const deadBefore = await deadLetterTotal(svc.base);

    // Action: a post, and its drains.
    const r = await t.api.post('/v1/sessions/ahead/messages?wait=true', { messages: [user('after')] });

    // Assert: the message is archived, the entry is a dead letter once, and nothing is left to
    // drain (it was read and dead-lettered again on every pass, about 30 times a second).
    assert.equal(r.status, 201, r.text);
    assert.deepEqual(
      (await archived(t.api, 'ahead')).map((m) => [m.seq, m.content]),
      [
        [1, 'before'],
        [2, 'after'],
      ],
    );
    await eventually(async () => (await svc.deps.redis.llen(keys.inbox)) === 0, 10_000, 'an empty inbox');
    assert.deepEqual(await svc.deps.redis.lrange(`${svc.config.prefix}:dead:${t.tenantId}:ahead`, 0, -1), [
      entry,
    ]);
    assert.equal((await deadLetterTotal(svc.base)) - deadBefore, 1);
  });

  void test('an entry with an id and a role but not a whole message is dead-lettered, and the session goes on', async () => {
    // Setup: a corrupt inbox: at the next seq, JSON with an id and a role and nothing else.
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/partial/messages?wait=true', { messages: [user('before')] });
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'partial');
    const seq = await svc.deps.redis.hincrby(keys.sess, 'seq', 1);
    const entry = `${seq} ${await svc.deps.redis.hget(keys.sess, 'gen')} {"id":"z","role":"user"}`;
    await svc.deps.redis.rpush(keys.inbox, entry);

    // Action: a post behind it.
    const r = await t.api.post('/v1/sessions/partial/messages?wait=true', { messages: [user('after')] });

    // Assert: archived (before, the entry's insert failed on every drain, for good, and held the
    // message behind it), and the entry is a dead letter.
    assert.equal(r.status, 201, r.text);
    assert.deepEqual(
      (await archived(t.api, 'partial')).map((m) => m.content),
      ['before', 'after'],
    );
    assert.deepEqual(await svc.deps.redis.lrange(`${svc.config.prefix}:dead:${t.tenantId}:partial`, 0, -1), [
      entry,
    ]);
  });

  void test('a session deleted while its drain dead-letters an unreadable entry keeps no dead letter', async () => {
    // Setup: a session whose inbox holds an entry that is no message, not armed (no worker takes
    // it), and a drain whose database deletes the session as soon as the drain's transaction ends.
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/gone/messages?wait=true', { messages: [user('before')] });
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'gone');
    const gen = await svc.deps.redis.hget(keys.sess, 'gen');
    const seq = await svc.deps.redis.hincrby(keys.sess, 'seq', 1);
    await svc.deps.redis.rpush(keys.inbox, `${seq} ${gen} {"content":"private text, not a message`);
    let deleted: number | null = null;
    const db: Db = {
      ...svc.deps.db,
      transaction: async (fn) => {
        try {
          return await svc.deps.db.transaction(fn);
        } finally {
          deleted ??= (await t.api.del('/v1/sessions/gone')).status;
        }
      },
    };

    // Action: the drain, with the delete (its Redis step too) between its transaction and what
    // it does in Redis after it.
    await drainSession({ ...svc.deps, db }, t.tenantId, 'gone');

    // Assert: the delete removed the entry, and nothing put it back (a dead letter without expiry
    // of a deleted session, content and all).
    assert.equal(deleted, 204);
    assert.equal(await svc.deps.redis.exists(`${svc.config.prefix}:dead:${t.tenantId}:gone`), 0);
    assert.equal(await svc.deps.redis.llen(keys.inbox), 0);
  });

  /**
   * A session archived up to seq 1 whose inbox then holds the entries `made(gen)` returns (made by
   * hand, seqs from 2), and a post behind them: its answer, what was archived, the session's dead
   * letters, and how far the dead-letter counter moved.
   */
  const postBehindHandMade = async (session: string, made: (gen: string | null) => string[]) => {
    const t = await svc.newTenant();
    await t.api.post(`/v1/sessions/${session}/messages?wait=true`, { messages: [user('before')] });
    const keys = inboxKeys(svc.config.prefix, t.tenantId, session);
    const entries = made(await svc.deps.redis.hget(keys.sess, 'gen'));
    await svc.deps.redis.rpush(keys.inbox, ...entries);
    await svc.deps.redis.hset(keys.sess, 'seq', entries.length + 1);
    const deadBefore = await deadLetterTotal(svc.base);
    const posted = await t.api.post(`/v1/sessions/${session}/messages?wait=true`, {
      messages: [user('after')],
    });
    return {
      entries,
      posted,
      archived: (await archived(t.api, session)).map((m) => [m.seq, m.content]),
      dead: await svc.deps.redis.lrange(`${svc.config.prefix}:dead:${t.tenantId}:${session}`, 0, -1),
      counted: (await deadLetterTotal(svc.base)) - deadBefore,
    };
  };

  void test('an entry holding text Postgres cannot store, in any field, is dead-lettered, and the session goes on', async () => {
    // Setup, action: a corrupt inbox of whole messages, each with a NUL or a lone surrogate in
    // another field, and one whose content is a backslash and "u0000" (six characters, stored as
    // they are); a post behind them.
    const call = (args: string) => [{ id: 'c1', type: 'function', function: { name: 'f', arguments: args } }];
    const r = await postBehindHandMade('nul', (gen) => [
      inboxEntry(2, gen, 'a\u0000b'),
      inboxEntry(3, gen, 'a\\u0000b'),
      inboxEntry(4, gen, 'x', { name: 'n\ud800' }),
      inboxEntry(5, gen, 'x', { metadata: { ok: { 'k\u0000': 1 } } }),
      inboxEntry(6, gen, 'x', { role: 'assistant', tool_calls: call('{"a":"\udc00"}') }),
      inboxEntry(7, gen, 'x', { tool_call_id: '\u0000', role: 'tool' }),
    ]);

    // Assert: archived (before, the first entry's insert failed on every drain, for good, and held
    // every later message), and the unstorable entries are dead letters, counted.
    assert.equal(r.posted.status, 201, r.posted.text);
    assert.deepEqual(r.archived, [
      [1, 'before'],
      [3, 'a\\u0000b'],
      [8, 'after'],
    ]);
    assert.deepEqual(r.dead, [r.entries[0], ...r.entries.slice(2)]);
    assert.equal(r.counted, 5);
  });

  void test('an entry whose fields the archive cannot take (sizes, types) is dead-lettered, and the session goes on', async () => {
    // Setup, action: a corrupt inbox of whole messages, each with one field past what the
    // archive's columns hold or of another type than the API writes, then one good entry; a post
    // behind them.
    const r = await postBehindHandMade('shape', (gen) => [
      inboxEntry(2, gen, 'x', { bytes: 1.5 }),
      inboxEntry(3, gen, 'x', { bytes: 2 ** 31 }),
      inboxEntry(4, gen, 'x', { bytes: -1 }),
      inboxEntry(5, gen, 'x', { sent_at_ns: '9999999999999999999' }),
      inboxEntry(6, gen, 'x', { sent_at_given: undefined }),
      inboxEntry(7, gen, 'x', { role: 'assistant', tool_calls: { id: 'c1' } }),
      inboxEntry(8, gen, 'x', { role: 'assistant', tool_calls: [null] }),
      inboxEntry(9, gen, 'good'),
    ]);

    // Assert: archived (before, each of the seven failed its drain's insert, or its index text, on
    // every drain, for good, and held every later message), and the seven are dead letters,
    // counted.
    assert.equal(r.posted.status, 201, r.posted.text);
    assert.deepEqual(r.archived, [
      [1, 'before'],
      [9, 'good'],
      [10, 'after'],
    ]);
    assert.deepEqual(r.dead, r.entries.slice(0, 7));
    assert.equal(r.counted, 7);
  });

  void test('an entry whose seq is above the entries after it is dead-lettered; they are archived in order', async () => {
    // Setup: a session archived up to seq 1, its counter at 3, and an inbox holding, in this order,
    // a copy of a message at seq 4 (not handed out yet), the messages at seqs 2 and 3, another
    // message at seq 3, and another at seq 2.
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/order/messages?wait=true', { messages: [user('before')] });
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'order');
    const gen = await svc.deps.redis.hget(keys.sess, 'gen');
    const high = inboxEntry(4, gen, 'copy at 4');
    const same = inboxEntry(3, gen, 'copy at 3');
    const low = inboxEntry(2, gen, 'copy at 2');
    await svc.deps.redis.rpush(
      keys.inbox,
      high,
      inboxEntry(2, gen, 'two'),
      inboxEntry(3, gen, 'three'),
      same,
      low,
    );
    await svc.deps.redis.hset(keys.sess, 'seq', 3);
    const deadBefore = await deadLetterTotal(svc.base);

    // Action: a drain, then a post, which takes seq 4.
    const drained = await drainSession(svc.deps, t.tenantId, 'order');
    const r = await t.api.post('/v1/sessions/order/messages?wait=true', { messages: [user('after')] });

    // Assert: one drain archived 2 and 3 and emptied the inbox (it read the same head 40 times a
    // job, for good, the copy at 4 never trimmed), the post's message has seq 4 (the copy had
    // taken it), and the three copies are dead letters, counted (the one repeating the seq before
    // it is no message of its own, lost to an id conflict unseen).
    assert.deepEqual([drained.archived, drained.more], [2, false]);
    assert.equal(r.status, 201, r.text);
    assert.deepEqual(
      (await archived(t.api, 'order')).map((m) => [m.seq, m.content]),
      [
        [1, 'before'],
        [2, 'two'],
        [3, 'three'],
        [4, 'after'],
      ],
    );
    assert.equal(await svc.deps.redis.llen(keys.inbox), 0);
    assert.deepEqual(await svc.deps.redis.lrange(`${svc.config.prefix}:dead:${t.tenantId}:order`, 0, -1), [
      high,
      same,
      low,
    ]);
    assert.equal((await deadLetterTotal(svc.base)) - deadBefore, 3);
  });

  void test('a delete removes an entry without a seq at the inbox tail: nothing of the session is left', async () => {
    // Setup: a session with a message waiting at seq 2 (not armed: no worker takes it) and, at
    // the tail, an entry with a seq and no generation, and one without either.
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/tail/messages?wait=true', { messages: [user('before')] });
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'tail');
    const dead = `${svc.config.prefix}:dead:${t.tenantId}:tail`;
    await svc.deps.redis.rpush(keys.inbox, inboxEntry(2, await svc.deps.redis.hget(keys.sess, 'gen'), 'two'));
    await svc.deps.redis.hset(keys.sess, 'seq', 2);
    await svc.deps.redis.rpush(keys.inbox, '99 junk', '{"content":"private text, by hand"}');
    const deadBefore = await deadLetterTotal(svc.base);
    const droppedBefore = await droppedTotal();

    // Action: the delete, and a drain after it.
    assert.equal((await t.api.del('/v1/sessions/tail')).status, 204);
    await drainSession(svc.deps, t.tenantId, 'tail');

    // Assert: no inbox, no dead letter (the entry outlived the delete, and the drain made it a
    // dead letter without expiry), the state expires as a deleted session's does, and the two
    // entries are counted as dead letters, the message as dropped (not they too).
    assert.equal(await svc.deps.redis.exists(keys.inbox), 0);
    assert.equal(await svc.deps.redis.exists(dead), 0);
    const ttl = await svc.deps.redis.ttl(keys.sess);
    assert.ok(ttl > 0 && ttl <= 24 * 3600, `state ttl ${ttl}`);
    assert.equal((await deadLetterTotal(svc.base)) - deadBefore, 2);
    assert.equal((await droppedTotal()) - droppedBefore, 1);
  });

  void test('the client-id hash drops ids archived over an hour ago; their re-posts still dedupe by the archive', async () => {
    const t = await svc.newTenant();
    const post = (messages: unknown[]) => t.api.post('/v1/sessions/ids/messages?wait=true', { messages });
    assert.equal((await post([1, 2, 3].map((n) => user(`m${n}`, { id: `m${n}` })))).status, 201);
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'ids');
    assert.deepEqual((await svc.deps.redis.hkeys(keys.ids)).sort(), ['m1', 'm2', 'm3']);
    // As if the drain that recorded m1–m3 as archived had been an hour ago.
    await svc.deps.redis.hset(keys.sess, 'idsat', Date.now() - 3_700_000);
    assert.equal((await post([user('m4', { id: 'm4' })])).status, 201);
    // An id accepted every second would otherwise stay as long as the session keeps talking.
    assert.deepEqual(await svc.deps.redis.hkeys(keys.ids), ['m4']);
    const again = await post([user('m1', { id: 'm1' }), user('m2', { id: 'm2' })]);
    assert.equal(again.status, 201);
    assert.deepEqual(again.body, {
      session_id: 'ids',
      accepted: 0,
      messages: [
        { id: 'm1', seq: 1 },
        { id: 'm2', seq: 2 },
      ],
    });
    const changed = await post([user('m2 edited', { id: 'm2' })]);
    assert.equal(changed.status, 409);
    assert.equal(changed.body.error.code, 'id_conflict');
    assert.deepEqual(
      (await archived(t.api, 'ids')).map((m) => m.id),
      ['m1', 'm2', 'm3', 'm4'],
    );
  });

  void test('the client-id prune keeps an id accepted after the last archived seq: its re-post before its drain keeps its seq', async () => {
    // Setup: m1–m3 archived, and the prune's mark (set by their drain) an hour old, so that the
    // next drain prunes; no worker drains the session meanwhile.
    const t = await svc.newTenant();
    const m = (n: number) => user(`m${n}`, { id: `m${n}` });
    const post = (messages: unknown[], query = '') =>
      t.api.post(`/v1/sessions/pending/messages${query}`, { messages });
    assert.equal((await post([m(1), m(2), m(3)], '?wait=true')).status, 201);
    const keys = inboxKeys(svc.config.prefix, t.tenantId, 'pending');
    await svc.deps.redis.hset(keys.sess, 'idsat', Date.now() - 3_700_000);
    const queue = svc.deps.queues.ingest;
    await queue.pause();
    try {
      await eventually(async () => (await queue.getActiveCount()) === 0, 20_000, 'running drains to end');
      // Action: a drain that finds the inbox empty, and m4 accepted between its read and its
      // finish script (which prunes with m4, seq 4, waiting in the inbox); then m4 re-posted.
      let first: { status: number; body: unknown } | null = null;
      const db: Db = {
        ...svc.deps.db,
        transaction: async (fn) => {
          try {
            return await svc.deps.db.transaction(fn);
          } finally {
            if (!first) {
              const r = await post([m(4)]);
              first = { status: r.status, body: r.body };
            }
          }
        },
      };
      await drainSession({ ...svc.deps, db }, t.tenantId, 'pending');
      const again = await post([m(4)]);

      // Assert: the re-post is the same message at the same seq, not a second one.
      const answer = { session_id: 'pending', messages: [{ id: 'm4', seq: 4 }] };
      assert.deepEqual(first, { status: 202, body: { ...answer, accepted: 1 } });
      assert.deepEqual(
        { status: again.status, body: again.body },
        { status: 202, body: { ...answer, accepted: 0 } },
      );
    } finally {
      await queue.resume();
    }
    await eventually(async () => (await archived(t.api, 'pending')).length === 4, 20_000, 'm4 archived');
    assert.deepEqual(
      (await archived(t.api, 'pending')).map((m) => [m.seq, m.id]),
      [
        [1, 'm1'],
        [2, 'm2'],
        [3, 'm3'],
        [4, 'm4'],
      ],
    );
  });

  void test('Bull Board lists the queues', async () => {
    const r = await api(svc.base, ADMIN_TOKEN).get(
      '/admin/queues/api/queues?activeQueue=ingest&page=1&jobsPerPage=10',
    );
    assert.equal(r.status, 200);
    const names = (r.body.queues as Array<{ name: string }>).map((q) => q.name).sort();
    assert.ok(names.includes('ingest') && names.includes('summary'), names.join(','));
  });

  void test('a flush job added in Bull Board creates no session: none for an empty inbox, none for an id the API refuses', async () => {
    // Setup
    const t = await svc.newTenant();
    const board = api(svc.base, ADMIN_TOKEN);
    const addFlush = async (sessionId: string) => {
      const r = await board.post('/admin/queues/api/queues/ingest/add', {
        name: 'flush',
        data: { v: 1, tenantId: t.tenantId, sessionId },
        // Kept once done, to read how it ended.
        options: { removeOnComplete: false },
      });
      assert.equal(r.status, 200, r.text);
      return r.body.job.id as string;
    };
    const ended = async (id: string) => {
      await eventually(
        async () => ['completed', 'failed'].includes(await svc.deps.queues.ingest.getJobState(id)),
        15_000,
        `job ${id} ended`,
      );
      return (await svc.deps.queues.ingest.getJob(id))!;
    };

    // Action: a session never posted to, and ids the API refuses (each was drained into a row
    // that GET /v1/sessions listed and GET and DELETE refused with 400)
    const ghost = await ended(await addFlush('ghost-never-posted'));
    const refused = ['has space/and slash', '..', 'x'.repeat(300)];
    const bad = await Promise.all(refused.map(async (sid) => ended(await addFlush(sid))));

    // Assert
    assert.equal(await ghost.getState(), 'completed');
    assert.equal((await t.api.get('/v1/sessions/ghost-never-posted')).status, 404);
    for (const job of bad) {
      assert.equal(await job.getState(), 'failed', job.data.sessionId);
      assert.equal(job.attemptsMade, 1, 'not retried');
      assert.match(job.failedReason, /malformed ingest job payload \(sessionId\): not retried/);
    }
    const listed = await t.api.get('/v1/sessions?limit=100');
    assert.equal(listed.status, 200);
    assert.deepEqual(listed.body.sessions, []);
    // A drain that finds entries still creates the session (an inbox without a session row, as a
    // Redis restored beside an older database holds).
    await svc.deps.redis.rpush(
      inboxKeys(svc.config.prefix, t.tenantId, 'first').inbox,
      inboxEntry(1, '1', 'hi'),
    );
    assert.equal((await drainSession(svc.deps, t.tenantId, 'first')).archived, 1);
    assert.equal((await t.api.get('/v1/sessions/first')).body.message_count, 1);
    await Promise.all([ghost, ...bad].map((j) => j.remove()));
  });

  void test('an inbox under a session id the API refuses goes to its dead letters once, not to a flush job every sweep', async () => {
    // Setup: a hand-made inbox, armed, under an id no flush job may name.
    const t = await svc.newTenant();
    const sid = 'bad sid/x';
    const keys = inboxKeys(svc.config.prefix, t.tenantId, sid);
    const entry = inboxEntry(1, '1', 'hand');
    await svc.deps.redis.rpush(keys.inbox, entry);
    await svc.deps.redis.hset(keys.sess, 'seq', '1', 'gen', '1', 'archived', '0', 'armed', '1');
    await svc.deps.redis.zadd(`${svc.config.prefix}:armed`, Date.now() - 120_000, keys.member);
    const deadBefore = await deadLetterTotal(svc.base);

    // Action: sweeps (the service's own sweeper may come round too)
    for (let i = 0; i < 3; i++) await runIngestSweep(svc.deps, 0);

    // Assert: moved once to the session's dead letters, disarmed, no flush job, no session.
    // (Before, every sweep asked for a flush that failed at once, one more dead letter a minute,
    // and the session stayed armed: archiving was behind for good, and every embed job waited.)
    assert.equal(await svc.deps.redis.llen(keys.inbox), 0);
    assert.deepEqual(await svc.deps.redis.lrange(`${svc.config.prefix}:dead:${t.tenantId}:${sid}`, 0, -1), [
      entry,
    ]);
    assert.equal(await svc.deps.redis.zscore(`${svc.config.prefix}:armed`, keys.member), null);
    assert.equal(await svc.deps.redis.hget(keys.sess, 'armed'), '0');
    assert.equal((await deadLetterTotal(svc.base)) - deadBefore, 1);
    const jobs = await svc.deps.queues.ingest.getJobs([
      'failed',
      'waiting',
      'prioritized',
      'active',
      'delayed',
    ]);
    assert.deepEqual(
      jobs.filter((j) => j?.data.tenantId === t.tenantId),
      [],
    );
    assert.deepEqual((await t.api.get('/v1/sessions?limit=100')).body.sessions, []);
  });

  void test("a tenant posting to many sessions does not hold up another tenant's messages", async () => {
    const queue = svc.deps.queues.ingest;
    const [heavy, light] = [await svc.newTenant(), await svc.newTenant()];
    const tenants = [heavy.tenantId, light.tenantId];
    await queue.pause();
    try {
      await eventually(async () => (await queue.getActiveCount()) === 0, 20_000, 'running drains to end');
      for (let i = 0; i < 6; i++) {
        const r = await heavy.api.post(`/v1/sessions/flood-${i}/messages`, {
          messages: [user(`flood ${i}`)],
        });
        assert.equal(r.status, 202);
      }
      // A second post to an armed session asks for no second job.
      await heavy.api.post('/v1/sessions/flood-0/messages', { messages: [user('flood 0 again')] });
      assert.equal(
        (await light.api.post('/v1/sessions/mine/messages', { messages: [user('mine')] })).status,
        202,
      );
      // The order a worker takes the flush jobs in: the wait list (no priority) first, then the
      // prioritized ones, lowest number first. The light tenant's job goes behind the heavy
      // tenant's first only (each tenant's first in a while is 1, first come first served), and
      // the heavy tenant's keep their order.
      const waiting = await queue.getJobs(['wait'], 0, -1, true);
      const prioritized = await queue.getJobs(['prioritized'], 0, -1, true);
      const order = [...waiting, ...prioritized]
        .filter((j) => tenants.includes((j.data as { tenantId: string }).tenantId))
        .map((j) => (j.data as { sessionId: string }).sessionId);
      assert.deepEqual(order, ['flood-0', 'mine', 'flood-1', 'flood-2', 'flood-3', 'flood-4', 'flood-5']);
    } finally {
      await queue.resume();
    }
    const w = await light.api.post('/v1/sessions/mine/messages?wait=true', { messages: [user('mine 2')] });
    assert.equal(w.status, 201);
    assert.deepEqual(
      (await archived(light.api, 'mine')).map((m) => m.content),
      ['mine', 'mine 2'],
    );
    for (let i = 0; i < 6; i++)
      await eventually(
        async () => (await archived(heavy.api, `flood-${i}`)).length === (i === 0 ? 2 : 1),
        20_000,
        `flood-${i} archived`,
      );
  });

  void test("a tenant's fair priority follows its recent rate in classes, and holds its class while the rate wobbles", async () => {
    const prefix = `${svc.config.prefix}-fair`;
    const key = fairKey(prefix, 'flush', 'busy');
    const next = () => nextFairPriority(svc.deps.redis, prefix, 'flush', 'busy');
    try {
      const seen: number[] = [];
      for (let i = 0; i < 200; i++) seen.push(await next());
      assert.equal(seen[0], 1, "a tenant's first job in a while");
      // The count expires after ten decay periods without a job (milliseconds, not seconds).
      const ttl = await svc.deps.redis.pttl(key);
      assert.ok(ttl > 0 && ttl <= 10 * 60_000, `pttl ${ttl}`);
      assert.ok(
        seen.every((p, i) => i === 0 || p >= seen[i - 1]!),
        'a burst never puts a later job ahead of an earlier one',
      );
      // 200 jobs: class round(log1.5 200) = 13.
      assert.equal(seen[199], 14);
      // 20 s without a job: the count fell by 28 % (to about 144, class 12.3): the class holds.
      await svc.deps.redis.hset(key, 't', Date.now() - 20_000);
      assert.equal(await next(), 14);
      // A minute more: the count fell by e (to about 54): the class goes down.
      await svc.deps.redis.hset(key, 't', Date.now() - 60_000);
      assert.equal(await next(), 11);
      // A count stamped ahead of Redis's clock (a Redis restored elsewhere, or stepped back) grows
      // nothing: no decay, and no pushing the tenant to the back.
      await svc.deps.redis.hset(key, 't', Date.now() + 3_600_000);
      assert.equal(await next(), 11);
    } finally {
      await deleteRedisPrefix(prefix);
    }
  });

  void test('the archive stores a row per message with its byte size and the tsvector', async () => {
    const t = await svc.newTenant();
    await t.api.post('/v1/sessions/tsv/messages?wait=true', {
      messages: [
        user('Compacting memories 我們討論了記憶系統'),
        // Plain English (its content is the full-text input as is) and a tool call without content.
        user('Compacting the archive nightly'),
        {
          role: 'assistant',
          content: null,
          tool_calls: [
            {
              id: 'c1',
              type: 'function',
              function: { name: 'compacting_tool', arguments: '{"when":"now"}' },
            },
          ],
        },
      ],
    });
    const db = makePgDb({ connectionString: svc.config.databaseUrl!, max: 1 });
    try {
      const r = await db.query<{ bytes: number; hit_en: boolean; hit_cjk: boolean; plain: boolean }>(
        `SELECT bytes,
                search_tsv @@ to_tsquery('english', 'compaction') AS hit_en,
                search_tsv @@ to_tsquery('simple', '記憶') AS hit_cjk,
                search_tsv = to_tsvector('english', content) AS plain
         FROM messages WHERE tenant_id = $1 AND session_id = 'tsv' ORDER BY seq`,
        [t.tenantId],
      );
      assert.equal(r.rows.length, 3);
      assert.ok(r.rows[0]!.bytes > 40, 'r.rows[0]!.bytes > 40');
      assert.deepEqual(
        r.rows.map((x) => x.hit_en),
        [true, true, true],
        'English is stemmed (compacting ~ compaction), tool calls included',
      );
      assert.equal(r.rows[0]!.hit_cjk, true, 'CJK is indexed as bigrams');
      assert.equal(r.rows[0]!.plain, false, 'the CJK part is not English text');
      assert.equal(r.rows[1]!.plain, true, 'plain English: exactly its English tsvector');
    } finally {
      await db.close();
    }
  });

  void test("a session's hot_bytes is the sum of its archived messages' sizes, drain after drain", async () => {
    const t = await svc.newTenant();
    const post = (messages: unknown[]) => t.api.post('/v1/sessions/hot/messages?wait=true', { messages });
    // Each ?wait=true returns once its own drain committed: three drains, each adding its bytes.
    assert.equal((await post([user('first drain'), user('also the first')])).status, 201);
    assert.equal((await post([user('second drain, a longer message than the others')])).status, 201);
    assert.equal((await post([{ role: 'assistant', content: 'third' }])).status, 201);
    const db = makePgDb({ connectionString: svc.config.databaseUrl!, max: 1 });
    try {
      const r = await db.query<{ n: number; sum: string }>(
        `SELECT count(*)::int AS n, sum(bytes)::text AS sum FROM messages
         WHERE tenant_id = $1 AND session_id = 'hot'`,
        [t.tenantId],
      );
      assert.equal(r.rows[0]!.n, 4);
      const s = await t.api.get('/v1/sessions/hot');
      assert.equal(s.body.message_count, 4);
      assert.equal(s.body.hot_bytes, Number(r.rows[0]!.sum));
    } finally {
      await db.close();
    }
  });

  void test('a message whose full-text cap falls inside an emoji is archived, and so are the messages after it', async () => {
    const t = await svc.newTenant();
    // The English full-text input is capped at 65,536 UTF-16 units: here unit 65,536 is the first
    // half of the emoji. Sent cut there, the drain's INSERT failed on every attempt.
    const emoji = `${'a '.repeat(32_767)}b😀 tail`;
    const cjk = `${'字 '.repeat(32_767)}b😀 尾巴`;
    const r = await t.api.post('/v1/sessions/cap/messages?wait=true', {
      messages: [user(emoji, { id: 'e' }), user(cjk, { id: 'c' })],
    });
    assert.equal(r.status, 201, r.text);
    const next = await t.api.post('/v1/sessions/cap/messages?wait=true', { messages: [user('after')] });
    assert.equal(next.status, 201, next.text);
    assert.deepEqual(
      (await archived(t.api, 'cap')).map((m) => m.content),
      [emoji, cjk, 'after'],
    );
    const found = await t.api.post('/v1/sessions/cap/search', { query: 'after', match: 'keyword' });
    assert.deepEqual(
      found.body.hits.map((h: { content: string }) => h.content),
      ['after'],
    );
  });
});
