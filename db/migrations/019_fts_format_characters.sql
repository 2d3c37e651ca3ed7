-- A sixth pass of the fts-backfill task (services/search/fts-backfill.ts): archive rows whose text
-- has invisible format characters (Unicode category Cf: soft hyphen, ZWNJ, ZWJ, zero-width space,
-- bidirectional marks) get their tsvector derived from the text as foldForIndex now reads it
-- (services/text/fts-text.ts): a soft hyphen, word joiner or zero-width no-break space dropped, any
-- other such character a word break. Until 2026-12-03 the database's parser decided, and embedded
-- PGlite (Postgres 18) kept `می‌خواهم` (with a ZWNJ) one word where Postgres 15 made it two, so
-- `خواهم` was found by full text on Postgres only; `software` found `soft<U+00AD>ware` on neither.
INSERT INTO maintenance_state (name) VALUES ('fts-format-v8');
