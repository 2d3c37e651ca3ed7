import { loadContext, loadToolRunBefore } from '../../db/queries/context.js';
import type { ContextRow, WindowMessageRow } from '../../db/queries/context.js';
import type { CoreDeps } from '../deps.js';
import { notFound } from '../errors.js';
import { waitArchived } from '../messages/accept-messages.js';
import { makeRelevanceJudge } from './relevance.js';
import { isEmptySummary, isRecord, summaryParts } from './summary-parts.js';
import { SYSTEM_BLOCK, turnContextMessage } from './system-block.js';
import { wellFormedWindow } from './window.js';
import type { ContextMessage } from './window.js';

/** Longest wait for `min_seq` (SPEC §4: ≤ 5 s). */
export const MIN_SEQ_WAIT_MS = 5000;

export interface ContextRequest {
  input?: string | undefined;
  max_messages?: number | undefined;
  min_seq?: number | undefined;
}

export interface ContextResponse {
  messages: ContextMessage[];
  system_block: string;
  summary: Record<string, unknown> | null;
  summary_version: number;
  window: { from_seq: number | null; to_seq: number | null };
  relevance: 'filtered' | 'all' | 'none';
}

/** `signal`: ends a `min_seq` wait early, as a timeout (the process is shutting down). */
export type ContextBuilder = (
  tenantId: string,
  sessionId: string,
  req: ContextRequest,
  signal?: AbortSignal,
) => Promise<{ body: ContextResponse; minSeqTimedOut: boolean }>;

const holds = (row: ContextRow | null, seq: number) =>
  row !== null && !row.deleted && Number(row.next_seq) - 1 >= seq;

/**
 * The next turn's context: hot window, turn-context message with the (relevant part of the)
 * summary, then the new input. One SQL round trip in the common case; one more when the window
 * starts inside a tool-call run, and one more after a `min_seq` wait. The decision model is asked
 * only when there is a summary, an input and a DECISION_MODEL.
 */
export function makeContextBuilder(deps: CoreDeps): ContextBuilder {
  const judge = makeRelevanceJudge(deps);
  const load = (tenantId: string, sessionId: string, maxMessages: number) =>
    loadContext(deps.db, { tenantId, sessionId, maxMessages });

  return async (tenantId, sessionId, req, signal) => {
    const maxMessages = req.max_messages ?? deps.config.maxHistoryMessages;
    let row = await load(tenantId, sessionId, maxMessages);
    let minSeqTimedOut = false;
    // No row at all: nothing was ever accepted for this session (accepting creates the row before
    // answering 202), so there is nothing to wait for. A tombstone may be revived by the wait.
    if (req.min_seq !== undefined && row !== null && !holds(row, req.min_seq)) {
      await waitArchived(deps, tenantId, sessionId, req.min_seq, MIN_SEQ_WAIT_MS, signal);
      row = await load(tenantId, sessionId, maxMessages);
      minSeqTimedOut = !holds(row, req.min_seq);
    }
    if (!row || row.deleted) throw notFound('session');

    const stored = isRecord(row.summary) ? row.summary : null;
    const parts = stored ? summaryParts(stored) : null;
    const usable = stored !== null && parts !== null && !isEmptySummary(parts);
    let summary = usable ? stored : null;
    let relevance: ContextResponse['relevance'] = 'none';
    const input = req.input;
    if (usable && deps.llm && deps.config.decisionModel && input !== undefined && input.trim() !== '') {
      const out = await judge({
        tenantId,
        sessionId,
        version: row.summary_version ?? 0,
        input,
        summary: stored,
        parts,
      });
      relevance = out.relevance;
      summary = out.summary;
    }

    let rows: WindowMessageRow[] = row.messages ?? [];
    const head = rows[0];
    if (head?.role === 'tool') {
      // The window starts inside a tool-call run: extend it back to the assistant message the
      // results answer (a second, small query, only in this case). Also when the window is
      // shorter than maxMessages: PAGE_MAX_BYTES may have cut it.
      const run = await loadToolRunBefore(deps.db, {
        tenantId,
        sessionId,
        beforeSeq: head.seq,
        startSeq: Number(row.start_seq),
      });
      const first = run[0];
      if (first?.role === 'assistant' && first.tool_calls) rows = [...run, ...rows];
    }
    const window = wellFormedWindow(rows);
    const messages = window.messages;
    const last = messages[messages.length - 1];
    // The input was already posted (post first, then ask with min_seq): it is the message being
    // answered, so it moves after the turn context instead of appearing twice, as posted (its
    // `name`, its content as one text part).
    const posted =
      input !== undefined && last?.role === 'user' && isText(last.content, input)
        ? messages.pop()
        : undefined;
    if (summary) messages.push(turnContextMessage(summary));
    if (input !== undefined) messages.push(posted ?? { role: 'user', content: input });
    return {
      body: {
        messages,
        system_block: usable ? SYSTEM_BLOCK : '',
        summary,
        summary_version: row.summary_version ?? 0,
        window: { from_seq: window.fromSeq, to_seq: window.toSeq },
        relevance,
      },
      minSeqTimedOut,
    };
  };
}

/** Content that is `text`: the string itself, or one text part of it. */
function isText(content: unknown, text: string): boolean {
  if (typeof content === 'string') return content === text;
  if (!Array.isArray(content) || content.length !== 1) return false;
  const part: unknown = content[0];
  return isRecord(part) && part.type === 'text' && part.text === text;
}
