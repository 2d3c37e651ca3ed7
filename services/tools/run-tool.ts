import { pageMessagesWithin } from '../../db/queries/messages.js';
import { escapeUnstorable } from '../text/unstorable.js';
import { wallClock } from '../time.js';
import { headAndTailUnits } from '../text/fts-text.js';
import { isOneLineSpace, oneLine } from '../text/one-line.js';
import { isHighSurrogate, isLowSurrogate } from '../text/code-points.js';
import { getSession } from '../../db/queries/sessions.js';
import type { CoreDeps } from '../deps.js';
import { AppError } from '../errors.js';
import type { ErrorMemory, ErrorRecord } from '../error-memory/types.js';
import { ERROR_ID_RE } from '../error-memory/types.js';
import { toStoredMessage } from '../routes/session-routes.js';
import type { StoredMessage } from '../routes/session-routes.js';
import { errorSearchBody, errorWriteBody } from '../routes/error-routes.js';
import { searchBodySchema, searchSessionDetailed } from '../search/search-session.js';
import type { DetailedHit } from '../search/search-session.js';
import { TOOL_NAMES } from './tool-definitions.js';
import type { ToolName } from './tool-definitions.js';
import { MAX_BODY_DEPTH, jsonNestedDeeperThan } from '../json-depth.js';

/** One message line is clipped here; the whole answer never exceeds MAX_OUTPUT. */
export const MAX_LINE_CHARS = 1200;
export const MAX_OUTPUT_CHARS = 12_000;
const MAX_READ = 50;
/**
 * A `read` or `list` fetches at most this much: its answer shows ~10 lines of 1,200 characters of
 * huge messages, and six concurrent reads of 32 MiB pages (the listing's bound) held the event
 * loop for seconds.
 */
const TOOL_PAGE_BYTES = 8 * 1024 * 1024;

export interface ToolDeps {
  core: Pick<CoreDeps, 'db' | 'config' | 'llm' | 'logger' | 'metrics'>;
  errors: ErrorMemory | null;
}

/** One valid call of each tool, quoted in the guidance text. */
const EXAMPLES: Record<ToolName, string> = {
  chat_history: '{"mode":"search","keyword":"deployment error","limit":5}',
  error_history: '{"keyword":"ECONNREFUSED 5432","tool_name":"psql"}',
  write_error:
    '{"tool_name":"shell","symptom":"permission denied: /var/log/app.log","action":"ran with sudo -u app","outcome":"resolved"}',
};

/** A problem with the model's arguments: answered as text (HTTP 200) so the model can fix its call. */
class ToolArgumentError extends Error {}

const guidance = (tool: ToolName, problem: string, example: string) =>
  new ToolArgumentError(`Invalid arguments for ${tool}: ${problem}. Example of a valid call: ${example}`);

export function clip(text: string, max = MAX_LINE_CHARS): string {
  const chars = Array.from(text);
  if (chars.length <= max) return text;
  return `${chars.slice(0, max).join('')} …[clipped ${chars.length - max} characters]`;
}

/**
 * `clip(oneLine(text), max)`, the same string, without flattening or splitting the whole text: on
 * a message of 1 MiB they made a copy and a million one-character strings to keep 1,200
 * characters, and a `list` of such messages took 4 s and 400 MB, holding every other request.
 * One pass over the UTF-16 units counts the code points oneLine would leave (the marker's count)
 * and finds where the first `max` of them end; only that head is flattened.
 */
export function clipLine(text: string, max = MAX_LINE_CHARS): string {
  let count = 0;
  // A run of whitespace after some text: one space, counted once a non-space follows (oneLine
  // trims a trailing one).
  let space = false;
  let end = 0;
  let endsInSpace = false;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (isOneLineSpace(c)) {
      if (count > 0) space = true;
      continue;
    }
    if (space) {
      space = false;
      if (++count === max) {
        end = i;
        endsInSpace = true;
      }
    }
    // A pair is one code point; a lone surrogate is one too, as Array.from counts them.
    if (isHighSurrogate(c) && isLowSurrogate(text.charCodeAt(i + 1))) i++;
    if (++count === max) end = i + 1;
  }
  if (count <= max) return oneLine(text);
  // oneLine trims the head's last space, which is one of the `max` when the cut follows it.
  const head = oneLine(text.slice(0, end)) + (endsInSpace ? ' ' : '');
  return `${head} …[clipped ${count - max} characters]`;
}

function contentText(content: unknown): string {
  if (content === null || content === undefined) return '';
  if (typeof content === 'string') return content;
  if (Array.isArray(content)) {
    return content
      .map((p: { type?: string; text?: string }) =>
        p.type === 'text' ? (p.text ?? '') : `[${p.type ?? 'part'}]`,
      )
      .join(' ');
  }
  return JSON.stringify(content);
}

/**
 * `[2026-01-02 03:04 UTC · user · #12] text` (`+08:00` in another zone) — compact and greppable
 * for a model, on one line (runs of whitespace, newlines included, shown as one space). The zone
 * is shown: without it a time in America/New_York read as UTC to the model.
 */
export function formatMessage(m: StoredMessage, timeZone: string): string {
  const t = wallClock(timeZone, Date.parse(m.sent_at.slice(0, 23) + 'Z'));
  const when = `${t.year}-${t.month}-${t.day} ${t.hour}:${t.minute} ${t.offset === '+00:00' ? 'UTC' : t.offset}`;
  let text = contentText(m.content);
  if (m.tool_calls?.length) {
    const calls = (m.tool_calls as Array<{ function?: { name?: string; arguments?: string } }>)
      .map((c) => `${c.function?.name ?? '?'}(${c.function?.arguments ?? ''})`)
      .join('; ');
    text = text ? `${text} [calls: ${calls}]` : `[calls: ${calls}]`;
  }
  // The name too: one with a newline wrote lines that looked like other messages.
  const who = m.name ? `${m.role}:${oneLine(m.name)}` : m.role;
  return `[${when} · ${who} · #${m.seq}] ${clipLine(text)}`;
}

/** Joins blocks until the output budget is spent, then says how many were left out. */
function bounded(blocks: string[], header: string): string {
  let out = header;
  let shown = 0;
  // Room for the note about what was left out (at most 100 characters with its count).
  const budget = MAX_OUTPUT_CHARS - 100;
  for (const b of blocks) {
    if (out.length + b.length + 2 > budget) break;
    out += `\n\n${b}`;
    shown++;
  }
  if (shown < blocks.length)
    out += `\n\n…[${blocks.length - shown} more not shown: narrow the search or lower limit]`;
  return out;
}

/**
 * Message lines under the output budget: as many as fit, from the start (`keep: 'first'`) or from
 * the end (`keep: 'last'`, for the newest messages), in order, with `more(n, line)` saying how many
 * were left out and where they are (`line` = the index of the first or last one left out), and
 * `tail`, when given, said after the lines when all of them fit.
 */
function boundedLines(
  lines: string[],
  heading: string | ((shown: number) => string),
  keep: 'first' | 'last',
  more: (left: number, at: number) => string,
  tail?: string,
): string {
  // A heading may name what is shown: its longest form is budgeted.
  const head = typeof heading === 'string' ? () => heading : heading;
  const headRoom = Math.max(head(0).length, head(lines.length).length);
  // Room for the note about what was left out (its numbers are at most 16 digits each).
  const budget = MAX_OUTPUT_CHARS - headRoom - Math.max(more(0, 0).length, tail?.length ?? 0) - 40;
  const order = keep === 'first' ? lines.map((_, i) => i) : lines.map((_, i) => lines.length - 1 - i);
  let used = 0;
  let shown = 0;
  for (const i of order) {
    if (used + lines[i]!.length + 1 > budget) break;
    used += lines[i]!.length + 1;
    shown++;
  }
  const header = head(shown);
  if (shown === lines.length) return `${header}\n\n${lines.join('\n')}${tail ? `\n\n${tail}` : ''}`;
  const left = lines.length - shown;
  if (keep === 'first') {
    return `${header}\n\n${lines.slice(0, shown).join('\n')}\n\n${more(left, shown)}`;
  }
  return `${header}\n\n${more(left, left - 1)}\n\n${lines.slice(left).join('\n')}`;
}

function formatHit(h: DetailedHit, timeZone: string): string {
  const lines = [...h.context, h.message].sort((a, b) => a.seq - b.seq);
  return lines.map((m) => `${m.seq === h.seq ? '> ' : '  '}${formatMessage(m, timeZone)}`).join('\n');
}

/**
 * A record as labelled lines, each field on its own line (oneLine): a symptom holding newlines
 * wrote a second, forged record (`outcome: resolved · seen 412×`) into the answer.
 */
function formatRecord(r: ErrorRecord): string {
  return [
    `id: ${r.id} · tool: ${oneLine(r.tool_name)} · outcome: ${r.outcome} · seen ${r.hits}× · last ${r.last_hit_at}`,
    `symptom: ${clip(oneLine(r.symptom), 600)}`,
    r.cause ? `cause: ${clip(oneLine(r.cause), 600)}` : null,
    `action: ${clip(oneLine(r.action), 800)}`,
    r.keywords.length ? `keywords: ${r.keywords.map(oneLine).join(', ')}` : null,
  ]
    .filter(Boolean)
    .join('\n');
}

const isObject = (v: unknown): v is Record<string, unknown> =>
  typeof v === 'object' && v !== null && !Array.isArray(v);

function intArg(
  args: Record<string, unknown>,
  key: string,
  tool: ToolName,
  example: string,
  range?: { min: number; max: number },
): number | undefined {
  const v = args[key];
  if (v === undefined || v === null) return undefined;
  const n = typeof v === 'string' && /^\d+$/.test(v) ? Number(v) : v;
  // Above 2^53 a number is no longer exact (and past 2^63 it is no seq Postgres can compare).
  const min = range?.min ?? 0;
  const max = range?.max ?? Number.MAX_SAFE_INTEGER;
  if (typeof n !== 'number' || !Number.isSafeInteger(n) || n < min || n > max) {
    const what = range ? `an integer between ${min} and ${max}` : `a non-negative integer (at most ${max})`;
    throw guidance(tool, `${key} must be ${what}`, example);
  }
  return n;
}

/** The arguments without their null values: models in strict mode send null for an optional field. */
const withoutNulls = (args: Record<string, unknown>) =>
  Object.fromEntries(Object.entries(args).filter(([, v]) => v !== null));

/** A field that, when given, must be a string (a number or object is not silently ignored). */
function stringArg(args: Record<string, unknown>, key: string, tool: ToolName, example: string): void {
  const v = args[key];
  if (v !== undefined && v !== null && typeof v !== 'string')
    throw guidance(tool, `${key} must be a string`, example);
}

/** One valid call of each `chat_history` mode, for guidance about that mode. */
const CHAT_EXAMPLES = {
  search: EXAMPLES.chat_history,
  read: '{"mode":"read","from_seq":120,"to_seq":130}',
  list: '{"mode":"list","limit":10}',
};

/**
 * `chat_history`. `windowFromSeq`: the first seq of the agent's context window, when the backend
 * gave it (the route's `?window_from_seq=`); else search leaves out the default window.
 */
async function chatHistory(
  deps: ToolDeps,
  tenantId: string,
  sid: string,
  args: Record<string, unknown>,
  windowFromSeq: number | undefined,
) {
  const allowed = ['mode', 'keyword', 'match', 'time_range', 'limit', 'from_seq', 'to_seq'];
  const unknown = Object.keys(args).filter((k) => !allowed.includes(k));
  const ex0 = EXAMPLES.chat_history;
  if (unknown.length) throw guidance('chat_history', `unknown field(s) ${unknown.join(', ')}`, ex0);
  stringArg(args, 'keyword', 'chat_history', ex0);
  const keyword = typeof args.keyword === 'string' ? args.keyword.trim() : undefined;
  // A blank keyword beside a search's own arguments is a search that lost its words, not a
  // request for the last messages (which would drop `match` and `time_range` without a word).
  const searchOnly = ['match', 'time_range'].filter((k) => args[k] !== undefined && args[k] !== null);
  if ((args.mode === undefined || args.mode === null) && keyword === '' && searchOnly.length > 0)
    throw guidance(
      'chat_history',
      `keyword is blank, and ${searchOnly.join(' and ')} ${searchOnly.length > 1 ? 'apply' : 'applies'} only to a search: give the words to search for, or leave keyword out to list the last messages`,
      ex0,
    );
  const mode = args.mode ?? (keyword ? 'search' : 'list');
  if (mode !== 'search' && mode !== 'read' && mode !== 'list')
    throw guidance('chat_history', 'mode must be "search", "read" or "list"', ex0);
  // Every argument is checked before the session is looked up, so that a model's broken call on
  // an agent's first turn (no messages yet) gets guidance too.
  const ex = CHAT_EXAMPLES[mode];
  const limit = intArg(args, 'limit', 'chat_history', ex, { min: 1, max: 32 }) ?? 8;
  const tz = deps.core.config.timeZone;
  const empty = 'No messages in this conversation yet.';

  if (mode === 'search') {
    if (!keyword) throw guidance('chat_history', 'mode "search" needs a non-empty keyword', ex);
    const parsed = searchBodySchema.safeParse({
      query: keyword,
      match: args.match ?? 'hybrid',
      time_range: args.time_range ?? 'all',
      limit,
      exclude_window: true,
      window_from_seq: windowFromSeq,
    });
    if (!parsed.success) {
      const i = parsed.error.issues[0]!;
      // The search's `query` is this tool's `keyword`.
      const field = i.path[0] === 'query' || i.path.length === 0 ? 'keyword' : i.path.join('.');
      throw guidance('chat_history', `${field}: ${i.message}`, ex);
    }
    let hits: DetailedHit[];
    try {
      ({ hits } = await searchSessionDetailed(deps.core, tenantId, sid, parsed.data));
    } catch (err) {
      // Deleted since the check above: the same answer as if it had been gone before.
      if (err instanceof AppError && err.status === 404) return empty;
      throw err;
    }
    if (hits.length === 0)
      return `No earlier messages match "${clip(keyword, 200)}" (the current context window is not searched).`;
    return bounded(
      hits.map((h) => formatHit(h, tz)),
      `${hits.length} match(es) for "${clip(keyword, 200)}" outside the current context (> marks the hit):`,
    );
  }
  if (mode === 'read') {
    const from = intArg(args, 'from_seq', 'chat_history', ex);
    const to = intArg(args, 'to_seq', 'chat_history', ex);
    if (from === undefined || to === undefined)
      throw guidance('chat_history', 'mode "read" needs from_seq and to_seq', ex);
    if (to < from) throw guidance('chat_history', 'to_seq must not be below from_seq', ex);
    if (!(await getSession(deps.core.db, tenantId, sid))) return empty;
    const { rows, cut } = await pageMessagesWithin(deps.core.db, {
      tenantId,
      sessionId: sid,
      afterSeq: from - 1,
      beforeSeq: to + 1,
      // One more than shown: "more after them" only when there are.
      limit: MAX_READ + 1,
      desc: false,
      maxBytes: TOOL_PAGE_BYTES,
    });
    const over = rows.length > MAX_READ;
    if (over) rows.pop();
    if (rows.length === 0) return `No messages between #${from} and #${to}.`;
    const readOn = (seq: number) => `{"mode":"read","from_seq":${seq},"to_seq":${to}}`;
    const last = Number(rows[rows.length - 1]!.seq);
    // More messages in the range than one read shows: the note names the first one not shown,
    // whether the output limit or the count left it out.
    const more = (cut || over) && last < to;
    const body = rows.map((r) => formatMessage(toStoredMessage(r), tz));
    return boundedLines(
      body,
      // The range asked for while more of it is left to read (also when the output limit cuts
      // the page: "the first 50" of which 10 were shown), with how many are shown; else the range
      // shown (a read of #1–#100 on a 50-message session showed "Messages #1–#100").
      (shown) =>
        more || shown < rows.length
          ? `Messages #${from}–#${to} (the first ${shown} of them):`
          : `Messages #${Number(rows[0]!.seq)}–#${last}:`,
      'first',
      (left, at) =>
        `…[${left} more message(s) not shown (output limit)${more ? ', and more after them' : ''}: read on with ${readOn(Number(rows[at]?.seq ?? 0))}]`,
      more ? `…[more messages after #${last}: read on with ${readOn(last + 1)}]` : undefined,
    );
  }
  // mode "list"
  if (!(await getSession(deps.core.db, tenantId, sid))) return empty;
  // Under TOOL_PAGE_BYTES: fewer than `limit` of the newest when they are huge.
  const { rows } = await pageMessagesWithin(deps.core.db, {
    tenantId,
    sessionId: sid,
    afterSeq: null,
    beforeSeq: null,
    limit,
    desc: true,
    maxBytes: TOOL_PAGE_BYTES,
  });
  rows.reverse();
  const body = rows.map((r) => formatMessage(toStoredMessage(r), tz));
  return boundedLines(
    body,
    `The last ${rows.length} message(s):`,
    'last',
    (left, at) =>
      `…[${left} earlier message(s) not shown (output limit): read them with {"mode":"read","from_seq":${Number(rows[0]?.seq ?? 0)},"to_seq":${Number(rows[at]?.seq ?? 0)}}]`,
  );
}

async function errorHistory(deps: ToolDeps, tenantId: string, given: Record<string, unknown>) {
  const ex = EXAMPLES.error_history;
  if (!deps.errors) return 'Error memory is not available on this server.';
  const args = withoutNulls(given);
  const allowed = ['mode', 'keyword', 'tool_name', 'limit', 'id'];
  const unknown = Object.keys(args).filter((k) => !allowed.includes(k));
  if (unknown.length) throw guidance('error_history', `unknown field(s) ${unknown.join(', ')}`, ex);
  stringArg(args, 'keyword', 'error_history', ex);
  const mode = args.mode ?? (typeof args.id === 'string' && !args.keyword ? 'read' : 'search');
  if (mode === 'read') {
    if (typeof args.id !== 'string' || !ERROR_ID_RE.test(args.id)) {
      throw guidance(
        'error_history',
        'mode "read" needs an id like err_ followed by 20 letters/digits',
        '{"mode":"read","id":"err_…"}',
      );
    }
    const r = await deps.errors.get(tenantId, args.id);
    return r ? formatRecord(r) : `No error record ${args.id} (it may have expired).`;
  }
  if (mode !== 'search') throw guidance('error_history', 'mode must be "search" or "read"', ex);
  const keyword = typeof args.keyword === 'string' ? args.keyword.trim() : '';
  if (!keyword)
    throw guidance('error_history', 'mode "search" needs keyword (the error text or its key terms)', ex);
  const limit = intArg(args, 'limit', 'error_history', ex, { min: 1, max: 16 }) ?? 4;
  stringArg(args, 'tool_name', 'error_history', ex);
  // A blank tool name (models send "" or " " for "any") filters nothing. Otherwise the arguments
  // obey what `POST /v1/errors/search` does (a lone surrogate in a tool name was a 500 here).
  const toolName = typeof args.tool_name === 'string' && args.tool_name.trim() ? args.tool_name : undefined;
  const parsed = errorSearchBody.safeParse({
    // Cut to what the REST body takes (4,000 UTF-16 units), without clip's marker: a pasted stack
    // trace is what a model sends here, and its error line is at the end (a Python traceback's
    // last line), so the cut keeps both ends. Cutting the head only answered NONE to a stored fix.
    query: headAndTailUnits(keyword, 4000),
    limit,
    ...(toolName === undefined ? {} : { tool_name: toolName }),
  });
  if (!parsed.success) {
    const i = parsed.error.issues[0]!;
    const field = i.path[0] === 'query' ? 'keyword' : i.path.join('.');
    throw guidance('error_history', `${field}: ${i.message}`, ex);
  }
  const records = await deps.errors.search(tenantId, parsed.data);
  if (records.length === 0) return 'NONE: no similar error was recorded before.';
  // Ranked by similarity first (README: error memory): a failed attempt can come before a fix.
  return bounded(
    records.map(formatRecord),
    `${records.length} similar error(s), the closest first (an outcome "resolved" record's action is a known fix):`,
  );
}

async function writeError(deps: ToolDeps, tenantId: string, sid: string, args: Record<string, unknown>) {
  const ex = EXAMPLES.write_error;
  if (!deps.errors) return 'Error memory is not available on this server.';
  // The record names the session the call came from, not one the model may have made up.
  const parsed = errorWriteBody.safeParse({ ...withoutNulls(args), session_id: sid });
  if (!parsed.success) {
    const i = parsed.error.issues[0]!;
    throw guidance('write_error', `${i.path.join('.') || 'arguments'}: ${i.message}`, ex);
  }
  const r = await deps.errors.write(tenantId, parsed.data);
  return r.deduplicated
    ? `Recorded: merged into existing record ${r.id} (same tool and symptom).`
    : `Recorded as ${r.id}.`;
}

/** Executes one tool call; argument problems come back as guidance text, never as an HTTP error. */
export async function runTool(
  deps: ToolDeps,
  tenantId: string,
  sid: string,
  name: string,
  args: unknown,
  opts: { windowFromSeq?: number | undefined } = {},
): Promise<string> {
  // Its text may quote what it refused ("unknown field(s) …"); it goes to the model as it is.
  return escapeUnstorable(await toolText(deps, tenantId, sid, name, args, opts));
}

async function toolText(
  deps: ToolDeps,
  tenantId: string,
  sid: string,
  name: string,
  args: unknown,
  opts: { windowFromSeq?: number | undefined },
): Promise<string> {
  if (!(TOOL_NAMES as readonly string[]).includes(name)) {
    throw new AppError(404, 'not_found', `unknown tool "${name}" (tools: ${TOOL_NAMES.join(', ')})`);
  }
  const tool = name as ToolName;
  if (typeof args === 'string') {
    // Models sometimes send the arguments as the JSON string they produced. Checked for depth
    // first, as every JSON body is (services/json-depth.ts): the body's check sees one string, and
    // 8 MiB of nested arrays inside it held the event loop for 4 s in JSON.parse.
    if (jsonNestedDeeperThan(Buffer.from(args, 'utf8'), MAX_BODY_DEPTH))
      return `Invalid arguments for ${tool}: nested more than ${MAX_BODY_DEPTH} levels deep. Example of a valid call: ${EXAMPLES[tool]}`;
    try {
      args = args.trim() === '' ? {} : (JSON.parse(args) as unknown);
    } catch {
      return `Invalid arguments for ${tool}: not valid JSON. Example of a valid call: ${EXAMPLES[tool]}`;
    }
  }
  if (!isObject(args)) {
    return `Invalid arguments for ${tool}: send a JSON object of arguments (see the tool's parameters).`;
  }
  try {
    if (tool === 'chat_history') return await chatHistory(deps, tenantId, sid, args, opts.windowFromSeq);
    if (tool === 'error_history') return await errorHistory(deps, tenantId, args);
    return await writeError(deps, tenantId, sid, args);
  } catch (err) {
    if (err instanceof ToolArgumentError) return err.message;
    throw err;
  }
}
