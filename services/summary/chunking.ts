import type { Block } from './render.js';

/**
 * Cuts rendered messages into chunks of at most `budget` code points (SPEC §6 step 4). Every
 * block is already at most `budget` (long messages were truncated when rendered).
 *
 * A chunk that is not the last never ends on a user message, so a question is summarised with
 * its answer: the chunk ends before the trailing user message(s) instead. When a user message is
 * alone in its chunk (it and its reply do not fit together), the reply joins it and both are
 * shortened to share the budget (`refit` re-renders a block within a smaller size). The one case
 * that still ends on a user message is a run of consecutive user messages without any reply that
 * by itself exceeds the budget: it is cut where it must be, keeping its last message for the
 * reply's chunk.
 */
export function planChunks(
  blocks: Block[],
  budget: number,
  refit: (b: Block, maxSize: number) => Block,
): Block[][] {
  const chunks: Block[][] = [];
  let i = 0;
  while (i < blocks.length) {
    let j = i;
    let size = 0;
    while (j < blocks.length && size + blocks[j]!.size <= budget) size += blocks[j++]!.size;
    if (j === i) j = i + 1; // an oversized block (callers prevent it) still makes progress
    if (j === blocks.length) {
      chunks.push(blocks.slice(i));
      break;
    }
    let end = j;
    while (end > i && blocks[end - 1]!.role === 'user') end--;
    if (end > i) {
      chunks.push(blocks.slice(i, end));
      i = end;
      continue;
    }
    // blocks i..j-1 are all user messages and the next one does not fit with them
    const next = blocks[j]!;
    if (j - i === 1 && next.role !== 'user') {
      chunks.push(fitPair(blocks[i]!, next, budget, refit));
      i = j + 1;
      continue;
    }
    if (j - i === 1) {
      chunks.push([blocks[i]!]); // a user message followed by another user message
      i = j;
      continue;
    }
    chunks.push(blocks.slice(i, j - 1));
    i = j - 1;
  }
  return chunks;
}

/** A lone user message and its reply, shortened so both fit: each keeps at least half if needed. */
function fitPair(
  user: Block,
  reply: Block,
  budget: number,
  refit: (b: Block, maxSize: number) => Block,
): Block[] {
  if (user.size + reply.size <= budget) return [user, reply];
  const half = Math.floor(budget / 2);
  if (user.size <= half) return [user, refit(reply, budget - user.size)];
  if (reply.size <= half) return [refit(user, budget - reply.size), reply];
  return [refit(user, half), refit(reply, budget - half)];
}
