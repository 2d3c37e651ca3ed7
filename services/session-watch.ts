import type { Queryable } from '../db/pool.js';
import { summaryRunCurrent } from '../db/queries/summaries.js';

/** How often a long LLM call of a session looks whether the session is still the one it read. */
export const SESSION_WATCH_MS = 1000;

/**
 * Aborts `controller` once the session is deleted or reset (its generation moves on): a call in
 * flight, and its retries, then stop sending the session's text to the LLM endpoint. A delete
 * answered 204 while an embed call waited on a slow endpoint, and its retries sent the deleted text
 * again 2.5 and 6.8 s later. The first look comes after `intervalMs`: a quick call costs no query.
 * Returns the function that stops watching. A failed look is not an abort (Postgres will tell the
 * write, which checks the generation again). The look is the one a summary run makes before each
 * call (`summaryRunCurrent`: same generation, not deleted, its tenant not being erased).
 */
export function watchSession(
  db: Queryable,
  s: { tenantId: string; sessionId: string; generation: number },
  controller: AbortController,
  intervalMs = SESSION_WATCH_MS,
): () => void {
  let looking = false;
  const timer = setInterval(() => {
    if (looking || controller.signal.aborted) return;
    looking = true;
    summaryRunCurrent(db, s).then(
      (current) => {
        looking = false;
        if (!current) controller.abort();
      },
      () => {
        looking = false;
      },
    );
  }, intervalMs);
  timer.unref();
  return () => clearInterval(timer);
}
