-- The archive's tsvector of a message whose English input is longer than 65,536 bytes
-- (db/queries/messages.ts, ARCHIVE_TSVECTOR_SQL). Until 2026-12-01 that input was cut at 65,536
-- characters, so that no message could exceed Postgres's 1 MB of lexemes per tsvector, and the
-- words of a long tool output past that point were never found once it left the recent part. Now
-- the whole text is indexed; only when its lexemes would exceed the limit (about a megabyte of
-- distinct tokens: hashes, ids, base64) is the first 65,536 characters indexed instead, which fits
-- by construction (services/text/fts-text.ts). The exception block costs a subtransaction, so
-- only such long rows come here.
--
-- The CJK half goes first here: `a || b` shifts b's positions past a's, and Postgres records no
-- position above 16,383, so after the words of a long English text every CJK bigram sat at 16,383
-- and no CJK phrase (a word of 3+ characters) matched. The CJK half is at most 32,768 characters
-- (fts-text.ts); queries never relate positions across the two halves, so the order changes no
-- match.
CREATE FUNCTION mnemos_archive_tsvector(en text, cjk text)
RETURNS tsvector
LANGUAGE plpgsql STABLE AS $$
BEGIN
  BEGIN
    RETURN coalesce(cjk, '')::tsvector || to_tsvector('english', en);
  EXCEPTION WHEN program_limit_exceeded THEN
    RETURN coalesce(cjk, '')::tsvector || to_tsvector('english', left(en, 65536));
  END;
END $$;

-- A second pass of the fts-backfill task (services/search/fts-backfill.ts): archive rows whose
-- searchable text is longer than the old cut get their whole text indexed.
INSERT INTO maintenance_state (name) VALUES ('fts-long-v3');
