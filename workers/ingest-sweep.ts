import type { CoreDeps } from '../services/deps.js';
import { staleArmedSessions, touchArmed } from '../services/messages/inbox.js';
import { enqueueFlush } from '../services/fair-priority.js';

/**
 * Crash recovery for the ingest path: a session stays "armed" while its inbox holds messages. If
 * the API died between accepting and enqueueing, or a flush job was dead-lettered, nothing would
 * drain it; this re-requests a flush for sessions armed longer than `afterMs` without a drain
 * taking entries (finishDrain re-stamps the score of a session it leaves armed), at most one
 * job per session at a time.
 */
export async function runIngestSweep(deps: Pick<CoreDeps, 'redis' | 'queues' | 'config'>, afterMs: number) {
  const stale = await staleArmedSessions(deps.redis, deps.config.prefix, afterMs);
  for (const s of stale) {
    // One re-request per session until that job ends: a drain that keeps failing retries its job
    // from the delayed set for many minutes, and a new job at every sweep beside it multiplied
    // the failures (one more retrying job a minute, each later a dead letter).
    // At the tenant's fair priority: a flooding tenant's sessions that waited a minute behind
    // its own backlog would otherwise all go ahead of every other tenant's (services/fair-priority.ts).
    await enqueueFlush(deps, s.tenantId, s.sessionId, { dedupe: 'sweep' });
    await touchArmed(deps.redis, deps.config.prefix, s.member);
  }
  return { requeued: stale.length };
}
