import { createHash } from 'node:crypto';
import type { JobsOptions } from 'bullmq';
import type { QueueRegistry } from '../../workers/queues.js';

/**
 * One embed and one compact job per session at a time, however busy the session is: BullMQ
 * deduplication keyed by the session, with `keepLastIfActive` so a batch archived while the job
 * runs (after it looked for missing vectors) still gets exactly one follow-up job once it ends.
 * A plain job id or plain deduplication would drop that follow-up. Session ids may contain ':',
 * which BullMQ ids must not, so the key is a hash.
 */
export function sessionJobKey(kind: 'embed' | 'compact', tenantId: string, sessionId: string): string {
  const h = createHash('sha256').update(`${tenantId}\n${sessionId}`).digest('hex').slice(0, 32);
  return `${kind}-${h}`;
}

const dedup = (id: string): JobsOptions => ({ deduplication: { id, keepLastIfActive: true } });

export async function enqueueEmbed(
  queues: Pick<QueueRegistry, 'embed'>,
  a: { tenantId: string; sessionId: string; generation: number },
): Promise<void> {
  await queues.embed.add(
    'embed',
    { v: 1, tenantId: a.tenantId, sessionId: a.sessionId, generation: a.generation },
    dedup(sessionJobKey('embed', a.tenantId, a.sessionId)),
  );
}

export async function enqueueCompact(
  queues: Pick<QueueRegistry, 'compact'>,
  a: { tenantId: string; sessionId: string },
): Promise<void> {
  await queues.compact.add(
    'compact',
    { v: 1, tenantId: a.tenantId, sessionId: a.sessionId },
    dedup(sessionJobKey('compact', a.tenantId, a.sessionId)),
  );
}
