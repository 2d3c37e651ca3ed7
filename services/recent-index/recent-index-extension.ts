import { Counter } from 'prom-client';
import type { Registry } from 'prom-client';
import { compactTriggerState } from '../../db/queries/compaction.js';
import { deleteOrphanVectors, sessionsMissingVectors } from '../../db/queries/vectors.js';
import { makeCompactProcessor } from '../../workers/compact.js';
import { makeEmbedProcessor } from '../../workers/embed.js';
import type { ExtensionFactory } from '../extension.js';
import { maintainAnnIndexes, requestIndexDrops } from './ann-indexes.js';
import { shouldEnqueueCompact } from './compaction-plan.js';
import { makeEmbedder } from './embedder.js';
import { ensureVectorIndex } from './index-state.js';
import { enqueueCompact, enqueueEmbed } from './jobs.js';
import { scheduleMaintenance } from '../../workers/queues.js';

function counter<L extends string>(
  registry: Registry,
  name: string,
  help: string,
  labelNames: L[] = [],
): Counter<L> {
  return (
    (registry.getSingleMetric(name) as Counter<L> | undefined) ??
    new Counter({ name, help, labelNames, registers: [registry] })
  );
}

const EMBED_SWEEP_EVERY_MS = 10 * 60_000;
const ANN_INDEXES_EVERY_MS = 10 * 60_000;
/** Sessions the sweep looks at: active in the last day, quiet for the last five minutes. */
const EMBED_SWEEP_WITHIN_MS = 24 * 3_600_000;
const EMBED_SWEEP_IDLE_MS = 5 * 60_000;
const EMBED_SWEEP_LIMIT = 1_000;

/**
 * Enqueues an embed job for every recently active, now quiet session that still misses vectors
 * (its job failed for good, or the enqueue after its last commit failed). Busy sessions are left
 * alone: each archived batch enqueues their job anyway. Returns how many were enqueued.
 */
export async function sweepMissingVectors(
  deps: Parameters<ExtensionFactory>[0],
  model: string,
  opts: { withinMs?: number; idleMs?: number; limit?: number } = {},
): Promise<number> {
  const sessions = await sessionsMissingVectors(deps.db, {
    roles: deps.config.embedRoles,
    model,
    withinMs: opts.withinMs ?? EMBED_SWEEP_WITHIN_MS,
    idleMs: opts.idleMs ?? EMBED_SWEEP_IDLE_MS,
    limit: opts.limit ?? EMBED_SWEEP_LIMIT,
  });
  for (const s of sessions) await enqueueEmbed(deps.queues, s);
  return sessions.length;
}

/**
 * The recent index (tier 2) and compaction: embeds hot messages after each archived batch, keeps
 * the hot history under MAX_HISTORY_BYTES, and refuses to start when the configured embedder is
 * not the one the index was built with (`mnemos reembed` rebuilds it). See docs/recent-index.md.
 */
export const recentIndexExtension: ExtensionFactory = async (deps) => {
  const embedder = makeEmbedder(deps.config, deps.llm, deps.logger);
  await ensureVectorIndex(deps.db, embedder, {
    withoutLlm: !deps.config.llm.configured,
    configuredModel: deps.config.embedding.model,
  });

  const registry = deps.metrics.registry;
  const written = counter(registry, 'mnemos_embeddings_written_total', 'Vectors written to the recent index');
  const skipped = counter(
    registry,
    'mnemos_embeddings_skipped_total',
    'Messages the embedder refused (recorded, not retried)',
  );
  const compactions = counter(registry, 'mnemos_compactions_total', 'Compaction attempts by outcome', [
    'outcome',
  ]);
  const log = deps.logger.child({ module: 'recent-index' });
  // A pass skipped for a recent index too wide for HNSW says so once per process, not every
  // 10 minutes (loadConfig warns at start too).
  let warnedTooWide = false;
  const maintainAnn = async (opts: { goneOnly?: boolean } = {}) => {
    const r = await maintainAnnIndexes(deps, opts);
    if (r.skipped && !warnedTooWide) {
      warnedTooWide = true;
      log.warn(
        { reason: r.skipped },
        'huge sessions get no HNSW index of their own: their semantic search stays exact',
      );
    }
    return r;
  };

  return {
    name: 'recent-index',
    processors: {
      embed: makeEmbedProcessor(deps, embedder, (r) => {
        written.inc(r.written);
        skipped.inc(r.skipped);
      }),
      compact: makeCompactProcessor(deps, (outcome) => compactions.inc({ outcome })),
    },
    async afterArchive(a) {
      // Compaction first: it is cheap to decide and may shrink what the embed job has to do.
      if (a.hotBytes > deps.config.maxHistoryBytes) {
        try {
          const state = await compactTriggerState(deps.db, a);
          if (shouldEnqueueCompact(a.hotBytes, deps.config.maxHistoryBytes, state))
            await enqueueCompact(deps.queues, a);
        } catch (err) {
          log.warn({ err: { message: (err as Error).message } }, 'could not request compaction');
        }
      }
      await enqueueEmbed(deps.queues, a);
    },
    maintenance: {
      'embed-sweep': async () => {
        const n = await sweepMissingVectors(deps, embedder.model);
        if (n > 0) log.info({ sessions: n }, 'embed sweep: re-enqueued sessions missing vectors');
        return n;
      },
      'ann-indexes': () => maintainAnn(),
      // Asked for by a delete: drops the indexes of sessions no longer live, nothing else.
      'ann-indexes-gone': () => maintainAnn({ goneOnly: true }),
    },
    async schedule() {
      await scheduleMaintenance(deps.queues, 'embed-sweep', EMBED_SWEEP_EVERY_MS);
      await scheduleMaintenance(deps.queues, 'ann-indexes', ANN_INDEXES_EVERY_MS);
    },
    async purgeSession(tenantId, sessionId) {
      await deleteOrphanVectors(deps.db, tenantId, sessionId);
      await requestIndexDrops(deps, 'ann-indexes', { tenantId, sessionId });
    },
    purgeTenant: async (tenantId) => {
      await requestIndexDrops(deps, 'ann-indexes', { tenantId });
    },
  };
};
