-- Recent index (tier 2) bookkeeping: the state of a running `mnemos reembed`, and messages the
-- embedder rejected for good. Portable to PostgreSQL 15+ and PGlite.

-- While `mnemos reembed` runs: the embedder it builds for, who holds the lease (a random id) and
-- when it started. `updated_at` is its heartbeat; a lease with an old heartbeat may be taken over.
ALTER TABLE vector_index
  ADD COLUMN target_model       text,
  ADD COLUMN target_dimensions  integer,
  ADD COLUMN reembed_id         text,
  ADD COLUMN reembed_started_at timestamptz;

-- A message the embedder refused (HTTP 400 for that input alone, while its batch-mates embedded
-- fine). Recorded per model so one poison message cannot block a session's vectors forever; a
-- reembed for another model tries it again. Holds no content.
CREATE TABLE message_vector_skips (
  tenant_id   text NOT NULL,
  session_id  text NOT NULL,
  seq         bigint NOT NULL,
  model       text NOT NULL,
  reason      text NOT NULL,
  at          timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant_id, session_id, seq, model),
  CONSTRAINT message_vector_skips_session_fk FOREIGN KEY (tenant_id, session_id)
    REFERENCES sessions (tenant_id, id) ON DELETE CASCADE
);
