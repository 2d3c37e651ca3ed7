import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { getEventListeners } from 'node:events';
import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import type { RequestListener, Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, test } from 'node:test';
import {
  MnemosError,
  createMnemosAdmin,
  createMnemosClient,
  parseRetryAfter,
} from '../client/mnemos-client.js';
import type {
  ContextResult,
  ImportLine,
  MessageInput,
  MnemosClient,
  RetryInfo,
} from '../client/mnemos-client.js';
import { runTurn } from '../examples/agent-loop.js';
import { startFakeOpenAI } from './support/fake-openai.js';
import type { FakeOpenAI } from './support/fake-openai.js';
import { ADMIN_TOKEN, eventually, startTestService } from './support/harness.js';
import type { TestService } from './support/harness.js';

const sid = (what: string) => `client-${what}-${randomBytes(3).toString('hex')}`;

let svc: TestService;
let fake: FakeOpenAI;
let apiKey: string;
let mnemos: MnemosClient;

before(async () => {
  fake = await startFakeOpenAI();
  // No LLM for the service itself (local embedder); a small window so chat_history has history.
  svc = await startTestService({ env: { MAX_HISTORY_MESSAGES: '4' } });
  apiKey = (await svc.newTenant()).apiKey;
  mnemos = createMnemosClient({ baseUrl: svc.base, apiKey });
});
after(async () => {
  await svc.stop();
  await fake.close();
});

async function rejects(promise: Promise<unknown>): Promise<MnemosError> {
  try {
    await promise;
  } catch (err) {
    assert.ok(err instanceof MnemosError, `expected a MnemosError, got ${String(err)}`);
    return err;
  }
  assert.fail('expected the call to fail');
}

const jsonResponse = (status: number, body: unknown, headers: Record<string, string> = {}) =>
  new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json', ...headers } });

type Step = Response | 'network' | 'deliver-then-fail';

/** A fetch that plays `steps` (one per call) and then delegates to the real fetch. */
function scriptedFetch(...steps: Step[]) {
  const calls: Array<{ method: string; url: string; at: number }> = [];
  const impl: typeof fetch = async (input, init) => {
    calls.push({ method: init?.method ?? 'GET', url: String(input), at: Date.now() });
    const step = steps.shift();
    if (step === undefined) return fetch(input, init);
    if (step === 'network') throw new TypeError('fetch failed');
    if (step === 'deliver-then-fail') {
      // The server gets and applies the request; the answer is lost on the way back.
      await (await fetch(input, init)).text();
      throw new TypeError('fetch failed: socket hang up');
    }
    return step;
  };
  return { impl, calls };
}

/** A plain local HTTP server (for what the real service never does: stall, or not listen). */
async function localServer(
  handler: RequestListener,
): Promise<{ base: string; server: Server; close: () => Promise<void> }> {
  const server = createServer(handler);
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as AddressInfo;
  return {
    base: `http://127.0.0.1:${port}`,
    server,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}

/** `promise`, or a failure once `ms` passed (for calls that used to hang). */
async function within<T>(ms: number, promise: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_resolve, reject) => {
    timer = setTimeout(() => reject(new Error(`still waiting after ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([promise, late]);
  } finally {
    clearTimeout(timer);
  }
}

void describe('client: messages', () => {
  void test('posts with wait and reads every message back through the iterator', async () => {
    const s = sid('roundtrip');
    const input: MessageInput[] = Array.from({ length: 7 }, (_, i) => ({
      role: i % 2 === 0 ? 'user' : 'assistant',
      content: `message number ${i}`,
    }));
    const posted = await mnemos.postMessages(s, input, { wait: true });
    assert.equal(posted.durable, true);
    assert.equal(posted.accepted, 7);
    assert.equal(posted.session_id, s);
    assert.equal(posted.messages.length, 7);
    // Ids were assigned by the client (UUIDs) and seqs increase.
    for (const m of posted.messages) assert.match(m.id, /^[0-9a-f-]{36}$/);
    const seqs = posted.messages.map((m) => m.seq);
    assert.deepEqual(
      seqs,
      [...seqs].sort((a, b) => a - b),
    );

    const all = [];
    for await (const m of mnemos.iterateMessages(s, { pageSize: 3 })) all.push(m);
    assert.deepEqual(
      all.map((m) => [m.id, m.seq, m.role, m.content]),
      posted.messages.map((m, i) => [m.id, m.seq, input[i]!.role, input[i]!.content]),
    );
    const desc = [];
    for await (const m of mnemos.iterateMessages(s, { order: 'desc', pageSize: 2 })) desc.push(m.seq);
    assert.deepEqual(desc, [...seqs].reverse());
    const after = [];
    for await (const m of mnemos.iterateMessages(s, { afterSeq: seqs[4]! })) after.push(m.seq);
    assert.deepEqual(after, seqs.slice(5));

    const page = await mnemos.listMessages(s, { limit: 2 });
    assert.deepEqual(
      page.messages.map((m) => m.seq),
      seqs.slice(0, 2),
    );
    assert.equal(page.next, seqs[1]);
    const info = await mnemos.getSession(s);
    assert.equal(info.id, s);
    assert.equal(info.message_count, 7);
    // Always sent (required in /openapi.json): typed so (this did not compile when it was optional).
    const createdAt: string = info.created_at;
    assert.ok(!Number.isNaN(Date.parse(createdAt)), '!Number.isNaN(Date.parse(createdAt))');
  });

  void test('an iterator whose session is reset or deleted between two pages rejects with session_changed, never mixing two sessions', async () => {
    for (const clear of ['reset', 'delete'] as const) {
      // Setup: two turns; pages of two, so the clear lands between the first and second page.
      const s = sid(`changed-${clear}`);
      await mnemos.postMessages(
        s,
        ['old1', 'old1-reply', 'old2', 'old2-reply'].map((content, i) => ({
          role: i % 2 === 0 ? 'user' : 'assistant',
          content,
        })),
        { wait: true },
      );
      // Action: read the first page, clear the session and write to it again, then read on.
      const seen: unknown[] = [];
      const err = await rejects(
        (async () => {
          for await (const m of mnemos.iterateMessages(s, { pageSize: 2 })) {
            seen.push(m.content);
            if (seen.length !== 2) continue;
            if (clear === 'reset') await mnemos.resetSession(s);
            else assert.equal(await mnemos.deleteSession(s), true);
            await mnemos.postMessages(s, [{ role: 'user', content: 'new1' }], { wait: true });
          }
        })(),
      );
      // Assert: a 409 after the first page, not old1, old1-reply, new1 as if it were one listing.
      assert.equal(err.status, 409, clear);
      assert.equal(err.code, 'session_changed');
      assert.deepEqual(seen, ['old1', 'old1-reply']);
      // Starting over reads the new session.
      const fresh = [];
      for await (const m of mnemos.iterateMessages(s, { pageSize: 2 })) fresh.push(m.content);
      assert.deepEqual(fresh, ['new1']);
    }
  });

  void test('an empty id is refused by the server, not replaced by a made-up one', async () => {
    const s = sid('empty-id');
    const err = await rejects(mnemos.postMessages(s, [{ id: '', role: 'user', content: 'x' }]));
    assert.equal(err.status, 400);
    assert.equal(err.code, 'validation_failed');
    assert.equal((err.details as { problems: Array<{ path: string }> }).problems[0]!.path, 'messages[0].id');
    assert.equal((await rejects(mnemos.listMessages(s))).status, 404, 'nothing stored');
  });

  void test('posting the same ids twice returns the same seqs and stores each message once', async () => {
    const s = sid('idem');
    const first = await mnemos.postMessages(
      s,
      [
        { role: 'user', content: 'a' },
        { role: 'assistant', content: 'b' },
      ],
      { wait: true },
    );
    const again = await mnemos.postMessages(
      s,
      [
        { id: first.messages[0]!.id, role: 'user', content: 'a' },
        { id: first.messages[1]!.id, role: 'assistant', content: 'b' },
      ],
      { wait: true },
    );
    assert.equal(again.accepted, 0);
    assert.deepEqual(again.messages, first.messages);
    const page = await mnemos.listMessages(s);
    assert.deepEqual(
      page.messages.map((m) => m.seq),
      first.messages.map((m) => m.seq),
    );
  });

  void test('a post whose answer was lost is retried without duplicates', async () => {
    const s = sid('lost');
    const { impl, calls } = scriptedFetch('deliver-then-fail');
    const retries: RetryInfo[] = [];
    const client = createMnemosClient({
      baseUrl: svc.base,
      apiKey,
      fetch: impl,
      backoffBaseMs: 10,
      onRetry: (r) => retries.push(r),
    });
    const res = await client.postMessages(
      s,
      [
        { role: 'user', content: 'hello' },
        { role: 'assistant', content: 'hi there' },
      ],
      { wait: true },
    );
    assert.equal(calls.length, 2);
    assert.equal(retries.length, 1);
    // The first attempt stored them; the retry got the original seqs back.
    assert.equal(res.accepted, 0);
    const stored = (await mnemos.listMessages(s)).messages;
    assert.deepEqual(
      stored.map((m) => [m.id, m.seq, m.content]),
      res.messages.map((m, i) => [m.id, m.seq, ['hello', 'hi there'][i]]),
    );
  });

  void test('context puts the input last after the hot window', async () => {
    const s = sid('ctx');
    const posted = await mnemos.postMessages(s, [
      { role: 'user', content: 'first question' },
      { role: 'assistant', content: 'first answer' },
    ]);
    const lastSeq = posted.messages[1]!.seq;
    const ctx = await mnemos.context(s, { input: 'second question', minSeq: lastSeq });
    assert.equal(ctx.minSeqTimedOut, false);
    assert.deepEqual(ctx.messages, [
      { role: 'user', content: 'first question' },
      { role: 'assistant', content: 'first answer' },
      { role: 'user', content: 'second question' },
    ]);
    assert.deepEqual(ctx.window, { from_seq: posted.messages[0]!.seq, to_seq: lastSeq });
    assert.equal(ctx.summary_version, 0);
    assert.equal(ctx.system_block, '');
    // With DECISION_MODEL an irrelevant current_discussion is left out: the type says so (this
    // assignment did not compile when the type required it).
    const trimmed: ContextResult['summary'] = {
      key_decisions: ['Do: reply in English'],
      past_discussions: [],
    };
    assert.equal(trimmed?.current_discussion?.topic, undefined);
  });

  void test('search finds an archived message by keyword', async () => {
    const s = sid('search');
    const posted = await mnemos.postMessages(
      s,
      [
        { role: 'user', content: 'we picked pgvector for the recent index' },
        { role: 'assistant', content: 'noted, the weather is fine' },
      ],
      { wait: true },
    );
    const hits = await mnemos.search(s, { query: 'pgvector', match: 'keyword', limit: 4, timeRange: 'all' });
    assert.equal(hits[0]?.seq, posted.messages[0]!.seq);
    assert.equal(hits[0]?.content, 'we picked pgvector for the recent index');
  });
});

void describe('client: errors', () => {
  void test('a missing session is a MnemosError with status, code and request id', async () => {
    const err = await rejects(mnemos.getSession(sid('missing')));
    assert.equal(err.status, 404);
    assert.equal(err.code, 'not_found');
    assert.match(err.requestId ?? '', /^[0-9a-f-]{36}$/);
    assert.equal(err.attempts, 1);
  });

  void test('bad input is a 400 whose details name the field', async () => {
    const err = await rejects(mnemos.postMessages(sid('bad'), [{ role: 'robot' as 'user', content: 'x' }]));
    assert.equal(err.status, 400);
    assert.equal(err.code, 'validation_failed');
    assert.match(JSON.stringify(err.details), /messages\[0\]\.role/);
    const limit = await rejects(mnemos.listMessages(sid('bad'), { limit: 0 }));
    assert.equal(limit.status, 400);
  });

  void test('summaries: 404 when none, 409 llm_not_configured without an LLM', async () => {
    const s = sid('sum');
    await mnemos.postMessages(s, [{ role: 'user', content: 'x' }], { wait: true });
    assert.equal((await rejects(mnemos.getSummary(s))).code, 'not_found');
    const err = await rejects(mnemos.summarize(s));
    assert.equal(err.status, 409);
    assert.equal(err.code, 'llm_not_configured');
    assert.equal((await rejects(mnemos.job('summary.nope'))).status, 404);
    const usage = await mnemos.usage({ window: '7d', sessionId: s });
    assert.deepEqual(usage, { window: '7d', rows: [] });
  });

  void test('a wrong API key is a 401', async () => {
    const bad = createMnemosClient({ baseUrl: svc.base, apiKey: 'mn_nope_nope' });
    const err = await rejects(bad.listSessions());
    assert.equal(err.status, 401);
    assert.equal(err.code, 'unauthorized');
  });
});

void describe('client: retries', () => {
  const unavailable = () =>
    jsonResponse(
      503,
      { error: { code: 'unavailable', message: 'redis is unavailable, retry later' } },
      { 'retry-after': '1' },
    );
  const limited = (after: string) =>
    jsonResponse(429, { error: { code: 'rate_limited', message: 'slow down' } }, { 'retry-after': after });

  void test('retries 503 after retry-after and then succeeds', async () => {
    const s = sid('503');
    const { impl, calls } = scriptedFetch(unavailable(), unavailable());
    const retries: RetryInfo[] = [];
    const client = createMnemosClient({
      baseUrl: svc.base,
      apiKey,
      fetch: impl,
      onRetry: (r) => retries.push(r),
    });
    const started = Date.now();
    const res = await client.postMessages(s, [{ role: 'user', content: 'after the outage' }], { wait: true });
    assert.equal(calls.length, 3);
    assert.equal(res.durable, true);
    assert.equal(res.accepted, 1);
    assert.deepEqual(
      retries.map((r) => [r.attempt, r.status]),
      [
        [1, 503],
        [2, 503],
      ],
    );
    // retry-after: 1 → 1 s plus at most 10 % jitter, each time.
    for (const r of retries) assert.ok(r.delayMs >= 1000 && r.delayMs <= 1100, `delay ${r.delayMs}`);
    assert.ok(calls[1]!.at - calls[0]!.at >= 990, 'second attempt came after retry-after');
    assert.ok(Date.now() - started >= 1990, 'Date.now() - started >= 1990');
    assert.equal((await mnemos.listMessages(s)).messages.length, 1);
  });

  void test('retries 429 after retry-after, on a POST read too', async () => {
    const s = sid('429');
    await mnemos.postMessages(s, [{ role: 'user', content: 'rate limits are fine' }], { wait: true });
    const { impl, calls } = scriptedFetch(limited('1'));
    const retries: RetryInfo[] = [];
    const client = createMnemosClient({
      baseUrl: svc.base,
      apiKey,
      fetch: impl,
      onRetry: (r) => retries.push(r),
    });
    const hits = await client.search(s, { query: 'rate limits', match: 'keyword' });
    assert.equal(calls.length, 2);
    assert.equal(hits.length, 1);
    assert.equal(retries[0]?.status, 429);
    assert.ok(
      retries[0]!.delayMs >= 1000 && retries[0]!.delayMs <= 1100,
      'retries[0]!.delayMs >= 1000 && retries[0]!.delayMs <= 1100',
    );
    assert.ok(calls[1]!.at - calls[0]!.at >= 990, 'calls[1]!.at - calls[0]!.at >= 990');
  });

  void test('a retry-after longer than maxRetryAfterMs fails the call at once, naming the wait', async () => {
    // Was: retried after the cap (2 s here) against a limit that asked for 48 s, meeting the same
    // 429 on every retry.
    const { impl, calls } = scriptedFetch(limited('48'), limited('48'), limited('48'));
    const client = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: impl, maxRetryAfterMs: 2000 });
    const err = await rejects(client.listSessions());
    assert.equal(calls.length, 1);
    assert.equal(err.status, 429);
    assert.equal(err.code, 'rate_limited');
    assert.equal(err.attempts, 1);
    assert.equal(err.retryAfterMs, 48_000);
  });

  void test('postMessages with no messages is the server’s 400, not a durable success', async () => {
    const s = sid('empty');
    const err = await rejects(mnemos.postMessages(s, [], { wait: true }));
    assert.equal(err.status, 400);
    assert.equal(err.code, 'validation_failed');
    assert.equal((await rejects(mnemos.getSession(s))).status, 404);
  });

  void test('a 503 is not repeated for a request that is not idempotent: a reset that was applied is not applied again', async () => {
    const s = sid('reset-503');
    await mnemos.postMessages(s, [{ role: 'user', content: 'before the reset' }], { wait: true });
    // The server applies the reset, another agent is told its message is stored, then the reset's
    // answer is a 503 (Postgres gone after the commit, a proxy's 503).
    let calls = 0;
    const appliedThen503: typeof fetch = async (input, init) => {
      calls++;
      if (calls > 1) return fetch(input, init);
      await (await fetch(input, init)).text();
      await mnemos.postMessages(s, [{ role: 'user', content: 'posted after it' }], { wait: true });
      return unavailable();
    };
    const client = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: appliedThen503 });
    const err = await rejects(client.resetSession(s));
    assert.equal(err.status, 503);
    assert.equal(err.attempts, 1);
    assert.equal(calls, 1);
    // Before, the 503 was repeated after retry-after, and the repeat cleared this message too.
    assert.deepEqual(
      (await mnemos.listMessages(s)).messages.map((m) => m.content),
      ['posted after it'],
    );

    const write = scriptedFetch(unavailable());
    const writer = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: write.impl });
    const werr = await rejects(
      writer.writeError({ tool_name: 'shell', symptom: 'boom 503', action: 'none', outcome: 'failed' }),
    );
    assert.equal(werr.status, 503);
    assert.equal(write.calls.length, 1);

    // A 429 comes from the rate limiter before any route ran: repeated for every request.
    const limitedOnce = scriptedFetch(limited('0'));
    const resetter = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: limitedOnce.impl });
    assert.equal((await resetter.resetSession(s)).reset, true);
    assert.equal(limitedOnce.calls.length, 2);
    assert.deepEqual((await mnemos.listMessages(s)).messages, []);
  });

  void test('gives up after `retries` and reports the last answer', async () => {
    const { impl, calls } = scriptedFetch(limited('0'), limited('0'), limited('0'));
    const client = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: impl, retries: 2 });
    const err = await rejects(client.listSessions());
    assert.equal(calls.length, 3);
    assert.equal(err.status, 429);
    assert.equal(err.code, 'rate_limited');
    assert.equal(err.attempts, 3);
    assert.equal(err.retryAfterMs, 0);
  });

  void test('an answer that is not JSON after a retry names the attempts and the request id', async () => {
    const html = new Response('<html>gateway</html>', {
      status: 200,
      headers: { 'content-type': 'text/html' },
    });
    const { impl, calls } = scriptedFetch(limited('0'), html);
    const sent: string[] = [];
    const recording: typeof fetch = (input, init) => {
      sent.push((init?.headers as Record<string, string>)['x-request-id']!);
      return impl(input, init);
    };
    const client = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: recording });
    const err = await rejects(client.listSessions());
    assert.equal(calls.length, 2);
    assert.equal(err.code, 'invalid_response');
    assert.equal(err.attempts, 2);
    assert.equal(err.requestId, sent[0]);
    assert.equal(sent[1], sent[0]);
  });

  void test('network errors are retried for idempotent requests only', async () => {
    const read = scriptedFetch('network', 'network');
    const client = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: read.impl, backoffBaseMs: 5 });
    assert.deepEqual((await client.listSessions({ limit: 1 })).sessions.length, 1);
    assert.equal(read.calls.length, 3);

    const write = scriptedFetch('network');
    const writer = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: write.impl, backoffBaseMs: 5 });
    const err = await rejects(
      writer.writeError({ tool_name: 'shell', symptom: 'boom', action: 'none', outcome: 'failed' }),
    );
    assert.equal(err.status, 0);
    assert.equal(err.code, 'network_error');
    assert.equal(write.calls.length, 1);
  });

  void test('a request with no answer times out', async () => {
    const hang: typeof fetch = (_input, init) =>
      new Promise((_resolve, reject) => {
        init?.signal?.addEventListener('abort', () => reject(init.signal!.reason as Error));
      });
    const client = createMnemosClient({
      baseUrl: svc.base,
      apiKey,
      fetch: hang,
      timeoutMs: 50,
      retries: 1,
      backoffBaseMs: 5,
    });
    const err = await rejects(client.getSession('x'));
    assert.equal(err.code, 'timeout');
    assert.equal(err.attempts, 2);
  });
});

void describe('client: signals, streams, retry-after and ids', () => {
  void test('calls sharing one long-lived signal leave it no listener and no link to them', async () => {
    // Setup: a stub fetch for every kind of call (answers, errors, streams, a network error),
    // and one signal for all calls, as an app passes its shutdown signal.
    const line = `${JSON.stringify({ type: 'message', id: 'm1', seq: 1, role: 'user', content: 'x' })}\n`;
    const attemptSignals: AbortSignal[] = [];
    let n = 0;
    const stub: typeof fetch = (input, init) => {
      attemptSignals.push(init!.signal!);
      const url = String(input);
      if (url.includes('/export')) return Promise.resolve(new Response(line + line, { status: 200 }));
      if (url.includes('/missing'))
        return Promise.resolve(jsonResponse(404, { error: { code: 'not_found', message: 'no' } }));
      if (++n % 1000 === 1) return Promise.reject(new TypeError('fetch failed'));
      return Promise.resolve(jsonResponse(200, { sessions: [], next: null }));
    };
    const client = createMnemosClient({
      baseUrl: 'http://stub.invalid',
      apiKey: 'k',
      fetch: stub,
      backoffBaseMs: 1,
    });
    const shutdown = new AbortController();
    const { signal } = shutdown;

    // Action: 20,000 calls, retries among them, then errors and exports read whole or stopped early.
    for (let i = 0; i < 20_000; i++) await client.listSessions({ signal });
    for (let i = 0; i < 100; i++) {
      assert.equal((await rejects(client.getSession('missing', { signal }))).code, 'not_found');
      for await (const _l of client.exportSession('s', { signal })) break;
      const all = [];
      for await (const l of client.exportSession('s', { signal })) all.push(l);
      assert.equal(all.length, 2);
    }

    // Assert: nothing of the finished calls hangs on the signal (AbortSignal.any kept every attempt
    // reachable from it: 1.6 M calls grew the heap by 93 MB), and aborting it reaches none of them.
    assert.ok(attemptSignals.length > 20_000, 'attemptSignals.length > 20_000');
    assert.equal(getEventListeners(signal, 'abort').length, 0);
    shutdown.abort(new Error('shutting down'));
    assert.equal(attemptSignals.filter((s) => s.aborted).length, 0);
  });

  void test('calls in flight at once on one signal hang one listener on it, and an abort reaches each', async () => {
    const release: Array<() => void> = [];
    const stub: typeof fetch = (_input, init) =>
      new Promise((resolve, reject) => {
        init!.signal!.addEventListener('abort', () => reject(init!.signal!.reason as Error), { once: true });
        release.push(() => resolve(jsonResponse(200, { sessions: [], next: null })));
      });
    const client = createMnemosClient({ baseUrl: 'http://stub.invalid', apiKey: 'k', fetch: stub });
    const shutdown = new AbortController();
    const { signal } = shutdown;

    // 20 at once: a listener each made Node warn of a leak past 10 (MaxListenersExceededWarning).
    const first = Array.from({ length: 20 }, () => client.listSessions({ signal }));
    while (release.length < 20) await new Promise((r) => setImmediate(r));
    assert.equal(getEventListeners(signal, 'abort').length, 1);
    for (const r of release.splice(0)) r();
    await Promise.all(first);
    assert.equal(getEventListeners(signal, 'abort').length, 0);

    const second = Array.from({ length: 20 }, () =>
      client.listSessions({ signal }).then(
        () => 'answered',
        (err: unknown) => String(err),
      ),
    );
    while (release.length < 20) await new Promise((r) => setImmediate(r));
    shutdown.abort(new Error('shutting down'));
    for (const outcome of await Promise.all(second)) assert.match(outcome, /shutting down/);
    assert.equal(getEventListeners(signal, 'abort').length, 0);
  });

  void test('an import past the server limit stops at 64 MiB with body_too_large, not a broken pipe', async () => {
    let sentBytes = 0;
    const stub: typeof fetch = async (_input, init) => {
      const reader = (init!.body as ReadableStream<Uint8Array>).getReader();
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        sentBytes += value.length;
      }
      return jsonResponse(201, { imported: 0, first_seq: null, last_seq: null, summary: false });
    };
    const client = createMnemosClient({ baseUrl: 'http://stub.invalid', apiKey: 'k', fetch: stub });
    const content = 'x'.repeat(100_000);
    async function* lines() {
      for (let i = 0; i < 700; i++) yield { role: 'user' as const, content };
    }
    const err = await rejects(client.importSession('big', lines()));
    assert.equal(err.code, 'body_too_large');
    assert.ok(sentBytes <= 64 * 1024 * 1024, `${sentBytes} bytes sent`);
  });

  void test('an import streams its lines: the source is read while the body is sent', async () => {
    // Setup: a generator that counts the lines taken, and a fetch that notes the count when the
    // first bytes of the body go out.
    const s = sid('stream-import');
    const count = 3000;
    let pulled = 0;
    async function* source(): AsyncGenerator<ImportLine> {
      for (let i = 0; i < count; i++) {
        pulled++;
        await Promise.resolve();
        yield {
          id: `line-${i}`,
          role: 'user',
          content: `${i} ${'y'.repeat(1000)}`,
          sent_at: new Date(Date.UTC(2024, 0, 1, 0, 0, i)).toISOString(),
        };
      }
    }
    let pulledAtFirstBytes: number | undefined;
    const watching: typeof fetch = (input, init) => {
      const body = init?.body;
      if (!(body instanceof ReadableStream)) {
        pulledAtFirstBytes = pulled;
        return fetch(input, init);
      }
      const watched = (body as ReadableStream<Uint8Array>).pipeThrough(
        new TransformStream<Uint8Array, Uint8Array>({
          transform(chunk, controller) {
            pulledAtFirstBytes ??= pulled;
            controller.enqueue(chunk);
          },
        }),
      );
      return fetch(input, { ...init, body: watched });
    };
    const client = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: watching });

    // Action
    const imported = await client.importSession(s, source());

    // Assert: the first bytes left after a few dozen lines (buffered, after all 3000), and the
    // whole session arrived.
    assert.ok(pulledAtFirstBytes !== undefined && pulledAtFirstBytes < count / 10, `${pulledAtFirstBytes}`);
    assert.equal(imported.imported, count);
    assert.equal(imported.durable, true);
    const page = await mnemos.listMessages(s, { order: 'desc', limit: 1 });
    assert.equal(page.messages[0]?.id, `line-${count - 1}`);
    assert.equal((await mnemos.getSession(s)).message_count, count);

    // A source that fails midway: its own error, and the cut upload imported nothing.
    const broken = sid('broken-import');
    const boom = new Error('the source broke');
    async function* failing(): AsyncGenerator<ImportLine> {
      for (let i = 0; i < 500; i++) yield { role: 'user', content: `${i} ${'z'.repeat(1000)}` };
      throw boom;
    }
    await assert.rejects(mnemos.importSession(broken, failing()), (e: unknown) => e === boom);
    assert.equal((await rejects(mnemos.getSession(broken))).code, 'not_found');
  });

  void test('an import from an array is retried after a 503; from a generator it is not', async () => {
    const busy = () =>
      jsonResponse(503, { error: { code: 'import_busy', message: 'retry' } }, { 'retry-after': '0' });
    const line = (i: number): ImportLine => ({ role: 'user', content: `line ${i}` });

    // An array can be sent again: the 503 is retried, as every call's is.
    const fromArray = scriptedFetch(busy());
    const arrayClient = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: fromArray.impl });
    const imported = await arrayClient.importSession(sid('array-import'), [line(0), line(1)]);
    assert.equal(fromArray.calls.length, 2);
    assert.equal(imported.imported, 2);

    // A generator's lines cannot be read twice: the 503 (here after the first piece of the body
    // was read) is the caller's to handle, and the generator is closed.
    let closed = false;
    async function* lines(): AsyncGenerator<ImportLine> {
      try {
        for (let i = 0; i < 500; i++) yield { role: 'user', content: `${i} ${'w'.repeat(1000)}` };
      } finally {
        closed = true;
      }
    }
    let calls = 0;
    const readsThenBusy: typeof fetch = async (_input, init) => {
      calls++;
      const reader = (init!.body as ReadableStream<Uint8Array>).getReader();
      await reader.read();
      reader.releaseLock();
      return busy();
    };
    const generatorClient = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: readsThenBusy });
    const s = sid('generator-import');
    const err = await rejects(generatorClient.importSession(s, lines()));
    assert.equal(err.code, 'import_busy');
    assert.equal(err.retryAfterMs, 0);
    assert.equal(calls, 1);
    await within(
      5000,
      (async () => {
        while (!closed) await new Promise((resolve) => setImmediate(resolve));
      })(),
    );
    assert.equal((await rejects(mnemos.getSession(s))).code, 'not_found');
  });

  void test('an export that stalls after its headers times out; a slow reader does not', async () => {
    const line = (seq: number) =>
      `${JSON.stringify({ type: 'message', id: `m${seq}`, seq, role: 'user', content: 'x' })}\n`;
    const local = await localServer((req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      // One line, then nothing, the connection left open; or a whole body at once.
      if (req.url?.includes('/stalled/')) res.write(line(1));
      else res.end(line(1) + line(2) + line(3));
    });
    try {
      const client = createMnemosClient({ baseUrl: local.base, apiKey: 'k', timeoutMs: 200 });
      const seen: number[] = [];
      const started = Date.now();
      const err = await within(
        5000,
        rejects(
          (async () => {
            for await (const l of client.exportSession('stalled')) if (l.type === 'message') seen.push(l.seq);
          })(),
        ),
      );
      assert.equal(err.code, 'timeout');
      assert.deepEqual(seen, [1]);
      assert.ok(Date.now() - started >= 200, 'Date.now() - started >= 200');

      // The limit runs while a read waits for bytes, not while the caller holds a line.
      const all: number[] = [];
      for await (const l of client.exportSession('whole')) {
        if (l.type === 'message') all.push(l.seq);
        await new Promise((resolve) => setTimeout(resolve, 300));
      }
      assert.deepEqual(all, [1, 2, 3]);
    } finally {
      await local.close();
    }
  });

  void test('retry-after is delta-seconds or an HTTP date; anything else falls back to backoff', async () => {
    assert.equal(parseRetryAfter('5'), 5000);
    assert.equal(parseRetryAfter(' 1.5 '), 1500);
    for (const bad of [
      '-5',
      '+5',
      '1e3',
      '5s',
      'soon',
      '',
      '2030-01-01',
      'Nov 5',
      'Sun, 06 Nov 1994 08:49:37 PST',
    ]) {
      assert.equal(parseRetryAfter(bad), null, JSON.stringify(bad));
    }
    // The three forms of RFC 9110, 10 s ahead (whole seconds), and one in the past.
    const at = new Date(Math.ceil(Date.now() / 1000) * 1000 + 10_000);
    const [wd, dd, mon, yyyy, time] = at.toUTCString().split(' ') as [string, string, string, string, string];
    const weekday = {
      'Sun,': 'Sunday',
      'Mon,': 'Monday',
      'Tue,': 'Tuesday',
      'Wed,': 'Wednesday',
      'Thu,': 'Thursday',
      'Fri,': 'Friday',
      'Sat,': 'Saturday',
    }[wd]!;
    const forms = [
      at.toUTCString(),
      `${weekday}, ${dd}-${mon}-${yyyy.slice(2)} ${time} GMT`,
      `${wd.slice(0, 3)} ${mon} ${String(Number(dd)).padStart(2, ' ')} ${time} ${yyyy}`,
    ];
    for (const form of forms) {
      const ms = parseRetryAfter(form);
      assert.ok(ms !== null && ms > 8000 && ms <= 11_000, `${form}: ${ms}`);
    }
    assert.equal(parseRetryAfter('Sun, 06 Nov 1994 08:49:37 GMT'), 0);

    // A 429 with `retry-after: -5` waits the backoff (100–200 ms here), not 0 ms.
    const { impl, calls } = scriptedFetch(
      jsonResponse(429, { error: { code: 'rate_limited', message: 'slow down' } }, { 'retry-after': '-5' }),
    );
    const retries: RetryInfo[] = [];
    const client = createMnemosClient({
      baseUrl: svc.base,
      apiKey,
      fetch: impl,
      backoffBaseMs: 200,
      onRetry: (r) => retries.push(r),
    });
    await client.listSessions({ limit: 1 });
    assert.equal(calls.length, 2);
    assert.ok(retries[0]!.delayMs >= 100 && retries[0]!.delayMs <= 200, `delay ${retries[0]!.delayMs}`);
  });

  void test('a failed post carries the ids it sent; a repeat with them stores nothing twice', async () => {
    // Nothing listens on this port (it was just free).
    const gone = await localServer(() => undefined);
    await gone.close();
    const down = createMnemosClient({ baseUrl: gone.base, apiKey, retries: 1, backoffBaseMs: 5 });
    const err = await rejects(
      down.postMessages(sid('down'), [
        { id: 'mine-1', role: 'user', content: 'a' },
        { role: 'assistant', content: 'b' },
      ]),
    );
    assert.equal(err.code, 'network_error');
    assert.equal(err.attempts, 2);
    const { ids } = err.details as { ids: string[] };
    assert.equal(ids.length, 2);
    assert.equal(ids[0], 'mine-1');
    assert.match(ids[1]!, /^[0-9a-f-]{36}$/);

    // The server stored the post and the answer was lost: the ids make the repeat harmless.
    const s = sid('lost-ids');
    const input: MessageInput[] = [
      { role: 'user', content: 'question' },
      { role: 'assistant', content: 'answer' },
    ];
    const { impl } = scriptedFetch('deliver-then-fail');
    const noRetry = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: impl, retries: 0 });
    const lost = await rejects(noRetry.postMessages(s, input, { wait: true }));
    assert.equal(lost.code, 'network_error');
    const sent = (lost.details as { ids: string[] }).ids;
    const again = await mnemos.postMessages(
      s,
      input.map((m, i) => ({ ...m, id: sent[i] })),
      { wait: true },
    );
    assert.equal(again.accepted, 0);
    assert.deepEqual(
      again.messages.map((m) => m.id),
      sent,
    );
    assert.equal((await mnemos.getSession(s)).message_count, 2);
  });
});

void describe('client: error memory and tools', () => {
  void test('writes, deduplicates, finds, reads, lists, deletes and purges records', async () => {
    const tool = `deploy_${randomBytes(3).toString('hex')}`;
    const created = await mnemos.writeError({
      tool_name: tool,
      symptom: 'connection refused on port 5432',
      cause: 'postgres not started',
      action: 'start postgres before the migration',
      outcome: 'resolved',
    });
    assert.equal(created.deduplicated, false);
    const merged = await mnemos.writeError({
      tool_name: tool,
      symptom: 'connection refused on port 6543',
      action: 'start postgres before the migration',
      outcome: 'resolved',
    });
    assert.deepEqual(merged, { id: created.id, deduplicated: true });

    const found = await mnemos.searchErrors({ query: 'connection refused', toolName: tool });
    assert.deepEqual(
      found.map((r) => r.id),
      [created.id],
    );
    assert.equal(found[0]!.hits, 2);
    const hint = await mnemos.lookupError({ toolName: tool, error: 'dial tcp: connection refused' });
    assert.match(hint.related_errors, /start postgres/);
    assert.equal((await mnemos.getError(created.id)).symptom, 'connection refused on port 5432');
    const listed = [];
    for await (const r of mnemos.iterateErrors({ pageSize: 1 })) listed.push(r.id);
    assert.ok(listed.includes(created.id), 'listed.includes(created.id)');

    assert.equal(await mnemos.deleteError(created.id), true);
    assert.equal(await mnemos.deleteError(created.id), false);
    assert.equal((await rejects(mnemos.getError(created.id))).code, 'not_found');

    await mnemos.writeError({ tool_name: tool, symptom: 'disk full', action: 'prune', outcome: 'resolved' });
    // An empty or dot id would reach another route (fetch resolves dot segments; `DELETE
    // /v1/errors/` is the purge): refused before anything is sent, and nothing is deleted.
    for (const id of ['', '.', '..']) {
      const err = await rejects(mnemos.deleteError(id));
      assert.equal(err.code, 'invalid_argument', JSON.stringify(id));
      assert.equal(err.attempts, 0);
    }
    assert.equal((await rejects(mnemos.getSession('.'))).code, 'invalid_argument');
    assert.equal((await rejects(mnemos.getError(''))).code, 'invalid_argument');
    assert.equal((await mnemos.searchErrors({ query: 'disk full', toolName: tool })).length, 1);
    await mnemos.writeError({
      tool_name: tool,
      symptom: 'out of memory',
      action: 'resize',
      outcome: 'failed',
    });
    assert.equal(await mnemos.purgeErrors({ toolName: tool }), 2);
    assert.deepEqual(await mnemos.searchErrors({ query: 'disk full', toolName: tool }), []);
  });

  void test('lists the agent tools and runs them', async () => {
    const tools = await mnemos.tools();
    assert.deepEqual(tools.map((t) => t.function.name).sort(), [
      'chat_history',
      'error_history',
      'write_error',
    ]);
    const s = sid('tools');
    await mnemos.postMessages(s, [{ role: 'user', content: 'the build uses esbuild' }], { wait: true });
    const listed = await mnemos.runTool(s, 'chat_history', { mode: 'list', limit: 5 });
    assert.match(listed, /the build uses esbuild/);
    // Arguments as the model produced them: a JSON string.
    const tool = `lint_${randomBytes(3).toString('hex')}`;
    const wrote = await mnemos.runTool(
      s,
      'write_error',
      JSON.stringify({
        tool_name: tool,
        symptom: 'eslint crashed on a config',
        action: 'pin eslint 9',
        outcome: 'resolved',
      }),
    );
    assert.ok(wrote.length > 0, 'wrote.length > 0');
    const records = await mnemos.searchErrors({ query: 'eslint crashed', toolName: tool });
    assert.equal(records[0]?.action, 'pin eslint 9');
    assert.match(await mnemos.runTool(s, 'error_history', '{not json'), /not valid JSON/);
  });
});

void describe('client: split posts and aborted exports', () => {
  void test("an error of a later request of a split post names the caller's index and what was stored", async () => {
    const s = sid('split');
    const messages = Array.from({ length: 1500 }, (_, i) => ({
      role: i === 1200 ? 'robot' : 'user',
      content: `m${i}`,
    })) as MessageInput[];
    const err = await rejects(mnemos.postMessages(s, messages, { wait: true }));
    assert.equal(err.status, 400);
    const details = err.details as { problems: Array<{ path: string }>; accepted_before: unknown[] };
    assert.equal(details.problems[0]!.path, 'messages[1200].role');
    assert.match(err.message, /messages\[0\]\.\.messages\[999\] were stored/);
    assert.equal(details.accepted_before.length, 1000);
    assert.equal((await mnemos.getSession(s)).message_count, 1000);
    // Every id of the call, in the caller's order: a repeat with them stores nothing twice.
    const { ids } = err.details as { ids: string[] };
    assert.equal(ids.length, 1500);
    assert.equal(new Set(ids).size, 1500);
  });

  void test("aborting an export midway rejects with the caller's reason", async () => {
    const s = sid('abort');
    const big = 'x'.repeat(8000);
    await mnemos.postMessages(
      s,
      Array.from({ length: 1500 }, (_, i) => ({ role: 'user', content: `${i} ${big}` })) as MessageInput[],
      { wait: true },
    );
    const ac = new AbortController();
    const mine = new Error('the caller stopped');
    let lines = 0;
    await assert.rejects(
      (async () => {
        for await (const _line of mnemos.exportSession(s, { signal: ac.signal })) {
          if (++lines === 1) ac.abort(mine);
        }
      })(),
      (e: unknown) => e === mine,
    );
    assert.ok(lines < 1500, `stopped early (${lines} lines)`);
  });
});

void describe('client: lifecycle and admin', () => {
  void test('export streams the session and import restores it elsewhere', async () => {
    const s = sid('export');
    const posted = await mnemos.postMessages(
      s,
      [
        { role: 'user', content: 'one', sent_at: '2024-05-01T10:00:00Z' },
        { role: 'assistant', content: 'two', sent_at: '2024-05-01T10:00:01Z' },
      ],
      { wait: true },
    );
    const lines = [];
    for await (const line of mnemos.exportSession(s)) lines.push(line);
    assert.deepEqual(
      lines.map((l) => (l.type === 'message' ? [l.type, l.id, l.content] : [l.type])),
      posted.messages.map((m, i) => ['message', m.id, ['one', 'two'][i]]),
    );
    // An export's lines feed an import directly (streamed in, sent as JSON Lines).
    const copy = sid('import');
    const imported = await mnemos.importSession(copy, mnemos.exportSession(s));
    assert.equal(imported.imported, 2);
    assert.equal(imported.durable, true);
    const restored = [];
    for await (const m of mnemos.iterateMessages(copy)) restored.push([m.id, m.content, m.sent_at_ns]);
    assert.deepEqual(
      restored,
      lines.map((l) => (l.type === 'message' ? [l.id, l.content, l.sent_at_ns] : [])),
    );
    assert.equal((await rejects(mnemos.importSession(copy, lines))).status, 409);
  });

  void test('an export parses lines across chunk boundaries and reports a cut stream', async () => {
    const line = (seq: number) =>
      `${JSON.stringify({ type: 'message', id: `m${seq}`, seq, role: 'user', content: 'x' })}\n`;
    const text = line(1) + line(2);
    const chunks = [text.slice(0, 10), text.slice(10, 70), text.slice(70), line(3).slice(0, 5)];
    const cut: typeof fetch = () =>
      Promise.resolve(
        new Response(
          new ReadableStream<Uint8Array>({
            pull(controller) {
              const next = chunks.shift();
              if (next === undefined) controller.error(new TypeError('terminated'));
              else controller.enqueue(new TextEncoder().encode(next));
            },
          }),
          { status: 200, headers: { 'content-type': 'application/x-ndjson' } },
        ),
      );
    const client = createMnemosClient({ baseUrl: svc.base, apiKey, fetch: cut });
    const seen: number[] = [];
    const err = await rejects(
      (async () => {
        for await (const l of client.exportSession('any')) if (l.type === 'message') seen.push(l.seq);
      })(),
    );
    assert.deepEqual(seen, [1, 2]);
    assert.equal(err.code, 'stream_truncated');
  });

  void test('reset clears the archive, delete removes the session', async () => {
    const s = sid('reset');
    await mnemos.postMessages(s, [{ role: 'user', content: 'forget me' }], { wait: true });
    assert.deepEqual(await mnemos.resetSession(s, { keepSummary: false }), {
      session_id: s,
      reset: true,
      summary_kept: false,
    });
    assert.deepEqual((await mnemos.listMessages(s)).messages, []);
    assert.equal(await mnemos.deleteSession(s), true);
    assert.equal((await rejects(mnemos.getSession(s))).status, 404);
    assert.equal(await mnemos.deleteSession(s), false);
  });

  void test('admin creates tenants and keys; a revoked key stops working', async () => {
    const admin = createMnemosAdmin({ baseUrl: svc.base, adminToken: ADMIN_TOKEN });
    const name = `client-${randomBytes(4).toString('hex')}`;
    const tenant = await admin.createTenant(name);
    assert.ok(
      (await admin.listTenants()).some((x) => x.tenant_id === tenant.tenant_id && x.name === name),
      '(await admin.listTenants()).some((x) => x.tenant_id === tenant.tenant_id && x.name === name)',
    );
    assert.equal((await rejects(admin.createTenant(name))).status, 409);

    const key = await admin.createKey(tenant.tenant_id, { name: 'second' });
    assert.equal(key.tenant_id, tenant.tenant_id);
    const keys = await admin.listKeys(tenant.tenant_id);
    assert.deepEqual(keys.map((k) => k.name).sort(), ['default', 'second']);
    // Lists follow the pages: 101 more keys make 103, past the server's default page of 100.
    for (let i = 0; i < 101; i++) await admin.createKey(tenant.tenant_id, { name: `bulk-${i}` });
    assert.equal((await admin.listKeys(tenant.tenant_id)).length, 103);
    const second = createMnemosClient({ baseUrl: svc.base, apiKey: key.api_key });
    assert.deepEqual((await second.listSessions()).sessions, []);
    assert.equal(await admin.revokeKey(key.key_id), true);
    assert.equal((await rejects(second.listSessions())).code, 'unauthorized');

    // A tenant key is never an admin key.
    const tenantKey = createMnemosAdmin({ baseUrl: svc.base, adminToken: tenant.api_key });
    assert.equal((await rejects(tenantKey.listTenants())).code, 'forbidden');
    const wrong = createMnemosAdmin({ baseUrl: svc.base, adminToken: 'not-the-token' });
    assert.equal((await rejects(wrong.listTenants())).code, 'unauthorized');
  });

  void test('admin deletes a tenant', async () => {
    const admin = createMnemosAdmin({ baseUrl: svc.base, adminToken: ADMIN_TOKEN });
    const tenant = await admin.createTenant(`gone-${randomBytes(4).toString('hex')}`);
    const deleted = await admin.deleteTenant(tenant.tenant_id);
    assert.equal(deleted, true);
    assert.ok(
      !(await admin.listTenants()).some((x) => x.tenant_id === tenant.tenant_id),
      '!(await admin.listTenants()).some((x) => x.tenant_id === tenant.tenant_id)',
    );
    assert.equal(await admin.deleteTenant(tenant.tenant_id), false);
  });

  void test('ready reports per-dependency status', async () => {
    const ready = await mnemos.ready();
    assert.equal(ready.status, 'ready');
    assert.equal(ready.checks.postgres, 'ok');
    assert.equal(ready.checks.llm, 'disabled');
  });
});

void describe('client: summaries with an LLM', () => {
  let llmSvc: TestService;
  let client: MnemosClient;
  before(async () => {
    llmSvc = await startTestService({ env: { OPENAI_BASE_URL: fake.url, OPENAI_API_KEY: 'test' } });
    client = createMnemosClient({ baseUrl: llmSvc.base, apiKey: (await llmSvc.newTenant()).apiKey });
  });
  after(async () => {
    await llmSvc.stop();
  });

  void test('summarize with wait returns the new summary; getSummary, job and usage agree', async () => {
    const summary = {
      key_decisions: ['Do: keep answers short'],
      past_discussions: [],
      current_discussion: {
        topic: 'style',
        description: 'answer length',
        perspectives: '',
        direction: 'short',
      },
    };
    fake.reset();
    fake.onChat(() => ({ content: JSON.stringify(summary) }));
    const s = sid('summarize');
    const posted = await client.postMessages(
      s,
      [
        { role: 'user', content: 'please keep answers short from now on' },
        { role: 'assistant', content: 'will do' },
      ],
      { wait: true },
    );

    const done = await client.summarize(s, { wait: true });
    assert.equal(done.done, true);
    assert.ok(done.done && done.version >= 1, 'done.done && done.version >= 1');
    assert.deepEqual(done.done && done.summary, summary);
    const view = await client.getSummary(s);
    assert.deepEqual(view.summary, summary);
    assert.equal(view.cursor_seq, posted.messages[1]!.seq);
    const job = await client.job(done.job_id);
    assert.equal(job.state, 'completed');
    const usage = await client.usage({ sessionId: s });
    assert.ok(
      usage.rows.some((r) => r.purpose === 'summary' && r.calls >= 1),
      "usage.rows.some((r) => r.purpose === 'summary' && r.calls >= 1)",
    );

    // The export's summary line has every field (this did not compile when they were optional).
    const exported = [];
    for await (const line of client.exportSession(s)) exported.push(line);
    const last = exported.at(-1);
    assert.ok(last?.type === 'summary', "last?.type === 'summary'");
    const meta: { version: number; cursor_seq: number | null; status: string; updated_at: string } = last;
    assert.deepEqual(
      [meta.version, meta.cursor_seq, meta.status, typeof meta.updated_at],
      [view.version, view.cursor_seq, view.status, 'string'],
    );

    // The context now carries the summary and the system block.
    const ctx = await client.context(s, { input: 'next' });
    assert.equal(ctx.summary_version, view.version);
    assert.match(ctx.system_block, /Prior Conversation Context/);
    assert.match(String(ctx.messages.at(-2)?.content), /^Prior summary JSON/);
    fake.onChat(null);
  });

  void test("admin's retrySummaries clears a failed session's back-off, and a retry then summarizes it", async () => {
    // Setup: a session whose summary failed once (an answer that is not a summary).
    const tenant = await llmSvc.newTenant();
    const own = createMnemosClient({ baseUrl: llmSvc.base, apiKey: tenant.apiKey });
    const admin = createMnemosAdmin({ baseUrl: llmSvc.base, adminToken: ADMIN_TOKEN });
    const s = sid('retry');
    fake.reset();
    fake.onChat(() => ({ content: 'not a summary' }));
    await own.postMessages(s, [{ role: 'user', content: 'please keep answers short' }], { wait: true });
    const failed = await own.summarize(s, { wait: true });
    assert.ok(failed.done, 'failed.done');
    assert.equal(failed.failures, 1);

    // Action: the endpoint is mended, and the admin asks for a retry of the tenant's summaries.
    fake.onChat(() => ({
      content: JSON.stringify({
        key_decisions: ['Do: keep answers short'],
        past_discussions: [],
        current_discussion: { topic: 'style', description: '', perspectives: '', direction: '' },
      }),
    }));
    assert.equal(await admin.retrySummaries({ tenantId: tenant.tenantId }), 1);

    // Assert: the sweep the retry queued summarizes the session; an unknown tenant is a 404.
    await eventually(
      async () => ((await own.getSummary(s).catch(() => null))?.version ?? 0) >= 1,
      30_000,
      'the retried summary',
    );
    assert.deepEqual((await own.getSummary(s)).summary?.key_decisions, ['Do: keep answers short']);
    assert.equal((await rejects(admin.retrySummaries({ tenantId: 'no-such-tenant' }))).status, 404);
    assert.equal(await admin.retrySummaries(), 0, 'nothing failed is left');
    fake.onChat(null);
  });
});

void describe('examples/agent-loop.ts', () => {
  void test('runs a turn with a chat_history tool call and stores the whole turn', async () => {
    const s = sid('agent');
    // Older history, pushed out of the 4-message window by later small talk.
    await mnemos.postMessages(
      s,
      [
        { role: 'user', content: 'Should the recent index use pgvector with HNSW?' },
        { role: 'assistant', content: 'Yes: pgvector, exact k-NN per session, HNSW only if measured.' },
        { role: 'user', content: 'thanks' },
        { role: 'assistant', content: 'you are welcome' },
        { role: 'user', content: 'how is the weather' },
        { role: 'assistant', content: 'sunny' },
      ],
      { wait: true },
    );
    fake.reset();
    fake.queueChat(
      {
        status: 200,
        body: {
          id: 'chatcmpl-tool',
          object: 'chat.completion',
          created: 1,
          model: 'gpt-4o-mini',
          choices: [
            {
              index: 0,
              finish_reason: 'tool_calls',
              message: {
                role: 'assistant',
                content: null,
                refusal: null,
                tool_calls: [
                  {
                    id: 'call_1',
                    type: 'function',
                    function: { name: 'chat_history', arguments: '{"keyword":"pgvector"}' },
                  },
                ],
              },
            },
          ],
        },
      },
      { content: 'We chose pgvector with exact per-session k-NN.' },
    );
    const llm = { baseUrl: fake.url, apiKey: 'test', model: 'gpt-4o-mini' };

    const turn = await runTurn({
      mnemos,
      llm,
      sessionId: s,
      userText: 'What did we decide about the index?',
    });

    assert.equal(turn.answer, 'We chose pgvector with exact per-session k-NN.');
    assert.equal(turn.toolCalls, 1);
    const [first, second] = fake.chatRequests().map((r) => r.body as { messages: any[]; tools: any[] });
    assert.ok(first && second, 'first && second');
    assert.deepEqual(first.tools.map((t: any) => t.function.name).sort(), [
      'chat_history',
      'error_history',
      'write_error',
    ]);
    assert.equal(first.messages[0].role, 'system');
    // The new message is last, exactly once.
    assert.deepEqual(first.messages.at(-1), { role: 'user', content: 'What did we decide about the index?' });
    assert.equal(
      first.messages.filter((m: any) => m.content === 'What did we decide about the index?').length,
      1,
    );
    // The tool result (the old decision, found by search) went back to the model.
    const toolMsg = second.messages.at(-1);
    assert.equal(toolMsg.role, 'tool');
    assert.equal(toolMsg.tool_call_id, 'call_1');
    assert.match(toolMsg.content, /HNSW only if measured/);

    // The whole turn is in mnemos, in order, with the ids the example gave it (posted with a
    // 202: the context call with min_seq waits until it is archived).
    await mnemos.context(s, { minSeq: turn.lastSeq });
    const archived = (await mnemos.listMessages(s, { order: 'desc', limit: 4 })).messages.reverse();
    assert.deepEqual(
      archived.map((m) => [m.id, m.role, m.tool_call_id ?? null, m.tool_calls?.length ?? 0]),
      turn.posted.map((m) => [m.id, m.role, m.tool_call_id ?? null, m.tool_calls?.length ?? 0]),
    );
    assert.deepEqual(
      archived.map((m) => m.role),
      ['user', 'assistant', 'tool', 'assistant'],
    );
    assert.equal(archived.at(-1)!.seq, turn.lastSeq);

    // The next turn sees the previous one (minSeq = read-your-writes).
    fake.reset();
    fake.queueChat({ content: 'Anything else?' });
    const next = await runTurn({ mnemos, llm, sessionId: s, userText: 'ok', minSeq: turn.lastSeq });
    assert.equal(next.answer, 'Anything else?');
    const req = fake.chatRequests()[0]!.body as { messages: any[] };
    assert.deepEqual(req.messages.slice(-2), [
      { role: 'assistant', content: 'We chose pgvector with exact per-session k-NN.' },
      { role: 'user', content: 'ok' },
    ]);
  });

  void test('the first turn of a new session works without prior context', async () => {
    fake.reset();
    fake.queueChat({ content: 'Hello!' });
    const s = sid('fresh');
    const turn = await runTurn({
      mnemos,
      llm: { baseUrl: fake.url, model: 'gpt-4o-mini' },
      sessionId: s,
      userText: 'hi',
    });
    assert.equal(turn.answer, 'Hello!');
    const body = fake.chatRequests()[0]!.body as { messages: any[] };
    assert.deepEqual(body.messages.slice(1), [{ role: 'user', content: 'hi' }]);
    await mnemos.context(s, { minSeq: turn.lastSeq });
    const stored = (await mnemos.listMessages(s)).messages;
    assert.deepEqual(
      stored.map((m) => [m.role, m.content]),
      [
        ['user', 'hi'],
        ['assistant', 'Hello!'],
      ],
    );
  });
});

/** Metrics named in the ops brief (some are added by other modules) and those found in the code. */
const PLANNED_METRICS = [
  'mnemos_http_request_duration_seconds',
  'mnemos_messages_accepted_total',
  'mnemos_messages_archived_total',
  'mnemos_queue_jobs',
  'mnemos_queue_oldest_job_age_seconds',
  'mnemos_queue_paused',
  'mnemos_job_duration_seconds',
  'mnemos_job_failures_total',
  'mnemos_ingest_dead_letter_total',
  'mnemos_llm_calls_total',
  'mnemos_llm_tokens_total',
  'mnemos_summary_lag_seconds',
  'mnemos_summaries_stalled',
  'mnemos_search_duration_seconds',
  'mnemos_error_memory_hits_total',
  'mnemos_rate_limited_total',
  // The README tells operators to alert on these: each needs a panel too.
  'mnemos_queue_longest_active_job_seconds',
  'mnemos_redis_behind_total',
  'mnemos_ingest_inbox_moved_total',
  'mnemos_error_memory_upkeep_skipped_total',
];
const OTHER_KNOWN_METRICS = [
  'mnemos_messages_duplicate_total',
  'mnemos_messages_dropped_total',
  'mnemos_enqueue_failures_total',
  'mnemos_summarize_jobs_total',
  'mnemos_summary_chunks_total',
  'mnemos_summary_noise_dropped_total',
  'mnemos_embeddings_written_total',
  'mnemos_embeddings_skipped_total',
  'mnemos_compactions_total',
  'mnemos_process_resident_memory_bytes',
  'mnemos_process_cpu_seconds_total',
  'mnemos_process_start_time_seconds',
  'mnemos_nodejs_eventloop_lag_p99_seconds',
];

void describe('docs/grafana/mnemos.json', () => {
  type Panel = {
    type: string;
    title: string;
    panels?: Panel[];
    datasource?: { uid?: string };
    targets?: Array<{ expr: string }>;
  };
  const dashboard = JSON.parse(
    readFileSync(new URL('../docs/grafana/mnemos.json', import.meta.url), 'utf8'),
  ) as {
    schemaVersion: number;
    panels: Panel[];
    templating: { list: Array<{ name: string; type: string; query: unknown }> };
  };
  const panels = dashboard.panels.flatMap((p) => [p, ...(p.panels ?? [])]).filter((p) => p.type !== 'row');
  const known = new Set([...PLANNED_METRICS, ...OTHER_KNOWN_METRICS]);
  const metricsOf = (expr: string) =>
    [...expr.matchAll(/\bmnemos_[a-z0-9_]+/g)].map(([name]) => {
      const base = name.replace(/_(bucket|count|sum)$/, '');
      return known.has(base) ? base : name;
    });

  void test('every panel queries known mnemos metrics through the DS_PROMETHEUS variable', () => {
    assert.ok(dashboard.schemaVersion >= 36, 'dashboard.schemaVersion >= 36');
    assert.deepEqual(
      dashboard.templating.list.find((v) => v.name === 'DS_PROMETHEUS'),
      {
        ...dashboard.templating.list.find((v) => v.name === 'DS_PROMETHEUS'),
        type: 'datasource',
        query: 'prometheus',
      },
    );
    assert.ok(panels.length >= 20, 'panels.length >= 20');
    for (const p of panels) {
      assert.equal(p.datasource?.uid, '${DS_PROMETHEUS}', p.title);
      assert.ok(p.targets && p.targets.length > 0, `${p.title} has no query`);
      for (const t of p.targets) {
        const names = metricsOf(t.expr);
        assert.ok(names.length > 0, `${p.title}: ${t.expr} names no mnemos metric`);
        for (const n of names) assert.ok(known.has(n), `${p.title}: unknown metric ${n}`);
      }
    }
    const used = new Set(panels.flatMap((p) => (p.targets ?? []).flatMap((t) => metricsOf(t.expr))));
    for (const name of PLANNED_METRICS) assert.ok(used.has(name), `no panel for ${name}`);
  });

  void test('the metrics it queries are exposed by a running service (except those still to come)', async () => {
    // Search registers its histogram on first use.
    await mnemos.search(sid('metrics'), { query: 'x' }).catch(() => undefined);
    const text = await (await fetch(`${svc.base}/metrics`)).text();
    const exposed = new Set([...text.matchAll(/^# TYPE (\S+) /gm)].map((m) => m[1]));
    const notYet = ['mnemos_summary_lag_seconds', 'mnemos_error_memory_hits_total'];
    const used = new Set(panels.flatMap((p) => (p.targets ?? []).flatMap((t) => metricsOf(t.expr))));
    const missing = [...used].filter((n) => !exposed.has(n) && !notYet.includes(n));
    assert.deepEqual(missing, []);
    // A search may run up to SEARCH_TIMEOUT_MS (10 s): it has a bucket below +Inf.
    assert.match(text, /mnemos_search_duration_seconds_bucket\{le="10",/);
  });
});
