import type { CoreDeps } from '../services/deps.js';
import { staleArmedSessions, touchArmed } from '../services/messages/inbox.js';

/**
 * Crash recovery for the ingest path: a session stays "armed" while its inbox holds messages. If
 * the API died between accepting and enqueueing, or a flush job was dead-lettered, nothing would
 * drain it; this re-requests a flush for sessions armed longer than `afterMs` without a drain
 * taking entries (finishDrain re-stamps the score of a session it leaves armed).
 */
export async function runIngestSweep(deps: Pick<CoreDeps, 'redis' | 'queues' | 'config'>, afterMs: number) {
  const stale = await staleArmedSessions(deps.redis, deps.config.prefix, afterMs);
  for (const s of stale) {
    await deps.queues.ingest.add('flush', { v: 1, tenantId: s.tenantId, sessionId: s.sessionId });
    await touchArmed(deps.redis, deps.config.prefix, s.member);
  }
  return { requeued: stale.length };
}
