import { z } from 'zod';
import { TOOL_CALL_SEPARATOR } from '../../db/queries/summaries.js';
import type { CoreDeps } from '../deps.js';
import { LlmError } from '../llm/llm-client.js';
import { noisePrompt, supersedePrompt } from './prompts.js';
import { codePoints, takeCodePoints } from '../text/code-points.js';
import { oneLine } from '../text/one-line.js';
import { formatMessageTime } from './render.js';
import type { SourceMessage } from './render.js';
import { extractJsonObject, summaryEntries } from './summary-shape.js';

/**
 * The decision model's two judgements before chunking (SPEC §6 step 3), as two calls with their
 * own usage purposes: `noise` (which new conversations to drop) and `supersede` (which entries
 * of the previous summary the kept conversations overturn). Two small prompts are easier for a
 * small decision model than one combined one, the supersede call is skipped when the previous
 * summary has no entries or nothing survived, and each step fails on its own: any error, timeout
 * or invalid answer keeps everything.
 */

export const NOISE_CONFIDENCE = 0.7;
/**
 * Per message in decision prompts: enough to see what a turn is about, not its whole text. Noise
 * shows at the start of a turn; decisions are made by the user, so the supersede prompt keeps more
 * of user messages and less of the replies.
 */
const NOISE_MESSAGE_CHARS = 200;
const SUPERSEDE_USER_CHARS = 300;
const SUPERSEDE_REPLY_CHARS = 120;
const DECISION_ENTRY_CHARS = 400;

/** A user message and the replies after it (messages before the first user message form one too). */
export interface Conversation {
  id: string;
  messages: SourceMessage[];
}

export function groupConversations(messages: SourceMessage[]): Conversation[] {
  const out: Conversation[] = [];
  for (const m of messages) {
    const last = out[out.length - 1];
    if (!last || m.role === 'user') out.push({ id: `c${out.length + 1}`, messages: [m] });
    else last.messages.push(m);
  }
  return out;
}

const clip = (s: string, n: number) => (codePoints(s) > n ? `${takeCodePoints(s, n)}…` : s);

/** The compact rendering the decision model judges (per message capped, in code points). */
export function renderConversation(
  c: Conversation,
  timeZone: string,
  cap: (role: string) => number = () => NOISE_MESSAGE_CHARS,
): string {
  const first = c.messages[0];
  const when = first ? formatMessageTime(first.sentAtNs, timeZone).slice(0, 16) : '';
  const lines = c.messages.map((m) => {
    const body = [
      m.content,
      m.toolCalls ? `→ tool call: ${m.toolCalls.split(TOOL_CALL_SEPARATOR).join('; ')}` : '',
    ]
      .filter(Boolean)
      .join(' ');
    const more = m.contentChars > codePoints(m.content) ? '…' : '';
    return `${m.role}: ${clip(oneLine(body), cap(m.role))}${more}`;
  });
  return `[${c.id}] ${when}\n${lines.join('\n')}`;
}

interface DecisionCall {
  tenantId: string;
  sessionId: string;
  model: string;
  timeZone: string;
  signal?: AbortSignal;
}

const noiseAnswer = z.object({
  noise: z.array(
    z.object({
      id: z.union([z.string(), z.number()]),
      confidence: z.number().min(0).max(1),
    }),
  ),
});

/** Ids of the conversations judged noise with confidence ≥ 0.7; null when the step failed. */
export async function judgeNoise(
  deps: Pick<CoreDeps, 'llm' | 'logger'>,
  call: DecisionCall,
  conversations: Conversation[],
): Promise<Set<string> | null> {
  if (!deps.llm || conversations.length === 0) return null;
  const log = conversations.map((c) => renderConversation(c, call.timeZone)).join('\n\n');
  const answer = await ask(deps, call, 'noise', noisePrompt(log), noiseAnswer);
  if (!answer) return null;
  const known = new Set(conversations.map((c) => c.id));
  const drop = new Set<string>();
  for (const n of answer.noise) {
    const id = typeof n.id === 'number' ? `c${n.id}` : n.id.trim();
    if (known.has(id) && n.confidence >= NOISE_CONFIDENCE) drop.add(id);
  }
  return drop;
}

const supersedeAnswer = z.object({
  key_decisions: z.array(z.number().int()).default([]),
  past_discussions: z.array(z.number().int()).default([]),
});

function entryText(e: unknown): string {
  // One line each: a stored entry holding newlines wrote its own "Past discussions:" and
  // "New conversations:" sections into the prompt.
  if (typeof e === 'string') return clip(oneLine(e), DECISION_ENTRY_CHARS);
  if (e !== null && typeof e === 'object') {
    const r = e as Record<string, unknown>;
    const s = (k: string) => (typeof r[k] === 'string' ? (r[k] as string) : '');
    const text = `${s('topic')}: ${s('description')} (direction: ${s('direction')}; last discussed ${s('last_discussed')})`;
    return clip(oneLine(text), DECISION_ENTRY_CHARS);
  }
  return clip(JSON.stringify(e) ?? '', DECISION_ENTRY_CHARS);
}

/**
 * 0-based indexes of the previous summary's key_decisions and past_discussions that the new
 * conversations overturn or replace; null when the step failed (keep everything).
 */
export async function findSuperseded(
  deps: Pick<CoreDeps, 'llm' | 'logger'>,
  call: DecisionCall,
  previous: unknown,
  conversations: Conversation[],
): Promise<{ keyDecisions: number[]; pastDiscussions: number[] } | null> {
  const { keyDecisions, pastDiscussions } = summaryEntries(previous);
  if (!deps.llm || conversations.length === 0 || keyDecisions.length + pastDiscussions.length === 0)
    return null;
  const prompt = supersedePrompt({
    keyDecisions: keyDecisions.map(entryText),
    pastDiscussions: pastDiscussions.map(entryText),
    conversations: conversations
      .map((c) =>
        renderConversation(c, call.timeZone, (role) =>
          role === 'user' ? SUPERSEDE_USER_CHARS : SUPERSEDE_REPLY_CHARS,
        ),
      )
      .join('\n\n'),
  });
  const answer = await ask(deps, call, 'supersede', prompt, supersedeAnswer);
  if (!answer) return null;
  const pick = (nums: number[], len: number) => [
    ...new Set(nums.filter((n) => n >= 1 && n <= len).map((n) => n - 1)),
  ];
  return {
    keyDecisions: pick(answer.key_decisions, keyDecisions.length),
    pastDiscussions: pick(answer.past_discussions, pastDiscussions.length),
  };
}

async function ask<S extends z.ZodType>(
  deps: Pick<CoreDeps, 'llm' | 'logger'>,
  call: DecisionCall,
  purpose: 'noise' | 'supersede',
  messages: ReturnType<typeof noisePrompt>,
  schema: S,
): Promise<z.output<S> | null> {
  try {
    const res = await deps.llm!.chat({
      purpose,
      model: call.model,
      messages,
      json: true,
      temperature: 0,
      tenantId: call.tenantId,
      sessionId: call.sessionId,
      ...(call.signal ? { signal: call.signal } : {}),
    });
    const parsed = schema.safeParse(extractJsonObject(res.content));
    if (parsed.success) return parsed.data;
    deps.logger.warn(
      { purpose, model: call.model },
      'decision model gave an invalid answer; keeping everything',
    );
    return null;
  } catch (err) {
    const kind = err instanceof LlmError ? err.kind : err instanceof SyntaxError ? 'not_json' : 'error';
    if (kind !== 'aborted') {
      deps.logger.warn({ purpose, model: call.model, kind }, 'decision step failed; keeping everything');
    }
    return null;
  }
}
