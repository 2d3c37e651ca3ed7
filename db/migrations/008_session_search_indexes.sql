-- Per-session partial indexes on messages for huge sessions (SEARCH_INDEX_MIN_MESSAGES), built and
-- dropped by the search-indexes maintenance task (services/search/session-indexes.ts): 'fts' is a
-- GIN index on search_tsv over the session's rows only (its full-text match then reads posting
-- lists of that session instead of the whole table's), 'trgm' a pg_trgm GIN index on its content
-- (the substring match over its recent part). This table records which exist; like
-- vector_ann_indexes it has no foreign key, so that a deleted session's row outlives it until its
-- indexes are dropped.
CREATE TABLE session_search_indexes (
  index_name  text PRIMARY KEY,
  tenant_id   text NOT NULL,
  session_id  text NOT NULL,
  kind        text NOT NULL CHECK (kind IN ('fts', 'trgm')),
  messages    integer NOT NULL,
  built_at    timestamptz NOT NULL DEFAULT now(),
  UNIQUE (tenant_id, session_id, kind)
);
