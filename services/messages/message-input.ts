import { createHash, randomUUID } from 'node:crypto';
import { z } from 'zod';
import { AppError } from '../errors.js';
import { nowNs, parseSentAt } from '../time.js';
import { fieldPath, parseInput } from '../validate.js';

export const MAX_MESSAGES_PER_REQUEST = 1000;
export const MAX_CONTENT_BYTES = 1024 * 1024;
export const MAX_METADATA_BYTES = 16 * 1024;

export const SESSION_ID_RE = /^[A-Za-z0-9._:@-]{1,256}$/;

export function assertSessionId(sid: string): string {
  if (!SESSION_ID_RE.test(sid) || sid === '.' || sid === '..') {
    throw new AppError(
      400,
      'invalid_session_id',
      'session id must be 1-256 characters of A-Z a-z 0-9 . _ : @ - (and not "." or "..")',
      { path: 'sid' },
    );
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

export const messageSchema = z
  .object({
    id: z.string().min(1).max(128).optional(),
    role: z.enum(['user', 'assistant', 'system', 'developer', 'tool']),
    content: z.union([z.string(), z.null(), z.array(part).min(1)]).optional(),
    name: z.string().min(1).max(256).optional(),
    tool_call_id: z.string().min(1).max(256).optional(),
    tool_calls: z.array(toolCall).min(1).max(128).optional(),
    sent_at: z
      .string({ error: 'must be a string: RFC 3339, unix ns as a decimal string, or YYYY-MM-DD HH:MM:SS' })
      .optional(),
    // Checked, not copied: a copy made by assignment would drop an own `__proto__` key.
    metadata: z
      .custom<Record<string, unknown>>((v) => typeof v === 'object' && v !== null && !Array.isArray(v), {
        message: 'must be a JSON object',
      })
      .meta({ type: 'object', description: 'free-form JSON object, at most 16 KiB' })
      .optional(),
  })
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

// NUL cannot be stored by Postgres (text or jsonb); a lone surrogate is not valid UTF-8.
// eslint-disable-next-line no-control-regex
const BAD_CHARS = /\u0000|[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;
/** True for text Postgres cannot store (NUL) or that is not valid UTF-8 (a lone surrogate). */
export const hasBadChars = (s: string) => BAD_CHARS.test(s);

/** Nesting allowed in a message (its free-form `metadata`, and anything rejected after the walk). */
export const MAX_JSON_DEPTH = 64;

/**
 * The path of the first value nested deeper than MAX_JSON_DEPTH below `v`, or null. Iterative, so
 * that a body of 100,000 nested arrays is a 400 here rather than a stack overflow in a recursive
 * walk (findBadValue, stableStringify, JSON.stringify) after it.
 */
function tooDeep(v: unknown, path: (string | number)[]): string | null {
  interface Node {
    x: object;
    key: string | number;
    up: Node | null;
    depth: number;
  }
  if (!v || typeof v !== 'object') return null;
  const stack: Node[] = [{ x: v, key: '', up: null, depth: 0 }];
  while (stack.length > 0) {
    const n = stack.pop()!;
    if (n.depth >= MAX_JSON_DEPTH) {
      const keys: (string | number)[] = [];
      for (let at: Node | null = n; at?.up; at = at.up) keys.unshift(at.key);
      return fieldPath([...path, ...keys]);
    }
    const entries: Array<[string | number, unknown]> = Array.isArray(n.x)
      ? n.x.map((y, i) => [i, y])
      : Object.entries(n.x);
    for (const [key, y] of entries) {
      if (y && typeof y === 'object') stack.push({ x: y, key, up: n, depth: n.depth + 1 });
    }
  }
  return null;
}

interface BadValue {
  path: string;
  kind: 'chars' | 'number';
}

/**
 * The first string (or key) with a NUL or a lone surrogate, or the first number JSON.parse could
 * not hold (`1e400` reads as Infinity, which would be stored as null).
 */
function findBadValue(v: unknown, path: (string | number)[]): BadValue | null {
  if (typeof v === 'string') return BAD_CHARS.test(v) ? { path: fieldPath(path), kind: 'chars' } : null;
  if (typeof v === 'number') return Number.isFinite(v) ? null : { path: fieldPath(path), kind: 'number' };
  if (Array.isArray(v)) {
    for (let i = 0; i < v.length; i++) {
      const r = findBadValue(v[i], [...path, i]);
      if (r) return r;
    }
  } else if (v && typeof v === 'object') {
    for (const [k, x] of Object.entries(v)) {
      if (BAD_CHARS.test(k)) return { path: fieldPath([...path, k]), kind: 'chars' };
      const r = findBadValue(x, [...path, k]);
      if (r) return r;
    }
  }
  return null;
}

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
    const deep = tooDeep(raw, ['messages', i]);
    if (deep) {
      const message = `nested more than ${MAX_JSON_DEPTH} levels deep`;
      throw new AppError(400, 'validation_failed', `${deep}: ${message}`, {
        problems: [{ path: deep, message }],
      });
    }
    const bad = findBadValue(raw, ['messages', i]);
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
    if (m.metadata && utf8(JSON.stringify(m.metadata)) > MAX_METADATA_BYTES) {
      throw new AppError(
        400,
        'validation_failed',
        `messages[${i}].metadata: must be at most 16 KiB of JSON`,
        {
          problems: [{ path: `messages[${i}].metadata`, message: 'must be at most 16 KiB of JSON' }],
        },
      );
    }
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
