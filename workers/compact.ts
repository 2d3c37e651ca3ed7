import type { Job } from 'bullmq';
import { withTransaction } from '../db/pool.js';
import { hotHistory, markCompactBlocked, moveCutoff } from '../db/queries/compaction.js';
import { lockSession } from '../db/queries/sessions.js';
import type { CoreDeps } from '../services/deps.js';
import { planCompaction } from '../services/recent-index/compaction-plan.js';
import type { CompactionPlan } from '../services/recent-index/compaction-plan.js';
import { parsePayload } from './queues.js';

export type CompactOutcome = CompactionPlan['kind'] | 'missing';

/**
 * Compacts one session's hot history (SPEC §6) in one transaction under the session row lock,
 * the lock the ingest drain takes, so the cutoff, hot_bytes and the vector pruning never race an
 * archive batch. With no valid cut point it only records `compact_blocked_at_bytes`, which stops
 * the post-archive hook from re-enqueueing on every batch (see shouldEnqueueCompact).
 */
export async function compactSession(
  deps: Pick<CoreDeps, 'db' | 'config'>,
  tenantId: string,
  sessionId: string,
): Promise<{ outcome: CompactOutcome; startSeq?: number; hotBytes?: number; vectorsDeleted?: number }> {
  return withTransaction(deps.db, async (tx) => {
    const session = await lockSession(tx, tenantId, sessionId);
    if (!session || session.deleted) return { outcome: 'missing' as const };
    const rows = await hotHistory(tx, tenantId, sessionId, session.start_seq);
    const plan = planCompaction(rows, deps.config.maxHistoryBytes);
    if (plan.kind === 'blocked') {
      await markCompactBlocked(tx, tenantId, sessionId, plan.hotBytes);
      return { outcome: plan.kind, hotBytes: plan.hotBytes };
    }
    if (plan.kind !== 'cut') return { outcome: plan.kind, hotBytes: plan.hotBytes };
    const { vectorsDeleted } = await moveCutoff(tx, {
      tenantId,
      sessionId,
      startSeq: plan.startSeq,
      startAtNs: plan.startAtNs,
      hotBytes: plan.keptBytes,
    });
    return {
      outcome: 'cut' as const,
      startSeq: Number(plan.startSeq),
      hotBytes: plan.keptBytes,
      vectorsDeleted,
    };
  });
}

export function makeCompactProcessor(
  deps: Pick<CoreDeps, 'db' | 'config' | 'logger'>,
  onOutcome?: (outcome: CompactOutcome) => void,
) {
  return async (job: Job): Promise<{ outcome: CompactOutcome; startSeq?: number }> => {
    const p = parsePayload('compact', job.data);
    const r = await compactSession(deps, p.tenantId, p.sessionId);
    onOutcome?.(r.outcome);
    if (r.outcome === 'cut') {
      deps.logger.debug(
        {
          tenantId: p.tenantId,
          startSeq: r.startSeq,
          hotBytes: r.hotBytes,
          vectorsDeleted: r.vectorsDeleted,
        },
        'compacted hot history',
      );
    }
    return r.startSeq === undefined ? { outcome: r.outcome } : { outcome: r.outcome, startSeq: r.startSeq };
  };
}
