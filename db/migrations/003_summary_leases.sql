-- Rolling summaries: the per-session lease that keeps two summarize runs of one session from
-- overlapping, across processes. Portable to PostgreSQL 15+ and PGlite.
--
-- A run takes the lease (insert, or take over an expired one), renews it while it works (LLM calls
-- can take minutes, so a transaction-scoped lock cannot span them) and deletes it when done. A
-- crashed holder's lease simply expires. Holds no content: `holder` is a random token.
CREATE TABLE summary_leases (
  tenant_id   text NOT NULL,
  session_id  text NOT NULL,
  holder      text NOT NULL,
  expires_at  timestamptz NOT NULL,
  PRIMARY KEY (tenant_id, session_id),
  CONSTRAINT summary_leases_session_fk FOREIGN KEY (tenant_id, session_id)
    REFERENCES sessions (tenant_id, id) ON DELETE CASCADE
);

-- The stalled-summaries gauge is sampled on every /metrics scrape.
CREATE INDEX summaries_stalled ON summaries (tenant_id) WHERE status = 'stalled';
