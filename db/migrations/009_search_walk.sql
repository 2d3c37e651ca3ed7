-- The last step of every search statement (db/queries/search.ts): `selectHits`
-- (services/search/rank-hits.ts) in SQL, over p_ord, the candidate seqs in rank order. Step i
-- takes candidate i: if it is not shown yet it becomes a hit, and only then are its neighbours
-- looked up (`around`: the 2 archived messages before it and the 1 after it, whatever the cutoff;
-- NULL for a skipped candidate). `shown` and `picked` lag one step behind (they cover the steps
-- before), so that the lookup appears once. The walk stops after p_limit hits. It returns
-- `around`, the hits with their neighbours, and `rows`, the archived rows of what it shows (hits
-- and contexts, at most 4 x p_limit), leaving out p_have, rows the caller already holds. JSON keeps
-- it to one row; `sent_at_ns` goes as text (ns exceed 2^53).
--
-- A function rather than a CTE of each statement: PL/pgSQL plans its query once per connection and
-- reuses the plan, while the statements around it, whose plans depend on the query's terms, are
-- planned at every search. Planning the walk inside them cost 0.23-0.46 ms of a 1.6-2.6 ms keyword
-- or hybrid statement (docs/search.md).
CREATE FUNCTION mnemos_search_walk(p_tenant text, p_session text, p_ord bigint[], p_limit integer,
                                   p_have bigint[])
RETURNS TABLE (around json, rows json)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
BEGIN
  RETURN QUERY
  WITH RECURSIVE walk AS (
    SELECT 0 AS i, '{}'::bigint[] AS shown, 0 AS picked, NULL::bigint AS seq,
      NULL::bigint[] AS around, p_ord AS ord
    UNION ALL
    SELECT w.i + 1,
      CASE WHEN w.around IS NULL THEN w.shown ELSE w.shown || w.seq || w.around END,
      w.picked + (w.around IS NOT NULL)::int,
      w.ord[w.i + 1],
      CASE WHEN w.ord[w.i + 1] <> ALL (
             CASE WHEN w.around IS NULL THEN w.shown ELSE w.shown || w.seq || w.around END)
        THEN ARRAY(
          (SELECT n.seq FROM messages n
           WHERE n.tenant_id = p_tenant AND n.session_id = p_session AND n.seq < w.ord[w.i + 1]
           ORDER BY n.seq DESC LIMIT 2)
          UNION ALL
          (SELECT n.seq FROM messages n
           WHERE n.tenant_id = p_tenant AND n.session_id = p_session AND n.seq > w.ord[w.i + 1]
           ORDER BY n.seq ASC LIMIT 1))
      END,
      w.ord
    FROM walk w
    WHERE w.picked + (w.around IS NOT NULL)::int < p_limit AND w.i < cardinality(w.ord))
  SELECT
    (SELECT json_agg(json_build_array(x.seq, x.around)) FROM walk x WHERE x.around IS NOT NULL),
    (SELECT json_agg(json_build_array(m.seq, m.id, m.role, m.content, m.parts, m.name,
                                      m.tool_call_id, m.tool_calls, m.metadata, m.sent_at_ns::text,
                                      m.fingerprint))
     FROM messages m
     WHERE m.tenant_id = p_tenant AND m.session_id = p_session AND m.seq <> ALL (p_have)
       AND m.seq = ANY ((SELECT y.shown || y.seq || y.around FROM walk y
                         ORDER BY y.i DESC LIMIT 1)::bigint[]));
END
$$;
