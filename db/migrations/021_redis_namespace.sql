-- The Redis namespace (MNEMOS_PREFIX and REDIS_URL's database number) this database is used with.
-- Inboxes, id state, error memory and dead letters live in Redis under it: a process started with
-- another one saw none of them, gave seqs of messages still waiting in the old inboxes to new
-- ones, and the old messages were dropped as replays once the old prefix came back. Recorded by
-- the first start; a start with another namespace refuses (services/redis-namespace.ts). Neither
-- the host nor the password is recorded: those change with a failover or a managed endpoint.
CREATE TABLE redis_namespace (
  singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  prefix      text NOT NULL,
  redis_db    integer NOT NULL,
  recorded_at timestamptz NOT NULL DEFAULT now()
);
