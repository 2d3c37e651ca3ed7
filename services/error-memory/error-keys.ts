/**
 * Redis key layout of error memory (T = `<prefix>:err:<tenant>`):
 *   T:rec:<id>                         HASH, the record (real PEXPIRE of the TTL)
 *   T:dedupe:<tool>:<sha1(normalised)> STRING holding the id; same TTL, renewed with the record
 *   T:all                              ZSET id → created ms (listing, purge, sweep)
 *   T:tool:<tool>                      ZSET id → created ms (tool filter, purge by tool)
 *   T:term:<term>                      ZSET id → last write or hit ms (search candidates)
 *   T:tterm:<tool>:<term>              ZSET id → last write or hit ms, of one tool's records (so a
 *                                      lookup by tool is not crowded out by other tools' records)
 *   T:resolved                         ZSET id → created ms of the records whose outcome is resolved
 *                                      (a record never leaves it while it lives: a failed attempt
 *                                      does not replace a fix); ranking reads the fixes first
 *                                      when more candidates than it reads share the query's terms
 *   T:ikeys                            SET of the tool, term and resolved keys above (for the sweep)
 *   T:dead                             SET of ids known gone, still to be swept out of T:ikeys
 *   T:pending                          ZSET id → ms of records being created: registered before the
 *                                      record is saved, removed once it has its expiry and its
 *                                      index entries, so a writer that dies in between leaves an
 *                                      entry the sweep and purge find
 *   T:v                                STRING "3" once every record of the tenant is under its
 *                                      tool's term keys and, if resolved, in T:resolved (a tenant
 *                                      that started on this layout, or one the sweep re-indexed;
 *                                      "2" before T:resolved existed: the sweep re-indexes those
 *                                      once more); without it a lookup by tool also reads the
 *                                      tenant-wide term keys
 *   <prefix>:err:tenants               SET of tenants with error memory (for the sweep)
 * (<tool> is URI-encoded.) Index entries are only candidates: every record is read before it is
 * returned, and an id whose record is gone is dropped lazily, then swept from every index.
 */

/** Tenant ids go into key names and SCAN patterns, so they must not hold `:` or glob characters. */
export const TENANT_RE = /^[A-Za-z0-9._@-]{1,128}$/;

export const tenantsRegistryKey = (prefix: string) => `${prefix}:err:tenants`;

export function errorKeys(prefix: string, tenantId: string) {
  if (!TENANT_RE.test(tenantId))
    throw new Error('error memory: tenant id has characters unsafe in Redis keys');
  const base = `${prefix}:err:${tenantId}`;
  return {
    base,
    rec: (id: string) => `${base}:rec:${id}`,
    /** The redis-om entity id: the schema is named `<prefix>:err`, so its key is `rec` above. */
    entity: (id: string) => `${tenantId}:rec:${id}`,
    dedupePrefix: `${base}:dedupe:`,
    all: `${base}:all`,
    tool: (tool: string) => `${base}:tool:${encodeURIComponent(tool)}`,
    term: (term: string) => `${base}:term:${term}`,
    toolTerm: (tool: string, term: string) => `${base}:tterm:${encodeURIComponent(tool)}:${term}`,
    resolved: `${base}:resolved`,
    ikeys: `${base}:ikeys`,
    dead: `${base}:dead`,
    pending: `${base}:pending`,
    version: `${base}:v`,
  };
}
export type ErrorKeys = ReturnType<typeof errorKeys>;
