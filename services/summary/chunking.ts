import type { Block } from './render.js';

/**
 * Cuts rendered messages into chunks of at most `budget` code points (SPEC §6 step 4). Every
 * block is already at most `budget` (long messages were truncated when rendered).
 *
 * A chunk that is not the last never ends on a user message, so a question is summarised with
 * its answer: the chunk ends before the trailing user message(s) instead. When the user messages
 * are alone in their chunk (they and their reply do not fit together), the reply joins them and
 * all are shortened to share the budget (`refit` re-renders a block within a smaller size). The
 * one case that still ends on a user message is a run of consecutive user messages without any
 * reply that by itself exceeds the budget (or is so long that shortening every message to share
 * the budget with the reply would not fit): it is cut where it must be, keeping its last message
 * for the reply's chunk.
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
    // blocks i..j-1 are all user messages (they fit together) and the next one does not fit
    const next = blocks[j]!;
    if (next.role === 'user') {
      // The run of questions goes on past the budget: these share a chunk, and the run's last
      // question is paired with the reply further on. (Cut one question at a time, a run of short
      // questions before a long one cost a call each.)
      chunks.push(blocks.slice(i, j));
      i = j;
      continue;
    }
    const group = fitWithReply(blocks.slice(i, j), next, budget, refit);
    if (group) {
      chunks.push(group);
      i = j + 1;
      continue;
    }
    // Several questions that cannot all be shortened to share the budget with their reply (a lone
    // one always can): all but the last, which goes with the reply.
    chunks.push(blocks.slice(i, j - 1));
    i = j - 1;
  }
  return chunks;
}

/**
 * User messages and their reply, shortened so all fit: the reply keeps at least half the budget
 * if it needs it, the user messages share the rest in proportion to their sizes. Null when
 * several user messages cannot be shortened that far (each keeps at least its header); a lone
 * one is always paired.
 */
function fitWithReply(
  users: Block[],
  reply: Block,
  budget: number,
  refit: (b: Block, maxSize: number) => Block,
): Block[] | null {
  const usersSize = users.reduce((n, b) => n + b.size, 0);
  if (usersSize + reply.size <= budget) return [...users, reply];
  const half = Math.floor(budget / 2);
  const shrink = (room: number) =>
    users.length === 1
      ? [refit(users[0]!, room)]
      : users.map((b) => refit(b, Math.floor((room * b.size) / usersSize)));
  const group =
    usersSize <= half
      ? [...users, refit(reply, budget - usersSize)]
      : reply.size <= half
        ? [...shrink(budget - reply.size), reply]
        : [...shrink(half), refit(reply, budget - half)];
  if (users.length > 1 && group.reduce((n, b) => n + b.size, 0) > budget) return null;
  return group;
}
