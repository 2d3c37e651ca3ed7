-- The tool-call pass of the fts-backfill task (services/search/fts-backfill.ts) again, under a new
-- name: until 2026-12-02 the arguments' values were read through JSON.parse, so a number was
-- indexed as the double it rounds to (`1234567890123456789` as `1234567890123456800`, `1.10` as
-- `1.1`) and a key given twice kept only its last value; an id searched as the model wrote it was
-- never found. Rows with tool calls are derived again from the arguments' text.
INSERT INTO maintenance_state (name) VALUES ('fts-args-v6');
-- The new pass does all the old one did: the old one is marked done, so that no row in
-- maintenance_state looks like a pass left unfinished.
UPDATE maintenance_state SET done_at = now() WHERE name = 'fts-args-v4' AND done_at IS NULL;
