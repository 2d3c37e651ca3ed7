-- Indexes for the list endpoints, whose pages cost what they skip without them (a tester's
-- probe at scale, 2026-12-02):
-- * GET /v1/sessions walks a tenant's sessions in id order and skipped its tombstones one by one:
--   deleted sessions stay as rows (they keep next_seq), and the temp reaper adds one for every
--   `temp-` session, so a tenant with 200,000 of them read 5,761 buffers (55 ms) for a page of
--   101 live sessions. The partial index holds live sessions only.
-- * the admin tenant list and the key list page in (created_at, id) order and sorted the whole
--   table for each page (920 buffers a page at 100,000 tenants: paging through all of them grew
--   with their square).
CREATE INDEX sessions_live ON sessions (tenant_id, id) WHERE deleted_at IS NULL;
CREATE INDEX tenants_created ON tenants (created_at, id);
CREATE INDEX api_keys_created ON api_keys (created_at, id);
