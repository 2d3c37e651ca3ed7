-- A fifth pass of the fts-backfill task (services/search/fts-backfill.ts): archive rows whose text
-- has compounds, words joined by `.`, `/` or `@` (`java.lang.NullPointerException`,
-- `/app/worker/tasks.py`, `ops-team@example.org`), get their tsvector derived with each compound's
-- parts as words too (compoundParts in services/text/fts-text.ts). Until 2026-12-02 Postgres's
-- parser indexed such a compound as one token only, and once a message left the recent part no
-- search for `NullPointerException` or `tasks` found it.
INSERT INTO maintenance_state (name) VALUES ('fts-compound-v7');
