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
 * for the reply's chunk; unless the message that sharing would shorten is the one message cut to
 * the budget anyway (`fitRunWithReply`).
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
      // A run past the budget only because one of its messages is too long for any chunk (a
      // pasted log): the whole run goes with its reply, the others whole. Cut apart, the
      // instruction before the log was summarised alone, without the reply, in a call of its own.
      const runStart = i === 0 || blocks[i - 1]!.role !== 'user';
      const joined = runStart ? fitRunWithReply(blocks, i, budget, refit) : null;
      if (joined) {
        chunks.push(joined);
        i += joined.length;
        continue;
      }
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
 * The run of user messages starting at `start` and the reply after it, as one chunk shortened by
 * `fitWithReply`, when the only message it shortens is the one cut anyway (rendered `cut` to the
 * budget): cutting the run apart would keep little more of it, and costs a call without the
 * reply. Null otherwise (no reply, several such messages, or a message that would lose text it
 * keeps on its own).
 */
function fitRunWithReply(
  blocks: Block[],
  start: number,
  budget: number,
  refit: (b: Block, maxSize: number) => Block,
): Block[] | null {
  let end = start;
  while (end < blocks.length && blocks[end]!.role === 'user') end++;
  if (end === blocks.length) return null;
  const users = blocks.slice(start, end);
  // One such message: with several, each would keep a share of what one kept cut apart.
  if (users.filter((b) => b.cut).length !== 1) return null;
  const group = fitWithReply(users, blocks[end]!, budget, refit);
  if (!group || users.some((b, k) => group[k] !== b && !b.cut)) return null;
  return group;
}

/**
 * User messages and their reply, shortened so all fit: the reply keeps at least half the budget
 * if it needs it, the user messages share the rest (`shares`). Null when several user messages
 * cannot be shortened that far: one that is cut would keep none of its text (only its header and
 * the marker); a lone one is always paired.
 */
function fitWithReply(
  users: Block[],
  reply: Block,
  budget: number,
  refit: (b: Block, maxSize: number) => Block,
): Block[] | null {
  const sizes = users.map((b) => b.size);
  const usersSize = sizes.reduce((n, s) => n + s, 0);
  if (usersSize + reply.size <= budget) return [...users, reply];
  const half = Math.floor(budget / 2);
  let bare = false;
  const shrink = (room: number) => {
    const caps = shares(sizes, room);
    return users.map((b, k) => {
      if (caps[k]! >= b.size) return b;
      const cut = refit(b, caps[k]!);
      // Refit to nothing, a message keeps its header and the marker: cut that far, it says nothing.
      if (cut.size <= refit(b, 0).size) bare = true;
      return cut;
    });
  };
  const group =
    usersSize <= half
      ? [...users, refit(reply, budget - usersSize)]
      : reply.size <= half
        ? [...shrink(budget - reply.size), reply]
        : [...shrink(half), refit(reply, budget - half)];
  if (users.length > 1 && (bare || group.reduce((n, b) => n + b.size, 0) > budget)) return null;
  return group;
}

/**
 * How much of `room` each user message may take (sizes count the header, the indentation and
 * the separator, as `Block.size` does): every message up to a common cap stays whole, and the
 * longer ones are cut to that cap, the largest that fits (water-filling). Shares in proportion
 * to size left a short instruction beside a pasted log less room than its header and the
 * truncation marker: "target PostgreSQL 16, never MySQL" reached the model as `Fix this,
 * …[truncated 57 characters]` while the log kept 15,700 characters. What the cap's rounding
 * leaves goes, one code point each, to the shortest of the cut messages.
 */
function shares(sizes: number[], room: number): number[] {
  const order = sizes.map((_, k) => k).sort((a, b) => sizes[a]! - sizes[b]! || a - b);
  const out = [...sizes];
  let left = room;
  for (let n = 0; n < order.length; n++) {
    const k = order[n]!;
    const rest = order.length - n;
    if (sizes[k]! * rest <= left) {
      left -= sizes[k]!;
      continue;
    }
    // This message and every longer one are over an even split of what is left: all get the cap.
    const cap = Math.floor(left / rest);
    let extra = left - cap * rest;
    for (const m of order.slice(n)) out[m] = cap + (extra-- > 0 ? 1 : 0);
    break;
  }
  return out;
}
