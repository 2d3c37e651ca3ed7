import { createHash } from 'node:crypto';
import type { WindowMessageRow } from '../../db/queries/context.js';

/** An OpenAI chat message as the context endpoint returns it (no seq, ids or metadata). */
export interface ContextMessage {
  role: string;
  content: unknown;
  name?: string;
  tool_calls?: unknown[];
  tool_call_id?: string;
}

export interface HotWindow {
  messages: ContextMessage[];
  fromSeq: number | null;
  toSeq: number | null;
  /** Messages left out or changed to keep tool calls well-formed (for logs and tests). */
  repaired: number;
}

const callId = (c: unknown): string | undefined =>
  typeof c === 'object' && c !== null && 'id' in c && typeof c.id === 'string' ? c.id : undefined;

const OPENAI_NAME = /^[a-zA-Z0-9_-]{1,64}$/;

/**
 * A name OpenAI accepts (`^[a-zA-Z0-9_-]+$`, at most 64 characters, for a message's `name` and a
 * tool call's function name): each run of other characters becomes `_`. The archive keeps the name
 * as posted; only the context, which promises messages ready to send, is rewritten. Null when
 * nothing of the name survives (`小明`): a message then goes without its name.
 */
export function sendableName(name: string): string | null {
  if (OPENAI_NAME.test(name)) return name;
  const s = name.replace(/[^a-zA-Z0-9_-]+/g, '_').slice(0, 64);
  return /[a-zA-Z0-9]/.test(s) ? s : null;
}

function sendableCall(c: unknown): unknown {
  if (typeof c !== 'object' || c === null || !('function' in c)) return c;
  const fn = c.function as { name?: unknown };
  if (typeof fn?.name !== 'string' || OPENAI_NAME.test(fn.name)) return c;
  return { ...c, function: { ...fn, name: sendableName(fn.name) ?? '_' } };
}

/**
 * Tool-call ids as OpenAI takes them: at most 40 characters (a longer one is `400 string too
 * long`, and Responses-API items, gateways and other SDKs make ids of 50 and more), of the
 * characters every OpenAI-style endpoint accepts (Anthropic's allow only these), once per context
 * (a call id repeated in a later message is refused by some providers). Any other id becomes
 * `call_` and 24 characters of a hash of the message's seq and the id, the same for the call and
 * its result, and the same in every context that shows them.
 */
const SENDABLE_CALL_ID = /^[a-zA-Z0-9_-]{1,40}$/;

function sendableCallId(seq: number, id: string, taken: ReadonlySet<string>): string {
  // A posted id may be the hash of another (crafted, or copied from an earlier context): then the
  // next salt, so ids stay unique within the context.
  for (let salt = 0; ; salt++) {
    const source = salt === 0 ? `${seq}:${id}` : `${seq}:${id}#${salt}`;
    const to = `call_${createHash('sha256').update(source).digest('base64url').slice(0, 24)}`;
    if (!taken.has(to)) return to;
  }
}

/**
 * Content parts OpenAI accepts for the role: images only on user messages. Another role's image
 * part becomes the text part `[image]`, so the model still sees that one was there.
 */
function sendableContent(role: string, content: unknown): unknown {
  if (role === 'user' || !Array.isArray(content)) return content;
  if (!content.some((p) => (p as { type?: unknown })?.type === 'image_url')) return content;
  return content.map((p) =>
    (p as { type?: unknown })?.type === 'image_url' ? { type: 'text', text: '[image]' } : p,
  );
}

/**
 * Makes the stored window sendable: OpenAI rejects a tool result that does not directly follow
 * (within the run of tool results) the assistant message whose tool_calls it answers, and an
 * assistant message with a tool call that gets no result. Orphan tool results are dropped; tool
 * calls without a result lose that call (a message left with neither content nor calls is
 * dropped), and so does a repeated call id. Names, call ids and content parts OpenAI refuses are
 * rewritten (sendableName, sendableCallId, sendableContent). A well-formed history passes through
 * unchanged.
 */
export function wellFormedWindow(rows: readonly WindowMessageRow[]): HotWindow {
  type Slot = { row: WindowMessageRow; calls: unknown[] | null };
  const out: Slot[] = [];
  let repaired = 0;
  let open: { slot: Slot; ids: Set<string>; answered: Set<string> } | null = null;

  const closeRun = () => {
    if (!open) return;
    const { slot, answered } = open;
    const calls = slot.calls ?? [];
    const kept = calls.filter((c) => {
      const id = callId(c);
      return id !== undefined && answered.has(id);
    });
    if (kept.length !== calls.length) {
      repaired++;
      slot.calls = kept.length > 0 ? kept : null;
    }
    open = null;
  };

  for (const row of rows) {
    if (row.role === 'tool') {
      const id = row.tool_call_id ?? '';
      if (open && open.ids.has(id) && !open.answered.has(id)) {
        open.answered.add(id);
        out.push({ row, calls: null });
      } else {
        repaired++;
      }
      continue;
    }
    closeRun();
    const slot: Slot = { row, calls: row.tool_calls };
    out.push(slot);
    if (row.role === 'assistant' && row.tool_calls && row.tool_calls.length > 0) {
      // A repeated call id can be answered only once: the first call with it stays.
      const ids = new Set<string>();
      const calls = row.tool_calls.filter((c) => {
        const id = callId(c);
        if (id === undefined || ids.has(id)) return false;
        ids.add(id);
        return true;
      });
      if (calls.length !== row.tool_calls.length) {
        repaired++;
        slot.calls = calls;
      }
      open = { slot, ids, answered: new Set() };
    }
  }
  closeRun();

  const messages: ContextMessage[] = [];
  const seqs: number[] = [];
  // Call ids the context holds so far, and what the current message's results must be renamed to.
  const usedIds = new Set<string>();
  let renamed = new Map<string, string>();
  for (const { row, calls } of out) {
    // Content parts that are all empty text say nothing either (an agent framework's way of
    // writing no content).
    const emptyContent =
      row.content === null ||
      row.content === '' ||
      (Array.isArray(row.content) &&
        row.content.every(
          (p) => (p as { type?: unknown }).type === 'text' && (p as { text?: unknown }).text === '',
        ));
    if (row.role === 'assistant' && row.tool_calls && !calls && emptyContent) {
      // Every call of this message went unanswered and it says nothing else.
      continue;
    }
    const m: ContextMessage = { role: row.role, content: sendableContent(row.role, row.content) };
    const name = row.name === null ? null : sendableName(row.name);
    if (name !== null) m.name = name;
    if (row.role !== 'tool') renamed = new Map();
    if (calls) {
      m.tool_calls = calls.map((c) => {
        const sendable = sendableCall(c);
        const id = callId(c)!;
        if (SENDABLE_CALL_ID.test(id) && !usedIds.has(id)) {
          usedIds.add(id);
          return sendable;
        }
        const to = sendableCallId(row.seq, id, usedIds);
        usedIds.add(to);
        renamed.set(id, to);
        return { ...(sendable as object), id: to };
      });
      if (renamed.size > 0) repaired++;
    }
    if (row.tool_call_id !== null) m.tool_call_id = renamed.get(row.tool_call_id) ?? row.tool_call_id;
    messages.push(m);
    seqs.push(row.seq);
  }
  return { messages, fromSeq: seqs[0] ?? null, toSeq: seqs[seqs.length - 1] ?? null, repaired };
}
