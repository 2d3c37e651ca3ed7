import { existsSync } from 'node:fs';
import { readdir, readFile, stat } from 'node:fs/promises';
import path from 'node:path';
import { AppError } from '../errors.js';
import { assertSessionId, parseMessages } from '../messages/message-input.js';
import { summarySchema } from '../summary/summary-shape.js';
import { nowNs, parseSentAt } from '../time.js';
import { parseCursorValue, splitTimeHeader } from './agenvoy-time.js';
import type { SplitHeader } from './agenvoy-time.js';
import type { ImportCursor, ImportInput, ImportMessage } from './import-input.js';
import type { SqliteDb } from './sqlite.js';

/**
 * Reads Agenvoy's per-session files (SPEC §5 `import agenvoy`): `<sessions>/<sid>/history.json`
 * (OpenAI-style messages; user turns may start with a `當前時間:`/`sendAt:` header in local time),
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

const ROLES = new Set(['user', 'assistant', 'system', 'developer', 'tool']);
interface Draft {
  raw: Record<string, unknown>;
  role: string;
  text: string;
  ns: bigint | null;
  /** A history.db row whose send_at was 0 (time unknown to Agenvoy). */
  untimed: boolean;
  source: 'json' | 'db';
  /** Where it came from, for notes: `history.json[3]`, `history.db row 17`. */
  at: string;
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

function normaliseContent(content: unknown): { content: unknown; header: SplitHeader | null } {
  if (typeof content === 'string') {
    const h = splitTimeHeader(content);
    return { content: h.text, header: h.time ? h : null };
  }
  if (Array.isArray(content)) {
    let header: SplitHeader | null = null;
    const parts = content
      .filter((p): p is Record<string, unknown> => !!p && typeof p === 'object')
      .map((p, i) => {
        if (p.type === 'text' && typeof p.text === 'string') {
          if (i === 0) {
            const h = splitTimeHeader(p.text);
            if (h.time) header = h;
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
        return null;
      })
      .filter((p) => p !== null);
    return { content: parts.length > 0 ? parts : null, header };
  }
  return { content: content ?? null, header: null };
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
    if (d.ns === null && prev !== null) d.ns = prev + 1n;
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

async function readJson(file: string): Promise<unknown> {
  if (!existsSync(file)) return undefined;
  try {
    // A byte-order mark (editors on Windows write one) is not part of the JSON.
    return JSON.parse((await readFile(file, 'utf8')).replace(/^\uFEFF/, '')) as unknown;
  } catch {
    throw new AppError(400, 'invalid_file', `${path.basename(file)} is not valid JSON`);
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
    .prepare('SELECT rowid AS _rowid, * FROM messages WHERE session_id = ? ORDER BY rowid')
    .safeIntegers(true)
    .all(sessionId) as Array<Record<string, unknown>>;
}

export async function readAgenvoySession(
  dir: string,
  sessionId: string,
  db: SqliteDb | null,
  timeZone: string,
): Promise<AgenvoySessionRead> {
  const notes: string[] = [];
  const historyFile = path.join(dir, 'history.json');
  const history = (await readJson(historyFile)) ?? [];
  if (!Array.isArray(history)) throw new AppError(400, 'invalid_file', 'history.json is not an array');

  const json: Draft[] = [];
  const unreadTimes: string[] = [];
  let skipped = 0;
  for (const [index, m] of (history as Array<Record<string, unknown>>).entries()) {
    if (!m || typeof m !== 'object' || typeof m.role !== 'string' || !ROLES.has(m.role)) {
      skipped++;
      continue;
    }
    const { content, header } = normaliseContent(m.content);
    if (header?.time && toNs(header.time, timeZone) === null) unreadTimes.push(header.time);
    const raw: Record<string, unknown> = { role: m.role, content };
    const calls = normaliseToolCalls(m.tool_calls);
    if (calls) raw.tool_calls = calls;
    if (typeof m.tool_call_id === 'string' && m.tool_call_id) raw.tool_call_id = m.tool_call_id;
    if (typeof m.name === 'string' && m.name) raw.name = m.name;
    if (header?.workDir) raw.metadata = { work_dir: header.workDir };
    json.push({
      raw,
      role: m.role,
      text: flatten(content),
      ns: toNs(header?.time ?? null, timeZone),
      untimed: false,
      source: 'json',
      at: `history.json[${index}]`,
    });
  }
  fillTimes(json, await mtimeNs(historyFile));
  if (unreadTimes.length > 0) {
    notes.push(
      `${unreadTimes.length} time header(s) could not be read (${unreadTimes
        .slice(0, 3)
        .map((t) => JSON.stringify(t))
        .join(', ')}${unreadTimes.length > 3 ? ', …' : ''}): those messages follow the previous one`,
    );
  }

  const archived: Draft[] = [];
  if (db) {
    for (const r of dbRows(db, sessionId)) {
      const role = String(r.role ?? '');
      const body = typeof r.content === 'string' ? r.content : '';
      if (!ROLES.has(role) || body.trim() === '') continue;
      const h = splitTimeHeader(body);
      const sendAt = typeof r.send_at === 'bigint' ? r.send_at : BigInt(Math.trunc(Number(r.send_at ?? 0)));
      const raw: Record<string, unknown> = { role, content: h.text };
      const meta: Record<string, unknown> = {};
      if (h.workDir) meta.work_dir = h.workDir;
      if (typeof r.sender === 'string' && r.sender) meta.sender = r.sender;
      if (Object.keys(meta).length > 0) raw.metadata = meta;
      archived.push({
        raw,
        role,
        text: h.text,
        ns: sendAt > 0n ? sendAt : null,
        untimed: sendAt <= 0n,
        source: 'db',
        at: `history.db row ${String(r._rowid)}`,
      });
    }
    fillTimes(archived, json[0]?.ns ?? nowNs());
  }

  // Merge without duplicates: history.json wins (it keeps structured content). An archived row is
  // the same message as one of history.json with its role and text when their times are equal;
  // failing that (second pass, so an exact pair is never taken by a near one), when its time is
  // within a minute of it (history.json times come from whole-second headers, plus 1 ns per
  // reply; an archive may hold the real send time), taking the nearest; or, for a row Agenvoy
  // could not time, any of them.
  const key = (d: Draft) => `${d.role}\u0000${d.text}`;
  const candidates = new Map<string, Array<bigint | null>>();
  for (const d of json) {
    const list = candidates.get(key(d)) ?? [];
    list.push(d.ns);
    candidates.set(key(d), list);
  }
  const NEAR_NS = 60_000_000_000n;
  const distance = (a: bigint | null, b: bigint | null) =>
    a === null || b === null ? null : a > b ? a - b : b - a;
  const takeExact = (d: Draft) => {
    const list = candidates.get(key(d));
    const at = list ? list.findIndex((ns) => ns === d.ns) : -1;
    if (at < 0) return false;
    list!.splice(at, 1);
    return true;
  };
  const takeNear = (d: Draft) => {
    const list = candidates.get(key(d));
    if (!list || list.length === 0) return false;
    let best = -1;
    let bestDistance: bigint | null = null;
    list.forEach((ns, i) => {
      const dist = distance(ns, d.ns);
      if (d.untimed) {
        if (best < 0) best = i;
      } else if (dist !== null && dist <= NEAR_NS && (bestDistance === null || dist < bestDistance)) {
        best = i;
        bestDistance = dist;
      }
    });
    if (best < 0) return false;
    list.splice(best, 1);
    return true;
  };
  const matched = archived.map((d) => !d.untimed && takeExact(d));
  archived.forEach((d, i) => {
    if (!matched[i]) matched[i] = takeNear(d);
  });
  const duplicates = matched.filter(Boolean).length;
  const onlyArchived = archived.filter((_d, i) => !matched[i]);

  const messages: ImportMessage[] = [];
  for (const d of [...onlyArchived, ...json]) {
    try {
      const [m] = parseMessages({ messages: [{ ...d.raw, sent_at: String(d.ns) }] }, timeZone);
      messages.push({ message: m!, sourceSeq: null });
    } catch (err) {
      skipped++;
      if (notes.length < 10) {
        const why = (err as Error).message.replace(/^messages\[0\]\.?/, '') || 'invalid';
        notes.push(`skipped ${d.at} (${d.role}): ${why}`);
      }
    }
  }

  let summary: ImportInput['summary'] = null;
  // A broken summary costs the summary, not the history (the summary sweep rebuilds one).
  const rawSummary = await readJson(path.join(dir, 'summary.json')).catch((err: unknown) => {
    notes.push(`${(err as Error).message}: summary skipped (the summary sweep rebuilds it)`);
    return undefined;
  });
  if (rawSummary && typeof rawSummary === 'object' && Object.keys(rawSummary).length > 0) {
    const shaped = summarySchema.safeParse(rawSummary);
    if (shaped.success) {
      summary = { summary: shaped.data, cursor: await readCursor(dir, timeZone, notes) };
    } else {
      notes.push('summary.json is not in the current summary shape: skipped (the summary sweep rebuilds it)');
    }
  }
  return {
    sessionId,
    input: { messages, summary },
    stats: { fromJson: json.length, fromDb: onlyArchived.length, duplicates, skipped },
    notes,
  };
}

async function readCursor(dir: string, timeZone: string, notes: string[]): Promise<ImportCursor> {
  const cursorFile = path.join(dir, '.summary_cursor');
  if (existsSync(cursorFile)) {
    const c = parseCursorValue(await readFile(cursorFile, 'utf8'), timeZone);
    if (c) return c;
    notes.push('.summary_cursor is unreadable: the summary job sets the cursor');
  }
  const meta = (await readJson(path.join(dir, 'summary.meta.json')).catch(() => undefined)) as
    { last_message_time?: unknown } | undefined;
  if (meta && typeof meta.last_message_time === 'string') {
    const c = parseCursorValue(meta.last_message_time, timeZone);
    if (c) return c;
  }
  return { kind: 'none' };
}

/** Session directories under `sessionsDir` (names that are valid session ids; others are reported). */
export async function listAgenvoySessions(
  sessionsDir: string,
): Promise<{ ids: string[]; invalid: string[] }> {
  const entries = await readdir(sessionsDir, { withFileTypes: true });
  const ids: string[] = [];
  const invalid: string[] = [];
  for (const e of entries) {
    if (!e.isDirectory() || e.name.startsWith('.')) continue;
    try {
      ids.push(assertSessionId(e.name));
    } catch {
      invalid.push(e.name);
    }
  }
  return { ids: ids.sort(), invalid };
}
