-- Session lifecycle (reset, delete, import, temp reaper). Portable to PostgreSQL 15+ and PGlite.

-- A reset or delete bumps `generation` in Postgres and then moves the session's Redis state (the
-- inbox generation) to it. `redis_generation` records the last generation Redis is known to hold:
-- a crash or Redis outage between the two steps leaves it behind, and the lifecycle reconciler
-- finishes the step later. Without it, Redis would keep stamping new messages with the old
-- generation, and the ingest worker would drop them as stale.
ALTER TABLE sessions ADD COLUMN redis_generation integer NOT NULL DEFAULT 1;
-- Only rows whose generation moved: the column's default already holds the rest, and rewriting
-- every row (deleted ones too) under the ALTER's exclusive lock took 93 s on 3 million sessions.
UPDATE sessions SET redis_generation = generation WHERE generation <> 1;
CREATE INDEX sessions_redis_behind ON sessions (tenant_id, id) WHERE redis_generation <> generation;

-- The temp reaper's candidates: live throwaway sessions.
CREATE INDEX sessions_temp_live ON sessions (created_at) WHERE deleted_at IS NULL AND id LIKE 'temp-%';
