import { createHash } from 'node:crypto';
import { pageSummaryCandidates } from '../db/queries/summaries.js';
import type { Config } from '../services/config.js';
import type { CoreDeps } from '../services/deps.js';
import { enqueueSummarizeMany } from '../services/summary/enqueue-summarize.js';

const PAGE_SIZE = 500;

/**
 * The LLM configuration a summary run works under, as recorded with its failures: 12 hex digits of
 * SHA-256 over SUMMARY_MODEL and OPENAI_BASE_URL (the base URL may hold credentials: it is never
 * stored itself; the API key is not part of it).
 */
export function summaryConfigFingerprint(config: Pick<Config, 'summaryModel' | 'llm'>): string {
  return createHash('sha256')
    .update(`${config.summaryModel}\n${config.llm.baseURL ?? ''}`)
    .digest('hex')
    .slice(0, 12);
}

/**
 * The summary sweep (SUMMARY_CRON): every live, non-`temp-` session with archived messages past
 * its summary cursor, and not stalled in back-off, gets one summarize job. A session whose failures
 * happened under another LLM configuration (a model name or endpoint fixed since) is due at once. Sessions are read in
 * keyset pages so any number of them costs bounded memory; jobs are deduplicated per session
 * (see enqueue-summarize.ts), so overlapping sweeps, several worker processes and API requests
 * never queue two jobs for one session. Pages come in (tenant, session) order; each job's rank
 * among its tenant's interleaves the tenants in the queue (enqueueSummarizeMany).
 */
export async function runSummarySweep(
  deps: Pick<CoreDeps, 'db' | 'queues' | 'llm' | 'config'>,
  opts: { pageSize?: number } = {},
): Promise<{ candidates: number }> {
  if (!deps.llm) return { candidates: 0 };
  const limit = opts.pageSize ?? PAGE_SIZE;
  let afterTenantId = '';
  let afterSessionId = '';
  let candidates = 0;
  const config = summaryConfigFingerprint(deps.config);
  // Each session's place among its tenant's (whose sessions are contiguous, across pages).
  let tenant = '';
  let rank = 0;
  for (;;) {
    const page = await pageSummaryCandidates(deps.db, { afterTenantId, afterSessionId, limit, config });
    await enqueueSummarizeMany(
      deps.queues,
      page.map((c) => {
        if (c.tenant_id !== tenant) [tenant, rank] = [c.tenant_id, 0];
        return { tenantId: c.tenant_id, sessionId: c.id, rank: rank++ };
      }),
    );
    candidates += page.length;
    const last = page[page.length - 1];
    if (!last || page.length < limit) break;
    afterTenantId = last.tenant_id;
    afterSessionId = last.id;
  }
  return { candidates };
}
