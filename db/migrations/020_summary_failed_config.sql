-- Summary failures remember the LLM configuration they happened under (a short fingerprint of
-- SUMMARY_MODEL and OPENAI_BASE_URL, workers/summarize.ts summaryConfigFingerprint; never a
-- secret). The sweep takes a failed or stalled session at once when the configuration running it
-- differs, so a fixed model name or endpoint heals stalled summaries at the next sweep; before,
-- they waited out their back-off (up to 6 h, and longer with every failure) and only a
-- `POST …/summarize` with each tenant's key brought them back. NULL: recorded before this
-- migration (any configuration counts as different: one retry after the upgrade).
ALTER TABLE summaries ADD COLUMN failed_config text;
