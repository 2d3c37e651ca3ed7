import { z } from 'zod';
import { hasBadChars } from '../messages/message-input.js';
import { fieldPath } from '../validate.js';

/**
 * The rolling summary's shape (SPEC §6) and the parsing of model output into it. Anything the
 * model returns that does not fit is a failed chunk: the previous summary and cursor stay.
 */

export const MAX_KEY_DECISIONS = 8;
export const MAX_PAST_DISCUSSIONS = 8;
const MAX_FIELD_CHARS = 4000;

// The marker as models write it, stored in the canonical `Do: ` / `Don't: ` form: the word in any
// case, a typographic apostrophe, a list bullet before it (`- `, `* `, `• `), spaces before the
// colon, a full-width colon (zh-TW and ja text, often with no space after it), and after the
// colon any whitespace (several spaces, a tab, a no-break space, a line break) and zero-width
// characters. An ASCII colon with nothing between it and the rule (`Do:x`), a marker without its
// colon, or one with no rule after it is no marker.
const MARKER =
  /^(?:[-*\u2022][^\S\r\n\u2028\u2029]+)?(do|don['\u2018\u2019\u02bc\uff07`´]t)(?:[^\S\r\n\u2028\u2029]*\uff1a|[^\S\r\n\u2028\u2029]+:|:(?=\s))[\s\u200b-\u200d\u2060\ufeff]*(?=[^\s\u200b-\u200d\u2060\ufeff])/i;
const normaliseMarker = (s: string) =>
  s.trim().replace(MARKER, (_, word: string) => (word.toLowerCase() === 'do' ? 'Do: ' : "Don't: "));

// Postgres's jsonb cannot hold NUL or a lone surrogate: text with them is not a summary (a model's
// answer with them is a failed chunk, an import's a 400), never a statement that fails to save.
const BAD_CHARS_MESSAGE = 'NUL characters and lone surrogates are not allowed';
const text = z
  .string()
  .max(MAX_FIELD_CHARS)
  .refine((s) => !hasBadChars(s), BAD_CHARS_MESSAGE);

// `perspectives` is one string in the shape; a list of viewpoints is accepted and joined, and the
// joined string has the bound of every field (16 parts of 4,000 made one of 64,030).
const perspectives = z.union([
  text,
  z
    .array(text)
    .max(16)
    .transform((a) => a.join('; '))
    .pipe(text),
]);

export const summarySchema = z.object({
  key_decisions: z
    .array(
      z
        .string()
        .transform(normaliseMarker)
        .pipe(
          z
            .string()
            .max(MAX_FIELD_CHARS)
            .regex(/^(Do|Don't): \S/, `must be "Do: " or "Don't: " followed by the rule`)
            .refine((s) => !hasBadChars(s), BAD_CHARS_MESSAGE),
        ),
    )
    .max(MAX_KEY_DECISIONS),
  past_discussions: z
    .array(
      z.object({
        topic: text,
        description: text,
        direction: text,
        last_discussed: text,
      }),
    )
    .max(MAX_PAST_DISCUSSIONS),
  current_discussion: z.object({
    topic: text,
    description: text,
    perspectives,
    direction: text,
  }),
});

export type Summary = z.output<typeof summarySchema>;

export const emptySummary = (): Summary => ({
  key_decisions: [],
  past_discussions: [],
  current_discussion: { topic: '', description: '', perspectives: '', direction: '' },
});

/**
 * The answer without a reasoning model's thinking before it. Models served without a reasoning
 * parser (DeepSeek-R1, Qwen3 and QwQ on Ollama, vLLM or llama.cpp) write it into the answer, and
 * its drafts were taken for the answer (`Draft: {…"Do: use MySQL"…} Wait, the user said
 * PostgreSQL`). DeepSeek-R1's template opens `<think>` in the prompt, so the answer often holds
 * only the closing tag. An answer that starts as JSON has no thinking, whatever tags its strings
 * quote. Otherwise the answer is the first JSON object after the start or after a closing tag
 * (the earliest such cut of the first MAX_THINKING_CUTS) that holds every closing tag after the
 * cut in its strings: thinking may mention `</think>` itself, and an answer in prose may quote
 * it (`{"description":"R1 still writes </think> first"}` once failed every time). Failing that,
 * the answer starts after the last closing tag that JSON follows, or after the last closing tag.
 * An opening tag never closed is thinking cut off: no answer.
 */
const CLOSING_TAG = /<\/(?:think|thinking|reasoning)>/gi;
const MAX_THINKING_CUTS = 8;

function withoutThinking(raw: string): string {
  const text = raw.trim();
  if (text.startsWith('{') || text.startsWith('```')) return text;
  const tags = [...text.matchAll(CLOSING_TAG)].map((m) => ({ at: m.index, end: m.index + m[0].length }));
  if (tags.length === 0) return /^<(?:think|thinking|reasoning)>/i.test(text) ? '' : text;
  const cuts = [0, ...tags.map((t) => t.end)].slice(0, MAX_THINKING_CUTS);
  for (const [i, cut] of cuts.entries()) {
    const rest = text.slice(cut);
    const span = firstObjectSpan(rest);
    if (span && tags.slice(i).every((t) => t.at - cut > span.start && t.end - cut < span.end)) {
      return rest.slice(span.start, span.end);
    }
  }
  const answers = tags.map((t) => text.slice(t.end).trim());
  return answers.findLast((a) => a.startsWith('{') || a.startsWith('```')) ?? answers[answers.length - 1]!;
}

/**
 * Strips reasoning and code fences and finds the first balanced JSON object in a model's answer.
 */
export function extractJsonObject(raw: string): unknown {
  const trimmed = withoutThinking(raw);
  const fenced = /^```[a-zA-Z]*\s*\n?([\s\S]*?)\n?```\s*$/.exec(trimmed);
  const body = fenced ? fenced[1]!.trim() : trimmed;
  try {
    return JSON.parse(body);
  } catch {
    // fall through: prose around the object, or several objects
  }
  const found = firstBalancedObject(body);
  if (found === null) throw new SyntaxError('no JSON object in the answer');
  return JSON.parse(found);
}

/**
 * At most this many `{` are tried as the object's start. Each try scans to the end of the answer
 * when it never balances, so without a bound a malformed answer of n braces costs n² steps (120 KB
 * of `{` held the event loop 22 s); a real answer has its object among its first few braces.
 */
const MAX_OBJECT_STARTS = 32;

function firstBalancedObject(s: string): string | null {
  const span = firstObjectSpan(s);
  return span && s.slice(span.start, span.end);
}

/** Where the first balanced `{…}` of `s` that parses as JSON is (`end` exclusive). */
function firstObjectSpan(s: string): { start: number; end: number } | null {
  let tries = 0;
  for (
    let start = s.indexOf('{');
    start !== -1 && tries < MAX_OBJECT_STARTS;
    start = s.indexOf('{', start + 1), tries++
  ) {
    let depth = 0;
    let inString = false;
    let escaped = false;
    for (let i = start; i < s.length; i++) {
      const c = s[i];
      if (inString) {
        if (escaped) escaped = false;
        else if (c === '\\') escaped = true;
        else if (c === '"') inString = false;
        continue;
      }
      if (c === '"') inString = true;
      else if (c === '{') depth++;
      else if (c === '}') {
        depth--;
        if (depth === 0) {
          try {
            JSON.parse(s.slice(start, i + 1));
            return { start, end: i + 1 };
          } catch {
            break; // balanced but not JSON: try the next '{'
          }
        }
      }
    }
  }
  return null;
}

export type ParseOutcome<T> = { ok: true; value: T } | { ok: false; error: string };

/**
 * Parses a summary answer. The error names field paths only, never model text, because it is
 * stored in `last_error` and logged.
 */
export function parseSummaryAnswer(raw: string): ParseOutcome<Summary> {
  let json: unknown;
  try {
    json = extractJsonObject(raw);
  } catch {
    return { ok: false, error: 'invalid summary: the answer is not a JSON object' };
  }
  const r = summarySchema.safeParse(json);
  if (r.success) return { ok: true, value: r.data };
  const problems = r.error.issues
    .slice(0, 5)
    .map((i) => `${fieldPath(i.path) || 'summary'}: ${i.message}`)
    .join('; ');
  return { ok: false, error: `invalid summary: ${problems}` };
}

/** A stored summary as the decision step sees it (imported ones may not fit the schema exactly). */
export function summaryEntries(stored: unknown): { keyDecisions: unknown[]; pastDiscussions: unknown[] } {
  const rec = stored !== null && typeof stored === 'object' && !Array.isArray(stored) ? stored : {};
  const kd = (rec as Record<string, unknown>)['key_decisions'];
  const pd = (rec as Record<string, unknown>)['past_discussions'];
  return { keyDecisions: Array.isArray(kd) ? kd : [], pastDiscussions: Array.isArray(pd) ? pd : [] };
}

/** The stored summary without the entries at the given 0-based indexes. */
export function pruneSummary(
  stored: unknown,
  remove: { keyDecisions: number[]; pastDiscussions: number[] },
): unknown {
  if (stored === null || typeof stored !== 'object' || Array.isArray(stored)) return stored;
  const { keyDecisions, pastDiscussions } = summaryEntries(stored);
  const kd = new Set(remove.keyDecisions);
  const pd = new Set(remove.pastDiscussions);
  return {
    ...stored,
    key_decisions: keyDecisions.filter((_, i) => !kd.has(i)),
    past_discussions: pastDiscussions.filter((_, i) => !pd.has(i)),
  };
}
