import { dropInvalidLeftovers } from '../../db/queries/partial-indexes.js';
import {
  SESSION_INDEX_PREFIXES,
  buildSessionIndex,
  dropSessionIndex,
  ensureTrigramExtension,
  listSessionIndexes,
  sessionsNeedingIndex,
} from '../../db/queries/session-indexes.js';
import type { SessionIndexKind } from '../../db/queries/session-indexes.js';
import { buildForLiveSession } from '../recent-index/ann-indexes.js';
import type { CoreDeps } from '../deps.js';

/**
 * Huge sessions get partial indexes of their own on `messages` (SEARCH_INDEX_MIN_MESSAGES, default
 * 8,000): a GIN index of their tsvectors, so that their full-text match no longer intersects the
 * table-wide posting lists of common words with their rows, and a pg_trgm index of their content
 * for the substring match over the recent part. Measured in bench/search.ts (docs/search.md): on a
 * session of 20,000 short messages in a 200,000-message archive, keyword p95 69 → 22 ms.
 *
 * Every index on `messages` costs planning time in every statement on it (~6 µs each, measured
 * with 100 partial indexes), so at most SEARCH_INDEX_MAX_SESSIONS sessions get each kind, the
 * largest first. Writes into an indexed session also update its GIN indexes (~2.4× the Postgres
 * CPU per archived row with both, mostly the trigrams; docs/search.md); other sessions only test
 * the index predicates.
 */

export interface SessionIndexMaintenance {
  built: string[];
  dropped: string[];
  /** Set when pg_trgm cannot be created here: trigram indexes are skipped. */
  trigramsUnavailable?: true;
}

const KINDS: SessionIndexKind[] = ['fts', 'trgm'];

/**
 * One pass of the `search-indexes` maintenance task: drops invalid leftovers of failed builds, and
 * the indexes of sessions that were
 * deleted or shrank below half the threshold (reset; compaction for the recent part's trigram
 * index), forgets indexes that vanished, then builds at most `maxBuilds` missing ones of each kind
 * while fewer than `maxSessions` sessions have that kind (and drops one at once whose session was
 * deleted or reset while it was built). Postgres only: on PGlite (one
 * connection) a build would stall everything.
 */
export async function maintainSessionIndexes(
  deps: Pick<CoreDeps, 'db' | 'config' | 'logger'>,
  opts: { minMessages?: number; maxSessions?: number; maxBuilds?: number; goneOnly?: boolean } = {},
): Promise<SessionIndexMaintenance> {
  const out: SessionIndexMaintenance = { built: [], dropped: [] };
  if (deps.db.kind !== 'postgres') return out;
  const minMessages = opts.minMessages ?? deps.config.searchIndexMinMessages;
  const maxSessions = opts.maxSessions ?? deps.config.searchIndexMaxSessions;
  out.dropped.push(...(await dropInvalidLeftovers(deps.db, SESSION_INDEX_PREFIXES)));
  const existing = await listSessionIndexes(deps.db);
  for (const x of existing) {
    if (x.building) continue;
    const big = minMessages > 0 && x.current_messages >= minMessages / 2;
    if (x.exists && x.live && (big || opts.goneOnly)) continue;
    await dropSessionIndex(deps.db, x.index_name);
    if (!out.dropped.includes(x.index_name)) out.dropped.push(x.index_name);
  }
  if (minMessages <= 0 || opts.goneOnly) return out;
  for (const kind of KINDS) {
    const kept = existing.filter((x) => x.kind === kind && !out.dropped.includes(x.index_name)).length;
    const room = Math.min(opts.maxBuilds ?? 1, maxSessions - kept);
    if (room <= 0) continue;
    const todo = await sessionsNeedingIndex(deps.db, { kind, minMessages, limit: room });
    if (todo.length === 0) continue;
    if (kind === 'trgm' && !(await ensureTrigramExtension(deps.db))) {
      out.trigramsUnavailable = true;
      deps.logger.warn('pg_trgm is not available: huge sessions get no trigram index');
      continue;
    }
    for (const s of todo) {
      const started = Date.now();
      const built = await buildForLiveSession(deps.db, s, () => buildSessionIndex(deps.db, { ...s, kind }));
      if (!built) continue;
      if (!built.live) {
        await dropSessionIndex(deps.db, built.name);
        out.dropped.push(built.name);
        continue;
      }
      deps.logger.info(
        { index: built.name, kind, messages: s.messages, ms: Date.now() - started },
        'built a search index of a huge session',
      );
      out.built.push(built.name);
    }
  }
  return out;
}
