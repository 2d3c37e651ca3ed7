-- Keep embeddings inline in the heap row (a 1536-d vector is ~6 KB and fits a page) instead of
-- TOASTing them out of line: exact k-NN reads every vector of a session, and following a TOAST
-- pointer per row cost ~25 % on 20k 1536-d vectors in one session (tmp probe, p50 78 → 58 ms).
-- Larger vectors still go out of line as a last resort (MAIN, unlike PLAIN, never fails an insert).
ALTER TABLE message_vectors ALTER COLUMN embedding SET STORAGE MAIN;
