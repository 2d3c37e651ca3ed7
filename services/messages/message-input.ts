import { createHash, randomUUID } from 'node:crypto';
import { UNSTORABLE, escapeUnstorable } from '../text/unstorable.js';
import { z } from 'zod';
import { AppError } from '../errors.js';
import { nowNs, parseSentAt } from '../time.js';
import { fieldPath, parseInput } from '../validate.js';

export const MAX_MESSAGES_PER_REQUEST = 1000;
export const MAX_CONTENT_BYTES = 1024 * 1024;
export const MAX_METADATA_BYTES = 16 * 1024;

export const SESSION_ID_RE = /^[A-Za-z0-9._:@-]{1,256}$/;

/** The API's session-id rule; also what a queued job's payload must name (workers/queues.ts). */
export const isSessionId = (sid: string): boolean => SESSION_ID_RE.test(sid) && sid !== '.' && sid !== '..';

const SESSION_ID_RULE = 'must be 1-256 characters of A-Z a-z 0-9 . _ : @ - (and not "." or "..")';

/** The same rule for a session id given in a body or query field (`session_id`). */
export const sessionIdField = z
  .string()
  .regex(SESSION_ID_RE, SESSION_ID_RULE)
  .refine((sid) => sid !== '.' && sid !== '..', SESSION_ID_RULE);

export function assertSessionId(sid: string): string {
  if (!isSessionId(sid)) {
    throw new AppError(400, 'invalid_session_id', `session id ${SESSION_ID_RULE}`, { path: 'sid' });
  }
  return sid;
}

const textPart = z.object({ type: z.literal('text'), text: z.string() }).strict();
const imagePart = z
  .object({
    type: z.literal('image_url'),
    image_url: z
      .object({ url: z.string().min(1), detail: z.enum(['auto', 'low', 'high']).optional() })
      .strict(),
  })
  .strict();
const part = z.discriminatedUnion('type', [textPart, imagePart]);

const toolCall = z
  .object({
    id: z.string().min(1).max(256),
    type: z.literal('function'),
    function: z.object({ name: z.string().min(1).max(256), arguments: z.string() }).strict(),
  })
  .strict();

/**
 * Fields of a message as OpenAI's SDKs return it (`choices[0].message`, Python's `model_dump()`)
 * that are not message fields here: a post of the whole object named only the key, and the user
 * did not learn which fields to pick.
 */
const RESPONSE_ONLY_FIELDS = new Set([
  'refusal',
  'annotations',
  'audio',
  'function_call',
  'reasoning_content',
  'parsed',
]);

const messageFields = (iss: { code?: string; keys?: string[] }) => {
  const response = iss.keys?.filter((k) => RESPONSE_ONLY_FIELDS.has(k)) ?? [];
  if (iss.code !== 'unrecognized_keys' || response.length === 0) return undefined;
  const quoted = (keys: string[]) => keys.map((k) => `"${k}"`).join(', ');
  return (
    `Unrecognized key(s): ${quoted(iss.keys!)} (${quoted(response)}: of the chat completion response, ` +
    'not of a message; post role, content, name, tool_calls, tool_call_id, and id, sent_at, metadata)'
  );
};

/**
 * A null where a message field must have a value (`"name": null`): what Python's `model_dump()`
 * writes for a field the model left unset. A bare "expected array, received null" did not say that
 * leaving the field out is the fix.
 */
const NULL_FIELD =
  "must not be null: leave the field out (Python's model_dump() writes null for unset fields: use model_dump(exclude_none=True))";
const notNull = (iss: { input?: unknown }) => (iss.input === null ? NULL_FIELD : undefined);

export const messageSchema = z
  .object(
    {
      id: z.string({ error: notNull }).min(1).max(128).optional(),
      role: z.enum(['user', 'assistant', 'system', 'developer', 'tool']),
      content: z
        .union([z.string(), z.null(), z.array(part).min(1)])
        .optional()
        .meta({
          description:
            'text, or content parts; at most 1 MiB of UTF-8 (parts: their JSON); null only on an assistant message with tool_calls',
        }),
      name: z.string({ error: notNull }).min(1).max(256).optional(),
      tool_call_id: z.string({ error: notNull }).min(1).max(256).optional(),
      tool_calls: z.array(toolCall, { error: notNull }).min(1).max(128).optional(),
      sent_at: z
        .string({
          error: (iss) =>
            notNull(iss) ?? 'must be a string: RFC 3339, unix ns as a decimal string, or YYYY-MM-DD HH:MM:SS',
        })
        .optional(),
      // Checked, not copied: a copy made by assignment would drop an own `__proto__` key.
      metadata: z
        .custom<Record<string, unknown>>((v) => typeof v === 'object' && v !== null && !Array.isArray(v), {
          error: (iss) => notNull(iss) ?? 'must be a JSON object',
        })
        .meta({ type: 'object', description: 'free-form JSON object, at most 16 KiB' })
        .optional(),
    },
    { error: messageFields },
  )
  .strict()
  .superRefine((m, ctx) => {
    const hasContent = m.content !== undefined && m.content !== null;
    if (!hasContent && !(m.role === 'assistant' && m.tool_calls)) {
      ctx.addIssue({
        code: 'custom',
        path: ['content'],
        message: 'content may be null or absent only on an assistant message with tool_calls',
      });
    }
    if (m.tool_calls && m.role !== 'assistant') {
      ctx.addIssue({
        code: 'custom',
        path: ['tool_calls'],
        message: 'only assistant messages carry tool_calls',
      });
    }
    if (m.role === 'tool' && !m.tool_call_id) {
      ctx.addIssue({ code: 'custom', path: ['tool_call_id'], message: 'a tool message needs tool_call_id' });
    }
    if (m.tool_call_id && m.role !== 'tool') {
      ctx.addIssue({
        code: 'custom',
        path: ['tool_call_id'],
        message: 'only tool messages carry tool_call_id',
      });
    }
  });

export const postMessagesSchema = z
  .object({ messages: z.array(z.unknown()).min(1).max(MAX_MESSAGES_PER_REQUEST) })
  .strict();

export type MessageInput = z.infer<typeof messageSchema>;

/** What the API hands to the inbox, and what the ingest worker archives. */
export interface AcceptedMessage {
  id: string;
  /** True when the client chose the id (idempotency applies). */
  cid: boolean;
  role: MessageInput['role'];
  content: string | null;
  parts: unknown[] | null;
  name: string | null;
  tool_call_id: string | null;
  tool_calls: unknown[] | null;
  metadata: Record<string, unknown> | null;
  sent_at_ns: string;
  sent_at_given: boolean;
  bytes: number;
  /** sha256 over the fields an idempotent re-post must repeat (sent_at compared separately). */
  fp: string;
}

/** Deterministic JSON: object keys sorted, so re-posts with reordered metadata compare equal. */
export function stableStringify(v: unknown): string {
  if (Array.isArray(v)) return `[${v.map(stableStringify).join(',')}]`;
  if (v && typeof v === 'object') {
    const o = v as Record<string, unknown>;
    return `{${Object.keys(o)
      .filter((k) => o[k] !== undefined)
      .sort()
      .map((k) => `${JSON.stringify(k)}:${stableStringify(o[k])}`)
      .join(',')}}`;
  }
  return JSON.stringify(v) ?? 'null';
}

/** True for text Postgres cannot store (NUL) or that is not valid UTF-8 (a lone surrogate). */
export const hasBadChars = (s: string) => UNSTORABLE.test(s);
/** `s` with each NUL as a space and each lone surrogate as U+FFFD: text Postgres can store. */
export const replaceBadChars = (s: string) =>
  s.replace(new RegExp(UNSTORABLE.source, 'g'), (c) => (c === '\u0000' ? ' ' : '\uFFFD'));

/** Nesting allowed in a message (its free-form `metadata`, and anything rejected after the walk). */
export const MAX_JSON_DEPTH = 64;

interface BadValue {
  path: string;
  kind: 'chars' | 'number' | 'deep';
}

/**
 * The first value of `v` that cannot be stored as given: nested deeper than MAX_JSON_DEPTH, a
 * string (or key) with a NUL or a lone surrogate, or a number JSON.parse could not hold (`1e400`
 * reads as Infinity, which would be stored as null). One walk that stops descending at
 * MAX_JSON_DEPTH, so that a body of 100,000 nested arrays is a 400 here rather than a stack
 * overflow in a recursive walk after it (stableStringify, JSON.stringify); one path, pushed and
 * popped as it goes and copied only for the answer (a copy per value cost the body's size times
 * its depth: seconds for 8 MiB of nested arrays).
 */
function findBadValue(v: unknown, path: (string | number)[]): BadValue | null {
  const walk = (x: unknown, depth: number): BadValue | null => {
    if (typeof x === 'string') return UNSTORABLE.test(x) ? { path: fieldPath(path), kind: 'chars' } : null;
    if (typeof x === 'number') return Number.isFinite(x) ? null : { path: fieldPath(path), kind: 'number' };
    if (!x || typeof x !== 'object') return null;
    if (depth >= MAX_JSON_DEPTH) return { path: fieldPath(path), kind: 'deep' };
    if (Array.isArray(x)) {
      for (let i = 0; i < x.length; i++) {
        path.push(i);
        const r = walk(x[i], depth + 1);
        path.pop();
        if (r) return r;
      }
      return null;
    }
    for (const k in x) {
      if (!Object.prototype.hasOwnProperty.call(x, k)) continue;
      // Quoted as escapes: as themselves they made the 400 one that strict decoders refuse.
      // Quoted as escapes: as themselves they made the 400 one that strict JSON decoders refuse.
      if (UNSTORABLE.test(k)) return { path: fieldPath([...path, escapeUnstorable(k)]), kind: 'chars' };
      path.push(k);
      const r = walk((x as Record<string, unknown>)[k], depth + 1);
      path.pop();
      if (r) return r;
    }
    return null;
  };
  return walk(v, 0);
}

/**
 * True when `metadata` is surely over MAX_METADATA_BYTES of JSON. It counts a lower bound of the
 * JSON's size (a byte per value, a string's UTF-16 length plus its quotes) and stops as soon as
 * that passes the limit, so a body of 8 MiB of metadata is refused after ~16 KiB of work, before
 * the walk over the whole message (findBadValue). The exact check (JSON.stringify) follows for
 * what passes.
 */
function metadataSurelyTooLarge(metadata: unknown): boolean {
  if (!metadata || typeof metadata !== 'object') return false;
  let size = 0;
  const stack: unknown[] = [metadata];
  while (stack.length > 0) {
    const x = stack.pop();
    if (typeof x === 'string') size += x.length + 2;
    else if (x && typeof x === 'object') {
      if (Array.isArray(x)) {
        size += 2 + x.length;
        if (size > MAX_METADATA_BYTES) return true;
        for (const y of x) stack.push(y);
      } else {
        for (const k in x) {
          if (!Object.prototype.hasOwnProperty.call(x, k)) continue;
          size += k.length + 3;
          stack.push((x as Record<string, unknown>)[k]);
          if (size > MAX_METADATA_BYTES) return true;
        }
        size += 2;
      }
    } else size += 1;
    if (size > MAX_METADATA_BYTES) return true;
  }
  return false;
}

const metadataTooLarge = (i: number) =>
  new AppError(400, 'validation_failed', `messages[${i}].metadata: must be at most 16 KiB of JSON`, {
    problems: [{ path: `messages[${i}].metadata`, message: 'must be at most 16 KiB of JSON' }],
  });

const utf8 = (s: string) => Buffer.byteLength(s, 'utf8');

function flattenText(content: MessageInput['content']): string | null {
  if (content === undefined || content === null) return null;
  if (typeof content === 'string') return content;
  return content
    .filter((p): p is z.infer<typeof textPart> => p.type === 'text')
    .map((p) => p.text)
    .join('\n');
}

/**
 * Validates a whole POST body and normalises each message. Throws the first 4xx; nothing is
 * stored unless every message passes.
 */
export function parseMessages(body: unknown, timeZone: string): AcceptedMessage[] {
  const { messages } = parseInput(postMessagesSchema, body);
  const seen = new Map<string, number>();
  const out: AcceptedMessage[] = [];
  const receivedNs = nowNs();
  messages.forEach((raw, i) => {
    if (raw && typeof raw === 'object' && metadataSurelyTooLarge((raw as { metadata?: unknown }).metadata)) {
      throw metadataTooLarge(i);
    }
    const bad = findBadValue(raw, ['messages', i]);
    if (bad?.kind === 'deep') {
      const message = `nested more than ${MAX_JSON_DEPTH} levels deep`;
      throw new AppError(400, 'validation_failed', `${bad.path}: ${message}`, {
        problems: [{ path: bad.path, message }],
      });
    }
    if (bad?.kind === 'chars') {
      throw new AppError(
        400,
        'invalid_characters',
        `${bad.path}: NUL characters and lone surrogates are not allowed`,
        {
          problems: [{ path: bad.path, message: 'NUL characters and lone surrogates are not allowed' }],
        },
      );
    }
    if (bad) {
      const message = 'a number beyond the range of a double (it would be stored as null)';
      throw new AppError(400, 'validation_failed', `${bad.path}: ${message}`, {
        problems: [{ path: bad.path, message }],
      });
    }
    const m = parseInput(messageSchema, raw, `messages[${i}]`, ['messages', i]);
    const text = flattenText(m.content);
    const contentBytes =
      typeof m.content === 'string'
        ? utf8(m.content)
        : Array.isArray(m.content)
          ? utf8(JSON.stringify(m.content))
          : 0;
    if (contentBytes > MAX_CONTENT_BYTES) {
      throw new AppError(413, 'message_too_large', `messages[${i}].content exceeds 1 MiB of UTF-8`, {
        index: i,
        path: `messages[${i}].content`,
        bytes: contentBytes,
        limit: MAX_CONTENT_BYTES,
      });
    }
    if (m.metadata && utf8(JSON.stringify(m.metadata)) > MAX_METADATA_BYTES) throw metadataTooLarge(i);
    if (m.id !== undefined) {
      const prev = seen.get(m.id);
      if (prev !== undefined) {
        throw new AppError(
          400,
          'duplicate_id',
          `messages[${i}].id repeats messages[${prev}].id in this request`,
          {
            problems: [{ path: `messages[${i}].id`, message: `same id as messages[${prev}]` }],
          },
        );
      }
      seen.set(m.id, i);
    }
    let sentNs = receivedNs;
    if (m.sent_at !== undefined) {
      const parsed = parseSentAt(m.sent_at, timeZone);
      if (typeof parsed === 'string') {
        throw new AppError(400, 'validation_failed', `messages[${i}].sent_at: ${parsed}`, {
          problems: [{ path: `messages[${i}].sent_at`, message: parsed }],
        });
      }
      sentNs = parsed;
    }
    const stored = {
      role: m.role,
      content: m.content ?? null,
      name: m.name,
      tool_call_id: m.tool_call_id,
      tool_calls: m.tool_calls,
      metadata: m.metadata,
    };
    out.push({
      id: m.id ?? randomUUID(),
      cid: m.id !== undefined,
      role: m.role,
      content: text,
      parts: Array.isArray(m.content) ? m.content : null,
      name: m.name ?? null,
      tool_call_id: m.tool_call_id ?? null,
      tool_calls: m.tool_calls ?? null,
      metadata: m.metadata ?? null,
      sent_at_ns: sentNs.toString(),
      sent_at_given: m.sent_at !== undefined,
      bytes: utf8(JSON.stringify(stored)),
      fp: createHash('sha256').update(stableStringify(stored)).digest('base64url').slice(0, 32),
    });
  });
  return out;
}
