import { deleteSummaryLease } from '../../db/queries/summaries.js';
import { forRequests } from '../deps.js';
import { makeSummaryProcessor } from '../../workers/summarize.js';
import type { Extension, ExtensionFactory } from '../extension.js';
import {
  makeSummaryRoutes,
  makeUsageRoutes,
  summaryRoutesMeta,
  usageRoutesMeta,
} from '../routes/summary-routes.js';
import { summaryDedupId } from './enqueue-summarize.js';
import { makeSummaryMetrics } from './summary-metrics.js';

export const SWEEP_SCHEDULER_ID = 'summary-sweep';

/**
 * Rolling summaries (SPEC §6 summary sweep and summarize, §4 Summary and Usage): the `summary`
 * queue's processor, the sweep's schedule (only with an LLM configured), and the routes
 * `GET /v1/sessions/:sid/summary`, `POST /v1/sessions/:sid/summarize` and `GET /v1/usage`.
 */
/** A job state in which the job has not started: it can be removed. */
const queued = (state: string | null) =>
  state === 'waiting' || state === 'delayed' || state === 'prioritized';

export const summaryExtension: ExtensionFactory = async (deps): Promise<Extension> => {
  const metrics = makeSummaryMetrics(deps.metrics.registry, deps.db);
  const routeDeps = forRequests(deps);
  return {
    name: 'summary',
    routes: [
      { prefix: '/v1/sessions', router: makeSummaryRoutes(routeDeps), meta: summaryRoutesMeta },
      { prefix: '/v1/usage', router: makeUsageRoutes(routeDeps), meta: usageRoutesMeta },
    ],
    processors: { summary: makeSummaryProcessor(deps, { metrics }) },
    async schedule() {
      // Without an LLM there is nothing to sweep; a scheduler left by an earlier deploy that had
      // one is removed so no worker keeps waking up for it.
      if (!deps.llm) {
        await deps.queues.summary.removeJobScheduler(SWEEP_SCHEDULER_ID);
        return;
      }
      await deps.queues.summary.upsertJobScheduler(
        SWEEP_SCHEDULER_ID,
        { pattern: deps.config.summaryCron, tz: deps.config.timeZone },
        { name: 'sweep', data: { v: 1, kind: 'sweep' } },
      );
    },
    async purgeSession(tenantId, sessionId) {
      // A queued job holds only ids and would find the session gone; drop it if it is not running.
      const id = await deps.queues.summary.getDeduplicationJobId(summaryDedupId(tenantId, sessionId));
      if (id) {
        const job = await deps.queues.summary.getJob(id);
        const state = job ? await job.getState() : null;
        if (job && queued(state)) {
          try {
            await job.remove();
          } catch (err) {
            // A worker took it between the two calls ("locked by another worker"): a running job
            // finds the session's generation moved on and writes nothing (lost_race). Only a job
            // still waiting is a failure to purge (the reset or delete answered 500 here).
            const now = await job.getState().catch(() => null);
            if (now === null || queued(now)) throw err;
          }
        }
      }
      await deleteSummaryLease(deps.db, tenantId, sessionId);
    },
  };
};
