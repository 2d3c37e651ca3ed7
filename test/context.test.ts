import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { after, before, beforeEach, describe, test } from 'node:test';
import { stripPriorSummary, SYSTEM_BLOCK, TURN_CONTEXT_HEADER } from '../services/context/system-block.js';
import { relevanceCacheKey } from '../services/context/relevance.js';
import { isGenericRule } from '../services/context/summary-parts.js';
import { startFakeOpenAI } from './support/fake-openai.js';
import type { FakeOpenAI, RecordedRequest } from './support/fake-openai.js';
import { REDIS_URL, api, deleteRedisPrefix, eventually, startTestService } from './support/harness.js';
import { startTcpProxy } from './support/tcp-proxy.js';
import type { Api, TestService } from './support/harness.js';

const DECISION_MODEL = 'decider-test';

const sid = (what: string) => `ctx-${what}-${randomBytes(3).toString('hex')}`;

type Msg = Record<string, unknown>;
const user = (text: string): Msg => ({ role: 'user', content: text });
const assistant = (text: string): Msg => ({ role: 'assistant', content: text });
const calls = (...ids: string[]): Msg => ({
  role: 'assistant',
  content: null,
  tool_calls: ids.map((id) => ({
    id,
    type: 'function',
    function: { name: 'lookup', arguments: `{"q":"${id}"}` },
  })),
});
const result = (id: string, text = `result of ${id}`): Msg => ({
  role: 'tool',
  tool_call_id: id,
  content: text,
});

/** Posts and waits until durable (201), so the archive holds them when the test asks for context. */
async function archive(
  api: Api,
  session: string,
  messages: Msg[],
): Promise<Array<{ id: string; seq: number }>> {
  const r = await api.post(`/v1/sessions/${session}/messages?wait=true`, { messages });
  assert.equal(r.status, 201, JSON.stringify(r.body));
  return r.body.messages;
}

const turns = (n: number): Msg[] =>
  Array.from({ length: n }, (_, i) => (i % 2 === 0 ? user(`question ${i}`) : assistant(`answer ${i}`)));

const SUMMARY = {
  key_decisions: [
    'Do: reply in Traditional Chinese',
    'Do: use pnpm for installs',
    "Don't: deploy on Fridays",
  ],
  past_discussions: [
    {
      topic: 'CI pipeline',
      description: 'moved CI to GitHub Actions',
      direction: 'done',
      last_discussed: '2026-01-02',
    },
    { topic: 'Pricing page', description: 'three tiers', direction: 'open', last_discussed: '2026-01-05' },
  ],
  current_discussion: {
    topic: 'Release plan',
    description: 'planning the 2.0 release',
    perspectives: 'user wants a beta first',
    direction: 'draft a timeline',
  },
};

async function putSummary(
  svc: TestService,
  tenantId: string,
  session: string,
  summary: unknown,
  version: number,
) {
  await svc.deps.db.query(
    `INSERT INTO summaries (tenant_id, session_id, summary, cursor_seq, version)
     VALUES ($1, $2, $3::jsonb, 0, $4)
     ON CONFLICT (tenant_id, session_id) DO UPDATE SET summary = EXCLUDED.summary, version = EXCLUDED.version`,
    [tenantId, session, JSON.stringify(summary), version],
  );
}

const context = (api: Api, session: string, body: Record<string, unknown> = {}) =>
  api.post(`/v1/sessions/${session}/context`, body);

/** Each message as [role, tool_call_id, ids of its tool_calls]: what pairs calls and results. */
const callShape = (messages: Msg[]) =>
  messages.map((m) => [
    m.role,
    m.tool_call_id ?? null,
    ((m.tool_calls ?? []) as Array<{ id: string }>).map((c) => c.id),
  ]);

const turnContextOf = (messages: Msg[]) =>
  messages.find((m) => typeof m.content === 'string' && m.content.startsWith(TURN_CONTEXT_HEADER));

void describe('context without a decision model', () => {
  let svc: TestService;
  let t: Awaited<ReturnType<TestService['newTenant']>>;

  before(async () => {
    svc = await startTestService({ env: { MAX_HISTORY_MESSAGES: '6' } });
    t = await svc.newTenant();
  });
  after(async () => {
    await svc.stop();
  });

  void test('without a summary: the last MAX_HISTORY_MESSAGES messages, no turn context, empty system block', async () => {
    const s = sid('plain');
    const acks = await archive(t.api, s, turns(10));

    const r = await context(t.api, s);

    assert.equal(r.status, 200);
    assert.deepEqual(
      r.body.messages.map((m: Msg) => m.content),
      ['question 4', 'answer 5', 'question 6', 'answer 7', 'question 8', 'answer 9'],
    );
    assert.deepEqual(r.body.messages[0], { role: 'user', content: 'question 4' });
    assert.deepEqual(r.body.window, { from_seq: acks[4]!.seq, to_seq: acks[9]!.seq });
    assert.equal(r.body.summary, null);
    assert.equal(r.body.summary_version, 0);
    assert.equal(r.body.system_block, '');
    assert.equal(r.body.relevance, 'none');
  });

  void test('max_messages sets the window size and input is appended last as a user message', async () => {
    const s = sid('max');
    await archive(t.api, s, turns(10));

    const r = await context(t.api, s, { max_messages: 3, input: 'and now?' });

    assert.equal(r.status, 200);
    assert.deepEqual(r.body.messages, [
      { role: 'assistant', content: 'answer 7' },
      { role: 'user', content: 'question 8' },
      { role: 'assistant', content: 'answer 9' },
      { role: 'user', content: 'and now?' },
    ]);
  });

  void test('an input posted first moves to the end as posted: its name, its one text part', async () => {
    const named = sid('named');
    await archive(t.api, named, [{ role: 'user', name: 'bob', content: 'hi named' }]);
    const r1 = await context(t.api, named, { input: 'hi named' });
    assert.deepEqual(r1.body.messages, [{ role: 'user', name: 'bob', content: 'hi named' }]);
    const parts = sid('parts');
    await archive(t.api, parts, [{ role: 'user', content: [{ type: 'text', text: 'hello parts' }] }]);
    const r2 = await context(t.api, parts, { input: 'hello parts' });
    assert.equal(r2.body.messages.length, 1, JSON.stringify(r2.body.messages));
    assert.deepEqual(r2.body.messages[0].content, [{ type: 'text', text: 'hello parts' }]);
  });

  void test('a window of huge messages ends at 32 MiB, and so does a page of messages', async () => {
    const s = sid('huge');
    // 1 MiB of a control character is 6 MiB as JSON (\u0001): seven are 42 MiB.
    for (let i = 0; i < 7; i++)
      await archive(t.api, s, [{ role: 'assistant', content: `${i}${'\u0001'.repeat(1024 * 1024 - 8)}` }]);
    const r = await context(t.api, s, { max_messages: 16 });
    assert.equal(r.status, 200);
    // Newest first while less than 32 MiB came before: 6 of them (36 MiB).
    assert.deepEqual(r.body.window, { from_seq: 2, to_seq: 7 });
    assert.deepEqual(
      r.body.messages.map((m: Msg) => String(m.content)[0]),
      ['1', '2', '3', '4', '5', '6'],
    );
    const page = await t.api.get(`/v1/sessions/${s}/messages?limit=500`);
    assert.equal(page.status, 200);
    assert.deepEqual(
      page.body.messages.map((m: { seq: number }) => m.seq),
      [1, 2, 3, 4, 5, 6],
    );
    assert.equal(page.body.next, 6);
    const rest = await t.api.get(`/v1/sessions/${s}/messages?limit=500&after_seq=6`);
    assert.deepEqual(
      rest.body.messages.map((m: { seq: number }) => m.seq),
      [7],
    );
    assert.equal(rest.body.next, null);
  });

  void test('a window inside a tool-call run of huge results keeps the call, trimmed to the results it shows', async () => {
    const s = sid('hugerun');
    const calls = Array.from({ length: 7 }, (_, i) => ({
      id: `call${i}`,
      type: 'function',
      function: { name: 'fetch', arguments: `{"page":${i}}` },
    }));
    await archive(t.api, s, [
      { role: 'user', content: 'fetch the pages' },
      { role: 'assistant', content: null, tool_calls: calls },
    ]);
    // 7 results of 6 MiB as JSON: the run in front of a 1-message window is 36 MiB.
    for (let i = 0; i < 7; i++)
      await archive(t.api, s, [
        { role: 'tool', tool_call_id: `call${i}`, content: `${i}${'\u0001'.repeat(1024 * 1024 - 8)}` },
      ]);
    const r = await context(t.api, s, { max_messages: 1 });
    assert.equal(r.status, 200);
    // It was empty: the run did not fit, and the lone result was an orphan.
    assert.deepEqual(callShape(r.body.messages), [
      ['assistant', null, ['call6']],
      ['tool', 'call6', []],
    ]);
    assert.deepEqual(r.body.window, { from_seq: 2, to_seq: 9 });
  });

  void test('a tool-call run longer than 256 rows (stray results re-posted) keeps the call, trimmed to the results shown', async () => {
    // 128 calls, then 172 results whose ids no call has, then the 128 real results: the look-back
    // read 257 rows, stopped short of the assistant message, and the window came back empty.
    const s = sid('longrun');
    const calls = Array.from({ length: 128 }, (_, i) => ({
      id: `k${i}`,
      type: 'function',
      function: { name: 'f', arguments: '{}' },
    }));
    await archive(t.api, s, [
      { role: 'user', content: 'go' },
      { role: 'assistant', content: null, tool_calls: calls },
      ...Array.from({ length: 172 }, (_, i) => ({ role: 'tool', tool_call_id: `zz${i}`, content: 'junk' })),
      ...Array.from({ length: 128 }, (_, i) => ({ role: 'tool', tool_call_id: `k${i}`, content: `r${i}` })),
    ]);
    const r = await context(t.api, s, { max_messages: 3 });
    assert.equal(r.status, 200);
    assert.deepEqual(callShape(r.body.messages), [
      ['assistant', null, ['k125', 'k126', 'k127']],
      ['tool', 'k125', []],
      ['tool', 'k126', []],
      ['tool', 'k127', []],
    ]);
    assert.deepEqual(r.body.window, { from_seq: 2, to_seq: 302 });
  });

  void test('with a summary: turn context after the window and before the input, system block set', async () => {
    const s = sid('summary');
    await archive(t.api, s, turns(4));
    await putSummary(svc, t.tenantId, s, SUMMARY, 3);

    const r = await context(t.api, s, { input: 'what did we discuss before?' });

    assert.equal(r.status, 200);
    const m = r.body.messages as Msg[];
    assert.equal(m.length, 6);
    assert.deepEqual(
      m.slice(0, 4).map((x) => x.content),
      ['question 0', 'answer 1', 'question 2', 'answer 3'],
    );
    assert.equal(m[4]!.role, 'user');
    const content = m[4]!.content as string;
    assert.ok(
      content.startsWith(`${TURN_CONTEXT_HEADER}\n`),
      'content.startsWith(`${TURN_CONTEXT_HEADER}\\n`)',
    );
    assert.deepEqual(JSON.parse(content.slice(TURN_CONTEXT_HEADER.length + 1)), SUMMARY);
    assert.deepEqual(m[5], { role: 'user', content: 'what did we discuss before?' });
    assert.deepEqual(r.body.summary, SUMMARY);
    assert.equal(r.body.summary_version, 3);
    assert.equal(r.body.system_block, SYSTEM_BLOCK);
    assert.match(r.body.system_block, /Prior Conversation Context/);
    assert.equal(r.body.relevance, 'none');
  });

  void test('a summary and no messages (after a reset) still gives the turn context', async () => {
    const s = sid('onlysum');
    await archive(t.api, s, [user('hello')]);
    await putSummary(svc, t.tenantId, s, SUMMARY, 1);
    await svc.deps.db.query('DELETE FROM messages WHERE tenant_id = $1 AND session_id = $2', [t.tenantId, s]);

    const r = await context(t.api, s);

    assert.equal(r.status, 200);
    assert.equal(r.body.messages.length, 1);
    assert.ok(turnContextOf(r.body.messages), 'turnContextOf(r.body.messages)');
    assert.deepEqual(r.body.window, { from_seq: null, to_seq: null });
  });

  void test('a window boundary inside a tool-call run is extended back to the assistant tool_calls message', async () => {
    const s = sid('toolrun');
    await archive(t.api, s, [
      user('look these up'),
      calls('call_a', 'call_b', 'call_c'),
      result('call_a'),
      result('call_b'),
      result('call_c'),
      assistant('here is what I found'),
    ]);

    // The last 3 messages start at the result of call_b.
    const r = await context(t.api, s, { max_messages: 3 });

    assert.equal(r.status, 200);
    const m = r.body.messages as Msg[];
    assert.deepEqual(
      m.map((x) => x.role),
      ['assistant', 'tool', 'tool', 'tool', 'assistant'],
    );
    assert.equal((m[0]!.tool_calls as unknown[]).length, 3);
    assert.equal(m[0]!.content, null);
    assert.deepEqual(
      m.slice(1, 4).map((x) => x.tool_call_id),
      ['call_a', 'call_b', 'call_c'],
    );
    assert.deepEqual(Object.keys(m[1]!).sort(), ['content', 'role', 'tool_call_id']);
  });

  void test('orphan tool results are dropped and unanswered tool calls removed, so the request stays valid', async () => {
    const s = sid('repair');
    const acks = await archive(t.api, s, [
      user('first'),
      result('call_ghost', 'a result whose call is not in the history'),
      calls('call_x', 'call_y'),
      result('call_x'),
      // call_y never got a result (the agent crashed)
      user('second'),
      {
        role: 'assistant',
        content: 'let me check',
        tool_calls: [{ id: 'call_z', type: 'function', function: { name: 'f', arguments: '{}' } }],
      },
      user('third'),
    ]);

    const r = await context(t.api, s, { max_messages: 100 });

    assert.equal(r.status, 200);
    assert.deepEqual(r.body.messages, [
      { role: 'user', content: 'first' },
      {
        role: 'assistant',
        content: null,
        tool_calls: [
          { id: 'call_x', type: 'function', function: { name: 'lookup', arguments: '{"q":"call_x"}' } },
        ],
      },
      { role: 'tool', tool_call_id: 'call_x', content: 'result of call_x' },
      { role: 'user', content: 'second' },
      { role: 'assistant', content: 'let me check' },
      { role: 'user', content: 'third' },
    ]);
    assert.deepEqual(r.body.window, { from_seq: acks[0]!.seq, to_seq: acks[6]!.seq });
  });

  void test('an assistant message whose every call went unanswered and that says nothing is dropped whole', async () => {
    const s = sid('silentcall');
    await archive(t.api, s, [
      user('q'),
      calls('call_q'),
      // No result for call_q, nor for call_r: left with neither content nor calls, OpenAI refuses them.
      user('again'),
      { ...calls('call_r'), content: '' },
      user('third'),
      // Content parts of empty text only say nothing either (t7).
      { ...calls('call_s'), content: [{ type: 'text', text: '' }] },
      user('fourth'),
    ]);

    const r = await context(t.api, s, { max_messages: 100 });

    assert.equal(r.status, 200);
    assert.deepEqual(r.body.messages, [
      { role: 'user', content: 'q' },
      { role: 'user', content: 'again' },
      { role: 'user', content: 'third' },
      { role: 'user', content: 'fourth' },
    ]);
  });

  void test('a second result for a call already answered is dropped: one result per call', async () => {
    const s = sid('dupresult');
    // 50 characters, as Responses-API item ids are: renamed in the context, where both of its
    // results would answer to the new name.
    const long = `fc_${'0123456789'.repeat(4)}abcdefg`;
    await archive(t.api, s, [
      user('look these up'),
      calls(long, 'call_b'),
      result(long, 'r1'),
      // A retried tool run that posted its result again.
      result(long, 'r1dup'),
      result('call_b', 'r2'),
      assistant('done'),
    ]);

    const r = await context(t.api, s, { max_messages: 100 });

    assert.equal(r.status, 200);
    const m = r.body.messages as Msg[];
    assert.deepEqual(
      m.map((x) => [x.role, x.content]),
      [
        ['user', 'look these up'],
        ['assistant', null],
        ['tool', 'r1'],
        ['tool', 'r2'],
        ['assistant', 'done'],
      ],
    );
    const ids = (m[1]!.tool_calls as Array<{ id: string }>).map((c) => c.id);
    assert.deepEqual([m[2]!.tool_call_id, m[3]!.tool_call_id], ids);
  });

  void test('a window that would start with orphan tool results drops them', async () => {
    const s = sid('orphanhead');
    await archive(t.api, s, [user('q'), result('call_lost'), result('call_lost2'), assistant('done')]);

    const r = await context(t.api, s, { max_messages: 3 });

    assert.equal(r.status, 200);
    assert.deepEqual(r.body.messages, [{ role: 'assistant', content: 'done' }]);
  });

  /** The session's compaction cutoff set at `seq`, as compaction leaves it. */
  const cutAt = (s: string, seq: number) =>
    svc.deps.db.query('UPDATE sessions SET start_seq = $3 WHERE tenant_id = $1 AND id = $2', [
      t.tenantId,
      s,
      seq,
    ]);

  void test('messages before the compaction cutoff stay out of the window, tool-run extension included', async () => {
    const s = sid('cutoff');
    const acks = await archive(t.api, s, [
      user('old question'),
      calls('call_old'),
      result('call_old'),
      assistant('old answer'),
      user('new question'),
    ]);
    // The cutoff falls between the assistant tool_calls message and its result.
    await cutAt(s, acks[2]!.seq);

    const all = await context(t.api, s, { max_messages: 100 });
    const three = await context(t.api, s, { max_messages: 3 });

    const expected = [
      { role: 'assistant', content: 'old answer' },
      { role: 'user', content: 'new question' },
    ];
    assert.deepEqual(all.body.messages, expected);
    assert.deepEqual(three.body.messages, expected);
    assert.equal(all.body.window.from_seq, acks[3]!.seq);
  });

  void test('a compaction cutoff on a user message keeps that message as the first of the window', async () => {
    const s = sid('cutuser');
    const acks = await archive(t.api, s, [
      user('old question'),
      assistant('old answer'),
      user('new question'),
      assistant('new answer'),
    ]);
    // Compaction keeps the messages from start_seq on: the cutoff message itself is hot history.
    await cutAt(s, acks[2]!.seq);

    const r = await context(t.api, s, { max_messages: 100 });

    assert.equal(r.status, 200);
    assert.deepEqual(r.body.messages, [
      { role: 'user', content: 'new question' },
      { role: 'assistant', content: 'new answer' },
    ]);
    assert.deepEqual(r.body.window, { from_seq: acks[2]!.seq, to_seq: acks[3]!.seq });
  });

  void test('an input larger than 1 MiB is a 413', async () => {
    const s = sid('big');
    await archive(t.api, s, [user('x')]);

    const r = await context(t.api, s, { input: 'é'.repeat(600 * 1024) });

    assert.equal(r.status, 413);
    assert.equal(r.body.error.code, 'message_too_large');
  });

  void test('developer, system and structured content pass through as stored, without ids or metadata', async () => {
    const s = sid('roles');
    const parts = [
      { type: 'text', text: 'what is in this picture?' },
      { type: 'image_url', image_url: { url: 'https://example.com/cat.png', detail: 'low' } },
    ];
    await archive(t.api, s, [
      { role: 'system', content: 'be brief' },
      { role: 'developer', content: 'use metric units' },
      {
        id: 'client-1',
        role: 'user',
        content: parts,
        name: 'alice',
        metadata: { trace: 'x' },
        sent_at: '2026-01-01T00:00:00Z',
      },
    ]);

    const r = await context(t.api, s);

    assert.deepEqual(r.body.messages, [
      { role: 'system', content: 'be brief' },
      { role: 'developer', content: 'use metric units' },
      { role: 'user', content: parts, name: 'alice' },
    ]);
  });

  void test('names, tool names, non-user images and repeated call ids OpenAI refuses are made sendable', async () => {
    const s = sid('sendable');
    const image = { type: 'image_url', image_url: { url: 'https://example.com/chart.png' } };
    await archive(t.api, s, [
      { role: 'user', content: [{ type: 'text', text: 'see' }, image], name: 'John Smith' },
      { role: 'user', content: 'hi', name: '小明' },
      {
        role: 'assistant',
        content: null,
        tool_calls: [
          { id: 'call_1', type: 'function', function: { name: 'my tool/v2', arguments: '{}' } },
          { id: 'call_1', type: 'function', function: { name: 'other', arguments: '{}' } },
        ],
      },
      { role: 'tool', tool_call_id: 'call_1', content: [{ type: 'text', text: 'plot:' }, image] },
      { role: 'assistant', content: [{ type: 'text', text: 'here it is' }, image], name: 'agent.v2' },
    ]);

    const r = await context(t.api, s);

    assert.equal(r.status, 200);
    assert.deepEqual(r.body.messages, [
      { role: 'user', content: [{ type: 'text', text: 'see' }, image], name: 'John_Smith' },
      { role: 'user', content: 'hi' },
      {
        role: 'assistant',
        content: null,
        tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'my_tool_v2', arguments: '{}' } }],
      },
      {
        role: 'tool',
        tool_call_id: 'call_1',
        content: [
          { type: 'text', text: 'plot:' },
          { type: 'text', text: '[image]' },
        ],
      },
      {
        role: 'assistant',
        content: [
          { type: 'text', text: 'here it is' },
          { type: 'text', text: '[image]' },
        ],
        name: 'agent_v2',
      },
    ]);
    // The archive keeps what was posted.
    const stored = await t.api.get(`/v1/sessions/${s}/messages`);
    assert.equal(stored.body.messages[0].name, 'John Smith');
    assert.equal(stored.body.messages[2].tool_calls.length, 2);
  });

  void test('call ids OpenAI refuses (over 40 characters, odd characters, reused) get short ids, call and result alike', async () => {
    const s = sid('callids');
    const long = 'fc_689e2d4880a0819d98acca37694989b00b15d90494fc6b87';
    const call = (id: string, name: string) => ({
      id,
      type: 'function',
      function: { name, arguments: '{}' },
    });
    await archive(t.api, s, [
      { role: 'user', content: 'check' },
      {
        role: 'assistant',
        content: null,
        tool_calls: [call(long, 'a'), call('idé', 'b'), call('call_0', 'c')],
      },
      { role: 'tool', tool_call_id: 'idé', content: 'B' },
      { role: 'tool', tool_call_id: long, content: 'A' },
      { role: 'tool', tool_call_id: 'call_0', content: 'C' },
      { role: 'assistant', content: null, tool_calls: [call('call_0', 'd')] },
      { role: 'tool', tool_call_id: 'call_0', content: 'D' },
      { role: 'assistant', content: 'done' },
    ]);

    const r = await context(t.api, s, { max_messages: 16 });

    assert.equal(r.status, 200);
    const m = r.body.messages as { role: string; tool_calls?: { id: string }[]; tool_call_id?: string }[];
    const ids = m[1]!.tool_calls!.map((c) => c.id);
    assert.match(ids[0]!, /^call_[A-Za-z0-9_-]{24}$/);
    assert.match(ids[1]!, /^call_[A-Za-z0-9_-]{24}$/);
    assert.equal(ids[2], 'call_0');
    assert.deepEqual(
      [m[2]!.tool_call_id, m[3]!.tool_call_id, m[4]!.tool_call_id],
      [ids[1], ids[0], 'call_0'],
    );
    const again = m[5]!.tool_calls![0]!.id;
    assert.match(again, /^call_[A-Za-z0-9_-]{24}$/);
    assert.equal(m[6]!.tool_call_id, again);
    assert.equal(new Set([...ids, again]).size, 4);
    // The same context twice names them alike (prompt caches), and the archive keeps the originals.
    assert.deepEqual((await context(t.api, s, { max_messages: 16 })).body.messages, r.body.messages);
    const stored = await t.api.get(`/v1/sessions/${s}/messages`);
    assert.equal(stored.body.messages[1].tool_calls[0].id, long);
    assert.equal(stored.body.messages[3].tool_call_id, long);
  });

  void test('a posted id equal to the rewrite of another is rewritten too: ids stay unique in the context', async () => {
    const s = sid('crafted');
    const hashed = (seq: number, id: string) =>
      `call_${createHash('sha256').update(`${seq}:${id}`).digest('base64url').slice(0, 24)}`;
    const call = (id: string) => ({ id, type: 'function', function: { name: 'f', arguments: '{}' } });
    await archive(t.api, s, [
      { role: 'user', content: 'go' },
      { role: 'assistant', content: null, tool_calls: [call('a.b'), call(hashed(2, 'a.b'))] },
      { role: 'tool', tool_call_id: 'a.b', content: 'A' },
      { role: 'tool', tool_call_id: hashed(2, 'a.b'), content: 'B' },
      { role: 'assistant', content: null, tool_calls: [call(hashed(7, 'x y'))] },
      { role: 'tool', tool_call_id: hashed(7, 'x y'), content: 'C' },
      { role: 'assistant', content: null, tool_calls: [call('x y')] },
      { role: 'tool', tool_call_id: 'x y', content: 'D' },
    ]);

    const r = await context(t.api, s, { max_messages: 16 });

    const m = r.body.messages as { tool_calls?: { id: string }[]; tool_call_id?: string; content: string }[];
    const ids = m.flatMap((x) => (x.tool_calls ?? []).map((c) => c.id));
    assert.equal(ids.length, 4);
    assert.equal(new Set(ids).size, 4, JSON.stringify(ids));
    for (const id of ids) assert.match(id, /^[A-Za-z0-9_-]{1,40}$/);
    // Each result still answers its own call.
    const answer = (text: string) => m.find((x) => x.content === text)!.tool_call_id;
    assert.deepEqual([answer('A'), answer('B'), answer('C'), answer('D')], ids);
  });

  void test('min_seq waits until a message answered with 202 is archived (read your writes)', async () => {
    const s = sid('ryw');
    await archive(t.api, s, [user('start')]);
    const batch = Array.from({ length: 400 }, (_, i) => user(`burst ${i}`));
    const posted = await t.api.post(`/v1/sessions/${s}/messages`, { messages: batch });
    assert.equal(posted.status, 202);
    const last = posted.body.messages[399].seq as number;

    const r = await context(t.api, s, { min_seq: last, max_messages: 1 });

    assert.equal(r.status, 200);
    assert.equal(r.headers.get('x-mnemos-min-seq'), null);
    assert.deepEqual(r.body.messages, [{ role: 'user', content: 'burst 399' }]);
    assert.equal(r.body.window.to_seq, last);
  });

  void test('an input that was already posted is not repeated: it moves after the turn context', async () => {
    const s = sid('postfirst');
    await archive(t.api, s, turns(2));
    await putSummary(svc, t.tenantId, s, SUMMARY, 1);
    const posted = await t.api.post(`/v1/sessions/${s}/messages`, { messages: [user('deploy to staging')] });
    assert.equal(posted.status, 202);
    const seq = posted.body.messages[0].seq as number;

    const r = await context(t.api, s, { input: 'deploy to staging', min_seq: seq });

    const m = r.body.messages as Msg[];
    assert.deepEqual(
      m.map((x) => x.content).filter((c) => c === 'deploy to staging'),
      ['deploy to staging'],
    );
    assert.deepEqual(m.at(-1), { role: 'user', content: 'deploy to staging' });
    assert.ok(turnContextOf(m) === m.at(-2), 'turnContextOf(m) === m.at(-2)');
    assert.deepEqual(
      m.slice(0, 2).map((x) => x.content),
      ['question 0', 'answer 1'],
    );
    assert.equal(r.body.window.to_seq, seq);
  });

  void test("an input equal to the last message is appended when that message is not the user's", async () => {
    const s = sid('echo');
    await archive(t.api, s, [user('all good?'), assistant('ok')]);

    // The user answers with the assistant's own words: a new message, not the one already posted.
    const r = await context(t.api, s, { input: 'ok' });

    assert.equal(r.status, 200);
    assert.deepEqual(r.body.messages, [
      { role: 'user', content: 'all good?' },
      { role: 'assistant', content: 'ok' },
      { role: 'user', content: 'ok' },
    ]);
  });

  void test('min_seq that never arrives: 200 with the current window and x-mnemos-min-seq: timeout', async () => {
    const s = sid('ahead');
    const acks = await archive(t.api, s, [user('only message')]);

    const r = await context(t.api, s, { min_seq: acks[0]!.seq + 1000 });

    assert.equal(r.status, 200);
    assert.equal(r.headers.get('x-mnemos-min-seq'), 'timeout');
    assert.deepEqual(r.body.messages, [{ role: 'user', content: 'only message' }]);
  });

  void test("another tenant's session, an unknown session and a deleted one are 404", async () => {
    const s = sid('mine');
    await archive(t.api, s, [user('secret plan')]);
    const other = await svc.newTenant();

    const theirs = await context(other.api, s, { min_seq: 1 });
    const unknown = await context(t.api, sid('nobody'));
    await svc.deps.db.query('UPDATE sessions SET deleted_at = now() WHERE tenant_id = $1 AND id = $2', [
      t.tenantId,
      s,
    ]);
    const deleted = await context(t.api, s);

    for (const r of [theirs, unknown, deleted]) {
      assert.equal(r.status, 404);
      assert.equal(r.body.error.code, 'not_found');
      assert.doesNotMatch(r.text, /secret plan/);
    }
  });

  void test('two tenants writing to the same session id each get only their own messages', async () => {
    const s = sid('shared');
    const other = await svc.newTenant();
    // Interleaved, so both sessions hold the same seqs and neither is a prefix of the other.
    await archive(t.api, s, [user('mine 1')]);
    await archive(other.api, s, [user('theirs 1'), assistant('theirs 2')]);
    await archive(t.api, s, [assistant('mine 2')]);

    const mine = await context(t.api, s, { max_messages: 100 });
    const theirs = await context(other.api, s, { max_messages: 100 });

    assert.equal(mine.status, 200);
    assert.deepEqual(mine.body.messages, [
      { role: 'user', content: 'mine 1' },
      { role: 'assistant', content: 'mine 2' },
    ]);
    assert.deepEqual(mine.body.window, { from_seq: 1, to_seq: 2 });
    assert.equal(theirs.status, 200);
    assert.deepEqual(theirs.body.messages, [
      { role: 'user', content: 'theirs 1' },
      { role: 'assistant', content: 'theirs 2' },
    ]);
    assert.deepEqual(theirs.body.window, { from_seq: 1, to_seq: 2 });
  });

  void test('bad input is a 400 naming the field', async () => {
    const s = sid('bad');
    await archive(t.api, s, [user('x')]);
    const cases: Array<[Record<string, unknown>, string]> = [
      [{ max_messages: 0 }, 'max_messages'],
      [{ max_messages: 1001 }, 'max_messages'],
      [{ max_messages: 2.5 }, 'max_messages'],
      [{ min_seq: -1 }, 'min_seq'],
      [{ input: 42 }, 'input'],
      [{ inputs: 'typo' }, 'inputs'],
      // As in a posted message: text Postgres or an LLM API could not take is refused, not echoed.
      [{ input: 'nul \u0000 here' }, 'input'],
      [{ input: 'lone \ud800' }, 'input'],
    ];
    for (const [body, path] of cases) {
      const r = await context(t.api, s, body);
      assert.equal(r.status, 400, JSON.stringify(body));
      assert.equal(r.body.error.details.problems[0].path, path);
    }
    const bad = await t.api.post('/v1/sessions/bad%20id/context', {});
    assert.equal(bad.status, 400);
    const nullBody = await t.api.post(`/v1/sessions/${s}/context`, null);
    assert.equal(nullBody.status, 400, 'a JSON null is not an object');
    const unknownQuery = await t.api.post(`/v1/sessions/${s}/context?inptu=x`, {});
    assert.equal(unknownQuery.status, 400);
    assert.match(JSON.stringify(unknownQuery.body.error), /inptu/);
    assert.equal((await t.api.post(`/v1/sessions/${s}/context`)).status, 200, 'no body at all is fine');
  });
});

void describe('context with a decision model', () => {
  let svc: TestService;
  let fake: FakeOpenAI;
  let t: Awaited<ReturnType<TestService['newTenant']>>;

  /** Relevance calls only (other LLM work in the process, if any, is ignored). */
  const relevanceCalls = (): RecordedRequest[] =>
    fake.chatRequests().filter((r) => JSON.stringify(r.body).includes('relevant to the user'));

  const answer = (kd: number[], pd: number[], cd: boolean) =>
    JSON.stringify({ key_decisions: kd, past_discussions: pd, current_discussion: cd });

  before(async () => {
    fake = await startFakeOpenAI();
    svc = await startTestService({
      env: {
        OPENAI_BASE_URL: fake.url,
        OPENAI_API_KEY: 'sk-test',
        DECISION_MODEL,
        // Well under the slow model's 3 s, and room for an answer on a loaded machine: at 200 ms
        // a judgement queued behind 4 test files on 2 cores missed it, and the test read 'all'.
        RELEVANCE_TIMEOUT_MS: '1500',
      },
    });
    t = await svc.newTenant();
  });
  // Scripted answers a test did not consume must not leak into the next one.
  beforeEach(() => fake.reset());
  after(async () => {
    await svc.stop();
    await fake.close();
  });

  async function sessionWithSummary(summary: unknown = SUMMARY, version = 1): Promise<string> {
    const s = sid('rel');
    await archive(t.api, s, turns(2));
    await putSummary(svc, t.tenantId, s, summary, version);
    return s;
  }

  void test('keeps only the relevant entries, plus generic rules the model left out', async () => {
    const s = await sessionWithSummary();
    fake.queueChat({ content: answer([1], [0], false) });

    const r = await context(t.api, s, { input: 'set up the CI cache with pnpm' });

    assert.equal(r.status, 200);
    assert.equal(r.body.relevance, 'filtered');
    const expected = {
      // 0 is a language rule: kept although the model did not pick it.
      key_decisions: [SUMMARY.key_decisions[0], SUMMARY.key_decisions[1]],
      past_discussions: [SUMMARY.past_discussions[0]],
    };
    assert.deepEqual(r.body.summary, expected);
    const tc = turnContextOf(r.body.messages);
    assert.ok(tc, 'tc');
    assert.deepEqual(JSON.parse((tc.content as string).slice(TURN_CONTEXT_HEADER.length + 1)), expected);
    assert.deepEqual(r.body.messages.at(-1), { role: 'user', content: 'set up the CI cache with pnpm' });

    const calls = relevanceCalls();
    assert.equal(calls.length, 1);
    const body = calls[0]!.body as {
      model: string;
      response_format?: unknown;
      messages: Array<{ content: string }>;
    };
    assert.equal(body.model, DECISION_MODEL);
    assert.deepEqual(body.response_format, { type: 'json_object' });
    assert.match(body.messages[1]!.content, /set up the CI cache with pnpm/);
    assert.match(body.messages[0]!.content, /language, format, style or workflow/);
    // Every entry is JSON on its own line: a decision's line breaks cannot open sections.
    const entries = body.messages[1]!.content.split('\n').filter((l) => /^\[\d+\] /.test(l));
    for (const e of entries) JSON.parse(e.replace(/^\[\d+\] /, ''));
    assert.equal(entries.length, SUMMARY.key_decisions.length + SUMMARY.past_discussions.length);

    const usage = await svc.deps.db.query<{ calls: number }>(
      `SELECT sum(calls)::int AS calls FROM llm_usage WHERE tenant_id = $1 AND session_id = $2 AND purpose = 'relevance'`,
      [t.tenantId, s],
    );
    assert.equal(usage.rows[0]!.calls, 1);
  });

  void test('nothing relevant: no turn-context message, system block kept', async () => {
    const summary = { ...SUMMARY, key_decisions: ['Do: use pnpm for installs'] };
    const s = await sessionWithSummary(summary);
    fake.queueChat({ content: answer([], [], false) });

    const r = await context(t.api, s, { input: 'tell me a joke' });

    assert.equal(r.status, 200);
    assert.equal(r.body.relevance, 'filtered');
    assert.equal(r.body.summary, null);
    assert.equal(turnContextOf(r.body.messages), undefined);
    assert.deepEqual(
      r.body.messages.map((m: Msg) => m.content),
      ['question 0', 'answer 1', 'tell me a joke'],
    );
    assert.equal(r.body.system_block, SYSTEM_BLOCK);
  });

  void test('a fenced answer, or one after a reasoning block, is read as the judgement', async () => {
    for (const content of [
      `\`\`\`json\n${answer([1], [0], false)}\n\`\`\``,
      `<think>maybe ${answer([0], [], true)}? no.</think>\n${answer([1], [0], false)}`,
    ]) {
      const s = await sessionWithSummary();
      fake.queueChat({ content });

      const r = await context(t.api, s, { input: 'set up the CI cache with pnpm' });

      assert.equal(r.body.relevance, 'filtered', content);
      assert.deepEqual(r.body.summary, {
        key_decisions: [SUMMARY.key_decisions[0], SUMMARY.key_decisions[1]],
        past_discussions: [SUMMARY.past_discussions[0]],
      });
    }
  });

  void test('a decision model slower than RELEVANCE_TIMEOUT_MS keeps the whole summary', async () => {
    const s = await sessionWithSummary();
    fake.onChat(() => ({ delayMs: 3000, then: { content: answer([], [], false) } }));

    const r = await context(t.api, s, { input: 'anything new about the release?' });

    assert.equal(r.status, 200);
    assert.equal(r.body.relevance, 'all');
    assert.deepEqual(r.body.summary, SUMMARY);
    assert.ok(turnContextOf(r.body.messages), 'turnContextOf(r.body.messages)');
  });

  void test('a Redis that stops answering does not hold the turn past RELEVANCE_TIMEOUT_MS (its cache is read within it)', async () => {
    // A service of its own whose Redis connections pass through a proxy the test can silence (a
    // failover or a partition: no reset, no answer).
    const proxy = await startTcpProxy(Number(new URL(REDIS_URL).port || 6379));
    const own = await startTestService({
      env: {
        OPENAI_BASE_URL: fake.url,
        OPENAI_API_KEY: 'sk-test',
        DECISION_MODEL,
        RELEVANCE_TIMEOUT_MS: '500',
        REDIS_URL: `redis://127.0.0.1:${proxy.port}`,
      },
    });
    try {
      const ot = await own.newTenant();
      const s = sid('stall');
      await archive(ot.api, s, turns(2));
      await putSummary(own, ot.tenantId, s, SUMMARY, 1);
      fake.queueChat({ content: answer([1], [0], false) });
      proxy.hole();
      const started = Date.now();
      const r = await context(ot.api, s, { input: 'set up the CI cache with pnpm' });
      const took = Date.now() - started;
      assert.equal(r.status, 200);
      // The judgement came (the model answered within the budget) though its cache stayed silent.
      assert.equal(r.body.relevance, 'filtered');
      // Before: 5 s for the cache read plus 5 s for its write (ioredis's command timeout).
      assert.ok(took < 4000, `answered after ${took} ms`);
    } finally {
      // Its connections come back (the silent ones reset), so that the service can stop.
      proxy.heal();
      proxy.reset();
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
      await proxy.close();
    }
  });

  void test('a failing decision model is asked once per turn: no retries on the request path', async () => {
    const s = await sessionWithSummary();
    const input = 'any news on the retry policy?';
    // retry-after 0: a client that retries would ask again at once and get the answer.
    fake.queueChat({ status: 500, headers: { 'retry-after': '0' } }, { content: answer([], [], false) });

    const r = await context(t.api, s, { input });

    assert.equal(r.status, 200);
    assert.equal(r.body.relevance, 'all');
    assert.deepEqual(r.body.summary, SUMMARY);
    assert.equal(relevanceCalls().filter((c) => JSON.stringify(c.body).includes(input)).length, 1);
  });

  void test('an invalid judgement keeps the whole summary and is not cached', async () => {
    const s = await sessionWithSummary();
    fake.queueChat({ content: answer([7], [], true) }); // index 7 does not exist

    const first = await context(t.api, s, { input: 'status?' });
    fake.queueChat({ content: 'not json at all' });
    const second = await context(t.api, s, { input: 'status?' });
    // Silent on the current discussion the summary has: not a "drop it".
    fake.queueChat({ content: JSON.stringify({ key_decisions: [], past_discussions: [] }) });
    const third = await context(t.api, s, { input: 'status?' });
    // One past the last entry of each list (3 key decisions, 2 past discussions).
    fake.queueChat({ content: answer([SUMMARY.key_decisions.length], [], true) });
    const fourth = await context(t.api, s, { input: 'status?' });
    fake.queueChat({ content: answer([], [SUMMARY.past_discussions.length], true) });
    const fifth = await context(t.api, s, { input: 'status?' });

    for (const [i, r] of [first, second, third, fourth, fifth].entries()) {
      assert.equal(r.body.relevance, 'all', `answer ${i + 1}`);
      assert.deepEqual(r.body.summary, SUMMARY);
    }
    const forThis = relevanceCalls().filter((c) => JSON.stringify(c.body).includes('status?'));
    assert.equal(forThis.length, 5);
    assert.equal(await svc.deps.redis.exists(relevanceCacheKey(svc.config.prefix, t.tenantId, s)), 0);
  });

  void test('the judgement is cached per summary version and input, and deleted with the session', async () => {
    const s = await sessionWithSummary(SUMMARY, 1);
    const input = 'how is the pricing page going?';
    const callsFor = (text: string) =>
      relevanceCalls().filter((c) => JSON.stringify(c.body).includes(text)).length;
    fake.queueChat({ content: answer([], [1], true) });

    const first = await context(t.api, s, { input });
    const second = await context(t.api, s, { input });

    assert.equal(callsFor(input), 1);
    assert.deepEqual(second.body.summary, first.body.summary);
    assert.equal(second.body.relevance, 'filtered');
    assert.deepEqual(second.body.summary.past_discussions, [SUMMARY.past_discussions[1]]);
    assert.deepEqual(second.body.summary.current_discussion, SUMMARY.current_discussion);
    const cached = await svc.deps.redis.hlen(relevanceCacheKey(svc.config.prefix, t.tenantId, s));
    assert.equal(cached, 1);

    await putSummary(svc, t.tenantId, s, SUMMARY, 2);
    fake.queueChat({ content: answer([], [], true) });
    const third = await context(t.api, s, { input });

    assert.equal(callsFor(input), 2);
    assert.equal(third.body.summary_version, 2);
    assert.deepEqual(third.body.summary.past_discussions, []);

    const deleted = await t.api.del(`/v1/sessions/${s}`);
    assert.ok(deleted.status >= 200 && deleted.status < 300, `DELETE answered ${deleted.status}`);
    assert.equal(await svc.deps.redis.exists(relevanceCacheKey(svc.config.prefix, t.tenantId, s)), 0);
  });

  void test('a judgement cached under one decision model is not served after DECISION_MODEL changes', async () => {
    const s = await sessionWithSummary(SUMMARY, 1);
    const input = 'what did we decide about the pricing page?';
    fake.queueChat({ content: answer([], [1], true) });
    const first = await context(t.api, s, { input });
    assert.deepEqual(first.body.summary.past_discussions, [SUMMARY.past_discussions[1]]);

    // The same database and prefix (so the same cache), another decision model.
    const other = await startTestService({
      databaseUrl: svc.config.databaseUrl,
      prefix: svc.config.prefix,
      env: { OPENAI_BASE_URL: fake.url, OPENAI_API_KEY: 'sk-test', DECISION_MODEL: 'decider-better' },
    });
    try {
      fake.queueChat({ content: answer([], [0], true) });
      const again = await context(api(other.base, t.apiKey), s, { input });
      const asked = relevanceCalls().filter((c) => (c.body as { model?: string }).model === 'decider-better');
      assert.equal(asked.length, 1, 'the new model is asked');
      assert.equal(again.body.relevance, 'filtered');
      assert.deepEqual(again.body.summary.past_discussions, [SUMMARY.past_discussions[0]]);
    } finally {
      await other.stop();
    }
  });

  void test('a judgement that arrives after the session was deleted is not left in the cache', async () => {
    // A service of its own with time for a slow judgement, so the delete lands while it runs.
    const own = await startTestService({
      env: {
        OPENAI_BASE_URL: fake.url,
        OPENAI_API_KEY: 'sk-test',
        DECISION_MODEL,
        RELEVANCE_TIMEOUT_MS: '5000',
      },
    });
    try {
      const ot = await own.newTenant();
      const s = sid('late');
      await archive(ot.api, s, turns(2));
      await putSummary(own, ot.tenantId, s, SUMMARY, 1);
      const key = relevanceCacheKey(own.config.prefix, ot.tenantId, s);
      fake.queueChat({ delayMs: 1500, then: { content: answer([1], [0], false) } });

      const turn = context(ot.api, s, { input: 'set up the CI cache with pnpm' });
      await eventually(async () => relevanceCalls().length === 1);
      assert.equal((await ot.api.del(`/v1/sessions/${s}`)).status, 204);
      assert.equal((await turn).body.relevance, 'filtered');
      // The cache write is not awaited by the turn: give it time to land.
      await new Promise((r) => setTimeout(r, 500));

      assert.equal(await own.deps.redis.exists(key), 0);
    } finally {
      await own.stop();
      await deleteRedisPrefix(own.config.prefix);
    }
  });

  void test('no input, or no summary: the decision model is not asked', async () => {
    const withSummary = await sessionWithSummary();
    const plain = sid('nosum');
    await archive(t.api, plain, turns(2));
    const before = relevanceCalls().length;

    const noInput = await context(t.api, withSummary);
    const noSummary = await context(t.api, plain, { input: 'hello' });

    assert.equal(relevanceCalls().length, before);
    assert.equal(noInput.body.relevance, 'none');
    assert.deepEqual(noInput.body.summary, SUMMARY);
    assert.equal(noSummary.body.relevance, 'none');
    assert.equal(noSummary.body.summary, null);
  });
});

void describe('stripPriorSummary', () => {
  void test('removes a leaked turn-context block and leaves other text alone', () => {
    const leaked = `Sure.\n${TURN_CONTEXT_HEADER}\n{"key_decisions":["Do: x {"],"p":[{"a":"}"}]}\nAnything else?`;
    assert.equal(stripPriorSummary(leaked), 'Sure.\n\nAnything else?');
    const fenced = `Answer.\n\n\`\`\`json\n${TURN_CONTEXT_HEADER}\n{"a":1}\n\`\`\`\n\nDone.`;
    assert.equal(stripPriorSummary(fenced), 'Answer.\n\nDone.');
    assert.equal(stripPriorSummary(`${TURN_CONTEXT_HEADER}: {"a": {"b": "c\\"}"}} tail`), 'tail');
    assert.equal(stripPriorSummary(`Text. ${TURN_CONTEXT_HEADER}\n{"never":"closed"`), 'Text.');
    assert.equal(stripPriorSummary('Plain {"json": true} reply.'), 'Plain {"json": true} reply.');
  });

  void test('leaves a mention of the header in prose alone: only a header followed by JSON goes', () => {
    for (const prose of [
      `I cannot show the ${TURN_CONTEXT_HEADER}, sorry.`,
      `See \`${TURN_CONTEXT_HEADER}\` in the docs; the rest of my answer follows. {"config": true}`,
      `${TURN_CONTEXT_HEADER}\n\`\`\`sh\nls\n\`\`\``,
    ]) {
      assert.equal(stripPriorSummary(prose), prose);
    }
    // A mention before a leaked block: the mention stays, the block goes.
    assert.equal(
      stripPriorSummary(
        `No ${TURN_CONTEXT_HEADER} here.\n${TURN_CONTEXT_HEADER}\n{"key_decisions":[]}\nBye.`,
      ),
      `No ${TURN_CONTEXT_HEADER} here.\n\nBye.`,
    );
  });

  void test('braces in prose after the header are no JSON; a blockquoted leak goes', () => {
    // `{like this}` does not parse: a mention, not a leak (it became `Use\n\nin docs.`).
    const prose = `Use ${TURN_CONTEXT_HEADER} {like this} in docs.`;
    assert.equal(stripPriorSummary(prose), prose);
    assert.equal(
      stripPriorSummary(
        `Use ${TURN_CONTEXT_HEADER} {"broken": } and ${TURN_CONTEXT_HEADER}\n{"ok":true}\nEnd.`,
      ),
      `Use ${TURN_CONTEXT_HEADER} {"broken": } and\n\nEnd.`,
    );
    // A reply quoting its context: the quoted header and the quoted JSON lines go, pretty-printed
    // or fenced, and the rest of the quote stays.
    const pretty = `Intro.\n> ${TURN_CONTEXT_HEADER}\n> {\n>   "key_decisions": ["Do: x}"]\n> }\n> more quoted\nAfter.`;
    assert.equal(stripPriorSummary(pretty), 'Intro.\n\n> more quoted\nAfter.');
    const fenced = `Intro.\n> \`\`\`json\n> ${TURN_CONTEXT_HEADER}\n> {"a":1}\n> \`\`\`\nAfter.`;
    assert.equal(stripPriorSummary(fenced), 'Intro.\n\nAfter.');
    assert.equal(stripPriorSummary(`Cut.\n> ${TURN_CONTEXT_HEADER}\n> {"a":[1,`), 'Cut.');
  });
});

void test('generic rules kept whatever the decision model says include length and brevity', () => {
  const kept = [
    'Do: answer concisely',
    'Do: keep answers short',
    'Do: be brief',
    "Don't: write long answers",
    'Do: reply in English',
    'Do: use markdown tables',
    '要簡潔',
  ];
  const topical = [
    'Do: use pnpm for installs',
    'Do: shorten the CI cache key',
    "Don't: run long migrations at noon",
    'Do: keep the retry budget short-lived',
  ];
  assert.deepEqual(
    kept.filter((r) => !isGenericRule(r)),
    [],
  );
  assert.deepEqual(topical.filter(isGenericRule), []);
});
