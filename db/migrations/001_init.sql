-- mnemos schema v1. Portable to PostgreSQL 15+ and PGlite (PostgreSQL 18).
CREATE EXTENSION IF NOT EXISTS vector;

CREATE TABLE tenants (
  id          text PRIMARY KEY,
  name        text NOT NULL UNIQUE,
  created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
  id            text PRIMARY KEY,
  tenant_id     text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
  name          text NOT NULL DEFAULT '',
  secret_hash   bytea NOT NULL,
  created_at    timestamptz NOT NULL DEFAULT now(),
  last_used_at  timestamptz,
  revoked_at    timestamptz
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id, created_at);

-- One row per session ever written to. `next_seq` is one past the highest archived seq and seeds
-- the Redis sequence counter; it survives reset and delete, so seq is never reused. A deleted
-- session keeps this row as a content-free tombstone (deleted_at set, generation bumped).
CREATE TABLE sessions (
  tenant_id        text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
  id               text NOT NULL,
  generation       integer NOT NULL DEFAULT 1,
  next_seq         bigint NOT NULL DEFAULT 1,
  message_count    integer NOT NULL DEFAULT 0,
  hot_bytes        bigint NOT NULL DEFAULT 0,
  start_seq        bigint NOT NULL DEFAULT 0,
  start_at_ns      bigint,
  created_at       timestamptz NOT NULL DEFAULT now(),
  last_message_at  timestamptz,
  deleted_at       timestamptz,
  -- hot_bytes at the last compaction attempt that found no cut point: no re-trigger until it grows.
  compact_blocked_at_bytes bigint,
  PRIMARY KEY (tenant_id, id)
);
CREATE INDEX sessions_recent ON sessions (tenant_id, last_message_at DESC NULLS LAST);

-- Tier 3: the archive. Every message ever accepted, never deleted by compaction.
CREATE TABLE messages (
  tenant_id      text NOT NULL,
  session_id     text NOT NULL,
  seq            bigint NOT NULL,
  id             text NOT NULL,
  role           text NOT NULL,
  content        text,
  parts          jsonb,
  name           text,
  tool_call_id   text,
  tool_calls     jsonb,
  metadata       jsonb,
  sent_at_ns     bigint NOT NULL,
  sent_at_given  boolean NOT NULL,
  bytes          integer NOT NULL,
  fingerprint    text NOT NULL,
  archived_at    timestamptz NOT NULL DEFAULT now(),
  -- Stemmed English lexemes plus CJK character bigrams, both from a capped text computed at write
  -- time (a tsvector must stay under 1 MB, so an accepted message can never fail indexing).
  search_tsv     tsvector NOT NULL,
  PRIMARY KEY (tenant_id, session_id, seq),
  CONSTRAINT messages_session_fk FOREIGN KEY (tenant_id, session_id)
    REFERENCES sessions (tenant_id, id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX messages_client_id ON messages (tenant_id, session_id, id);
CREATE INDEX messages_sent_at ON messages (tenant_id, session_id, sent_at_ns);
CREATE INDEX messages_fts ON messages USING gin (search_tsv);

-- Tier 2: the recent index (messages at or after the compaction cutoff). The column is an
-- untyped `vector` so the dimension follows the configured embedder; `vector_index` records
-- which model and dimension every row was made with, and `mnemos reembed` rebuilds it.
CREATE TABLE message_vectors (
  tenant_id   text NOT NULL,
  session_id  text NOT NULL,
  seq         bigint NOT NULL,
  embedding   vector NOT NULL,
  PRIMARY KEY (tenant_id, session_id, seq),
  CONSTRAINT message_vectors_session_fk FOREIGN KEY (tenant_id, session_id)
    REFERENCES sessions (tenant_id, id) ON DELETE CASCADE
);

CREATE TABLE vector_index (
  singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  model       text NOT NULL,
  dimensions  integer NOT NULL,
  state       text NOT NULL DEFAULT 'ready',
  updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE summaries (
  tenant_id      text NOT NULL,
  session_id     text NOT NULL,
  summary        jsonb NOT NULL,
  cursor_seq     bigint,
  version        integer NOT NULL DEFAULT 1,
  status         text NOT NULL DEFAULT 'ok',
  failures       integer NOT NULL DEFAULT 0,
  last_error     text,
  next_attempt_at timestamptz,
  updated_at     timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant_id, session_id),
  CONSTRAINT summaries_session_fk FOREIGN KEY (tenant_id, session_id)
    REFERENCES sessions (tenant_id, id) ON DELETE CASCADE
);

-- Usage outlives sessions: on delete the session id is cleared, the counts stay.
CREATE TABLE llm_usage (
  tenant_id      text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
  session_id     text,
  purpose        text NOT NULL,
  model          text NOT NULL,
  calls          integer NOT NULL DEFAULT 1,
  input_tokens   bigint NOT NULL DEFAULT 0,
  output_tokens  bigint NOT NULL DEFAULT 0,
  at             timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX llm_usage_tenant_at ON llm_usage (tenant_id, at);
CREATE INDEX llm_usage_session ON llm_usage (tenant_id, session_id) WHERE session_id IS NOT NULL;
