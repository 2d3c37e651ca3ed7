import { pageSummaryCandidates } from '../db/queries/summaries.js';
import type { CoreDeps } from '../services/deps.js';
import { enqueueSummarizeMany } from '../services/summary/enqueue-summarize.js';

const PAGE_SIZE = 500;

/**
 * The summary sweep (SUMMARY_CRON): every live, non-`temp-` session with archived messages past
 * its summary cursor, and not stalled in back-off, gets one summarize job. Sessions are read in
 * keyset pages so any number of them costs bounded memory; jobs are deduplicated per session
 * (see enqueue-summarize.ts), so overlapping sweeps, several worker processes and API requests
 * never queue two jobs for one session.
 */
export async function runSummarySweep(
  deps: Pick<CoreDeps, 'db' | 'queues' | 'llm'>,
  opts: { pageSize?: number } = {},
): Promise<{ candidates: number }> {
  if (!deps.llm) return { candidates: 0 };
  const limit = opts.pageSize ?? PAGE_SIZE;
  let afterTenantId = '';
  let afterSessionId = '';
  let candidates = 0;
  for (;;) {
    const page = await pageSummaryCandidates(deps.db, { afterTenantId, afterSessionId, limit });
    await enqueueSummarizeMany(
      deps.queues,
      page.map((c) => ({ tenantId: c.tenant_id, sessionId: c.id })),
    );
    candidates += page.length;
    const last = page[page.length - 1];
    if (!last || page.length < limit) break;
    afterTenantId = last.tenant_id;
    afterSessionId = last.id;
  }
  return { candidates };
}
