import type { Queryable } from '../pool.js';

export interface SummaryStateRow {
  version: number;
  cursor_seq: string | null;
  status: string;
}

export async function getSummaryState(q: Queryable, tenantId: string, sessionId: string): Promise<SummaryStateRow | null> {
  const r = await q.query<SummaryStateRow>(
    'SELECT version, cursor_seq, status FROM summaries WHERE tenant_id = $1 AND session_id = $2',
    [tenantId, sessionId],
  );
  return r.rows[0] ?? null;
}
