/**
 * Error memory: tool errors an agent ran into and what fixed them (or did not), kept per tenant
 * across sessions in Redis, each record living ERROR_MEMORY_TTL_DAYS after its last hit.
 * A "hit" is a write that merges into the record, or the record being returned by search,
 * lookup or get; every hit renews the TTL and sets `last_hit_at`. `hits` counts occurrences
 * (the first write plus every merged duplicate), not reads.
 */

export const OUTCOMES = ['resolved', 'failed', 'abandoned'] as const;
export type Outcome = (typeof OUTCOMES)[number];

/** Automatic tag derived from symptom + cause; stored beside the record, used in ranking. */
export const ERROR_CLASSES = [
  'timeout',
  'permission',
  'not_found',
  'invalid_parameter',
  'missing_parameter',
  'tool_missing',
  'other',
] as const;
export type ErrorClass = (typeof ERROR_CLASSES)[number];

/** The API shape of one record (exactly these fields, in this order). */
export type ErrorRecord = {
  id: string;
  tool_name: string;
  symptom: string;
  cause: string | null;
  action: string;
  outcome: Outcome;
  keywords: string[];
  hits: number;
  created_at: string;
  last_hit_at: string;
};

export type ErrorWriteInput = {
  tool_name: string;
  symptom: string;
  action: string;
  outcome: Outcome;
  cause?: string | null | undefined;
  keywords?: string[] | undefined;
  session_id?: string | undefined;
};

export type ErrorSearchInput = { tool_name?: string | undefined; query: string; limit: number };
export type ErrorLookupInput = { tool_name: string; error: string };

export type ErrorMemory = {
  write(tenantId: string, input: ErrorWriteInput): Promise<{ id: string; deduplicated: boolean }>;
  /** Ranked matches; every returned record is renewed. */
  search(tenantId: string, input: ErrorSearchInput): Promise<ErrorRecord[]>;
  /** At most 4 matches of the tool, as records and as compact text for an agent (`NONE` if none). */
  lookup(
    tenantId: string,
    input: ErrorLookupInput,
  ): Promise<{ related_errors: string; records: ErrorRecord[] }>;
  /** Renews the record. */
  get(tenantId: string, id: string): Promise<ErrorRecord | null>;
  /** Newest first; does not renew. */
  list(
    tenantId: string,
    input: { cursor?: string | undefined; limit: number },
  ): Promise<{ records: ErrorRecord[]; next: string | null }>;
  remove(tenantId: string, id: string): Promise<boolean>;
  /** Deletes the tenant's records of one tool, or all of them; returns how many. */
  purge(tenantId: string, input: { tool_name?: string | undefined }): Promise<number>;
  /**
   * Erases every error-memory key of the tenant (tenant deletion); returns records deleted. With
   * `sweepUnindexed: false`, only what its indexes know of (records, being written or not, and
   * their index keys): the keys of a record whose writer died before indexing it are found by
   * SCAN, which walks the whole keyspace, and tenant erasure sweeps the tenant's namespace anyway.
   */
  purgeTenant(tenantId: string, opts?: { sweepUnindexed?: boolean }): Promise<number>;
  /**
   * Drops index entries of expired or deleted records; returns how many records were cleaned.
   * With `existing` (which of these tenant ids the database still has), the records of the other
   * tenants are erased as purgeTenant does: an erased tenant's records that a Redis restored from
   * an older snapshot brought back would otherwise stay until their TTL.
   */
  sweepExpired(existing?: (tenantIds: string[]) => Promise<Set<string>>): Promise<number>;
  ping(): Promise<boolean>;
  close(): Promise<void>;
};

/** `err_` + 20 base32 characters (100 random bits). Checked before any Redis access. */
export const ERROR_ID_RE = /^err_[a-z2-7]{20}$/;
/** List cursor: `<created_ms>_<id>` of the last record of the previous page. */
export const LIST_CURSOR_RE = /^(\d{1,15})_(err_[a-z2-7]{20})$/;

/** A record as the store holds it (internal): the API fields plus what ranking and dedupe need. */
export type StoredError = {
  id: string;
  tool_name: string;
  symptom: string;
  cause: string | null;
  action: string;
  outcome: Outcome;
  keywords: string[];
  hits: number;
  created_ms: number;
  last_hit_ms: number;
  error_class: ErrorClass;
  embedding: number[] | null;
};
