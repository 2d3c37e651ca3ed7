/**
 * Where compaction cuts the hot history (SPEC §6), as a pure function of the hot rows.
 *
 * The cutoff moves to just before a user message (a turn boundary) so that what stays hot is at
 * most 80 % of MAX_HISTORY_BYTES; of the user messages that qualify, the earliest, so as much as
 * allowed stays hot. A cut that would separate an assistant's tool call from its tool result is
 * never taken, even in a malformed conversation where a user message sits between them.
 */

import type { HotRow } from '../../db/queries/compaction.js';

export const COMPACT_MIN_MESSAGES = 4;
export const COMPACT_KEEP_RATIO = 0.8;
/** Growth of hot_bytes past a blocked attempt that earns another try without a new user message. */
export const COMPACT_RETRY_GROWTH = 1.1;

/** The hot rows the planner reads, as `hotHistory` (db/queries/compaction.ts) returns them. */
export type PlanRow = HotRow;

export type CompactionPlan =
  | { kind: 'under_limit'; hotBytes: number }
  | { kind: 'too_few'; hotBytes: number }
  | { kind: 'blocked'; hotBytes: number }
  | { kind: 'cut'; hotBytes: number; index: number; startSeq: string; startAtNs: string; keptBytes: number };

export function planCompaction(rows: readonly PlanRow[], maxBytes: number): CompactionPlan {
  const hotBytes = rows.reduce((s, r) => s + r.bytes, 0);
  if (hotBytes <= maxBytes) return { kind: 'under_limit', hotBytes };
  if (rows.length < COMPACT_MIN_MESSAGES) return { kind: 'too_few', hotBytes };
  const budget = Math.floor(maxBytes * COMPACT_KEEP_RATIO);

  // A tool result at j answering a call declared at k < j forbids every cut in (k, j].
  const forbidden = new Array<boolean>(rows.length).fill(false);
  const declaredAt = new Map<string, number>();
  rows.forEach((r, j) => {
    if (r.role === 'assistant') for (const id of r.call_ids ?? []) declaredAt.set(id, j);
    if (r.role === 'tool' && r.tool_call_id !== null) {
      const k = declaredAt.get(r.tool_call_id);
      if (k !== undefined) for (let i = k + 1; i <= j; i++) forbidden[i] = true;
    }
  });

  const suffix = new Array<number>(rows.length + 1).fill(0);
  for (let i = rows.length - 1; i >= 0; i--) suffix[i] = suffix[i + 1]! + rows[i]!.bytes;

  // Index 0 is the current cutoff: cutting there changes nothing.
  for (let i = 1; i < rows.length; i++) {
    const r = rows[i]!;
    if (r.role === 'user' && !forbidden[i] && suffix[i]! <= budget) {
      return {
        kind: 'cut',
        hotBytes,
        index: i,
        startSeq: r.seq,
        startAtNs: r.sent_at_ns,
        keptBytes: suffix[i]!,
      };
    }
  }
  return { kind: 'blocked', hotBytes };
}

/**
 * The post-archive hook's question: is a compact job worth enqueueing? Over the limit, and not
 * known to be blocked; a blocked session is retried only when a user message arrives (adding any
 * other message can never create a cut point: it only grows every candidate's remainder) or, as a
 * safety net, when hot_bytes has grown 10 % past the blocked attempt.
 */
export function shouldEnqueueCompact(
  hotBytes: number,
  maxBytes: number,
  state: { blockedAtBytes: number | null; newUserMessage: boolean } | null,
): boolean {
  if (hotBytes <= maxBytes || !state) return false;
  if (state.blockedAtBytes === null || state.newUserMessage) return true;
  return hotBytes > state.blockedAtBytes * COMPACT_RETRY_GROWTH;
}
