import { deleteUsageBefore, tenantIdsFrom } from '../db/queries/usage.js';
import type { CoreDeps } from '../services/deps.js';

/** How often the `usage-retention` maintenance task runs. */
export const USAGE_RETENTION_EVERY_MS = 10 * 60_000;
const BATCH = 5000;
/** Statements per run: at most 1,000,000 rows; a backlog is taken over several runs. */
const MAX_BATCHES = 200;
const TENANT_PAGE = 500;

/** Where the task stands, kept by the process between its runs. */
export interface UsageRetentionState {
  /** The tenant the next run starts at, when the last one stopped at its budget. */
  resumeAt: string | null;
  /**
   * Per tenant, the cutoff of its last finished pass: no row older than it is left (`at` is the
   * insert's time, so none arrives later), and the next pass starts its index range there instead
   * of walking the entries of rows deleted since the last vacuum.
   */
  clearedBefore: Map<string, Date>;
  /**
   * The cutoffs of the pass under way, which replace `clearedBefore` when it ends: a tenant it did
   * not clear (none of its rows was old, or it was erased) keeps no entry.
   */
  passing: Map<string, Date>;
}

export const newUsageRetentionState = (): UsageRetentionState => ({
  resumeAt: null,
  clearedBefore: new Map(),
  passing: new Map(),
});

/**
 * Deletes `llm_usage` rows older than USAGE_RETENTION_DAYS (GET /v1/usage reads at most the last
 * 28 days, so no answer counted them; at one row per LLM call they grew without end). Walks the
 * tenants in id order and deletes each one's old rows oldest first, in batches of `batch` through
 * the (tenant_id, at) index, at most `maxBatches` statements per run; a run that stops there
 * leaves the tenant to resume at in `state`, so a tenant with a large backlog cannot keep the
 * others waiting. `now` is injectable for tests.
 */
export async function pruneUsage(
  deps: Pick<CoreDeps, 'db' | 'config' | 'logger'>,
  state: UsageRetentionState,
  opts: { now?: Date; batch?: number; maxBatches?: number } = {},
): Promise<{ deleted: number; finished: boolean }> {
  const now = opts.now ?? new Date();
  const before = new Date(now.getTime() - deps.config.usageRetentionDays * 86_400_000);
  const batch = opts.batch ?? BATCH;
  const maxBatches = opts.maxBatches ?? MAX_BATCHES;
  let statements = 0;
  let deleted = 0;
  const end = (resumeAt: string | null) => {
    state.resumeAt = resumeAt;
    if (resumeAt === null) {
      state.clearedBefore = state.passing;
      state.passing = new Map();
    }
    if (deleted > 0) {
      deps.logger.info(
        { deleted, before: before.toISOString(), resumeAt },
        'usage retention deleted old rows',
      );
    }
    return { deleted, finished: resumeAt === null };
  };
  let from = state.resumeAt;
  let inclusive = true;
  for (;;) {
    // A page of tenants says which have old rows at all (one index probe each, in one statement):
    // each tenant took a statement of the budget before, so a run reached 200 tenants whatever
    // their rows, and a pass over 5,000 tenants took 25 runs, over 4 hours (tester t8).
    const tenants = await tenantIdsFrom(deps.db, from, inclusive, TENANT_PAGE, before);
    for (const { id: tenantId, old } of tenants) {
      if (!old) continue;
      let lower = state.clearedBefore.get(tenantId) ?? null;
      for (;;) {
        if (statements >= maxBatches) return end(tenantId);
        statements++;
        const r = await deleteUsageBefore(deps.db, tenantId, lower, before, batch);
        deleted += r.deleted;
        if (r.deleted < batch) break;
        lower = r.lastAt;
      }
      state.passing.set(tenantId, before);
    }
    if (tenants.length < TENANT_PAGE) return end(null);
    from = tenants[tenants.length - 1]!.id;
    inclusive = false;
  }
}

/** The maintenance task: pruneUsage, each run going on from this process's previous one. */
export function makeUsageRetention(deps: Pick<CoreDeps, 'db' | 'config' | 'logger'>) {
  const state = newUsageRetentionState();
  return () => pruneUsage(deps, state);
}
