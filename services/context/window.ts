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

/**
 * Makes the stored window sendable: OpenAI rejects a tool result that does not directly follow
 * (within the run of tool results) the assistant message whose tool_calls it answers, and an
 * assistant message with a tool call that gets no result. Orphan tool results are dropped; tool
 * calls without a result lose that call (a message left with neither content nor calls is
 * dropped). A well-formed history passes through unchanged.
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
      const ids = new Set(row.tool_calls.map(callId).filter((x): x is string => x !== undefined));
      open = { slot, ids, answered: new Set() };
    }
  }
  closeRun();

  const messages: ContextMessage[] = [];
  const seqs: number[] = [];
  for (const { row, calls } of out) {
    const emptyContent = row.content === null || row.content === '';
    if (row.role === 'assistant' && row.tool_calls && !calls && emptyContent) {
      // Every call of this message went unanswered and it says nothing else.
      continue;
    }
    const m: ContextMessage = { role: row.role, content: row.content };
    if (row.name !== null) m.name = row.name;
    if (calls) m.tool_calls = calls;
    if (row.tool_call_id !== null) m.tool_call_id = row.tool_call_id;
    messages.push(m);
    seqs.push(row.seq);
  }
  return { messages, fromSeq: seqs[0] ?? null, toSeq: seqs[seqs.length - 1] ?? null, repaired };
}
