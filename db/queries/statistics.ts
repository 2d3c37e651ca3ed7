import type { Queryable } from '../pool.js';

/** The tables whose planner statistics search and ingestion plans depend on. */
export const ANALYZED_TABLES = ['messages', 'message_vectors', 'sessions'] as const;
export type AnalyzedTable = (typeof ANALYZED_TABLES)[number];

/**
 * Those of `ANALYZED_TABLES` whose planner statistics are missing or, when autovacuum is off,
 * stale the way autovacuum would have judged them (more than 10 % of the rows plus 1,000 changed
 * since the last ANALYZE; its defaults are 10 % plus 50, checked every minute).
 */
export async function tablesNeedingAnalyze(q: Queryable): Promise<AnalyzedTable[]> {
  const r = await q.query<{ relname: AnalyzedTable }>(
    `SELECT relname FROM pg_stat_user_tables
     WHERE schemaname = current_schema() AND relname = ANY($1::text[])
       AND ((last_analyze IS NULL AND last_autoanalyze IS NULL)
         OR (current_setting('autovacuum') = 'off' AND n_mod_since_analyze > 1000 + 0.1 * n_live_tup))
     ORDER BY relname`,
    [ANALYZED_TABLES],
  );
  return r.rows.map((x) => x.relname);
}

export async function analyzeTable(q: Queryable, table: AnalyzedTable): Promise<void> {
  // The name is one of ANALYZED_TABLES, never input.
  await q.query(`ANALYZE ${table}`);
}
