import { analyzeTable, tablesNeedingAnalyze } from '../../db/queries/statistics.js';
import type { AnalyzedTable } from '../../db/queries/statistics.js';
import type { CoreDeps } from '../deps.js';

/**
 * One pass of the `table-statistics` maintenance task: ANALYZE the archive, the recent index and
 * the sessions table when Postgres has no statistics for them, or has stale ones because
 * autovacuum is off. Without statistics the planner guessed its way into a nested loop for a
 * semantic search with exclusions that ran over a minute on a 4,800-message session (0.1 s after
 * ANALYZE). Postgres only (PGlite plans without this).
 */
export async function refreshTableStatistics(
  deps: Pick<CoreDeps, 'db' | 'logger'>,
): Promise<{ analyzed: AnalyzedTable[] }> {
  if (deps.db.kind !== 'postgres') return { analyzed: [] };
  const analyzed = await tablesNeedingAnalyze(deps.db);
  for (const table of analyzed) await analyzeTable(deps.db, table);
  if (analyzed.length > 0) deps.logger.info({ tables: analyzed }, 'planner statistics refreshed');
  return { analyzed };
}
