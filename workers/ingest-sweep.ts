import type { CoreDeps } from '../services/deps.js';
import {
  defineInboxScripts,
  finishDrain,
  inboxKeys,
  moveToDeadLetters,
  staleArmedSessions,
  touchArmed,
} from '../services/messages/inbox.js';
import { enqueueFlush } from '../services/fair-priority.js';
import { deadLetterKey } from '../services/lifecycle/lifecycle-redis.js';
import { payloads } from './queues.js';

/**
 * Crash recovery for the ingest path: a session stays "armed" while its inbox holds messages. If
 * the API died between accepting and enqueueing, or a flush job was dead-lettered, nothing would
 * drain it; this re-requests a flush for sessions armed longer than `afterMs` without a drain
 * taking entries (finishDrain re-stamps the score of a session it leaves armed), at most one
 * job per session at a time.
 */
export async function runIngestSweep(
  deps: Pick<CoreDeps, 'redis' | 'queues' | 'config' | 'metrics' | 'logger'>,
  afterMs: number,
) {
  const stale = await staleArmedSessions(deps.redis, deps.config.prefix, afterMs);
  for (const s of stale) {
    // An inbox under an id the API refuses (made by hand): no flush job may name it (parsePayload
    // fails it at once), so a flush asked for every minute became one more dead letter a minute,
    // and the session, armed for good, held every embed job of the deployment (archivingBehind).
    if (!payloads.ingest.safeParse({ v: 1, tenantId: s.tenantId, sessionId: s.sessionId }).success) {
      await deadLetterRefused(deps, s);
      continue;
    }
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

/**
 * Moves the inbox of a session id the API refuses to the session's dead letters, as the drain
 * moves entries that are no message (moveToDeadLetters), and disarms it: no session row is made.
 */
async function deadLetterRefused(
  deps: Pick<CoreDeps, 'redis' | 'config' | 'metrics' | 'logger'>,
  { tenantId, sessionId, member }: { tenantId: string; sessionId: string; member: string },
): Promise<void> {
  const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
  const key = deadLetterKey(deps.config.prefix, tenantId, sessionId);
  defineInboxScripts(deps.redis);
  let count = 0;
  for (;;) {
    const raw = await deps.redis.lrange(keys.inbox, 0, 99);
    const moved = raw.length === 0 ? 0 : await moveToDeadLetters(deps.redis, keys, key, raw);
    count += moved;
    if (moved === 0) break;
  }
  await finishDrain(deps.redis, keys, 0);
  // A member with no space (made by hand) is no `<tenant> <sid>` the keys name again.
  if (member !== keys.member) await deps.redis.zrem(keys.armed, member);
  if (count === 0) return;
  deps.metrics.ingestDeadLetter.inc(count);
  deps.logger.error(
    { tenantId, sessionId, count, key },
    'inbox of a session id the API refuses dead-lettered: no flush job may name it (made by hand)',
  );
}
