import {
  ANN_INDEX_PREFIX,
  HNSW_MAX_DIMENSIONS,
  buildAnnIndex,
  dropAnnIndex,
  listAnnIndexes,
  sessionsNeedingAnnIndex,
} from '../../db/queries/ann-indexes.js';
import { dropInvalidLeftovers } from '../../db/queries/partial-indexes.js';
import { getSession } from '../../db/queries/sessions.js';
import { getVectorIndex } from '../../db/queries/vectors.js';
import type { Queryable } from '../../db/pool.js';
import type { CoreDeps } from '../deps.js';
import { requestMaintenance } from '../../workers/queues.js';

/**
 * Huge sessions get their own HNSW index (ANN_MIN_VECTORS, default 8,000 vectors): exact k-NN
 * reads every vector of the session (~0.1 s for 20,000 of 1,536 dimensions), an HNSW index built
 * for that session only answers in a few ms, and no other session pays for it. What it costs, measured
 * in bench/partial-hnsw.ts: vector inserts into that session become ~27× slower (the recent
 * index of a busy huge session lags more; archiving does not), a build takes 10–25 s per 20,000
 * 1,536-d vectors (faster with a larger `maintenance_work_mem`), and every index adds ~7 µs to
 * planning statements on `message_vectors`. Below ~8,000 vectors the planner prefers the exact
 * scan anyway (at `hnsw.ef_search` 100, db/pool.ts).
 */

export interface AnnMaintenanceResult {
  built: string[];
  dropped: string[];
  /** Why nothing was built although sessions may need it (the recent index is too wide). */
  skipped?: string;
}

/**
 * One pass of the `ann-indexes` maintenance task: drops invalid leftovers of failed builds (a build
 * whose Postgres restarted under it), and the indexes of sessions that were deleted,
 * shrank below half the threshold (reset, compaction) or hold another dimension than the recent
 * index (reembed), forgets indexes that vanished (a reembed swaps the table), then builds at most
 * `maxBuilds` missing ones, largest session first (dropping one at once whose session was deleted
 * or reset while it was built), none when the recent index is wider than HNSW allows (`skipped`
 * says so). Postgres only: PGlite is one connection, where
 * a build would stall everything.
 */
export async function maintainAnnIndexes(
  deps: Pick<CoreDeps, 'db' | 'config' | 'logger'>,
  opts: { minVectors?: number; maxBuilds?: number; goneOnly?: boolean } = {},
): Promise<AnnMaintenanceResult> {
  const out: AnnMaintenanceResult = { built: [], dropped: [] };
  const minVectors = opts.minVectors ?? deps.config.annMinVectors;
  if (deps.db.kind !== 'postgres') return out;
  out.dropped.push(...(await dropInvalidLeftovers(deps.db, [ANN_INDEX_PREFIX])));
  const index = await getVectorIndex(deps.db);
  for (const a of await listAnnIndexes(deps.db)) {
    if (a.building) continue;
    const current = index !== null && a.dimensions === index.dimensions;
    const big = minVectors > 0 && a.current_vectors >= minVectors / 2;
    const keep = a.exists && a.live && current && (big || opts.goneOnly === true);
    if (keep) continue;
    await dropAnnIndex(deps.db, a.index_name);
    if (!out.dropped.includes(a.index_name)) out.dropped.push(a.index_name);
  }
  if (minVectors <= 0 || opts.goneOnly || !index || index.state !== 'ready') return out;
  // Every build would fail at Postgres, be retried and dead-lettered, pass after pass, on the same
  // largest session first, so no session ever got an index. Such sessions keep the exact k-NN.
  if (index.dimensions > HNSW_MAX_DIMENSIONS) {
    return {
      ...out,
      skipped: `the recent index has ${index.dimensions} dimensions, more than the ${HNSW_MAX_DIMENSIONS} pgvector indexes with HNSW`,
    };
  }
  const todo = await sessionsNeedingAnnIndex(deps.db, { minVectors, limit: opts.maxBuilds ?? 1 });
  for (const s of todo) {
    const started = Date.now();
    const built = await buildForLiveSession(deps.db, s, () =>
      buildAnnIndex(deps.db, { ...s, dimensions: index.dimensions }),
    );
    if (!built) continue;
    if (!built.live) {
      await dropAnnIndex(deps.db, built.name);
      out.dropped.push(built.name);
      continue;
    }
    deps.logger.info(
      { index: built.name, vectors: s.vectors, ms: Date.now() - started },
      'built the HNSW index of a huge session',
    );
    out.built.push(built.name);
  }
  return out;
}

/**
 * Runs `build` (an index over one session's rows, recorded when done; its name is returned) for a
 * session that is live now, then tells whether it still is, in the same generation (a delete or a
 * reset bumps it). A build can wait minutes (CREATE INDEX CONCURRENTLY waits out every older
 * snapshot), and a delete meanwhile found no record of the index to drop: the caller drops one
 * that is not `live` at once. A delete committed after the re-check finds the record, and drops
 * the index itself. Null when the session was gone before the build (nothing built).
 */
export async function buildForLiveSession(
  db: Queryable,
  s: { tenantId: string; sessionId: string },
  build: () => Promise<string>,
): Promise<{ name: string; live: boolean } | null> {
  const before = await getSession(db, s.tenantId, s.sessionId);
  if (!before) return null;
  const name = await build();
  const after = await getSession(db, s.tenantId, s.sessionId);
  return { name, live: after?.generation === before.generation };
}

/**
 * After a delete, a reset that drops the summary, or a tenant erasure: when the registry of `task`
 * records indexes of the session (or of the whole tenant), asks a worker for a `<task>-gone` pass,
 * which drops the indexes of sessions no longer live (erasing tenants' sessions are not) and
 * nothing else, deciding from what is live when it runs (so a session re-created under the id
 * meanwhile keeps the index it needs). A DROP INDEX CONCURRENTLY waits until no index build runs
 * on its table, and a build waits out every older snapshot (a long report, a `pg_dump`): run by
 * the request, a delete answered after 68 s, past PG_REQUEST_TIMEOUT_MS, and a tenant erasure
 * after 140 s; run beside it, the waiting drops held every connection of the API process's pool
 * (503s for all its requests).
 */
export async function requestIndexDrops(
  deps: Pick<CoreDeps, 'db' | 'queues'>,
  task: 'search-indexes' | 'ann-indexes',
  filter: { tenantId: string; sessionId?: string },
): Promise<boolean> {
  if (deps.db.kind !== 'postgres') return false;
  const registry = task === 'search-indexes' ? 'session_search_indexes' : 'vector_ann_indexes';
  const r = await deps.db.query(
    `SELECT 1 FROM ${registry} WHERE tenant_id = $1 AND ($2::text IS NULL OR session_id = $2) LIMIT 1`,
    [filter.tenantId, filter.sessionId ?? null],
  );
  if ((r.rowCount ?? 0) === 0) return false;
  await requestMaintenance(deps.queues, `${task}-gone`);
  return true;
}
