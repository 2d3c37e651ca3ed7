-- A third pass of the fts-backfill task (services/search/fts-backfill.ts): archive rows with tool
-- calls get their tsvector derived from the arguments' decoded keys and values. Until 2026-12-02
-- the raw JSON was indexed, so an escape glued itself to the next word ("cd /srv\nrestart" indexed
-- `nrestart`, `\u8a18` hex fragments) and those words were never found.
INSERT INTO maintenance_state (name) VALUES ('fts-args-v4');
