import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { COMPACT_KEEP_RATIO, planCompaction } from '../services/recent-index/compaction-plan.js';
import type { PlanRow } from '../services/recent-index/compaction-plan.js';
import { deleteRedisPrefix, dropTestDatabase, eventually, startTestService } from './support/harness.js';
import type { Api, TestService } from './support/harness.js';

const MAX = 1024;
const BUDGET = Math.floor(MAX * COMPACT_KEEP_RATIO);

const pad = (label: string, length: number) =>
  `${label} ${'x'.repeat(Math.max(0, length - label.length - 1))}`;
const user = (content: string) => ({ role: 'user', content });
const assistant = (content: string) => ({ role: 'assistant', content });
const toolCall = (id: string) => ({
  role: 'assistant',
  content: null,
  tool_calls: [{ id, type: 'function', function: { name: 'search', arguments: '{"q":"refund policy"}' } }],
});
const toolResult = (id: string, content: string) => ({ role: 'tool', tool_call_id: id, content });

async function post(api: Api, sid: string, messages: unknown[]): Promise<number[]> {
  const r = await api.post(`/v1/sessions/${sid}/messages?wait=true`, { messages });
  assert.equal(r.status, 201, r.text);
  return r.body.messages.map((m: { seq: number }) => m.seq);
}

void describe('compaction', () => {
  let svc: TestService;
  before(async () => {
    svc = await startTestService({ env: { MAX_HISTORY_BYTES: String(MAX) } });
  });
  after(async () => {
    await svc.stop();
    await deleteRedisPrefix(svc.config.prefix);
    await dropTestDatabase(svc.config.databaseUrl!);
  });

  async function compactions(outcome: string): Promise<number> {
    const metric = svc.deps.metrics.registry.getSingleMetric('mnemos_compactions_total');
    const values = (await metric!.get()).values;
    return values.find((v) => v.labels.outcome === outcome)?.value ?? 0;
  }
  const allCompactions = async () =>
    (await Promise.all(['cut', 'blocked', 'too_few', 'under_limit', 'missing'].map(compactions))).reduce(
      (a, b) => a + b,
    );

  async function compactQueueIdle(): Promise<boolean> {
    const c = await svc.deps.queues.compact.getJobCounts('waiting', 'active', 'delayed', 'prioritized');
    return Object.values(c).every((n) => n === 0);
  }

  async function rows(tenantId: string, sid: string) {
    const r = await svc.deps.db.query<{ seq: string; role: string; bytes: number }>(
      'SELECT seq, role, bytes FROM messages WHERE tenant_id = $1 AND session_id = $2 ORDER BY seq',
      [tenantId, sid],
    );
    return r.rows.map((x) => ({ seq: Number(x.seq), role: x.role, bytes: x.bytes }));
  }

  async function vectorSeqs(tenantId: string, sid: string): Promise<number[]> {
    const r = await svc.deps.db.query<{ seq: string }>(
      'SELECT seq FROM message_vectors WHERE tenant_id = $1 AND session_id = $2 ORDER BY seq',
      [tenantId, sid],
    );
    return r.rows.map((x) => Number(x.seq));
  }

  void test('cuts before the earliest user message leaving ≤ 80 %, never between a tool call and its result', async () => {
    const t = await svc.newTenant();
    // Setup: a first turn under the limit, embedded before anything is compacted.
    const first = await post(t.api, 'tools', [
      user(pad('turn one question', 120)),
      assistant(pad('turn one answer', 120)),
    ]);
    assert.deepEqual(
      await eventually(async () => ((await vectorSeqs(t.tenantId, 'tools')).length === 2 ? true : null)),
      true,
    );

    // Action: a turn with a tool call and a big tool result, then a short turn: over the limit.
    const second = await post(t.api, 'tools', [
      user(pad('turn two question', 70)),
      toolCall('call_1'),
      toolResult('call_1', pad('tool result', 300)),
      assistant(pad('turn two answer', 70)),
      user(pad('turn three question', 70)),
      assistant(pad('turn three answer', 70)),
    ]);
    const all = await rows(t.tenantId, 'tools');
    const total = all.reduce((s, r) => s + r.bytes, 0);
    const suffix = (seq: number) => all.filter((r) => r.seq >= seq).reduce((s, r) => s + r.bytes, 0);
    const [u2, call, , , u3] = second as [number, number, number, number, number, number];
    // The fixture exercises what it claims: over the limit; the turn-two user message leaves too much;
    // cutting at the tool call would have fitted (but would split the turn); turn three fits.
    assert.ok(total > MAX, `total ${total}`);
    assert.ok(suffix(u2) > BUDGET, `suffix(u2) ${suffix(u2)}`);
    assert.ok(suffix(call) <= BUDGET, `suffix(call) ${suffix(call)}`);
    assert.ok(suffix(u3) <= BUDGET, 'suffix(u3) <= BUDGET');

    // Assert: the cutoff moved to turn three, visible through the API.
    const session = await eventually(async () => {
      const r = await t.api.get('/v1/sessions/tools');
      return r.body.start_seq === u3 ? r.body : null;
    });
    assert.equal(session.hot_bytes, suffix(u3));
    const listed = await t.api.get('/v1/sessions/tools/messages');
    assert.deepEqual(
      listed.body.messages.map((m: { seq: number }) => m.seq),
      [...first, ...second],
      'the archive keeps every message',
    );
    const kept = listed.body.messages.find((m: { seq: number }) => m.seq === u3);
    assert.equal(session.start_at, kept.sent_at);

    // Recent vectors: none below the cutoff (the first turn's were pruned), the kept ones present.
    const seqs = await eventually(async () => {
      const v = await vectorSeqs(t.tenantId, 'tools');
      return v.length === 2 && v[0] === u3 ? v : null;
    });
    assert.deepEqual(seqs, [u3, second[5]]);
  });

  void test('fewer than 4 hot messages: nothing moves, however big', async () => {
    const t = await svc.newTenant();
    const before = await compactions('too_few');
    await post(t.api, 'few', [
      user(pad('big', 500)),
      assistant(pad('bigger', 500)),
      user(pad('biggest', 500)),
    ]);
    await eventually(async () => (await compactions('too_few')) > before);
    const s = await t.api.get('/v1/sessions/few');
    assert.equal(s.body.start_seq, 0);
    assert.equal(s.body.start_at, null);
    assert.ok(s.body.hot_bytes > MAX, 's.body.hot_bytes > MAX');
  });

  void test('a giant message with no cut point: nothing moves, no re-trigger per ingest, a new user turn unblocks', async () => {
    const t = await svc.newTenant();
    const runsBefore = await allCompactions();
    const blockedBefore = await compactions('blocked');
    await post(t.api, 'giant', [
      user('short question'),
      assistant('short answer'),
      user('please paste the log'),
      assistant(pad('giant log', 3000)),
    ]);
    const blockedAt = await eventually(async () => {
      const r = await svc.deps.db.query<{ b: string | null }>(
        `SELECT compact_blocked_at_bytes AS b FROM sessions WHERE tenant_id = $1 AND id = 'giant'`,
        [t.tenantId],
      );
      return r.rows[0]?.b ?? null;
    });
    assert.equal(Number(blockedAt), (await t.api.get('/v1/sessions/giant')).body.hot_bytes);
    assert.equal((await t.api.get('/v1/sessions/giant')).body.start_seq, 0);

    // More archived batches without a user message: the hook does not enqueue compaction again.
    let last = 0;
    for (let i = 0; i < 4; i++)
      [last] = (await post(t.api, 'giant', [assistant(`follow-up ${i}`)])) as [number];
    // The hook decides on compaction before it enqueues embedding: once the last vector exists, the
    // decision for every batch has been taken.
    await eventually(async () => (await vectorSeqs(t.tenantId, 'giant')).includes(last));
    await eventually(compactQueueIdle);
    assert.equal(await compactions('blocked'), blockedBefore + 1);
    assert.equal(await allCompactions(), runsBefore + 1, 'one compaction run for five archived batches');
    assert.equal((await t.api.get('/v1/sessions/giant')).body.start_seq, 0);

    // A new user message creates a cut point and compaction runs again.
    const [u] = (await post(t.api, 'giant', [user('next topic')])) as [number];
    const s = await eventually(async () => {
      const r = await t.api.get('/v1/sessions/giant');
      return r.body.start_seq === u ? r.body : null;
    });
    const kept = await rows(t.tenantId, 'giant');
    assert.equal(s.hot_bytes, kept.find((r) => r.seq === u)!.bytes);
    const flag = await svc.deps.db.query(
      `SELECT compact_blocked_at_bytes AS b FROM sessions WHERE tenant_id = $1 AND id = 'giant'`,
      [t.tenantId],
    );
    assert.deepEqual(flag.rows, [{ b: null }]);
  });

  void test('the message the cutoff starts at is hot: its size counts and its vector stays', async () => {
    const t = await svc.newTenant();
    const sessionOf = async () => (await t.api.get('/v1/sessions/start-hot')).body;
    // Turn one, then turn two whose big question U is the later cut point: all under the limit and
    // embedded before anything is compacted.
    await post(t.api, 'start-hot', [
      user(pad('turn one question', 300)),
      assistant(pad('turn one answer', 150)),
    ]);
    const second = await post(t.api, 'start-hot', [user(pad('turn two question', 300)), assistant('ok')]);
    const [u] = second as [number];
    await eventually(async () => (await vectorSeqs(t.tenantId, 'start-hot')).length === 4);
    assert.equal((await sessionOf()).start_seq, 0, 'nothing compacted yet');
    // A skip mark below the coming cut (as the embedder leaves for a message it cannot embed).
    await svc.deps.db.query(
      `INSERT INTO message_vector_skips (tenant_id, session_id, seq, model, reason)
       VALUES ($1, 'start-hot', $2, 'some-model', 'empty')`,
      [t.tenantId, u - 1],
    );
    // A long answer without a user message: over the limit, the cut goes to U.
    const [a3] = (await post(t.api, 'start-hot', [assistant(pad('turn two long answer', 300))])) as [number];
    await eventually(async () => (await sessionOf()).start_seq === u);
    await eventually(async () => (await vectorSeqs(t.tenantId, 'start-hot')).includes(a3));
    await eventually(compactQueueIdle);
    assert.deepEqual(
      await vectorSeqs(t.tenantId, 'start-hot'),
      [u, second[1], a3],
      'the vector of the start message stays',
    );
    const skips = await svc.deps.db.query(
      `SELECT seq FROM message_vector_skips WHERE tenant_id = $1 AND session_id = 'start-hot'`,
      [t.tenantId],
    );
    assert.deepEqual(skips.rows, [], 'skip marks below the cutoff go with the vectors');
    const all = await rows(t.tenantId, 'start-hot');
    assert.equal(
      (await sessionOf()).hot_bytes,
      all.filter((r) => r.seq >= u).reduce((n, r) => n + r.bytes, 0),
    );

    // Over the limit again only when U (the start message) is counted: the cut moves on.
    const third = await post(t.api, 'start-hot', [
      user('turn three'),
      assistant(pad('turn three answer', 420)),
    ]);
    const rowsNow = await rows(t.tenantId, 'start-hot');
    const hot = rowsNow.filter((r) => r.seq >= u).reduce((n, r) => n + r.bytes, 0);
    const withoutStart = hot - rowsNow.find((r) => r.seq === u)!.bytes;
    assert.ok(
      hot > MAX && withoutStart <= MAX,
      `fixture: hot ${hot}, without the start message ${withoutStart}`,
    );
    await eventually(
      async () => (await sessionOf()).start_seq === third[0],
      15_000,
      'the cut moved to turn three',
    );
  });
});

void describe('compaction plan', () => {
  const row = (seq: number, role: string, bytes: number, extra: Partial<PlanRow> = {}): PlanRow => ({
    seq: String(seq),
    role,
    bytes,
    sent_at_ns: String(seq * 1000),
    tool_call_id: null,
    call_ids: null,
    ...extra,
  });

  void test('takes the earliest qualifying user message, so as much as allowed stays hot', () => {
    const plan = planCompaction(
      [
        row(1, 'user', 400),
        row(2, 'assistant', 400),
        row(3, 'user', 200),
        row(4, 'assistant', 200),
        row(5, 'user', 100),
      ],
      1000,
    );
    assert.deepEqual(plan, {
      kind: 'cut',
      hotBytes: 1300,
      index: 2,
      startSeq: '3',
      startAtNs: '3000',
      keptBytes: 500,
    });
  });

  void test('never cuts between a tool call and its result, even at a misplaced user message', () => {
    const rows = [
      row(1, 'user', 400),
      row(2, 'assistant', 100, { call_ids: ['c1'] }),
      row(3, 'user', 50), // a client posted a user message before the tool result
      row(4, 'tool', 100, { tool_call_id: 'c1' }),
      row(5, 'assistant', 100),
      row(6, 'user', 100),
      row(7, 'assistant', 100),
    ];
    const plan = planCompaction(rows, 800);
    assert.equal(plan.kind, 'cut');
    assert.equal(plan.kind === 'cut' && plan.startSeq, '6');
  });

  void test('under the limit, too few messages, or no cut point', () => {
    assert.equal(planCompaction([row(1, 'user', 10)], 1024).kind, 'under_limit');
    assert.equal(
      planCompaction([row(1, 'user', 900), row(2, 'assistant', 900), row(3, 'user', 10)], 1024).kind,
      'too_few',
    );
    assert.equal(
      planCompaction(
        [row(1, 'user', 10), row(2, 'assistant', 10), row(3, 'user', 10), row(4, 'assistant', 5000)],
        1024,
      ).kind,
      'blocked',
    );
  });
});
