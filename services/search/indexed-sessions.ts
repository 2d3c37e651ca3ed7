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
  keys: Set<string>;
  at: number;
  loading: Promise<void> | null;
}

const byDb = new WeakMap<Queryable, Known>();
const key = (tenantId: string, sessionId: string) => `${tenantId}\n${sessionId}`;

async function load(db: Queryable, known: Known): Promise<void> {
  try {
    const rows = await sessionsWithOwnIndexes(db);
    known.keys = new Set(rows.map((r) => key(r.tenant_id, r.session_id)));
    known.at = Date.now();
  } finally {
    known.loading = null;
  }
}

/**
 * True when the session may have an index of its own, or when that cannot be told (the list could
 * not be read yet): the caller then plans with the values, as it would without this module.
 */
export async function mayHaveOwnIndexes(
  db: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<boolean> {
  let known = byDb.get(db);
  if (!known) {
    known = { keys: new Set(), at: 0, loading: null };
    byDb.set(db, known);
  }
  if (Date.now() - known.at > REFRESH_MS && !known.loading) {
    known.loading = load(db, known);
    // The first load is waited for; later ones refresh in the background.
    if (known.at === 0) await known.loading.catch(() => undefined);
    else known.loading.catch(() => undefined);
  } else if (known.at === 0 && known.loading) {
    await known.loading.catch(() => undefined);
  }
  if (known.at === 0) return true;
  return known.keys.has(key(tenantId, sessionId));
}
