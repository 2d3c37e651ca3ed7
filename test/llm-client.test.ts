import { after, before, beforeEach, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { ConfigError, loadConfig } from '../services/config.js';
import { LlmError, makeLlmClient } from '../services/llm/llm-client.js';
import type { LlmCallEvent, LlmClientOptions, LlmUsage } from '../services/llm/llm-client.js';
import {
  LOCAL_EMBEDDING_MODEL,
  lightStem,
  localEmbed,
  localEmbedMany,
  localFeatures,
} from '../services/llm/local-embedder.js';
import { decodeFloat32Base64, startFakeOpenAI } from './support/fake-openai.js';
import * as reference from './support/local-embedder-reference.js';
import type { FakeOpenAI } from './support/fake-openai.js';

const CTX = { purpose: 'summary', tenantId: 't1', sessionId: 's1' } as const;
const MESSAGES = [{ role: 'user', content: 'hello' }] as const;

let fake: FakeOpenAI;

before(async () => {
  fake = await startFakeOpenAI();
});
after(async () => {
  await fake.close();
});
beforeEach(() => fake.reset());

function client(overrides: Partial<LlmClientOptions> = {}) {
  return makeLlmClient({ baseURL: fake.url, timeoutMs: 2000, baseDelayMs: 5, maxDelayMs: 50, ...overrides });
}

function chatReq(extra: Record<string, unknown> = {}) {
  return { ...CTX, model: 'gpt-4o-mini', messages: [...MESSAGES], ...extra };
}

async function rejectsWith(promise: Promise<unknown>, check: (err: LlmError) => void): Promise<LlmError> {
  try {
    await promise;
  } catch (err) {
    assert.ok(err instanceof LlmError, `expected LlmError, got ${String(err)}`);
    check(err);
    return err;
  }
  assert.fail('expected the call to fail');
}

function cosine(a: number[], b: number[]): number {
  let dot = 0;
  let na = 0;
  let nb = 0;
  a.forEach((v, i) => {
    const w = b[i] ?? 0;
    dot += v * w;
    na += v * v;
    nb += w * w;
  });
  return dot / Math.sqrt(na * nb);
}

void describe('llm client: chat', () => {
  void test('happy path returns content and reports usage once', async () => {
    const usages: LlmUsage[] = [];
    const calls: LlmCallEvent[] = [];
    fake.queueChat({ content: 'a summary', usage: { prompt_tokens: 12, completion_tokens: 3 } });
    const result = await client({
      onUsage: (u) => void usages.push(u),
      onCall: (e) => void calls.push(e),
    }).chat(chatReq());

    assert.deepEqual(result, {
      content: 'a summary',
      inputTokens: 12,
      outputTokens: 3,
      finishReason: 'stop',
    });
    assert.ok(
      usages[0]?.startedAt instanceof Date && usages[0].startedAt.getTime() <= Date.now(),
      'usages[0]?.startedAt instanceof Date && usages[0].startedAt.getTime() <= Date.now()',
    );
    assert.deepEqual(
      usages.map(({ startedAt: _, ...u }) => u),
      [
        {
          purpose: 'summary',
          model: 'gpt-4o-mini',
          inputTokens: 12,
          outputTokens: 3,
          tenantId: 't1',
          sessionId: 's1',
        },
      ],
    );
    assert.equal(calls.length, 1);
    assert.equal(calls[0]?.outcome, 'ok');
    const [req] = fake.chatRequests();
    assert.equal((req?.body as any).model, 'gpt-4o-mini');
    assert.deepEqual((req?.body as any).messages, MESSAGES);
    assert.equal((req?.body as any).response_format, undefined);
    // A placeholder key is sent when only a baseURL is configured.
    assert.equal(req?.headers['authorization'], 'Bearer unused');
  });

  void test('missing sessionId is reported as null and an async onUsage is awaited', async () => {
    let usage: LlmUsage | undefined;
    await client({
      onUsage: async (u) => {
        await new Promise((r) => setTimeout(r, 20));
        usage = u;
      },
    }).chat({ purpose: 'noise', tenantId: 't2', model: 'm', messages: [...MESSAGES] });
    assert.equal(usage?.sessionId, null);
    assert.equal(usage?.purpose, 'noise');
  });

  void test('JSON mode sends response_format json_object and passes sampling params', async () => {
    fake.queueChat({ content: '{"ok":true}' });
    const result = await client().chat(chatReq({ json: true, temperature: 0.2, maxTokens: 50 }));
    assert.equal(result.content, '{"ok":true}');
    const body = fake.chatRequests()[0]?.body as any;
    assert.deepEqual(body.response_format, { type: 'json_object' });
    assert.equal(body.temperature, 0.2);
    assert.equal(body.max_tokens, 50);
  });

  void test('a 400 about response_format falls back to plain mode and remembers it', async () => {
    fake.queueChat(
      {
        status: 400,
        body: { error: { message: 'response_format is not supported by this server', type: 'x' } },
      },
      { content: '{"a":1}' },
      { content: '{"b":2}' },
    );
    const warnings: string[] = [];
    const llm = client({ logger: { warn: (_o, msg) => void warnings.push(msg) } });
    assert.equal((await llm.chat(chatReq({ json: true }))).content, '{"a":1}');
    assert.equal((await llm.chat(chatReq({ json: true }))).content, '{"b":2}');
    const formats = fake.chatRequests().map((r) => (r.body as any).response_format);
    assert.deepEqual(formats, [{ type: 'json_object' }, undefined, undefined]);
    assert.equal(warnings.length, 1);
  });

  void test('a model rejecting max_tokens/temperature is adapted to, per model', async () => {
    fake.queueChat(
      {
        status: 400,
        body: {
          error: {
            message:
              "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.",
            param: 'max_tokens',
          },
        },
      },
      {
        status: 400,
        body: {
          error: { message: "Unsupported value: 'temperature' does not support 0.2 with this model." },
        },
      },
      { content: 'one' },
      { content: 'two' },
      { content: 'other model' },
    );
    const llm = client();
    const req = chatReq({ model: 'reasoner', temperature: 0.2, maxTokens: 10 });
    assert.equal((await llm.chat(req)).content, 'one');
    assert.equal((await llm.chat(req)).content, 'two');
    assert.equal((await llm.chat({ ...req, model: 'classic' })).content, 'other model');
    const sent = fake.chatRequests().map((r) => {
      const b = r.body as any;
      return [b.model, b.max_tokens, b.max_completion_tokens, b.temperature];
    });
    assert.deepEqual(sent, [
      ['reasoner', 10, undefined, 0.2],
      ['reasoner', undefined, 10, 0.2],
      ['reasoner', undefined, 10, undefined],
      ['reasoner', undefined, 10, undefined],
      ['classic', 10, undefined, 0.2],
    ]);
  });

  void test("OpenAI's 'must contain the word json' 400 is a prompt bug, not a reason to drop JSON mode", async () => {
    fake.queueChat({
      status: 400,
      body: {
        error: {
          message:
            "'messages' must contain the word 'json' in some form, to use 'response_format' of type 'json_object'.",
        },
      },
    });
    await rejectsWith(client().chat(chatReq({ json: true })), (err) => assert.equal(err.kind, 'bad_request'));
    assert.equal(fake.chatRequests().length, 1);
  });

  void test('429 with retry-after: 0 is retried and succeeds', async () => {
    fake.queueChat({ status: 429, headers: { 'retry-after': '0' } }, { content: 'ok' });
    const calls: LlmCallEvent[] = [];
    const result = await client({ onCall: (e) => void calls.push(e) }).chat(chatReq());
    assert.equal(result.content, 'ok');
    assert.equal(fake.chatRequests().length, 2);
    assert.deepEqual(
      calls.map((c) => [c.outcome, c.kind]),
      [
        ['error', 'rate_limited'],
        ['ok', undefined],
      ],
    );
  });

  void test('retry-after-ms is honoured as the backoff delay', async () => {
    fake.queueChat({ status: 429, headers: { 'retry-after-ms': '300' } }, { content: 'ok' });
    const started = Date.now();
    await client({ maxDelayMs: 5000 }).chat(chatReq());
    const [first, second] = fake.chatRequests();
    assert.ok(first && second, 'first && second');
    assert.ok(second.at - first.at >= 280, `retried after ${second.at - first.at}ms`);
    assert.ok(Date.now() - started < 2000, 'Date.now() - started < 2000');
  });

  void test('a retry-after longer than maxDelayMs is not retried sooner: the call ends with the wait asked for', async () => {
    fake.queueChat(
      { status: 429, headers: { 'retry-after': '60' } },
      { status: 503, headers: { 'retry-after-ms': '41' } },
      { content: 'never' },
    );
    const started = Date.now();
    await rejectsWith(client({ maxAttempts: 3, maxDelayMs: 40 }).chat(chatReq()), (err) => {
      assert.equal(err.kind, 'rate_limited');
      assert.equal(err.retryable, true);
      assert.equal(err.status, 429);
      assert.equal(err.retryAfterMs, 60_000);
    });
    await rejectsWith(client({ maxAttempts: 3, maxDelayMs: 40 }).chat(chatReq()), (err) => {
      assert.deepEqual([err.kind, err.status, err.retryAfterMs], ['server', 503, 41]);
    });
    assert.ok(Date.now() - started < 1000, 'Date.now() - started < 1000');
    assert.equal(fake.chatRequests().length, 2, 'one request per call: a retry 8 s into 60 is refused again');
  });

  void test('500 x3 fails retryable with kind server after exactly maxAttempts requests', async () => {
    fake.queueChat({ status: 500 }, { status: 500 }, { status: 500 }, { content: 'never reached' });
    let usageCalls = 0;
    await rejectsWith(client({ maxAttempts: 3, onUsage: () => void usageCalls++ }).chat(chatReq()), (err) => {
      assert.equal(err.kind, 'server');
      assert.equal(err.retryable, true);
      assert.equal(err.status, 500);
    });
    assert.equal(fake.chatRequests().length, 3);
    assert.equal(usageCalls, 0);
  });

  void test('400 fails at once, not retryable', async () => {
    fake.queueChat({ status: 400 }, { content: 'never reached' });
    await rejectsWith(client().chat(chatReq()), (err) => {
      assert.equal(err.kind, 'bad_request');
      assert.equal(err.retryable, false);
      assert.equal(err.status, 400);
    });
    assert.equal(fake.chatRequests().length, 1);
  });

  void test("an endpoint's error text, which may quote the input, stays out of the error; its type and code stay", async () => {
    fake.queueChat({
      status: 400,
      body: {
        error: {
          message: "Invalid input: input_value='my password is hunter2'",
          type: 'invalid_request_error',
          code: 'context_length_exceeded',
        },
      },
    });
    await rejectsWith(client().chat(chatReq()), (err) => {
      assert.equal(err.message, 'llm endpoint answered 400 (invalid_request_error, context_length_exceeded)');
    });
    fake.queueEmbeddings({
      status: 401,
      // A token or a number where the code goes is no error code either.
      body: {
        error: {
          message: 'Incorrect API key provided: sk-ab***cd',
          code: 'sk-proj-abc123',
          type: '4111111111111111',
        },
      },
    });
    const embed = client().embed({ ...CTX, purpose: 'embedding', model: 'e', input: ['x'] });
    await rejectsWith(embed, (err) => {
      assert.equal(err.message, 'llm endpoint answered 401');
      assert.equal(err.kind, 'auth');
    });
  });

  void test('401 is an auth error, not retried', async () => {
    fake.queueChat({ status: 401 });
    await rejectsWith(client({ apiKey: 'sk-test' }).chat(chatReq()), (err) => {
      assert.equal(err.kind, 'auth');
      assert.equal(err.retryable, false);
    });
    assert.equal(fake.chatRequests().length, 1);
    assert.equal(fake.chatRequests()[0]?.headers['authorization'], 'Bearer sk-test');
  });

  void test('malformed JSON body is invalid_response and not retried', async () => {
    fake.queueChat({ malformed: true }, { content: 'never reached' });
    await rejectsWith(client().chat(chatReq()), (err) => {
      assert.equal(err.kind, 'invalid_response');
      assert.equal(err.retryable, false);
    });
    assert.equal(fake.chatRequests().length, 1);
  });

  void test('empty content is invalid_response, and its billed usage is still recorded', async () => {
    fake.queueChat({ content: '', usage: { prompt_tokens: 250, completion_tokens: 10 } });
    const usages: LlmUsage[] = [];
    await rejectsWith(client({ onUsage: (u) => void usages.push(u) }).chat(chatReq()), (err) =>
      assert.equal(err.kind, 'invalid_response'),
    );
    assert.equal(fake.chatRequests().length, 1);
    assert.deepEqual(
      usages.map((u) => [u.inputTokens, u.outputTokens]),
      [[250, 10]],
    );
  });

  void test('a hanging endpoint times out per attempt and is retryable', async () => {
    fake.queueChat({ hang: true }, { hang: true }, { content: 'never reached' });
    const started = Date.now();
    await rejectsWith(client({ maxAttempts: 2 }).chat(chatReq({ timeoutMs: 200 })), (err) => {
      assert.equal(err.kind, 'timeout');
      assert.equal(err.retryable, true);
    });
    const elapsed = Date.now() - started;
    assert.equal(fake.chatRequests().length, 2);
    assert.ok(elapsed >= 400 && elapsed < 1500, `took ${elapsed}ms`);
  });

  void test('a slow answer that fits in the timeout succeeds', async () => {
    fake.queueChat({ delayMs: 50, then: { content: 'late but fine' } });
    assert.equal((await client().chat(chatReq({ timeoutMs: 1000 }))).content, 'late but fine');
  });

  /**
   * Aborts once the fake has the call's first request (in the backoff after a 429, or while the
   * fake holds its answer). A fixed 100 ms timer raced the request on a loaded machine: aborted
   * before it arrived, the request reached the fake later and took the next test's script.
   */
  const abortOnceRequested = (controller: AbortController) => {
    const poll = setInterval(() => {
      if (fake.chatRequests().length === 0) return;
      clearInterval(poll);
      setTimeout(() => controller.abort(), 50);
    }, 5);
  };

  void test('abort during the backoff sleep ends the call quickly as aborted', async () => {
    fake.queueChat({ status: 429, headers: { 'retry-after': '5' } }, { content: 'never reached' });
    const controller = new AbortController();
    abortOnceRequested(controller);
    const started = Date.now();
    await rejectsWith(client({ maxDelayMs: 10_000 }).chat(chatReq({ signal: controller.signal })), (err) => {
      assert.equal(err.kind, 'aborted');
      assert.equal(err.retryable, false);
    });
    // Well before the 5 s the endpoint asked for.
    assert.ok(Date.now() - started < 4000, 'Date.now() - started < 4000');
    assert.equal(fake.chatRequests().length, 1);
  });

  void test('abort during an in-flight request is aborted, not timeout', async () => {
    fake.queueChat({ hang: true });
    const controller = new AbortController();
    abortOnceRequested(controller);
    await rejectsWith(client().chat(chatReq({ signal: controller.signal })), (err) =>
      assert.equal(err.kind, 'aborted'),
    );
    assert.equal(fake.chatRequests().length, 1);
  });

  void test('an already-aborted signal sends nothing', async () => {
    await rejectsWith(client().chat(chatReq({ signal: AbortSignal.abort() })), (err) =>
      assert.equal(err.kind, 'aborted'),
    );
    assert.equal(fake.chatRequests().length, 0);
  });

  void test('an unreachable endpoint is a retryable network error', async () => {
    const dead = await startFakeOpenAI();
    const url = dead.url;
    await dead.close();
    await rejectsWith(
      makeLlmClient({ baseURL: url, timeoutMs: 1000, maxAttempts: 2, baseDelayMs: 1 }).chat(chatReq()),
      (err) => {
        assert.equal(err.kind, 'network');
        assert.equal(err.retryable, true);
      },
    );
  });

  void test('a throwing onUsage is logged and does not fail the call', async () => {
    const warnings: Array<{ obj: object; msg: string }> = [];
    const result = await client({
      onUsage: () => {
        throw new Error('metrics down');
      },
      logger: { warn: (obj, msg) => void warnings.push({ obj, msg }) },
    }).chat(chatReq());
    assert.equal(result.content, '{}');
    assert.equal(warnings.length, 1);
    assert.match(warnings[0]?.msg ?? '', /onUsage/);
  });
});

/** A 200 chat completion whose first choice is `choice` (merged over a plain answer). */
function completion(choice: Record<string, unknown>, extra: Record<string, unknown> = {}) {
  return {
    status: 200,
    body: {
      id: 'chatcmpl-x',
      object: 'chat.completion',
      model: 'gpt-4o-mini',
      choices: [
        { index: 0, message: { role: 'assistant', content: 'text' }, finish_reason: 'stop', ...choice },
      ],
      usage: { prompt_tokens: 7, completion_tokens: 2, total_tokens: 9 },
      ...extra,
    },
  };
}

void describe('llm client: real providers', () => {
  void test("an endpoint's error code becomes the error's code (Azure's content filter, OpenAI's model_not_found)", async () => {
    fake.queueChat(
      {
        status: 400,
        body: {
          error: {
            message:
              "The response was filtered due to the prompt triggering Azure OpenAI's content management policy.",
            type: null,
            param: 'prompt',
            code: 'content_filter',
            status: 400,
          },
        },
      },
      {
        status: 404,
        body: {
          error: {
            message: 'The model `gpt-9` does not exist',
            type: 'invalid_request_error',
            code: 'model_not_found',
          },
        },
      },
      // Only the type is a word: it stands in.
      { status: 400, body: { error: { message: 'bad', type: 'invalid_request_error', code: 400 } } },
      // Neither is: no code at all.
      { status: 400, body: { error: { message: 'bad', type: 'Bad Request', code: 'sk-abc123' } } },
    );
    const llm = client();
    const codes: Array<[string, number | undefined, string | undefined]> = [];
    for (let i = 0; i < 4; i++) {
      await rejectsWith(llm.chat(chatReq()), (err) => void codes.push([err.kind, err.status, err.code]));
    }
    assert.deepEqual(codes, [
      ['bad_request', 400, 'content_filter'],
      ['bad_request', 404, 'model_not_found'],
      ['bad_request', 400, 'invalid_request_error'],
      ['bad_request', 400, undefined],
    ]);
  });

  void test('an answer without text says why in its code: no choices, refusal, content filter, length, no text', async () => {
    fake.queueChat(
      completion({}, { choices: [] }),
      completion({}, { choices: undefined }),
      completion({
        message: { role: 'assistant', content: null, refusal: "I can't help with my password hunter2" },
      }),
      completion({ message: { role: 'assistant', content: null }, finish_reason: 'content_filter' }),
      completion({ message: { role: 'assistant', content: '' }, finish_reason: 'length' }),
      completion({ message: { role: 'assistant', content: null }, finish_reason: 'stop' }),
    );
    const usages: LlmUsage[] = [];
    const llm = client({ onUsage: (u) => void usages.push(u) });
    const seen: Array<[string | undefined, boolean]> = [];
    for (let i = 0; i < 6; i++) {
      await rejectsWith(llm.chat(chatReq()), (err) => {
        assert.equal(err.kind, 'invalid_response');
        assert.doesNotMatch(err.message, /hunter2/);
        seen.push([err.code, err.retryable]);
      });
    }
    assert.deepEqual(seen, [
      ['no_choices', false],
      ['no_choices', false],
      ['refusal', false],
      ['content_filter', false],
      ['length', false],
      ['no_text', false],
    ]);
    assert.equal(fake.chatRequests().length, 6, 'none is retried');
    assert.equal(usages.length, 6, 'each is billed');
  });

  void test('an answer with a refusal is refused also when it carries text', async () => {
    fake.queueChat(
      completion({
        message: {
          role: 'assistant',
          content: "I'm sorry",
          refusal: "I can't help with my password hunter2",
        },
      }),
      completion({
        message: { role: 'assistant', content: '{"key_decisions":[', refusal: 'I cannot continue.' },
      }),
    );
    const usages: LlmUsage[] = [];
    const llm = client({ onUsage: (u) => void usages.push(u) });
    for (let i = 0; i < 2; i++) {
      await rejectsWith(llm.chat(chatReq()), (err) => {
        assert.deepEqual([err.kind, err.code, err.retryable], ['invalid_response', 'refusal', false]);
        assert.doesNotMatch(err.message, /hunter2|sorry/);
      });
    }
    assert.equal(fake.chatRequests().length, 2, 'none is retried');
    assert.equal(usages.length, 2, 'each is billed');
  });

  void test('an answer cut at the token limit is returned with finishReason length', async () => {
    fake.queueChat(
      completion({ message: { role: 'assistant', content: '{"summary": "half' }, finish_reason: 'length' }),
    );
    const result = await client().chat(chatReq());
    assert.equal(result.content, '{"summary": "half');
    assert.equal(result.finishReason, 'length');
  });

  void test("an array content's text parts are the answer, its thinking parts are not", async () => {
    fake.queueChat(
      completion({
        message: {
          role: 'assistant',
          content: [
            { type: 'thinking', thinking: [{ type: 'text', text: 'let me think' }] },
            { type: 'text', text: '{"a":' },
            { type: 'text', text: '1}' },
          ],
        },
      }),
      completion({
        message: { role: 'assistant', content: [{ type: 'thinking', thinking: 'only thoughts' }] },
      }),
    );
    const llm = client();
    assert.equal((await llm.chat(chatReq())).content, '{"a":1}');
    await rejectsWith(llm.chat(chatReq()), (err) => assert.equal(err.code, 'no_text'));
  });

  void test('a 200 with an error body is classified by its code: 429, 5xx and none retried, a 4xx or a fault word not', async () => {
    const errorBody = (code: unknown) => ({
      status: 200,
      body: { error: { code, message: 'Provider returned error' } },
    });
    fake.queueChat(
      errorBody(429),
      { content: 'after 429' },
      errorBody(502),
      errorBody('503'),
      errorBody(400),
    );
    const calls: LlmCallEvent[] = [];
    const llm = client({ maxAttempts: 2, onCall: (e) => void calls.push(e) });
    assert.equal((await llm.chat(chatReq())).content, 'after 429');
    await rejectsWith(llm.chat(chatReq()), (err) => {
      assert.equal(err.kind, 'server');
      assert.equal(err.retryable, true);
      assert.equal(err.code, 'error_body');
    });
    await rejectsWith(llm.chat(chatReq()), (err) => {
      assert.equal(err.kind, 'invalid_response');
      assert.equal(err.retryable, false);
      assert.equal(err.code, 'error_body');
      assert.doesNotMatch(err.message, /Provider returned/);
    });
    assert.deepEqual(
      calls.map((c) => c.kind ?? c.outcome),
      ['rate_limited', 'ok', 'server', 'server', 'invalid_response'],
    );

    // No code, or one that says nothing (a gateway whose upstream timed out), is an outage: only a
    // code naming the request's fault is not retried (the recent index takes it for the input's).
    const errorOf = (error: Record<string, unknown>) => ({ status: 200, body: { error } });
    fake.queueEmbeddings(
      errorOf({ code: 503, message: 'overloaded' }),
      'ok',
      errorOf({ message: 'upstream request timed out' }),
      'ok',
      errorOf({ code: 'upstream_error', message: 'provider failed' }),
      'ok',
      errorOf({ code: 422, message: 'input rejected' }),
      errorOf({ code: 'invalid_request_error', message: 'input rejected' }),
      errorOf({ code: 'invalid_api_key', message: 'who are you' }),
      // OpenAI's own shape: the word in `type`, `code` null (was an outage, retried).
      errorOf({ type: 'invalid_request_error', code: null, message: 'input rejected' }),
    );
    const embed = () => llm.embed({ ...CTX, purpose: 'embedding', model: 'e', input: ['x'], dimensions: 8 });
    for (let i = 0; i < 3; i++) assert.equal((await embed())[0]?.length, 8);
    for (let i = 0; i < 2; i++) {
      await rejectsWith(embed(), (err) => {
        assert.equal(err.kind, 'invalid_response');
        assert.equal(err.retryable, false);
        assert.equal(err.code, 'error_body');
      });
    }
    await rejectsWith(embed(), (err) => {
      assert.equal(err.kind, 'auth');
      assert.equal(err.code, 'error_body');
    });
    await rejectsWith(embed(), (err) => {
      assert.equal(err.kind, 'invalid_response');
      assert.equal(err.retryable, false);
    });
    assert.equal(fake.embeddingRequests().length, 10);
  });

  void test('a 200 error body with a word code is retried by what it says; a context-length text is context_length_exceeded', async () => {
    fake.queueChat(
      { status: 200, body: { error: { code: 'rate_limit_exceeded', message: 'slow down' } } },
      { content: 'after the word code' },
      {
        status: 400,
        body: {
          object: 'error',
          message: "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens.",
          type: 'BadRequestError',
          code: 400,
        },
      },
    );
    const llm = client({ maxAttempts: 2 });
    assert.equal((await llm.chat(chatReq())).content, 'after the word code');
    await rejectsWith(llm.chat(chatReq()), (err) => {
      assert.equal(err.kind, 'bad_request');
      assert.equal(err.code, 'context_length_exceeded');
      assert.doesNotMatch(err.message, /4096/);
    });
  });

  void test("an error body outside OpenAI's envelope (vLLM, FastAPI's 422) still names the refused parameter", async () => {
    fake.queueChat(
      // vLLM: the error at the top level.
      {
        status: 400,
        body: {
          object: 'error',
          message: 'response_format is not supported',
          type: 'BadRequestError',
          param: null,
          code: 400,
        },
      },
      // FastAPI/TGI: pydantic's validation details, as a 422.
      {
        status: 422,
        body: {
          detail: [
            { loc: ['body', 'temperature'], msg: 'extra fields not permitted', type: 'value_error.extra' },
          ],
        },
      },
      { content: '{"ok":true}' },
    );
    const dropped: unknown[] = [];
    const llm = client({
      logger: { warn: (obj) => void dropped.push((obj as { dropped?: unknown }).dropped) },
    });
    assert.equal((await llm.chat(chatReq({ json: true, temperature: 0.3 }))).content, '{"ok":true}');
    assert.deepEqual(dropped, ['response_format', 'temperature']);
    assert.deepEqual(
      fake.chatRequests().map((r) => [(r.body as any).response_format, (r.body as any).temperature]),
      [
        [{ type: 'json_object' }, 0.3],
        [undefined, 0.3],
        [undefined, undefined],
      ],
    );
  });

  void test('a re-wrapped error body keeps its status and headers, and its text stays out of the message', async () => {
    fake.queueChat(
      {
        status: 429,
        body: { object: 'error', message: 'slow down', code: 429 },
        headers: { 'retry-after-ms': '30' },
      },
      {
        status: 422,
        body: { detail: [{ loc: ['body', 'messages', 0], msg: 'my secret prompt is invalid' }] },
      },
    );
    await rejectsWith(client({ maxAttempts: 1 }).chat(chatReq()), (err) => {
      assert.equal(err.kind, 'rate_limited');
      assert.equal(err.retryAfterMs, 30);
    });
    const err = await rejectsWith(client().chat(chatReq()), (e) => {
      assert.equal(e.kind, 'bad_request');
      assert.equal(e.status, 422);
      assert.equal(e.message, 'llm endpoint answered 422');
    });
    // The SDK's error (the cause, not logged by us) has the text, where it once had "no body".
    assert.match(String((err.cause as Error).message), /body\.messages\.0: my secret prompt is invalid/);
  });

  void test('an embeddings endpoint refusing dimensions stops getting them, and the size is still checked', async () => {
    fake.queueEmbeddings(
      {
        status: 400,
        body: {
          error: {
            message: 'This model does not support specifying dimensions.',
            type: 'invalid_request_error',
            param: null,
            code: null,
          },
        },
      },
      'ok',
      'ok',
      {
        status: 422,
        body: {
          detail: [
            { loc: ['body', 'dimensions'], msg: 'Extra inputs are not permitted', type: 'extra_forbidden' },
          ],
        },
      },
    );
    const warnings: Array<{ obj: object; msg: string }> = [];
    const llm = client({ logger: { warn: (obj, msg) => void warnings.push({ obj, msg }) } });
    const embed = (model: string, dimensions: number) =>
      llm.embed({ ...CTX, purpose: 'embedding', model, input: ['x'], dimensions });
    // The fake's native size is 1536.
    assert.equal((await embed('ada', 1536))[0]?.length, 1536);
    assert.equal((await embed('ada', 1536))[0]?.length, 1536);
    await rejectsWith(embed('other', 64), (err) => {
      assert.equal(err.kind, 'invalid_response');
      assert.match(err.message, /has 1536 dimensions, expected 64/);
    });
    assert.deepEqual(
      fake.embeddingRequests().map((r) => [(r.body as any).model, (r.body as any).dimensions]),
      [
        ['ada', 1536],
        ['ada', undefined],
        ['ada', undefined],
        ['other', 64],
        ['other', undefined],
      ],
    );
    assert.deepEqual(
      warnings.map((w) => [w.msg, (w.obj as { dropped?: unknown }).dropped]),
      [
        ['llm endpoint rejected a parameter; adapting', 'dimensions'],
        ['llm endpoint rejected a parameter; adapting', 'dimensions'],
      ],
    );
  });

  void test("a base URL's query (Azure's api-version) is sent on every request, after the path", async () => {
    fake.queueChat({ echoUrl: true });
    const llm = client({ baseURL: `${fake.url}?api-version=2024-02-01` });
    assert.equal((await llm.chat(chatReq())).content, '/v1/chat/completions?api-version=2024-02-01');
    assert.equal(
      (await llm.embed({ ...CTX, purpose: 'embedding', model: 'e', input: ['x'], dimensions: 4 }))[0]?.length,
      4,
    );
    assert.deepEqual(
      fake.requests.map((r) => r.path),
      ['/v1/chat/completions', '/v1/embeddings'],
    );
  });

  void test('OPENAI_BASE_URL with a #fragment is a config error naming the variable', () => {
    const base = 'https://x.openai.azure.com/openai/deployments/d?api-version=2024-02-01';
    assert.equal(loadConfig({ OPENAI_BASE_URL: base }).llm.baseURL, base);
    for (const url of [`${base}#frag`, 'http://127.0.0.1:11434/v1#']) {
      assert.throws(
        () => loadConfig({ OPENAI_BASE_URL: url }),
        (err: unknown) =>
          err instanceof ConfigError &&
          err.problems.length === 1 &&
          /^OPENAI_BASE_URL: has a #fragment/.test(err.problems[0] ?? ''),
      );
    }
    assert.throws(() => makeLlmClient({ baseURL: `${fake.url}#x`, timeoutMs: 1000 }), /fragment/);
  });
});

void describe('llm client: embed', () => {
  void test('float path returns vectors of the requested dimensions in input order', async () => {
    const usages: LlmUsage[] = [];
    const inputs = ['first text', 'second text', '記憶系統'];
    const vectors = await client({ onUsage: (u) => void usages.push(u) }).embed({
      ...CTX,
      purpose: 'embedding',
      model: 'text-embedding-3-small',
      input: inputs,
      dimensions: 64,
    });
    assert.equal(vectors.length, 3);
    for (const [i, v] of vectors.entries()) {
      assert.equal(v.length, 64);
      // The fake embeds with localEmbed, so order is checkable against it.
      assert.ok(
        cosine(v, localEmbed(inputs[i] ?? '', 64)) > 0.9999,
        "cosine(v, localEmbed(inputs[i] ?? '', 64)) > 0.9999",
      );
    }
    const body = fake.embeddingRequests()[0]?.body as any;
    assert.equal(body.encoding_format, 'float');
    assert.equal(body.dimensions, 64);
    assert.deepEqual(body.input, inputs);
    assert.equal(usages[0]?.purpose, 'embedding');
    assert.ok((usages[0]?.inputTokens ?? 0) > 0, '(usages[0]?.inputTokens ?? 0) > 0');
    assert.equal(usages[0]?.outputTokens, 0);
  });

  void test('vectors are re-ordered by index', async () => {
    fake.queueEmbeddings({
      status: 200,
      body: {
        object: 'list',
        data: [
          { object: 'embedding', index: 1, embedding: [0, 1] },
          { object: 'embedding', index: 0, embedding: [1, 0] },
        ],
      },
    });
    const vectors = await client().embed({ ...CTX, purpose: 'embedding', model: 'e', input: ['a', 'b'] });
    assert.deepEqual(vectors, [
      [1, 0],
      [0, 1],
    ]);
  });

  void test('a 500 then ok is retried', async () => {
    fake.queueEmbeddings({ status: 500 }, 'ok');
    const vectors = await client().embed({
      ...CTX,
      purpose: 'embedding',
      model: 'e',
      input: ['x'],
      dimensions: 8,
    });
    assert.equal(vectors[0]?.length, 8);
    assert.equal(fake.embeddingRequests().length, 2);
  });

  void test('wrong dimensions or non-finite values are invalid_response', async () => {
    fake.queueEmbeddings(
      { status: 200, body: { data: [{ index: 0, embedding: [1, 2, 3] }] } },
      { status: 200, body: { data: [{ index: 0, embedding: [1, 'x'] }] } },
    );
    const llm = client();
    await rejectsWith(
      llm.embed({ ...CTX, purpose: 'embedding', model: 'e', input: ['a'], dimensions: 4 }),
      (err) => {
        assert.equal(err.kind, 'invalid_response');
        assert.equal(err.retryable, false);
      },
    );
    await rejectsWith(llm.embed({ ...CTX, purpose: 'embedding', model: 'e', input: ['a'] }), (err) =>
      assert.equal(err.kind, 'invalid_response'),
    );
    assert.equal(fake.embeddingRequests().length, 2);
  });

  void test("a value beyond float4's range or a vector of zero length in float4 is invalid_response", async () => {
    const answer = (...vectors: number[][]) => ({
      status: 200,
      body: { data: vectors.map((embedding, index) => ({ index, embedding })) },
    });
    fake.queueEmbeddings(
      // 1e39 is a finite double but Infinity as a float4 (what pgvector stores).
      answer([0.5, 0.5], [1e39, 0.5]),
      answer([0, 0]),
      // Each value is a float4 (1e-23), but their squares, summed in float4, are 0.
      answer([0.5, 0.5], [1e-23, 1e-23]),
      answer([1e20, 1e20]),
      // Small but fine: stored as is.
      answer([1e-10, 1e18]),
    );
    const llm = client();
    const embed = (n: number) =>
      llm.embed({ ...CTX, purpose: 'embedding', model: 'e', input: ['a', 'b'].slice(0, n) });
    const expectBad = (message: RegExp, index: number) => (err: LlmError) => {
      assert.equal(err.kind, 'invalid_response');
      assert.equal(err.retryable, false);
      assert.equal(err.name, 'BadVectorError');
      assert.equal((err as LlmError & { index: number }).index, index);
      assert.match(err.message, message);
    };
    await rejectsWith(embed(2), expectBad(/vector 1 has values beyond float4's range/, 1));
    await rejectsWith(embed(1), expectBad(/vector 0 has zero length in float4/, 0));
    await rejectsWith(embed(2), expectBad(/vector 1 has zero length in float4/, 1));
    await rejectsWith(embed(1), expectBad(/vector 0 has a length beyond float4's range/, 0));
    assert.deepEqual(await embed(1), [[1e-10, 1e18]]);
    assert.equal(fake.embeddingRequests().length, 5, 'none is retried');
  });

  void test('empty input makes no request', async () => {
    assert.deepEqual(await client().embed({ ...CTX, purpose: 'embedding', model: 'e', input: [] }), []);
    assert.equal(fake.requests.length, 0);
  });
});

void describe('fake OpenAI server', () => {
  void test('base64 encoding decodes to the same vector as float', async () => {
    const post = async (extra: Record<string, unknown>) => {
      const res = await fetch(`${fake.url}/embeddings`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({
          model: 'text-embedding-3-small',
          input: 'compaction of memories',
          dimensions: 32,
          ...extra,
        }),
      });
      assert.equal(res.status, 200);
      return ((await res.json()) as any).data[0].embedding as unknown;
    };
    const asFloat = await post({ encoding_format: 'float' });
    const asBase64 = await post({ encoding_format: 'base64' });
    const asDefault = await post({});
    assert.ok(
      Array.isArray(asFloat) && asFloat.length === 32,
      'Array.isArray(asFloat) && asFloat.length === 32',
    );
    assert.equal(typeof asBase64, 'string');
    assert.equal(asDefault, asBase64);
    assert.deepEqual(decodeFloat32Base64(asBase64 as string), asFloat);
  });

  void test('chat echoes the model, models are listed, unknown routes are 404', async () => {
    const chat = await fetch(`${fake.url}/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'my-model', messages: [{ role: 'user', content: 'hi' }] }),
    });
    const body = (await chat.json()) as any;
    assert.equal(body.object, 'chat.completion');
    assert.equal(body.model, 'my-model');
    assert.equal(body.choices[0].message.content, '{}');
    assert.equal(body.choices[0].finish_reason, 'stop');

    const models = (await (await fetch(`${fake.url}/models`)).json()) as any;
    assert.ok(models.data.length > 0, 'models.data.length > 0');

    const missing = await fetch(`${fake.url}/nope`);
    assert.equal(missing.status, 404);
    assert.equal(typeof ((await missing.json()) as any).error.message, 'string');
    assert.deepEqual(
      fake.requests.map((r) => [r.method, r.path]),
      [
        ['POST', '/v1/chat/completions'],
        ['GET', '/v1/models'],
        ['GET', '/v1/nope'],
      ],
    );
  });

  void test('onChat handler answers when the queue is empty', async () => {
    fake.onChat((body) => ({ content: `echo:${body.messages[0].content}` }));
    assert.equal((await client().chat(chatReq())).content, 'echo:hello');
  });
});

void describe('local embedder', () => {
  void test('is deterministic and L2-normalised', () => {
    const a = localEmbed('The quick brown fox, 2024!', 384);
    const b = localEmbed('The quick brown fox, 2024!', 384);
    assert.deepEqual(a, b);
    assert.equal(a.length, 384);
    const norm = Math.sqrt(a.reduce((s, v) => s + v * v, 0));
    assert.ok(Math.abs(norm - 1) < 1e-9, 'Math.abs(norm - 1) < 1e-9');
    assert.deepEqual(localEmbedMany(['The quick brown fox, 2024!'], 384), [a]);
    assert.equal(LOCAL_EMBEDDING_MODEL, 'local-hash');
  });

  void test('output is pinned: changing it invalidates stored vectors', () => {
    // If this fails, the hash/tokeniser changed; that needs a new model name and a re-embed.
    const v = localEmbed('Compacting conversation memories: 記憶系統 memory', 64);
    const nonZero = v.flatMap((x, i) => (x === 0 ? [] : [[i, Number(x.toFixed(6))]]));
    // memories + memory share a stem, so that feature carries the sublinear weight 1 + ln 2.
    assert.deepEqual(nonZero, [
      [5, -0.603667],
      [11, 0.356535],
      [23, -0.356535],
      [31, 0.356535],
      [44, 0.356535],
      [46, 0.356535],
    ]);
  });

  void test('empty or featureless text gives a unit vector, never zero', () => {
    for (const text of ['', '   ', '?!...']) {
      const v = localEmbed(text, 8);
      assert.deepEqual(v, [1, 0, 0, 0, 0, 0, 0, 0]);
    }
  });

  void test('same-stem words are closer than unrelated words', () => {
    assert.equal(lightStem('compacting'), 'compact');
    assert.equal(lightStem('compaction'), 'compact');
    const dims = 256;
    const query = localEmbed('compacting the archive', dims);
    const sameStem = localEmbed('archive compaction', dims);
    const unrelated = localEmbed('banana smoothie recipe', dims);
    assert.ok(cosine(query, sameStem) > 0.6, `same stem ${cosine(query, sameStem)}`);
    assert.ok(
      cosine(query, sameStem) > cosine(query, unrelated) + 0.4,
      'cosine(query, sameStem) > cosine(query, unrelated) + 0.4',
    );
  });

  void test('CJK bigram overlap gives high similarity', () => {
    const dims = 384;
    const query = localEmbed('記憶系統', dims);
    const related = cosine(query, localEmbed('我們討論了記憶系統', dims));
    const unrelated = cosine(query, localEmbed('今天天氣很好，我們去公園散步', dims));
    assert.ok(related > 0.5, `related ${related}`);
    assert.ok(related > unrelated + 0.4, `related ${related} vs unrelated ${unrelated}`);
  });

  void test("gives exactly the reference tokeniser's features and vectors", () => {
    // The service's tokeniser is a one-pass rewrite of the original regular expressions
    // (test/support/local-embedder-reference.ts); stored vectors must not change with it.
    const samples = [
      'Compacting conversation memories: 記憶系統 memory',
      'The deployment scripts failed; we rolled back the migrations and re-ran 12 jobs.',
      'API記憶 and ＡＰＩ full-width, ｶﾀｶﾅ half-width, カタカナー長音, 한국어 문장, 〇〇 digits',
      'café naïve Ὀδυσσεύς İstanbul ǅemal ﬁle Straße 𠀋𠀌 😀🙂 e\u0301 \u3099\u309a',
      'boxes matches databases classes ties lies ion lions dies status analysis addressed',
      '\ud800 lone \udc00 surrogates \ud83d',
      '',
      '!!! ... ？！',
    ];
    // Plus random strings over the character classes the tokeniser distinguishes.
    const ranges: Array<[number, number]> = [
      [0x20, 0x7e],
      [0xc0, 0x24f],
      [0x300, 0x36f],
      [0x370, 0x3ff],
      [0x3000, 0x303f],
      [0x3040, 0x30ff],
      [0x4e00, 0x4fff],
      [0xac00, 0xac40],
      [0xff00, 0xffef],
      [0x1f600, 0x1f64f],
      [0x20000, 0x20040],
      [0xd800, 0xdfff],
      [0x0600, 0x06ff],
      [0x0e00, 0x0e7f],
    ];
    let seed = 12345;
    const rand = () => {
      seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
      return seed / 2 ** 32;
    };
    for (let n = 0; n < 400; n++) {
      let text = '';
      const len = Math.floor(rand() * 60);
      for (let i = 0; i < len; i++) {
        const [lo, hi] = ranges[Math.floor(rand() * ranges.length)]!;
        const cp = lo + Math.floor(rand() * (hi - lo + 1));
        text += rand() < 0.3 ? ' ' : String.fromCodePoint(cp);
      }
      samples.push(text);
    }
    for (const text of samples) {
      assert.deepEqual(localFeatures(text), reference.localFeatures(text), JSON.stringify(text));
      for (const dims of [8, 384]) {
        const got = localEmbed(text, dims);
        const want = reference.localEmbed(text, dims);
        assert.ok(
          got.every((x, i) => Object.is(x, want[i])),
          `vector differs for ${JSON.stringify(text)}`,
        );
      }
    }
  });

  void test('Latin words glued to CJK are still separate features', () => {
    const dims = 384;
    assert.ok(
      cosine(localEmbed('API記憶', dims), localEmbed('api', dims)) > 0.5,
      "cosine(localEmbed('API記憶', dims), localEmbed('api', dims)) > 0.5",
    );
  });
});
