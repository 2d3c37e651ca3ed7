import type { Queryable } from '../pool.js';

export async function insertUsage(
  q: Queryable,
  u: {
    tenantId: string;
    sessionId: string | null;
    purpose: string;
    model: string;
    inputTokens: number;
    outputTokens: number;
    startedAt: Date;
  },
): Promise<void> {
  // A call that outlived its session's delete (or the session's re-creation under the same id)
  // keeps its counts without the id, like the rows the delete detached: it is not billed to a
  // session that no longer exists, nor to a new one that did not make it. FOR SHARE waits for a
  // delete in progress (it holds the row) and then sees its outcome.
  await q.query(
    `INSERT INTO llm_usage (tenant_id, session_id, purpose, model, calls, input_tokens, output_tokens)
     SELECT $1,
            CASE WHEN EXISTS (SELECT 1 FROM sessions s
                              WHERE s.tenant_id = $1 AND s.id = $2 AND s.deleted_at IS NULL
                                AND s.created_at <= $7::timestamptz
                              FOR SHARE)
                 THEN $2 END,
            $3, $4, 1, $5, $6
     WHERE EXISTS (SELECT 1 FROM tenants WHERE id = $1)`,
    [u.tenantId, u.sessionId, u.purpose, u.model, u.inputTokens, u.outputTokens, u.startedAt],
  );
}

export async function usageByWindow(
  q: Queryable,
  tenantId: string,
  windowHours: number,
  sessionId: string | null,
): Promise<
  Array<{ purpose: string; model: string; calls: number; input_tokens: number; output_tokens: number }>
> {
  const r = await q.query<{
    purpose: string;
    model: string;
    calls: string;
    input_tokens: string;
    output_tokens: string;
  }>(
    `SELECT purpose, model, sum(calls)::bigint AS calls, sum(input_tokens)::bigint AS input_tokens,
            sum(output_tokens)::bigint AS output_tokens
     FROM llm_usage
     WHERE tenant_id = $1 AND at >= now() - make_interval(hours => $2::int)
       AND ($3::text IS NULL OR session_id = $3)
     GROUP BY purpose, model ORDER BY purpose, model`,
    [tenantId, windowHours, sessionId],
  );
  return r.rows.map((x) => ({
    purpose: x.purpose,
    model: x.model,
    calls: Number(x.calls),
    input_tokens: Number(x.input_tokens),
    output_tokens: Number(x.output_tokens),
  }));
}
