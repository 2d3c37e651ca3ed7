import { pipeline } from 'node:stream';
import type { Transform } from 'node:stream';
import { setImmediate as nextTurn } from 'node:timers/promises';
import { createBrotliDecompress, createGunzip, createInflate } from 'node:zlib';
import { z } from 'zod';
import { AppError } from '../errors.js';
import { MAX_BODY_DEPTH, jsonNestedDeeperThan } from '../json-depth.js';
import { parseMessages } from '../messages/message-input.js';
import type { AcceptedMessage } from '../messages/message-input.js';
import { summarySchema } from '../summary/summary-shape.js';
import type { Summary } from '../summary/summary-shape.js';
import { parseSentAt } from '../time.js';
import { parseInput } from '../validate.js';

/**
 * What an import carries (SPEC §4 import, §5 `import jsonl`), parsed and validated exactly like
 * POST /messages (the same `parseMessages`), with error paths naming the line (`lines[12].role`)
 * or the array index (`messages[3].role`).
 */

export const MAX_IMPORT_BYTES = 64 * 1024 * 1024;
/**
 * One line is one message (or the summary): at most what one POST body may hold. A single line of
 * 64 MiB of nested arrays took JSON.parse 4 GB of heap and minutes of the event loop.
 */
export const MAX_IMPORT_LINE_BYTES = 8 * 1024 * 1024;
export const MAX_IMPORT_MESSAGES = 200_000;

/**
 * How much of an import runs between two turns of the event loop: SLICE_LINES lines, or fewer when
 * they pass SLICE_BYTES. A buffered body reaches the import through promises alone, which never let
 * another request in: a 60,000-line import stalled every tenant's requests for seconds, and 60 MiB
 * of blank lines held the API for 29 s.
 */
const SLICE_LINES = 100;
const SLICE_BYTES = 1024 * 1024;

/** Where the imported summary's cursor falls among the imported messages. */
export type ImportCursor =
  | { kind: 'none' }
  /** The `seq` of the exported session (message lines carry their old `seq`). */
  | { kind: 'source_seq'; seq: number }
  /** A time: messages sent at or before it are covered (to the second when `wholeSeconds`). */
  | { kind: 'sent_at'; ns: bigint; wholeSeconds: boolean };

export interface ImportMessage {
  message: AcceptedMessage;
  sourceSeq: number | null;
}

export interface ImportInput {
  messages: ImportMessage[];
  summary: { summary: Summary; cursor: ImportCursor } | null;
}

const seqField = z.number().int().min(0).max(Number.MAX_SAFE_INTEGER);
const summaryLine = z
  .object({
    type: z.literal('summary'),
    summary: z.record(z.string(), z.unknown()),
    cursor_seq: seqField.nullable().optional(),
    // Written by export, informational on import.
    version: z.number().int().optional(),
    status: z.string().optional(),
    updated_at: z.string().optional(),
  })
  .strict();
const messageExtras = z
  .object({
    type: z.literal('message').optional(),
    seq: seqField.optional(),
    sent_at_ns: z
      .string()
      .regex(/^\d{1,19}$/, 'must be unix nanoseconds as a decimal string')
      .optional(),
  })
  .passthrough();

const tooManyMessages = () =>
  new AppError(413, 'import_too_large', `an import holds at most ${MAX_IMPORT_MESSAGES} messages`, {
    limit: MAX_IMPORT_MESSAGES,
  });

/**
 * Validates raw messages (at most MAX_MESSAGES_PER_REQUEST), the first of them the import's
 * `offset`-th, and appends them to `out`; error paths are relabelled.
 */
function validateImportChunk(
  out: ImportMessage[],
  chunk: unknown[],
  sourceSeqs: Array<number | null>,
  offset: number,
  label: (index: number) => string,
  timeZone: string,
  line?: (index: number) => number,
): void {
  let parsed: AcceptedMessage[];
  try {
    parsed = parseMessages({ messages: chunk }, timeZone);
  } catch (err) {
    throw relabel(err, offset, label, line);
  }
  parsed.forEach((m, i) => out.push({ message: m, sourceSeq: sourceSeqs[i] ?? null }));
}

/**
 * Validates collected raw messages a slice at a time and relabels error paths. One 8 MiB body of
 * 200,000 small messages held the event loop for 3.5 s in one go.
 */
export async function validateImportMessages(
  raw: unknown[],
  sourceSeqs: Array<number | null>,
  label: (index: number) => string,
  timeZone: string,
): Promise<ImportMessage[]> {
  if (raw.length > MAX_IMPORT_MESSAGES) throw tooManyMessages();
  const out: ImportMessage[] = [];
  for (let offset = 0; offset < raw.length; offset += SLICE_LINES) {
    if (offset > 0) await nextTurn();
    const end = offset + SLICE_LINES;
    validateImportChunk(out, raw.slice(offset, end), sourceSeqs.slice(offset, end), offset, label, timeZone);
  }
  return checkImportIds(out, label);
}

/** Throws on a client id given twice in one import. */
function checkImportIds(out: ImportMessage[], label: (index: number) => string): ImportMessage[] {
  const seen = new Map<string, number>();
  out.forEach((m, i) => {
    if (!m.message.cid) return;
    const prev = seen.get(m.message.id);
    if (prev !== undefined) {
      throw new AppError(400, 'duplicate_id', `${label(i)}.id repeats ${label(prev)}.id`, {
        problems: [{ path: `${label(i)}.id`, message: `same id as ${label(prev)}` }],
      });
    }
    seen.set(m.message.id, i);
  });
  return out;
}

function relabel(
  err: unknown,
  offset: number,
  label: (index: number) => string,
  line?: (index: number) => number,
): unknown {
  if (!(err instanceof AppError)) return err;
  const fix = (s: string) => s.replace(/messages\[(\d+)\]/g, (_m, n: string) => label(offset + Number(n)));
  let details = err.details;
  if (details !== undefined) {
    details = JSON.parse(fix(JSON.stringify(details))) as unknown;
    if (details && typeof details === 'object' && 'index' in details && typeof details.index === 'number') {
      const d = details as { index: number; line?: number };
      d.index += offset;
      // JSON Lines: `index` counts the message lines from 0, the path names the line (from 1, a
      // summary line counted): the line number too, so that a client need not tell them apart.
      if (line) d.line = line(d.index);
    }
  }
  return new AppError(err.status, err.code, fix(err.message), details, err.headers);
}

/** `{"messages":[...]}` (application/json): the POST /messages body, any number of messages. */
export async function parseImportJson(body: unknown, timeZone: string): Promise<ImportInput> {
  // No body is `{}` (and a 400 naming `messages`); a JSON `null` is not an object either.
  const { messages } = parseInput(
    z.object({ messages: z.array(z.unknown()).min(1) }).strict(),
    body === undefined ? {} : body,
  );
  return {
    messages: await validateImportMessages(
      messages,
      messages.map(() => null),
      (i) => `messages[${i}]`,
      timeZone,
    ),
    summary: null,
  };
}

/**
 * JSON Lines: message lines (`type` "message" or absent) and at most one summary line. Messages
 * are validated as they come, a slice at a time (SLICE_LINES, or the lines of SLICE_BYTES), and
 * only their validated form is kept: holding every parsed line until the end let 7 concurrent
 * imports of 9 lines of 7 MiB of nested arrays (within every limit) exhaust the heap before the
 * first line was refused.
 */
export async function parseImportLines(
  lines: AsyncIterable<{ line: number; value: unknown; bytes?: number }>,
  timeZone: string,
): Promise<ImportInput> {
  const out: ImportMessage[] = [];
  let raw: unknown[] = [];
  let seqs: Array<number | null> = [];
  let rawBytes = 0;
  const lineOf: number[] = [];
  const label = (i: number) => `lines[${lineOf[i] ?? i + 1}]`;
  const validate = () => {
    validateImportChunk(out, raw, seqs, out.length, label, timeZone, (i) => lineOf[i] ?? i + 1);
    raw = [];
    seqs = [];
    rawBytes = 0;
  };
  let summary: ImportInput['summary'] = null;
  for await (const { line, value, bytes } of lines) {
    const at = `lines[${line}]`;
    if (!value || typeof value !== 'object' || Array.isArray(value)) {
      throw new AppError(400, 'validation_failed', `${at}: must be a JSON object`, {
        problems: [{ path: at, message: 'must be a JSON object' }],
      });
    }
    if ((value as { type?: unknown }).type === 'summary') {
      if (summary) {
        throw new AppError(400, 'validation_failed', `${at}: only one summary line is allowed`, {
          problems: [{ path: at, message: 'only one summary line is allowed' }],
        });
      }
      const s = parseInput(summaryLine, value, at, [`lines[${line}]`]);
      const shaped = parseInput(summarySchema, s.summary, `${at}.summary`, [`lines[${line}]`, 'summary']);
      summary = {
        summary: shaped,
        cursor:
          s.cursor_seq === undefined || s.cursor_seq === null
            ? { kind: 'none' }
            : { kind: 'source_seq', seq: s.cursor_seq },
      };
      continue;
    }
    const extras = parseInput(messageExtras, value, at, [`lines[${line}]`]);
    const { type: _type, seq, sent_at_ns, ...message } = extras;
    // sent_at_ns is exact; sent_at (RFC 3339 with ns) says the same thing in an export. A line
    // whose two disagree (one of them edited) is refused rather than one silently winning; a
    // malformed sent_at is left for the message validation to report.
    if (sent_at_ns !== undefined) {
      const given = (message as { sent_at?: unknown }).sent_at;
      const ns = typeof given === 'string' ? parseSentAt(given, timeZone) : undefined;
      if (typeof ns === 'bigint' && ns !== BigInt(sent_at_ns)) {
        const problem = `names another instant than sent_at_ns (${sent_at_ns})`;
        throw new AppError(400, 'validation_failed', `${at}.sent_at: ${problem}`, {
          problems: [{ path: `${at}.sent_at`, message: problem }],
        });
      }
      if (given === undefined || typeof ns === 'bigint')
        (message as Record<string, unknown>).sent_at = sent_at_ns;
    }
    if (out.length + raw.length >= MAX_IMPORT_MESSAGES) throw tooManyMessages();
    raw.push(message);
    seqs.push(seq ?? null);
    lineOf.push(line);
    rawBytes += bytes ?? 0;
    if (raw.length >= SLICE_LINES || rawBytes >= SLICE_BYTES) {
      validate();
      await nextTurn();
    }
  }
  if (raw.length > 0) validate();
  return { messages: checkImportIds(out, label), summary };
}

/**
 * The request's bytes, as the client sends them. A client that goes away mid-body makes the stream
 * fail with ECONNRESET, which the error handler would read as Postgres being down: it is the
 * client's doing, a 400 (that nobody receives) logged as such.
 */
export async function* clientBody(req: AsyncIterable<Buffer>): AsyncGenerator<Buffer> {
  try {
    for await (const chunk of req) yield chunk;
  } catch {
    throw new AppError(400, 'request_aborted', 'request aborted by the client');
  }
}

const DECODERS: Record<string, () => Transform> = {
  gzip: createGunzip,
  'x-gzip': createGunzip,
  deflate: createInflate,
  br: createBrotliDecompress,
};

/**
 * A `Content-Encoding` header's coding, lower-cased: `identity` when absent or empty (as
 * body-parser read it; an empty header was a 415 `unsupported_encoding`).
 */
export const contentCoding = (header: string | undefined): string =>
  (header ?? '').trim().toLowerCase() || 'identity';

/**
 * The body with its `Content-Encoding` (identity, gzip, deflate or br; any case) undone, a chunk at a
 * time: the import's limits are then counted on the decoded bytes, so a small body that inflates
 * past them is refused (413) as soon as it has, its memory flat.
 */
export function decodedBody(
  source: AsyncIterable<Buffer>,
  contentEncoding: string | undefined,
): AsyncIterable<Buffer> {
  const coding = contentCoding(contentEncoding);
  if (coding === 'identity') return source;
  const decoder = DECODERS[coding];
  if (!decoder) {
    throw new AppError(
      415,
      'unsupported_encoding',
      `content-encoding ${contentEncoding} is not supported: send identity, gzip, deflate or br`,
    );
  }
  return decoded(source, decoder(), coding);
}

async function* decoded(
  source: AsyncIterable<Buffer>,
  decoder: Transform,
  coding: string,
): AsyncGenerator<Buffer> {
  // Its failures (the client's, the decoder's) reach the loop below through the decoder.
  let fed = 0;
  const counted = (async function* () {
    for await (const chunk of source) {
      fed += chunk.length;
      yield chunk;
    }
  })();
  const piped = new Promise<Error | null>((resolve) =>
    pipeline(counted, decoder, (err) => resolve(err ?? null)),
  );
  try {
    for await (const chunk of decoder) yield chunk as Buffer;
    // A deflate or br stream ends where its data says, and zlib drops what follows: a body of two
    // streams (or one and some garbage) imported its first part only and answered 201.
    const failed = await piped;
    if (failed || fed > (decoder as unknown as { bytesWritten: number }).bytesWritten) {
      throw new AppError(400, 'malformed_body', `the body has data after the end of its ${coding} data`);
    }
  } catch (err) {
    if (err instanceof AppError) throw err;
    throw new AppError(400, 'malformed_body', `the body is not valid ${coding} data`);
  } finally {
    decoder.destroy();
  }
}

/**
 * Splits a byte stream into JSON values, one per non-blank line, without holding more than one
 * line as text. UTF-8 is checked per line; the total size is capped (413 past `limitBytes`), and
 * so is each line (413 past MAX_IMPORT_LINE_BYTES), before it is parsed.
 */
export async function* readJsonLines(
  source: AsyncIterable<Buffer | string>,
  limitBytes = MAX_IMPORT_BYTES,
): AsyncGenerator<{ line: number; value: unknown; bytes: number }> {
  const decoder = new TextDecoder('utf-8', { fatal: true });
  let pending: Buffer[] = [];
  let pendingBytes = 0;
  let total = 0;
  let line = 0;
  // Blank lines too: they are never handed out, so the consumer's turns do not cover them.
  let sliceLines = 0;
  let sliceBytes = 0;
  const lineTooLong = () =>
    new AppError(413, 'line_too_large', `line ${line + 1} exceeds ${MAX_IMPORT_LINE_BYTES} bytes`, {
      line: line + 1,
      limit: MAX_IMPORT_LINE_BYTES,
    });
  const emit = (bytes: Buffer): { line: number; value: unknown; bytes: number } | null => {
    line++;
    let text: string;
    try {
      text = decoder.decode(bytes);
    } catch {
      throw new AppError(400, 'invalid_utf8', `line ${line} is not valid UTF-8`, { line });
    }
    text = text.replace(/^\uFEFF/, '').trim();
    if (text === '') return null;
    // As for a JSON body (services/json-depth.ts): a line of 8 MiB of nested arrays held the event
    // loop for seconds in JSON.parse, only for the validation after it to refuse the line.
    if (jsonNestedDeeperThan(bytes, MAX_BODY_DEPTH))
      throw new AppError(
        400,
        'body_too_deep',
        `line ${line} is nested more than ${MAX_BODY_DEPTH} levels deep (objects and arrays)`,
        { line, limit: MAX_BODY_DEPTH },
      );
    try {
      return { line, value: JSON.parse(text) as unknown, bytes: bytes.length };
    } catch {
      throw new AppError(400, 'malformed_json', `line ${line} is not valid JSON`, { line });
    }
  };
  for await (const chunk of source) {
    const buf = typeof chunk === 'string' ? Buffer.from(chunk, 'utf8') : chunk;
    total += buf.length;
    if (total > limitBytes) {
      throw new AppError(413, 'body_too_large', `the import exceeds ${limitBytes} bytes`, {
        limit: limitBytes,
      });
    }
    let start = 0;
    for (let nl = buf.indexOf(10, start); nl !== -1; nl = buf.indexOf(10, start)) {
      const part = buf.subarray(start, nl);
      if (pendingBytes + part.length > MAX_IMPORT_LINE_BYTES) throw lineTooLong();
      const whole = pending.length > 0 ? Buffer.concat([...pending, part]) : part;
      pending = [];
      pendingBytes = 0;
      const v = emit(whole);
      if (v) yield v;
      start = nl + 1;
      sliceBytes += whole.length;
      if (++sliceLines >= SLICE_LINES || sliceBytes >= SLICE_BYTES) {
        sliceLines = 0;
        sliceBytes = 0;
        await nextTurn();
      }
    }
    if (start < buf.length) {
      pending.push(buf.subarray(start));
      pendingBytes += buf.length - start;
      if (pendingBytes > MAX_IMPORT_LINE_BYTES) throw lineTooLong();
    }
  }
  if (pending.length > 0) {
    const v = emit(Buffer.concat(pending));
    if (v) yield v;
  }
}
