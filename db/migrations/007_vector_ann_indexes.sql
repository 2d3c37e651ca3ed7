-- Per-session partial HNSW indexes on message_vectors for huge sessions (ANN_MIN_VECTORS), built
-- and dropped by the ann-indexes maintenance task (services/recent-index/ann-indexes.ts). This
-- table records which exist; it has no foreign key so that a deleted session's row outlives it
-- until the task has dropped its index.
CREATE TABLE vector_ann_indexes (
  index_name  text PRIMARY KEY,
  tenant_id   text NOT NULL,
  session_id  text NOT NULL,
  dimensions  integer NOT NULL,
  vectors     integer NOT NULL,
  built_at    timestamptz NOT NULL DEFAULT now(),
  UNIQUE (tenant_id, session_id)
);
