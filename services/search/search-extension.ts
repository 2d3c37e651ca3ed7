import type { ExtensionFactory } from '../extension.js';
import { forRequests } from '../deps.js';
import { makeSearchRoutes, searchRoutesMeta } from '../routes/search-routes.js';
import { searchDuration } from './search-session.js';
import { maintainSessionIndexes } from './session-indexes.js';
import { refreshTableStatistics } from './table-statistics.js';
import {
  backfillCjkTsvectors,
  backfillCompoundTsvectors,
  backfillFoldedTsvectors,
  backfillFormatTsvectors,
  backfillLongTsvectors,
  backfillToolCallTsvectors,
} from './fts-backfill.js';
import { scheduleMaintenance } from '../../workers/queues.js';
import { requestIndexDrops } from '../recent-index/ann-indexes.js';

const SEARCH_INDEXES_EVERY_MS = 10 * 60_000;
const TABLE_STATISTICS_EVERY_MS = 5 * 60_000;
const FTS_BACKFILL_EVERY_MS = 60_000;

/**
 * Search over the archive and the recent index: `POST /v1/sessions/{sid}/search`, and the
 * `search-indexes` maintenance task that gives huge sessions their own full-text and trigram
 * indexes (session-indexes.ts), `table-statistics`, which analyzes the tables when Postgres
 * does not (table-statistics.ts), and `fts-backfill`, which re-derives the tsvector of CJK rows
 * archived before 2026-12-01 (fts-backfill.ts).
 */
export const searchExtension: ExtensionFactory = async (deps) => {
  // Registered up front so /metrics shows the histogram before the first search.
  searchDuration(deps.metrics.registry);
  return {
    name: 'search',
    routes: [{ prefix: '/v1/sessions', router: makeSearchRoutes(forRequests(deps)), meta: searchRoutesMeta }],
    maintenance: {
      'search-indexes': () => maintainSessionIndexes(deps),
      // Asked for by a delete: drops the indexes of sessions no longer live, nothing else.
      'search-indexes-gone': () => maintainSessionIndexes(deps, { goneOnly: true }),
      'table-statistics': () => refreshTableStatistics(deps),
      'fts-backfill': async () => ({
        cjk: await backfillCjkTsvectors(deps),
        long: await backfillLongTsvectors(deps),
        args: await backfillToolCallTsvectors(deps),
        folded: await backfillFoldedTsvectors(deps),
        compound: await backfillCompoundTsvectors(deps),
        format: await backfillFormatTsvectors(deps),
      }),
    },
    async schedule() {
      await scheduleMaintenance(deps.queues, 'search-indexes', SEARCH_INDEXES_EVERY_MS);
      await scheduleMaintenance(deps.queues, 'table-statistics', TABLE_STATISTICS_EVERY_MS);
      await scheduleMaintenance(deps.queues, 'fts-backfill', FTS_BACKFILL_EVERY_MS);
    },
    async purgeSession(tenantId, sessionId) {
      await requestIndexDrops(deps, 'search-indexes', { tenantId, sessionId });
    },
    purgeTenant: async (tenantId) => {
      await requestIndexDrops(deps, 'search-indexes', { tenantId });
    },
  };
};
