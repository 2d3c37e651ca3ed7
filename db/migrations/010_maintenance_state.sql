-- Progress of one-off passes over existing data, so that a pass resumes where it stopped and runs
-- once. The first: 'fts-cjk-v2' re-derives the tsvector of archive rows holding CJK text, which
-- until 2026-12-01 was built without the gap between CJK runs and with the katakana prolonged
-- sound mark as a word break (services/search/fts-backfill.ts).
CREATE TABLE maintenance_state (
  name text PRIMARY KEY,
  state jsonb NOT NULL DEFAULT '{}'::jsonb,
  done_at timestamptz
);
INSERT INTO maintenance_state (name) VALUES ('fts-cjk-v2');
