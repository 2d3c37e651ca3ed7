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
/**
 * The conversations of one decision prompt, rendered and joined, are at most this many code points
 * (the work units are cut to fit): a small decision model rejects a prompt past its context, and
 * the step then keeps everything on every run. The rules and, for supersede, the previous
 * summary's entries come on top.
 */
export const DECISION_LOG_CHARS = 24_000;
export const DECISION_CONVERSATIONS = 100;
/**
 * One conversation in a decision prompt, at most: a long agent turn (hundreds of tool calls) is
 * shown by its first messages and its last, around a line saying how many were left out. What the
 * model judges shows there: the request, how the turn went, how it ended.
 */
export const CONVERSATION_CHARS = 4_000;

/**
 * A user message and the replies after it (messages before the first user message form one too;
 * the work units of workers/summarize.ts group them). `continues`: the conversation began in an
 * earlier unit (the unit's message cap cut it) or before the run's cursor (the turn was still
 * going on at the previous run); its opening message is shown again, so the replies are judged
 * with the request they answer. `earlier`: its messages before this part, the opening one included.
 */
export interface Conversation {
  id: string;
  messages: SourceMessage[];
  continues?: { opener: SourceMessage; earlier: number };
}

const clip = (s: string, n: number) => (codePoints(s) > n ? `${takeCodePoints(s, n)}…` : s);
const supersedeCap = (role: string) => (role === 'user' ? SUPERSEDE_USER_CHARS : SUPERSEDE_REPLY_CHARS);

/**
 * The compact rendering the decision model judges (per message capped, in code points), at most
 * CONVERSATION_CHARS code points.
 */
export function renderConversation(
  c: Conversation,
  timeZone: string,
  cap: (role: string) => number = () => NOISE_MESSAGE_CHARS,
): string {
  const line = (m: SourceMessage) => {
    const body = [
      m.content,
      m.toolCalls ? `→ tool call: ${m.toolCalls.split(TOOL_CALL_SEPARATOR).join('; ')}` : '',
    ]
      .filter(Boolean)
      .join(' ');
    const more = m.contentChars > codePoints(m.content) ? '…' : '';
    return `${m.role}: ${clip(oneLine(body), cap(m.role))}${more}`;
  };
  const first = c.continues?.opener ?? c.messages[0];
  const when = first ? formatMessageTime(first.sentAtNs, timeZone).slice(0, 16) : '';
  const head = [`[${c.id}] ${when}`];
  if (c.continues) {
    const n = c.continues.earlier - 1;
    const left = n === 0 ? '' : n === 1 ? '1 earlier message left out ' : `${n} earlier messages left out `;
    head.push(line(c.continues.opener), `… ${left}(judged before) …`);
  }
  const lines = c.messages.map(line);
  const text = [...head, ...lines].join('\n');
  return codePoints(text) <= CONVERSATION_CHARS ? text : abbreviate(head, lines).join('\n');
}

/**
 * A conversation past CONVERSATION_CHARS: its first message, then its last and next-first
 * messages in turn while they fit, around a line counting the messages left out.
 */
function abbreviate(head: string[], lines: string[]): string[] {
  const cost = (s: string) => codePoints(s) + 1;
  const gap = (n: number) => `… ${n} messages left out …`;
  let used = [...head, lines[0] ?? '', gap(lines.length)].reduce((n, s) => n + cost(s), -1);
  let front = 1;
  let back = lines.length;
  for (let fromBack = true; front < back; fromBack = !fromBack) {
    const next = lines[fromBack ? back - 1 : front]!;
    if (used + cost(next) > CONVERSATION_CHARS) break;
    used += cost(next);
    if (fromBack) back--;
    else front++;
  }
  return [...head, ...lines.slice(0, front), gap(back - front), ...lines.slice(back)];
}

/** Code points `c` takes in a decision prompt, noise or supersede (the larger). */
export function conversationChars(c: Conversation, timeZone: string): number {
  return Math.max(
    codePoints(renderConversation(c, timeZone)),
    codePoints(renderConversation(c, timeZone, supersedeCap)),
  );
}

interface DecisionCall {
  tenantId: string;
  sessionId: string;
  model: string;
  timeZone: string;
  signal?: AbortSignal;
  /**
   * A failure the step must not swallow: thrown on to the caller instead of keeping everything
   * (the summary run defers when the endpoint pushes back, rather than calling it again at once).
   */
  rethrow?: (err: unknown) => boolean;
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
    conversations: conversations.map((c) => renderConversation(c, call.timeZone, supersedeCap)).join('\n\n'),
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
    if (call.rethrow?.(err)) throw err;
    const kind = err instanceof LlmError ? err.kind : err instanceof SyntaxError ? 'not_json' : 'error';
    if (kind !== 'aborted') {
      deps.logger.warn({ purpose, model: call.model, kind }, 'decision step failed; keeping everything');
    }
    return null;
  }
}
