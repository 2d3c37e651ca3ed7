import type { Queryable } from '../../db/pool.js';
import { sessionsWithOwnIndexes } from '../../db/queries/session-indexes.js';

/**
 * Which sessions have partial indexes of their own (HNSW for huge recent indexes, full text and
 * trigrams for huge archives), known to this process from a list re-read at most every
 * REFRESH_MS. Search plans a statement for such a session with its parameter values, so that
 * Postgres can prove the index's predicate; any other session's semantic statement is prepared
 * once and may run on a generic plan (search-session.ts). A stale answer only costs speed: an
 * index built in the last REFRESH_MS is not used yet by this process, one dropped meanwhile leaves
 * a custom plan that does not need it.
 */
export const REFRESH_MS = 30_000;

interface Known {
  /** Null until a list has been read. */
  keys: Set<string> | null;
  nextLoad: number;
  loading: Promise<void> | null;
}

const byDb = new WeakMap<Queryable, Known>();
const key = (tenantId: string, sessionId: string) => `${tenantId}\n${sessionId}`;

/** Never throws: a failed read keeps the previous list and is retried after REFRESH_MS. */
async function load(db: Queryable, known: Known): Promise<void> {
  try {
    const rows = await sessionsWithOwnIndexes(db);
    known.keys = new Set(rows.map((r) => key(r.tenant_id, r.session_id)));
  } catch {
    // Searches plan with their values meanwhile (or with the previous list).
  } finally {
    known.nextLoad = Date.now() + REFRESH_MS;
    known.loading = null;
  }
}

/**
 * True when the session may have an index of its own, or when that cannot be told (no list read
 * yet): the caller then plans with the values, as it would without this module. The first call
 * of a process waits for the list; later refreshes run in the background.
 */
export async function mayHaveOwnIndexes(
  db: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<boolean> {
  let known = byDb.get(db);
  if (!known) {
    known = { keys: null, nextLoad: 0, loading: null };
    byDb.set(db, known);
  }
  if (!known.loading && Date.now() >= known.nextLoad) known.loading = load(db, known);
  if (known.keys === null && known.loading) await known.loading;
  return known.keys === null || known.keys.has(key(tenantId, sessionId));
}
