/**
 * Pure ranking steps of search: merging keyword matchers, reciprocal-rank fusion, and choosing
 * hits with their context windows so that no message appears twice in a response.
 */

/** Which tier found a candidate: the archive's full text, or the recent part (substring, vectors). */
export interface Candidate {
  seq: number;
  score: number;
  archive: boolean;
  recent: boolean;
}

export const SUBSTRING_BONUS = 0.1;
/**
 * Added to a full-text match's score, so that every message full text matched ranks above every
 * message that only the substring match found (inside words: `index` in `reindexed`, `step 3` in
 * `step 300`): the bonus alone outranked full-text ranks (about 0.09), and the newest substring
 * matches pushed the one message with the words themselves out of the hits.
 */
export const FULL_TEXT_TIER = 1;

/**
 * Keyword score: for a full-text match FULL_TEXT_TIER plus `ts_rank_cd(…, 32)` (cover density,
 * normalised to 0..1), plus a fixed bonus when the message also (or only) contains the query's
 * terms verbatim. Ties: newer first.
 */
export function rankKeyword(
  rows: Array<{ seq: number; rank: number; byFts: boolean; bySubstring: boolean }>,
): Candidate[] {
  return rows
    .map((r) => ({
      seq: r.seq,
      score: (r.byFts ? FULL_TEXT_TIER + r.rank : 0) + (r.bySubstring ? SUBSTRING_BONUS : 0),
      archive: r.byFts,
      recent: r.bySubstring,
    }))
    .sort(byScoreThenNewest);
}

export function rankSemantic(rows: Array<{ seq: number; score: number }>): Candidate[] {
  return rows
    .map((r) => ({ seq: r.seq, score: r.score, archive: false, recent: true }))
    .sort(byScoreThenNewest);
}

/** The usual constant of reciprocal-rank fusion (Cormack, Clarke & Büttcher, SIGIR 2009). */
export const RRF_K = 60;

/**
 * Reciprocal-rank fusion: score(d) = Σ over lists of 1 / (RRF_K + rank of d in that list), ranks
 * from 1. Only ranks matter, so BM25-like and cosine scores need no calibration against each
 * other; a message near the top of both lists beats one at the top of only one.
 */
export function fuseRrf(lists: Candidate[][]): Candidate[] {
  const fused = new Map<number, Candidate>();
  for (const list of lists) {
    list.forEach((c, i) => {
      const prev = fused.get(c.seq);
      const add = 1 / (RRF_K + i + 1);
      if (prev) {
        prev.score += add;
        prev.archive ||= c.archive;
        prev.recent ||= c.recent;
      } else {
        fused.set(c.seq, { seq: c.seq, score: add, archive: c.archive, recent: c.recent });
      }
    });
  }
  return [...fused.values()].sort(byScoreThenNewest);
}

function byScoreThenNewest(a: Candidate, b: Candidate): number {
  return b.score - a.score || b.seq - a.seq;
}

/**
 * Walks candidates in rank order and keeps up to `limit` hits, each with its context (the seqs
 * around it, ascending). A candidate already shown, as a hit or in a higher-ranked hit's context,
 * is skipped; a context leaves out everything already shown. So every seq appears at most once.
 */
export function selectHits(
  ranked: readonly Candidate[],
  neighbours: ReadonlyMap<number, readonly number[]>,
  limit: number,
): Array<{ hit: Candidate; context: number[] }> {
  const shown = new Set<number>();
  const out: Array<{ hit: Candidate; context: number[] }> = [];
  for (const hit of ranked) {
    if (out.length >= limit) break;
    if (shown.has(hit.seq)) continue;
    shown.add(hit.seq);
    const context = (neighbours.get(hit.seq) ?? []).filter((s) => !shown.has(s));
    for (const s of context) shown.add(s);
    out.push({ hit, context });
  }
  return out;
}
