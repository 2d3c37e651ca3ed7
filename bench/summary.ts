/**
 * Rolling summaries: LLM calls, prompt size and job overhead of summarising a 2,000-message
 * conversation, and what the decision model's noise filter saves on a scripted noisy one.
 *
 *   node --import tsx bench/summary.ts [--messages 2000] [--rounds 3]
 *
 * Runs `summarizeSession` (the summarize job, without BullMQ) against a scratch database and the
 * fake OpenAI server of the tests, which answers at once with a full-size summary (8 decisions, 8
 * past discussions). "Overhead" is the job's wall time minus the time spent inside LLM calls
 * (HTTP to the local fake included in the LLM side): reading the archive, rendering, chunking,
 * the guarded saves and the lease. The noise judge is scripted (it flags greetings, thanks and
 * cancelled turns by their wording), so the savings measure the pipeline, not a model's judgement.
 */
import { randomBytes } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { insertArchiveBatch } from '../db/queries/messages.js';
import type { ArchiveInsertRow } from '../db/queries/messages.js';
import { lockOrCreateSession, recordArchived } from '../db/queries/sessions.js';
import { loadConfig } from '../services/config.js';
import type { CoreDeps } from '../services/deps.js';
import type { LlmClient } from '../services/llm/llm-client.js';
import { makeLogger } from '../services/logger.js';
import { closeDeps, openDeps } from '../services/runtime.js';
import { codePoints } from '../services/text/code-points.js';
import { createTenant } from '../services/tenants.js';
import { ftsDocument } from '../services/text/fts-text.js';
import { startFakeOpenAI } from '../test/support/fake-openai.js';
import type { FakeOpenAI } from '../test/support/fake-openai.js';
import { summarizeSession } from '../workers/summarize.js';
import { fmtInt, fmtMs, fmtPct, markdownTable, note } from './lib/format.js';
import { REDIS_URL, cleanupScratch, createScratchDatabase, onCleanup, scratchPrefix } from './lib/scratch.js';

const arg = (name: string, def: number) => {
  const i = process.argv.indexOf(`--${name}`);
  return i === -1 ? def : Number(process.argv[i + 1]);
};
const MESSAGES = arg('messages', 2000);
const ROUNDS = arg('rounds', 3);
const DECIDER = 'decider';

// Deterministic text: a small LCG over a fixed vocabulary.
let seed = 42;
const rand = () => (seed = (seed * 1103515245 + 12345) & 0x7fffffff) / 0x7fffffff;
const vocab =
  'deploy pipeline cache release window token agent tool result retry schema index query latency budget review branch merge config secret rollout canary metric alert'.split(
    ' ',
  );
const words = (n: number) =>
  Array.from({ length: n }, () => vocab[Math.floor(rand() * vocab.length)]).join(' ');
const between = (lo: number, hi: number) => lo + Math.floor(rand() * (hi - lo));

interface Turn {
  role: string;
  content: string | null;
  tool_calls?: unknown[];
  tool_call_id?: string;
}

/** A realistic working conversation: questions, long answers, some tool calls. */
function workConversation(n: number): Turn[] {
  const out: Turn[] = [];
  while (out.length < n) {
    out.push({ role: 'user', content: words(between(8, 60)) });
    if (rand() < 0.2) {
      const id = `call_${out.length}`;
      out.push({
        role: 'assistant',
        content: null,
        tool_calls: [
          { id, type: 'function', function: { name: 'search', arguments: '{"q":"release notes"}' } },
        ],
      });
      out.push({ role: 'tool', content: words(between(60, 200)), tool_call_id: id });
    }
    out.push({ role: 'assistant', content: words(between(40, 300)) });
  }
  return out.slice(0, n);
}

/** The same, with about a third of the conversations noise: greetings, thanks, cancelled turns. */
function noisyConversation(n: number): Turn[] {
  const out: Turn[] = [];
  while (out.length < n) {
    const r = rand();
    if (r < 0.12) {
      out.push(
        { role: 'user', content: 'hi, good morning' },
        { role: 'assistant', content: 'Good morning! How can I help?' },
      );
    } else if (r < 0.24) {
      out.push(
        { role: 'user', content: 'thanks, that helps' },
        { role: 'assistant', content: 'You are welcome.' },
      );
    } else if (r < 0.34) {
      out.push(
        { role: 'user', content: `stop, cancel that: ${words(20)}` },
        { role: 'assistant', content: `Cancelled. The run failed: ${words(between(80, 200))}` },
      );
    } else {
      out.push(
        { role: 'user', content: words(between(8, 60)) },
        { role: 'assistant', content: words(between(40, 300)) },
      );
    }
  }
  return out.slice(0, n);
}

const FULL_SUMMARY = JSON.stringify({
  key_decisions: Array.from({ length: 8 }, (_, i) => `Do: rule ${i}: ${words(10)}`),
  past_discussions: Array.from({ length: 8 }, (_, i) => ({
    topic: `topic ${i}`,
    description: words(30),
    direction: words(8),
    last_discussed: '2026-01-02',
  })),
  current_discussion: {
    topic: 'current',
    description: words(40),
    perspectives: words(20),
    direction: words(10),
  },
});

function scriptFake(fake: FakeOpenAI): void {
  fake.onChat((body: { model: string; messages: Array<{ content: string }> }) => {
    if (body.model !== DECIDER) return { content: FULL_SUMMARY };
    const system = body.messages[0]!.content;
    if (!/filter noise/.test(system)) return { content: '{"key_decisions": [], "past_discussions": []}' };
    const blocks = body.messages[1]!.content.split(/\n\n(?=\[c\d+\])/);
    const noise = blocks.flatMap((b) => {
      const id = /^\[?(?:Conversations:\s*)?\[?(c\d+)\]/.exec(b.replace(/^Conversations:\n\n/, ''))?.[1];
      const first = b.split('\n')[1] ?? '';
      return id && /^user: (hi|thanks|stop)/.test(first) ? [{ id, confidence: 0.9 }] : [];
    });
    return { content: JSON.stringify({ noise }) };
  });
}

async function seedSession(
  deps: CoreDeps,
  tenantId: string,
  sessionId: string,
  turns: Turn[],
): Promise<void> {
  const base = BigInt(Date.UTC(2026, 0, 2)) * 1_000_000n;
  const rows: ArchiveInsertRow[] = turns.map((t, i) => {
    const fts = ftsDocument(t.content ?? '');
    return {
      seq: i + 1,
      id: `m${i + 1}`,
      role: t.role,
      content: t.content,
      parts: null,
      name: null,
      tool_call_id: t.tool_call_id ?? null,
      tool_calls: t.tool_calls ?? null,
      metadata: null,
      sent_at_ns: String(base + BigInt(i) * 1_000_000_000n),
      sent_at_given: true,
      bytes: Buffer.byteLength(JSON.stringify(t)),
      fingerprint: randomBytes(8).toString('hex'),
      fts_en: fts.en,
      fts_cjk: fts.cjk,
    };
  });
  await deps.db.transaction(async (tx) => {
    await lockOrCreateSession(tx, tenantId, sessionId);
    for (let i = 0; i < rows.length; i += 500)
      await insertArchiveBatch(tx, tenantId, sessionId, rows.slice(i, i + 500));
    await recordArchived(tx, {
      tenantId,
      sessionId,
      nextSeq: rows.length + 1,
      count: rows.length,
      bytes: rows.reduce((a, r) => a + r.bytes, 0),
      lastSentNs: rows[rows.length - 1]!.sent_at_ns,
    });
  });
}

interface RunStats {
  summaryCalls: number;
  decisionCalls: number;
  summaryPromptCp: number;
  decisionPromptCp: number;
  transcriptCp: number;
  wallMs: number;
  llmMs: number;
}

async function run(
  deps: CoreDeps,
  fake: FakeOpenAI,
  tenantId: string,
  turns: Turn[],
  decision: boolean,
): Promise<RunStats> {
  const sessionId = `bench-${randomBytes(4).toString('hex')}`;
  await seedSession(deps, tenantId, sessionId, turns);
  fake.reset();
  scriptFake(fake);
  let llmMs = 0;
  const inner = deps.llm!;
  const timed: LlmClient = {
    async chat(req) {
      const t0 = performance.now();
      try {
        return await inner.chat(req);
      } finally {
        llmMs += performance.now() - t0;
      }
    },
    embed: (req) => inner.embed(req),
  };
  const runDeps = {
    ...deps,
    llm: timed,
    config: { ...deps.config, decisionModel: decision ? DECIDER : undefined },
  };
  const t0 = performance.now();
  const r = await summarizeSession(runDeps, { tenantId, sessionId });
  const wallMs = performance.now() - t0;
  if (r.outcome !== 'summarized') throw new Error(`unexpected outcome ${r.outcome}`);
  const stats: RunStats = {
    summaryCalls: 0,
    decisionCalls: 0,
    summaryPromptCp: 0,
    decisionPromptCp: 0,
    transcriptCp: 0,
    wallMs,
    llmMs,
  };
  for (const req of fake.chatRequests()) {
    const body = req.body as { model: string; messages: Array<{ content: string }> };
    const cp = body.messages.reduce((a, m) => a + codePoints(m.content), 0);
    if (body.model === DECIDER) {
      stats.decisionCalls++;
      stats.decisionPromptCp += cp;
    } else {
      stats.summaryCalls++;
      stats.summaryPromptCp += cp;
      const user = body.messages[1]!.content;
      stats.transcriptCp += codePoints(user.slice(user.indexOf('\n\n') + 2, user.lastIndexOf('\n\nReturn')));
    }
  }
  return stats;
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;

const pct = (delta: number) => `${delta > 0 ? '+' : delta < 0 ? '−' : '±'}${fmtPct(Math.abs(delta))}`;

function row(label: string, runs: RunStats[]): string[] {
  const s = runs[0]!;
  const overhead = median(runs.map((r) => r.wallMs - r.llmMs));
  return [
    label,
    fmtInt(s.summaryCalls),
    fmtInt(s.decisionCalls),
    (s.summaryPromptCp / MESSAGES).toFixed(0),
    (s.transcriptCp / MESSAGES).toFixed(0),
    (s.decisionPromptCp / MESSAGES).toFixed(0),
    fmtMs(median(runs.map((r) => r.wallMs))),
    fmtMs(overhead),
    `${((overhead / MESSAGES) * 1000).toFixed(0)} µs`,
  ];
}

async function main(): Promise<void> {
  const fake = await startFakeOpenAI();
  onCleanup(() => fake.close());
  const db = await createScratchDatabase('summary');
  const rows: string[][] = [];
  const savings: string[][] = [];
  for (const runes of [32000, 8000]) {
    const config = loadConfig({
      DATABASE_URL: db.url,
      REDIS_URL,
      MNEMOS_PREFIX: scratchPrefix(),
      OPENAI_BASE_URL: fake.url,
      OPENAI_API_KEY: 'bench',
      SUMMARY_RUNES: String(runes),
      LOG_LEVEL: 'silent',
      TZ: 'UTC',
    });
    const deps = await openDeps(config, makeLogger('silent'));
    try {
      const { tenant_id: tenantId } = await createTenant(deps.db, `bench-${randomBytes(3).toString('hex')}`);
      const rounds = async (turns: Turn[], decision: boolean) => {
        const out: RunStats[] = [];
        for (let i = 0; i < ROUNDS; i++) out.push(await run(deps, fake, tenantId, turns, decision));
        return out;
      };
      seed = 42;
      rows.push(row(`work, SUMMARY_RUNES ${fmtInt(runes)}`, await rounds(workConversation(MESSAGES), false)));
      seed = 7;
      const noisy = noisyConversation(MESSAGES);
      const without = await rounds(noisy, false);
      const withDecision = await rounds(noisy, true);
      rows.push(row(`noisy, SUMMARY_RUNES ${fmtInt(runes)}`, without));
      rows.push(row(`noisy, SUMMARY_RUNES ${fmtInt(runes)}, DECISION_MODEL`, withDecision));
      const a = without[0]!;
      const b = withDecision[0]!;
      savings.push([
        fmtInt(runes),
        pct(b.summaryCalls / a.summaryCalls - 1),
        pct((b.summaryCalls + b.decisionCalls) / a.summaryCalls - 1),
        pct(b.summaryPromptCp / a.summaryPromptCp - 1),
        pct((b.summaryPromptCp + b.decisionPromptCp) / a.summaryPromptCp - 1),
      ]);
    } finally {
      await closeDeps(deps);
    }
  }
  process.stdout.write(
    `${MESSAGES} messages per run, median of ${ROUNDS} rounds, fake LLM answering at once; cp = code points\n\n` +
      markdownTable(
        [
          'conversation',
          'summary calls',
          'decision calls',
          'summary prompt cp / msg',
          'of which transcript',
          'decision prompt cp / msg',
          'job wall',
          'overhead (wall − LLM)',
          'overhead / msg',
        ],
        rows,
      ) +
      '\n\nNoise filter on the noisy conversation (change with DECISION_MODEL vs without)\n\n' +
      markdownTable(
        ['SUMMARY_RUNES', 'summary calls', 'all LLM calls', 'summary-model prompt cp', 'all prompt cp'],
        savings,
      ) +
      '\n',
  );
}

try {
  await main();
} finally {
  for (const line of await cleanupScratch()) note(`cleanup: ${line}`);
}
