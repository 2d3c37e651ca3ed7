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

/**
 * Tenant ids in id order (the primary key), from `from` (included when `inclusive`) on: the walk of
 * the usage retention task.
 */
export async function tenantIdsFrom(
  q: Queryable,
  from: string | null,
  inclusive: boolean,
  limit: number,
  /** Also say, per tenant, whether it has a usage row recorded before this time. */
  usageBefore: Date,
): Promise<Array<{ id: string; old: boolean }>> {
  const r = await q.query<{ id: string; old: boolean }>(
    `SELECT t.id, EXISTS (SELECT 1 FROM llm_usage u WHERE u.tenant_id = t.id AND u.at < $3) AS old
     FROM tenants t WHERE $1::text IS NULL OR t.id ${inclusive ? '>=' : '>'} $1 ORDER BY t.id LIMIT $2`,
    [from, limit, usageBefore],
  );
  return r.rows;
}

/**
 * Deletes the oldest `limit` of a tenant's usage rows recorded in [`from`, `before`) (`from` null =
 * no lower bound), found in `at` order through the (tenant_id, at) index and deleted by ctid, so
 * neither step reads the tenant's newer rows. Returns how many went and the newest `at` among
 * them: the next batch's `from`, so it does not walk again the index entries of the rows this one
 * deleted (they stay in the index until a vacuum).
 */
export async function deleteUsageBefore(
  q: Queryable,
  tenantId: string,
  from: Date | null,
  before: Date,
  limit: number,
): Promise<{ deleted: number; lastAt: Date | null }> {
  const r = await q.query<{ n: number; last: Date | null }>(
    `WITH gone AS (
       DELETE FROM llm_usage
       WHERE ctid = ANY (ARRAY(SELECT ctid FROM llm_usage
                               WHERE tenant_id = $1 AND ($2::timestamptz IS NULL OR at >= $2) AND at < $3
                               ORDER BY at LIMIT $4))
         AND tenant_id = $1 AND at < $3
       RETURNING at)
     SELECT count(*)::int AS n, max(at) AS last FROM gone`,
    [tenantId, from, before, limit],
  );
  return { deleted: r.rows[0]?.n ?? 0, lastAt: r.rows[0]?.last ?? null };
}
