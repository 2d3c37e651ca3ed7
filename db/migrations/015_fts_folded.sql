-- A fourth pass of the fts-backfill task (services/search/fts-backfill.ts): archive rows whose text
-- has compatibility forms (full-width Latin, half-width katakana, decomposed accents) or a Greek
-- final sigma get their tsvector derived from the folded text (foldForIndex in
-- services/text/fts-text.ts). Until 2026-12-02 they were indexed as written, and a search in the
-- other form (`GPU` for `ＧＰＵ`) never found them.
INSERT INTO maintenance_state (name) VALUES ('fts-fold-v5');
