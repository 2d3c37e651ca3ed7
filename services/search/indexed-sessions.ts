import type { Queryable } from '../../db/pool.js';
import { sessionsWithOwnIndexes } from '../../db/queries/session-indexes.js';

/**
 * Which sessions have partial indexes of their own, known to this process from a list re-read at
 * most every REFRESH_MS: `ann`, an HNSW index over a huge recent index; `search`, full-text and
 * trigram indexes over a huge archive. A session with an `ann` index has its semantic statement
 * planned with its parameter values, so that Postgres can prove the index's predicate, and its
 * filtered k-NN joined below the index scan; any other semantic statement is prepared once and
 * may run on a generic plan (search-session.ts). A session with `search` indexes has its substring
 * match look at the newest rows first (keyword and hybrid statements are never prepared; see
 * db/queries/search.ts). A stale answer only costs speed: an index built in the last REFRESH_MS is
 * not used yet by this process, one dropped meanwhile leaves a plan that does not need it.
 */
export const REFRESH_MS = 30_000;

export interface OwnIndexes {
  ann: boolean;
  search: boolean;
}

interface Known {
  /** Null until a list has been read. */
  byKey: Map<string, OwnIndexes> | null;
  nextLoad: number;
  loading: Promise<void> | null;
}

const byDb = new WeakMap<Queryable, Known>();
const key = (tenantId: string, sessionId: string) => `${tenantId}\n${sessionId}`;
const NONE: OwnIndexes = { ann: false, search: false };
const UNKNOWN: OwnIndexes = { ann: true, search: true };

/** Never throws: a failed read keeps the previous list and is retried after REFRESH_MS. */
async function load(db: Queryable, known: Known): Promise<void> {
  try {
    const byKey = new Map<string, OwnIndexes>();
    for (const r of await sessionsWithOwnIndexes(db)) {
      const k = key(r.tenant_id, r.session_id);
      byKey.set(k, { ...(byKey.get(k) ?? NONE), [r.kind]: true });
    }
    known.byKey = byKey;
  } catch {
    // Searches plan with their values meanwhile (or with the previous list).
  } finally {
    known.nextLoad = Date.now() + REFRESH_MS;
    known.loading = null;
  }
}

/**
 * The kinds of index the session may have; both when that cannot be told (no list read yet): the
 * caller then plans with the values, as it would without this module. The first call of a process
 * waits for the list; later refreshes run in the background.
 */
export async function ownIndexes(db: Queryable, tenantId: string, sessionId: string): Promise<OwnIndexes> {
  let known = byDb.get(db);
  if (!known) {
    known = { byKey: null, nextLoad: 0, loading: null };
    byDb.set(db, known);
  }
  if (!known.loading && Date.now() >= known.nextLoad) known.loading = load(db, known);
  if (known.byKey === null && known.loading) await known.loading;
  if (known.byKey === null) return UNKNOWN;
  return known.byKey.get(key(tenantId, sessionId)) ?? NONE;
}
