import { existsSync } from 'node:fs';
import { readdir, stat } from 'node:fs/promises';
import path from 'node:path';
import { AppError } from '../errors.js';
import { assertSessionId, parseMessages } from '../messages/message-input.js';
import type { AcceptedMessage } from '../messages/message-input.js';
import { summarySchema } from '../summary/summary-shape.js';
import { nowNs, parseSentAt } from '../time.js';
import { parseCursorValue, splitTimeHeader } from './agenvoy-time.js';
import type { SplitHeader } from './agenvoy-time.js';
import { badUtf8At, readJson, readText } from './agenvoy-files.js';
import { NEAR_NS, lineUpZone, localInstants, matchArchive, nearest } from './agenvoy-match.js';
import type { ImportCursor, ImportInput, ImportMessage } from './import-input.js';
import type { SqliteDb } from './sqlite.js';

/**
 * Reads Agenvoy's per-session files (SPEC §5 `import agenvoy`): `<sessions>/<sid>/history.json`
 * (OpenAI-style messages; user turns may start with a `當前時間:`/`sendAt:` header in local time;
 * other roles' text is kept as written),
 * `summary.json`, the summary cursor from `.summary_cursor` (local `YYYY-MM-DD HH:MM:SS` or unix
 * time) or the older `summary.meta.json`, and the archive `.store/history.db` (SQLite table
 * `messages(session_id, send_at unix ns, role, content)`) beside or inside the sessions directory,
 * which still holds what compaction trimmed from history.json.
 */

export interface AgenvoySessionRead {
  sessionId: string;
  input: ImportInput;
  stats: { fromJson: number; fromDb: number; duplicates: number; skipped: number };
  notes: string[];
}

const SECOND_NS = 1_000_000_000n;
const ROLES = new Set(['user', 'assistant', 'system', 'developer', 'tool']);
/** Skip notes printed per session; the rest are counted. */
const MAX_SKIP_NOTES = 10;
/** The function name of the tool call put before a compacted tool result (Agenvoy keeps no call). */
export const SYNTHESISED_TOOL = 'agenvoy_tool';

interface Draft {
  raw: Record<string, unknown>;
  role: string;
  text: string;
  /** history.json: the header's local time, read in the session's zone into `own`. */
  naive: string | null;
  /** Its own time (a header, a history.db `send_at`); null when it has none (send_at 0). */
  own: bigint | null;
  /** `own`, or for a message without one an estimate (see fillTimes). */
  ns: bigint | null;
  source: 'json' | 'db';
  /** Where it came from, for notes: `history.json[3]`, `history.db row 17`. */
  at: string;
  rowid?: string;
}

function flatten(content: unknown): string {
  if (typeof content === 'string') return content;
  if (Array.isArray(content)) {
    return content
      .filter(
        (p): p is { type: 'text'; text: string } => !!p && p.type === 'text' && typeof p.text === 'string',
      )
      .map((p) => p.text)
      .join('\n');
  }
  return '';
}

/**
 * A history.json message's content as mnemos stores it. Only a user message's header is read and
 * stripped (Agenvoy stamps the user's input; a tool result or reply that starts with such lines
 * is kept as written). Parts other than text and image_url are dropped and named in `dropped`.
 *
 * In a content array the header is in the first non-empty text part, whatever parts come before
 * it (an image, audio): history.db holds the non-empty text parts joined by newlines, header
 * first. A text part the header fills entirely is dropped, so the stored content flattens to the
 * text history.db holds with its header stripped (`[header, "and this one?"]` → "and this one?",
 * not "\nand this one?").
 */
function normaliseContent(
  content: unknown,
  isUser: boolean,
): { content: unknown; header: SplitHeader | null; dropped: string[] } {
  const dropped: string[] = [];
  if (typeof content === 'string') {
    if (!isUser) return { content, header: null, dropped };
    const h = splitTimeHeader(content);
    return { content: h.text, header: h.time ? h : null, dropped };
  }
  if (Array.isArray(content)) {
    let header: SplitHeader | null = null;
    let firstText = true;
    /** The header filled its text part: a message of nothing else is "" (as a header-only string). */
    let emptied = false;
    const parts = content
      .filter((p): p is Record<string, unknown> => {
        if (p && typeof p === 'object' && !Array.isArray(p)) return true;
        dropped.push(p === null ? 'null' : Array.isArray(p) ? 'array' : typeof p);
        return false;
      })
      .map((p) => {
        if (p.type === 'text' && typeof p.text === 'string') {
          if (isUser && firstText && p.text !== '') {
            firstText = false;
            const h = splitTimeHeader(p.text);
            if (h.time) {
              header = h;
              if (h.text === '') {
                emptied = true;
                return null;
              }
            }
            return { type: 'text', text: h.text };
          }
          return { type: 'text', text: p.text };
        }
        if (p.type === 'image_url' && p.image_url && typeof p.image_url === 'object') {
          const img = p.image_url as { url?: unknown; detail?: unknown };
          const detail =
            img.detail === 'auto' || img.detail === 'low' || img.detail === 'high' ? img.detail : undefined;
          return { type: 'image_url', image_url: { url: img.url, ...(detail ? { detail } : {}) } };
        }
        const type = typeof p.type === 'string' && p.type ? p.type : 'untyped';
        dropped.push(type === 'text' || type === 'image_url' ? `malformed ${type}` : type);
        return null;
      })
      .filter((p) => p !== null);
    return { content: parts.length > 0 ? parts : emptied ? '' : null, header, dropped };
  }
  return { content: content ?? null, header: null, dropped };
}

function normaliseToolCalls(calls: unknown): unknown[] | undefined {
  if (!Array.isArray(calls) || calls.length === 0) return undefined;
  return calls.map(
    (c: { id?: unknown; type?: unknown; function?: { name?: unknown; arguments?: unknown } }) => ({
      id: c?.id,
      type: 'function',
      function: {
        name: c?.function?.name,
        arguments:
          typeof c?.function?.arguments === 'string'
            ? c.function.arguments
            : JSON.stringify(c?.function?.arguments ?? {}),
      },
    }),
  );
}

function toNs(time: string | null, timeZone: string): bigint | null {
  if (!time) return null;
  const ns = parseSentAt(time, timeZone);
  return typeof ns === 'string' ? null : ns;
}

/** Untimed messages follow the previous one by 1 ns (as Agenvoy stamps them); leading ones precede the first. */
function fillTimes(drafts: Draft[], fallbackEnd: bigint): void {
  let prev: bigint | null = null;
  for (const d of drafts) {
    d.ns = d.own ?? (prev === null ? null : prev + 1n);
    if (d.ns !== null) prev = d.ns;
  }
  const firstKnown = drafts.findIndex((d) => d.ns !== null);
  // With no time at all, the last message gets `fallbackEnd` (the file's mtime).
  const anchor = firstKnown === -1 ? fallbackEnd + 1n : drafts[firstKnown]!.ns!;
  const lead = firstKnown === -1 ? drafts.length : firstKnown;
  for (let i = 0; i < lead; i++) drafts[i]!.ns = anchor - BigInt(lead - i);
}

async function mtimeNs(file: string): Promise<bigint> {
  try {
    return BigInt(Math.floor((await stat(file)).mtimeMs)) * 1_000_000n;
  } catch {
    return nowNs();
  }
}

/** Finds the archive database: `<sessions>/../.store/history.db`, else `<sessions>/.store/history.db`. */
export function findHistoryDb(sessionsDir: string): string | null {
  for (const p of [
    path.join(sessionsDir, '..', '.store', 'history.db'),
    path.join(sessionsDir, '.store', 'history.db'),
  ]) {
    if (existsSync(p)) return p;
  }
  return null;
}

function dbRows(db: SqliteDb, sessionId: string): Array<Record<string, unknown>> {
  return db
    .prepare(
      'SELECT rowid AS _rowid, typeof(send_at) AS _send_at_type, * FROM messages WHERE session_id = ? ORDER BY rowid',
    )
    .safeIntegers(true)
    .all(sessionId) as Array<Record<string, unknown>>;
}

/** SQLite stores TEXT unchecked; better-sqlite3 would hand over bytes that are not UTF-8 replaced. */
function textIsIntact(db: SqliteDb, rowid: unknown): boolean {
  const row = db.prepare('SELECT CAST(content AS BLOB) AS b FROM messages WHERE rowid = ?').get(rowid) as
    { b: Uint8Array } | undefined;
  return !row || badUtf8At(row.b) < 0;
}

/** A history.db row's `send_at` (unix ns): null when Agenvoy did not know it (0, NULL) or it is no number. */
function sendAtOf(r: Record<string, unknown>): bigint | null | 'unreadable' {
  const v = r.send_at;
  let ns: bigint;
  if (typeof v === 'bigint') ns = v;
  else if (typeof v === 'number' && Number.isFinite(v)) ns = BigInt(Math.trunc(v));
  else if (typeof v === 'string' && /^\s*\d+\s*$/.test(v)) ns = BigInt(v.trim());
  else if (v === null || v === undefined) return null;
  else return 'unreadable';
  return ns > 0n ? ns : null;
}

export async function readAgenvoySession(
  dir: string,
  sessionId: string,
  db: SqliteDb | null,
  givenZone: string,
): Promise<AgenvoySessionRead> {
  const notes: string[] = [];
  let skipped = 0;
  let unnoted = 0;
  const skip = (at: string, why: string) => {
    skipped++;
    if (skipped - unnoted <= MAX_SKIP_NOTES) notes.push(`skipped ${at}: ${why}`);
    else unnoted++;
  };
  const historyFile = path.join(dir, 'history.json');
  const history = (await readJson(historyFile)) ?? [];
  if (!Array.isArray(history)) throw new AppError(400, 'invalid_file', 'history.json is not an array');

  const json: Draft[] = [];
  /** Messages that lost content parts mnemos does not store (the first MAX_SKIP_NOTES are named). */
  let partNotes = 0;
  for (const [index, m] of (history as Array<Record<string, unknown>>).entries()) {
    const at = `history.json[${index}]`;
    if (!m || typeof m !== 'object' || Array.isArray(m)) {
      skip(at, 'not a message object');
      continue;
    }
    if (typeof m.role !== 'string' || !ROLES.has(m.role)) {
      skip(at, `role ${JSON.stringify(m.role ?? null)} is none of ${[...ROLES].join(', ')}`);
      continue;
    }
    const { content, header, dropped } = normaliseContent(m.content, m.role === 'user');
    const raw: Record<string, unknown> = { role: m.role, content };
    const calls = normaliseToolCalls(m.tool_calls);
    if (calls) raw.tool_calls = calls;
    if (dropped.length > 0) {
      const types = [...new Set(dropped)].join(', ');
      if (content === null && !(m.role === 'assistant' && calls)) {
        skip(
          `${at} (${m.role})`,
          `its only content part(s) are unsupported (${types}): mnemos keeps text and image_url parts`,
        );
        continue;
      }
      partNotes++;
      if (partNotes <= MAX_SKIP_NOTES)
        notes.push(`${at}: dropped ${dropped.length} unsupported part(s) (${types})`);
    }
    if (typeof m.tool_call_id === 'string' && m.tool_call_id) raw.tool_call_id = m.tool_call_id;
    if (typeof m.name === 'string' && m.name) raw.name = m.name;
    if (header?.workDir) raw.metadata = { work_dir: header.workDir };
    json.push({
      raw,
      role: m.role,
      text: flatten(content),
      naive: header?.time ?? null,
      own: null,
      ns: null,
      source: 'json',
      at,
    });
  }
  if (partNotes > MAX_SKIP_NOTES) {
    notes.push(
      `… and ${partNotes - MAX_SKIP_NOTES} more message(s) of history.json with unsupported parts dropped`,
    );
  }
  const unreadTimes = json.filter((d) => d.naive && toNs(d.naive, givenZone) === null).map((d) => d.naive!);
  if (unreadTimes.length > 0) {
    notes.push(
      `${unreadTimes.length} time header(s) could not be read (${unreadTimes
        .slice(0, 3)
        .map((t) => JSON.stringify(t))
        .join(', ')}${unreadTimes.length > 3 ? ', …' : ''}): those messages follow the previous one`,
    );
  }

  const archived: Draft[] = [];
  let untimedTexts = 0;
  if (db) {
    for (const r of dbRows(db, sessionId)) {
      const at = `history.db row ${String(r._rowid)}`;
      const role = String(r.role ?? '');
      if (typeof r.content !== 'string') {
        skip(at, `content is ${r.content === null ? 'NULL' : 'not text (a BLOB)'}`);
        continue;
      }
      if (r.content.trim() === '') continue;
      if (!ROLES.has(role)) {
        skip(at, `role ${JSON.stringify(role)} is none of ${[...ROLES].join(', ')}`);
        continue;
      }
      if (r.content.includes('\uFFFD') && !textIsIntact(db, r._rowid)) {
        skip(at, 'content is not valid UTF-8');
        continue;
      }
      const sendAt = sendAtOf(r);
      if (sendAt === 'unreadable') {
        untimedTexts++;
        if (untimedTexts === 1) {
          notes.push(
            `${at}: send_at ${JSON.stringify(String(r.send_at))} (${String(r._send_at_type)}) is not unix nanoseconds: read as untimed, like send_at 0`,
          );
        }
      }
      // Only the user's input carries Agenvoy's header (see normaliseContent).
      const h: SplitHeader =
        role === 'user' ? splitTimeHeader(r.content) : { text: r.content, time: null, workDir: null };
      const raw: Record<string, unknown> = { role, content: h.text };
      const meta: Record<string, unknown> = {};
      if (h.workDir) meta.work_dir = h.workDir;
      if (typeof r.sender === 'string' && r.sender) meta.sender = r.sender;
      if (Object.keys(meta).length > 0) raw.metadata = meta;
      archived.push({
        raw,
        role,
        text: h.text,
        naive: null,
        own: sendAt === 'unreadable' ? null : sendAt,
        ns: null,
        source: 'db',
        at,
        rowid: String(r._rowid),
      });
    }
    if (untimedTexts > 1)
      notes.push(`${untimedTexts} history.db rows in all have a send_at that is no number`);
  }

  const key = (d: Draft) => `${d.role}\u0000${d.text}`;
  const archive = archiveTimes(archived, key);
  const zone = pickZone(json, archive, key, givenZone, notes);
  headerTimes(json, archive, key, zone);
  const fileEnd = await mtimeNs(historyFile);
  fillTimes(json, fileEnd);
  fillTimes(archived, json[0]?.ns ?? nowNs());

  // history.json is validated first: a message that is rejected takes no part in the merge (its
  // copy in history.db, if any, is imported instead).
  const parse = (batch: Array<Record<string, unknown>>, at: string, role: string, ns: bigint) => {
    try {
      return parseMessages({ messages: batch.map((raw) => ({ ...raw, sent_at: String(ns) })) }, zone);
    } catch (err) {
      const why = (err as Error).message.replace(/^messages\[\d+\]\.?/, '') || 'invalid';
      skip(`${at} (${role})`, why);
      return null;
    }
  };
  const accepted: Array<{ d: Draft; messages: AcceptedMessage[] }> = [];
  let synthesisedJson = 0;
  // The calls a tool result may answer: those of the assistant message right before its run.
  let open: Set<string> | null = null;
  for (const [index, d] of json.entries()) {
    const id = typeof d.raw.tool_call_id === 'string' ? d.raw.tool_call_id : null;
    // A tool result whose call is not right before it (compaction trimmed the call, or the call
    // had no id) gets a synthesised call, so it stays valid and sendable.
    const orphan = d.role === 'tool' && (id === null || !open?.delete(id));
    const batch = orphan ? withSynthesisedCall(d, id ?? `agenvoy_json_${index}`, id === null) : [d.raw];
    const messages = parse(batch, d.at, d.role, d.ns!);
    if (d.role !== 'tool') open = null;
    if (!messages) continue;
    if (orphan) synthesisedJson++;
    const calls = messages.at(-1)!.tool_calls as Array<{ id: string }> | null;
    if (d.role === 'assistant' && calls) open = new Set(calls.map((c) => c.id));
    accepted.push({ d, messages });
  }
  const kept = accepted.map((x) => x.d);

  // Merge without duplicates: history.json wins (it keeps structured content).
  const entry = (d: Draft) => ({ key: key(d), ns: d.ns!, timed: d.own !== null });
  const copyOf = matchArchive(archived.map(entry), kept.map(entry));
  const onlyArchived = archived.filter((_d, i) => copyOf[i]! < 0);
  const duplicates = archived.length - onlyArchived.length;
  refineTimes(kept, archived, copyOf);
  fillTimes(json, fileEnd);

  const messages: ImportMessage[] = [];
  let synthesised = 0;
  for (const d of onlyArchived) {
    // Agenvoy archives a tool result without its tool_call_id, and never the assistant message
    // that called it (its content is empty): a call is put before it so that it stays a valid,
    // searchable tool message.
    const calledBy = d.role === 'tool' && !d.raw.tool_call_id;
    const batch = calledBy ? withSynthesisedCall(d, `agenvoy_row_${d.rowid}`, true) : [d.raw];
    const parsed = parse(batch, d.at, d.role, d.ns!);
    if (!parsed) continue;
    for (const m of parsed) messages.push({ message: m, sourceSeq: null });
    if (calledBy) synthesised++;
  }
  for (const { d, messages: batch } of accepted) {
    for (const m of batch) messages.push({ message: { ...m, sent_at_ns: String(d.ns) }, sourceSeq: null });
  }
  if (synthesised > 0) {
    notes.push(
      `${synthesised} tool result(s) of history.db had no tool call (Agenvoy does not archive it): each follows a synthesised assistant call of "${SYNTHESISED_TOOL}"`,
    );
  }
  if (synthesisedJson > 0) {
    notes.push(
      `${synthesisedJson} tool result(s) of history.json had no call right before them (compaction trimmed it, or it had no id): each follows a synthesised assistant call of "${SYNTHESISED_TOOL}"`,
    );
  }
  if (unnoted > 0) notes.push(`… and ${unnoted} more skipped (${skipped} in all)`);

  let summary: ImportInput['summary'] = null;
  // A broken summary costs the summary, not the history (the summary sweep rebuilds one). Text
  // that is not UTF-8 refuses the session, like history.json.
  const rawSummary = await readJson(path.join(dir, 'summary.json')).catch((err: unknown) => {
    if (err instanceof AppError && err.code === 'invalid_utf8') throw err;
    notes.push(`${(err as Error).message}: summary skipped (the summary sweep rebuilds it)`);
    return undefined;
  });
  if (rawSummary && typeof rawSummary === 'object' && Object.keys(rawSummary).length > 0) {
    const shaped = summarySchema.safeParse(rawSummary);
    if (shaped.success) {
      summary = { summary: shaped.data, cursor: await readCursor(dir, zone, notes) };
    } else {
      notes.push('summary.json is not in the current summary shape: skipped (the summary sweep rebuilds it)');
    }
  }
  return {
    sessionId,
    input: { messages, summary },
    stats: { fromJson: kept.length, fromDb: onlyArchived.length, duplicates, skipped },
    notes,
  };
}

/**
 * A tool result and an assistant call of `SYNTHESISED_TOOL` put before it. `id`: the result's own
 * call id, or (`newId`) one derived from where it came from, so a re-import gives the same ids.
 */
function withSynthesisedCall(d: Draft, id: string, newId: boolean): Array<Record<string, unknown>> {
  const metadata = (d.raw.metadata as Record<string, unknown> | undefined) ?? {};
  return [
    {
      role: 'assistant',
      content: null,
      tool_calls: [{ id, type: 'function', function: { name: SYNTHESISED_TOOL, arguments: '{}' } }],
      metadata: { agenvoy_synthesised: 'tool_call' },
    },
    newId
      ? { ...d.raw, tool_call_id: id, metadata: { ...metadata, agenvoy_synthesised: 'tool_call_id' } }
      : d.raw,
  ];
}

/**
 * history.json's headers are whole seconds; a history.db copy may know the time within the second.
 * A header message takes its copy's time when that lies in the header's second and keeps it
 * before the next timed message (and the untimed ones between): messages cut apart by compaction
 * within one second then keep their order across the boundary.
 */
function refineTimes(json: Draft[], archived: Draft[], copyOf: number[]): void {
  const copy = new Map<Draft, bigint>();
  copyOf.forEach((j, a) => {
    const own = archived[a]!.own;
    if (j >= 0 && own !== null) copy.set(json[j]!, own);
  });
  let next: bigint | null = null;
  let between = 0n;
  for (let j = json.length - 1; j >= 0; j--) {
    const d = json[j]!;
    if (d.own === null) {
      between++;
      continue;
    }
    const t = copy.get(d);
    if (
      d.naive &&
      t !== undefined &&
      t > d.own &&
      t < d.own + SECOND_NS &&
      (next === null || t + between < next)
    ) {
      d.own = t;
    }
    next = d.own;
    between = 0n;
  }
}

/** history.db's timed rows' times by role and text, ascending. */
function archiveTimes(archived: Draft[], key: (d: Draft) => string): Map<string, bigint[]> {
  const archive = new Map<string, bigint[]>();
  for (const d of archived) {
    if (d.own === null) continue;
    const list = archive.get(key(d)) ?? [];
    list.push(d.own);
    archive.set(key(d), list);
  }
  for (const list of archive.values()) list.sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
  return archive;
}

/**
 * The zone history.json's naive header times are read in: the given one (`--tz`, else TZ), unless
 * history.db's absolute times show another lines them up better (see lineUpZone). Reading them in
 * a wrong zone would import every message still in history.json twice, and put the summary
 * cursor elsewhere.
 */
function pickZone(
  json: Draft[],
  archive: Map<string, bigint[]>,
  key: (d: Draft) => string,
  given: string,
  notes: string[],
): string {
  const headers = json.filter((d) => d.naive !== null).map((d) => ({ key: key(d), naive: d.naive! }));
  const reading = lineUpZone(headers, archive, given);
  if (!reading) {
    if (headers.length > 0 && archive.size > 0) {
      notes.push(
        `history.json and history.db share no timed message: the zone (${given}) could not be checked against history.db's times; if it is not the zone Agenvoy ran in, pass the right --tz`,
      );
    }
    return given;
  }
  const compared = `of the ${reading.samples} timed message(s) of history.json compared`;
  if (reading.zone !== given) {
    notes.push(
      `WARNING: history.json's times are not ${given} time: read in ${given}, ${reading.givenLined} ${compared} line up with their copies in history.db; read in ${reading.zone}, ${reading.lined} do. Imported them as ${reading.zone} time; pass --tz with the zone Agenvoy ran in to choose another`,
    );
    return reading.zone;
  }
  if (reading.givenLined * 2 >= reading.samples) return given;
  notes.push(
    `WARNING: only ${reading.givenLined} ${compared} line up with a copy of the same text in history.db, in ${given} or any other zone: if ${given} is not the zone Agenvoy ran in, pass the right --tz (messages that do not line up are imported from both files)`,
  );
  return given;
}

/**
 * A header's instant. In a fall-back overlap a naive time names two: the one history.db holds a
 * copy of the text near, else the one that keeps history.json in order after the previous header.
 */
function headerTimes(json: Draft[], archive: Map<string, bigint[]>, key: (d: Draft) => string, zone: string) {
  let prev: bigint | null = null;
  for (const d of json) {
    const both = d.naive ? localInstants(d.naive, zone) : [];
    d.own = both[0] ?? null;
    if (both.length === 2) {
      const [early, late] = both as [bigint, bigint];
      const copies = archive.get(key(d)) ?? [];
      const near = (ns: bigint) => copies.length > 0 && nearest(copies, ns) <= Number(NEAR_NS);
      if (near(late) && !near(early)) d.own = late;
      else if (near(early) === near(late) && prev !== null && early < prev) d.own = late;
    }
    if (d.own !== null) prev = d.own;
  }
}

/**
 * The summary cursor: `.summary_cursor`, else `summary.meta.json`'s `last_message_time`. A file
 * that cannot be read (no time in it, a directory) costs only the cursor, with a note; text that
 * is not UTF-8 refuses the session, like every file. Without a cursor the import sets it to the
 * newest imported message (import-session.ts `mapCursor`).
 */
async function readCursor(dir: string, timeZone: string, notes: string[]): Promise<ImportCursor> {
  const problems: string[] = [];
  const unreadable = (err: unknown) => {
    if (err instanceof AppError && err.code === 'invalid_utf8') throw err;
    problems.push((err as Error).message);
    return undefined;
  };
  let cursor: ImportCursor | null = null;
  let from = '';
  const text = await readText(path.join(dir, '.summary_cursor')).catch(unreadable);
  if (text !== undefined) {
    cursor = parseCursorValue(text, timeZone);
    const shown = text.trim();
    if (!cursor)
      problems.push(
        `.summary_cursor holds no time (${JSON.stringify(shown.slice(0, 40))}${shown.length > 40 ? '…' : ''})`,
      );
  }
  if (!cursor) {
    const meta = (await readJson(path.join(dir, 'summary.meta.json')).catch(unreadable)) as
      { last_message_time?: unknown } | undefined;
    if (meta !== undefined) {
      cursor =
        meta && typeof meta === 'object' && typeof meta.last_message_time === 'string'
          ? parseCursorValue(meta.last_message_time, timeZone)
          : null;
      if (cursor) from = `summary.meta.json's "last_message_time"`;
      else problems.push('summary.meta.json has no readable "last_message_time"');
    }
  }
  const then = from || 'the newest imported message (set by the import)';
  for (const p of problems) notes.push(`${p}: no cursor from it; the cursor is ${then}`);
  return cursor ?? { kind: 'none' };
}

/**
 * Session directories under `sessionsDir` (names that are valid session ids; others are reported).
 * A symlink to a directory is one too (a session moved to another disk and linked back).
 */
export async function listAgenvoySessions(
  sessionsDir: string,
): Promise<{ ids: string[]; invalid: string[] }> {
  const entries = await readdir(sessionsDir, { withFileTypes: true });
  const ids: string[] = [];
  const invalid: string[] = [];
  for (const e of entries) {
    if (e.name.startsWith('.')) continue;
    if (!e.isDirectory()) {
      if (!e.isSymbolicLink()) continue;
      // A dangling link, or one to a file, is no session.
      const target = await stat(path.join(sessionsDir, e.name)).catch(() => null);
      if (!target?.isDirectory()) continue;
    }
    try {
      ids.push(assertSessionId(e.name));
    } catch {
      invalid.push(e.name);
    }
  }
  return { ids: ids.sort(), invalid };
}
