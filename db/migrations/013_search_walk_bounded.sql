-- mnemos_search_walk (migration 009), its response bounded. A search shows at most 4 x p_limit
-- messages (128), each up to 1 MiB of content, which JSON escapes up to six times (a control
-- character is `\u0001`): 128 such messages were one `rows` value of 768 MB, more than a string
-- the Node driver can make, and the process died reading it. When the shown messages' stored
-- `bytes` pass 32 MiB (PAGE_MAX_BYTES of db/queries/messages.ts), each one's content is cut to its
-- first 65,536 code points with a marker, structured content (parts) is shown as that text, and
-- each tool call's `arguments` (only the 8 MiB body bounds them) is cut to 65,536 code points.
-- Unchanged otherwise. The total is a window aggregate over the rows as they are read: the same
-- check over a materialised CTE cost 0.07-0.09 ms more per call (p50 0.70 against 0.60-0.64 ms,
-- 1,200 interleaved calls on 300 sessions of a kept bench database); this form costs as 009 did.
CREATE OR REPLACE FUNCTION mnemos_search_walk(p_tenant text, p_session text, p_ord bigint[], p_limit integer,
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
    (SELECT json_agg(json_build_array(s.seq, s.id, s.role,
       CASE WHEN s.total <= 33554432 THEN s.content
            WHEN s.parts IS NULL AND (s.content IS NULL OR length(s.content) <= 65536) THEN s.content
            ELSE left(coalesce(s.content, ''), 65536) || ' …[cut: the search response passed 32 MiB]' END,
       CASE WHEN s.total > 33554432 THEN NULL ELSE s.parts END,
       s.name, s.tool_call_id,
       CASE WHEN s.total <= 33554432 OR jsonb_typeof(s.tool_calls) IS DISTINCT FROM 'array' THEN s.tool_calls
            ELSE (SELECT jsonb_agg(CASE WHEN jsonb_typeof(c -> 'function' -> 'arguments') = 'string'
                                          AND length(c -> 'function' ->> 'arguments') > 65536
                    THEN jsonb_set(c, '{function,arguments}',
                                   to_jsonb(left(c -> 'function' ->> 'arguments', 65536) || ' …[cut]'))
                    ELSE c END ORDER BY k)
                  FROM jsonb_array_elements(s.tool_calls) WITH ORDINALITY AS t(c, k)) END,
       s.metadata, s.sent_at_ns::text, s.fingerprint))
     FROM (SELECT m.seq, m.id, m.role, m.content, m.parts, m.name, m.tool_call_id, m.tool_calls, m.metadata,
             m.sent_at_ns, m.fingerprint, sum(m.bytes) OVER () AS total
           FROM messages m
           WHERE m.tenant_id = p_tenant AND m.session_id = p_session AND m.seq <> ALL (p_have)
             AND m.seq = ANY ((SELECT y.shown || y.seq || y.around FROM walk y
                               ORDER BY y.i DESC LIMIT 1)::bigint[])) s);
END
$$;
