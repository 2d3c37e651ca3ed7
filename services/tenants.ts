import { createHash, randomBytes, timingSafeEqual } from 'node:crypto';
import type { Db } from '../db/pool.js';
import {
  findApiKey,
  findTenant,
  insertApiKey,
  insertTenant,
  listApiKeys,
  listTenants,
  revokeApiKey,
  touchApiKey,
} from '../db/queries/tenants.js';
import type { PageAfter } from '../db/queries/tenants.js';
import { AppError, unavailable } from './errors.js';
import { codePoints } from './text/code-points.js';
import { monotonicNow } from './time.js';
import { pageOf } from './validate.js';
import { hasBadChars } from './messages/message-input.js';

/** API keys look like `mn_<key id>_<secret>`; only sha256(secret) is stored. */
const KEY_ID_RE = /^[a-z2-7]{12}$/;
const KEY_RE = /^mn_([a-z2-7]{12})_([A-Za-z0-9]{40})$/;

/**
 * The key id a CLI argument names: a key id as `key list` shows it, or an API key (`mn_<key id>_`
 * and its secret, pasted whole or cut short), read for its id; null for anything else.
 */
export function keyIdOf(arg: string): string | null {
  const id = /^mn_([a-z2-7]{12})_/.exec(arg)?.[1] ?? arg;
  return KEY_ID_RE.test(id) ? id : null;
}
const BASE32 = 'abcdefghijklmnopqrstuvwxyz234567';
const BASE62 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789';

function randomString(alphabet: string, length: number): string {
  // Rejection sampling keeps every character uniform.
  const out: string[] = [];
  const limit = 256 - (256 % alphabet.length);
  while (out.length < length) {
    for (const b of randomBytes(length * 2)) {
      if (b < limit && out.length < length) out.push(alphabet[b % alphabet.length]!);
    }
  }
  return out.join('');
}

const hashSecret = (secret: string) => createHash('sha256').update(secret).digest();

export const newTenantId = () => `t_${randomString(BASE32, 16)}`;
const TENANT_ID_RE = /^t_[a-z2-7]{16}$/;

export interface TenantView {
  tenant_id: string;
  name: string;
  created_at: string;
  /** When its erasure started; null for a tenant not under erasure. */
  erasing_at: string | null;
}

export interface KeyView {
  key_id: string;
  tenant_id: string;
  name: string;
  created_at: string;
  last_used_at: string | null;
  revoked_at: string | null;
}

// eslint-disable-next-line no-control-regex
const CONTROL_CHARS = /[\u0000-\u001f\u007f-\u009f]/;
/**
 * Characters that make a name look like another in a list: invisible ones (soft hyphen, zero-width
 * space, word joiner, byte-order mark) and bidirectional embeddings, overrides and isolates, which
 * reorder what follows ("acme\u202egnp" shows as "acmepng"). The zero-width joiner and non-joiner
 * stay: emoji sequences, Persian and Indic words need them.
 */
const INVISIBLE_CHARS = /[\u00ad\u180e\u200b\u2060-\u2064\ufeff\u202a-\u202e\u2066-\u2069]/;
const UNPRINTABLE =
  'must not contain control characters, lone surrogates, invisible characters or direction overrides';
const unprintable = (name: string) =>
  CONTROL_CHARS.test(name) || INVISIBLE_CHARS.test(name) || hasBadChars(name);

function badName(problem: string): AppError {
  return new AppError(400, 'validation_failed', `name: ${problem}`, {
    problems: [{ path: 'name', message: problem }],
  });
}

/** Tenant and key names: at most this many characters (code points, not UTF-16 units). */
export const MAX_NAME_CHARS = 128;

/** Tenant names are what `--tenant <id|name>` resolves: never blank, never shaped like an id. */
function assertTenantName(name: string): void {
  const problem =
    name.trim() === ''
      ? 'must not be blank'
      : name !== name.trim()
        ? 'must not start or end with spaces'
        : codePoints(name) > MAX_NAME_CHARS
          ? `must be at most ${MAX_NAME_CHARS} characters`
          : unprintable(name)
            ? UNPRINTABLE
            : TENANT_ID_RE.test(name)
              ? 'must not look like a tenant id (t_ and 16 characters of a-z and 2-7)'
              : null;
  if (problem) throw badName(problem);
}

export async function createTenant(db: Db, name: string): Promise<{ tenant_id: string; api_key: string }> {
  assertTenantName(name);
  return db.transaction(async (tx) => {
    const row = await insertTenant(tx, newTenantId(), name);
    if (!row) throw new AppError(409, 'tenant_exists', `a tenant named "${name}" already exists`);
    const key = await createKeyIn(tx, row.id, 'default');
    return { tenant_id: row.id, api_key: key.api_key };
  });
}

async function createKeyIn(tx: Parameters<typeof insertApiKey>[0], tenantId: string, name: string) {
  const id = randomString(BASE32, 12);
  const secret = randomString(BASE62, 40);
  if (!(await insertApiKey(tx, { id, tenantId, name, secretHash: hashSecret(secret) }))) {
    // Erased meanwhile, or being erased: the erasure revoked every key and no new one may outlive it.
    throw new AppError(404, 'not_found', 'tenant not found (it is being erased)');
  }
  return { key_id: id, api_key: `mn_${id}_${secret}` };
}

export async function createKey(
  db: Db,
  tenantIdOrName: string,
  name = '',
): Promise<{ key_id: string; tenant_id: string; api_key: string }> {
  // Key names are free text, but printable: the same rule as tenant names. None is '' (no name);
  // a blank one, or one with spaces around it, would list like another or like none.
  if (name !== '' && name.trim() === '') throw badName('must not be blank (leave it out for no name)');
  if (name !== name.trim()) throw badName('must not start or end with spaces');
  if (unprintable(name)) throw badName(UNPRINTABLE);
  if (codePoints(name) > MAX_NAME_CHARS) throw badName(`must be at most ${MAX_NAME_CHARS} characters`);
  const tenant = await findTenant(db, tenantIdOrName);
  if (!tenant) throw new AppError(404, 'not_found', 'tenant not found');
  const key = await createKeyIn(db, tenant.id, name);
  return { ...key, tenant_id: tenant.id };
}

/** A page of a listing: `next` is the opaque cursor of the following page, null after the last. */
export interface Page<T> {
  items: T[];
  next: string | null;
}

export interface PageRequest {
  cursor?: string | undefined;
  limit?: number | undefined;
}

function pageAfter(cursor: string | undefined): PageAfter | null {
  if (cursor === undefined) return null;
  // 16 digits of microseconds reach the year 2286; more would overflow Postgres's bigint and interval.
  const m = /^(\d{1,16}):([A-Za-z0-9_]{1,64})$/.exec(Buffer.from(cursor, 'base64url').toString());
  if (!m) {
    throw new AppError(400, 'validation_failed', 'cursor: not a cursor of this list', {
      problems: [{ path: 'cursor', message: 'not a cursor of this list' }],
    });
  }
  return { createdUs: m[1]!, id: m[2]! };
}

function toPage<R extends { id: string; created_us: string }, T>(
  rows: R[],
  limit: number | undefined,
  view: (row: R) => T,
): Page<T> {
  // The query asked for one row more than the page (none when there is no limit).
  const { items, more } = limit === undefined ? { items: rows, more: false } : pageOf(rows, limit);
  const last = items[items.length - 1];
  const full = more && last;
  return {
    items: items.map(view),
    next: full ? Buffer.from(`${last.created_us}:${last.id}`).toString('base64url') : null,
  };
}

/** Tenants in creation order; without `limit`, all of them. */
export async function tenantList(db: Db, page: PageRequest = {}): Promise<Page<TenantView>> {
  const rows = await listTenants(
    db,
    pageAfter(page.cursor),
    page.limit === undefined ? null : page.limit + 1,
  );
  return toPage(rows, page.limit, (t) => ({
    tenant_id: t.id,
    name: t.name,
    created_at: t.created_at.toISOString(),
    erasing_at: t.erasing_at?.toISOString() ?? null,
  }));
}

/** Keys in creation order, of one tenant (id or name; 404 when unknown) or of all. */
export async function keyList(
  db: Db,
  tenantIdOrName?: string,
  page: PageRequest = {},
): Promise<Page<KeyView>> {
  let tenantId: string | undefined;
  if (tenantIdOrName !== undefined) {
    const tenant = await findTenant(db, tenantIdOrName);
    if (!tenant) throw new AppError(404, 'not_found', 'tenant not found');
    tenantId = tenant.id;
  }
  const rows = await listApiKeys(
    db,
    tenantId,
    pageAfter(page.cursor),
    page.limit === undefined ? null : page.limit + 1,
  );
  return toPage(rows, page.limit, (k) => ({
    key_id: k.id,
    tenant_id: k.tenant_id,
    name: k.name,
    created_at: k.created_at.toISOString(),
    last_used_at: k.last_used_at?.toISOString() ?? null,
    revoked_at: k.revoked_at?.toISOString() ?? null,
  }));
}

export async function revokeKey(db: Db, keyId: string): Promise<boolean> {
  return revokeApiKey(db, keyId);
}

// A fixed hash to compare against when the key id is unknown, so a miss costs the same as a hit.
const DUMMY_HASH = hashSecret('mnemos-dummy-secret-for-constant-time-compare');

/** How long a verified key is trusted without asking Postgres again (revocation delay elsewhere). */
export const KEY_CACHE_MS = 5000;
const TOUCH_EVERY_MS = 60_000;
/** Cached verifications of key ids that exist, and of ids that do not. */
const MAX_KNOWN_KEYS = 10_000;
const MAX_UNKNOWN_KEYS = 1_000;

export interface KeyAuthenticator {
  /**
   * Resolves a bearer key to its tenant, or null. Constant-time on the secret. `maxAgeMs`: how old
   * the database's answer may be (default KEY_CACHE_MS); `verifiedAt` says when it was read.
   */
  authenticate(
    presented: string,
    maxAgeMs?: number,
  ): Promise<{ tenantId: string; keyId: string; verifiedAt: number } | null>;
  /** Forget cached keys (after a revocation or tenant erasure in this process). */
  clear(): void;
}

/**
 * Key verification with a short in-process cache: the hot path costs no Postgres round trip for a
 * key seen in the last few seconds, and `last_used_at` is written at most once a minute per key.
 * A revocation takes effect at once in the process that made it and within KEY_CACHE_MS elsewhere.
 */
export function makeKeyAuthenticator(
  db: Db,
  now: () => number = monotonicNow,
  opts: { readTimeoutMs?: number } = {},
): KeyAuthenticator {
  type KeyRow = { tenant_id: string; secret_hash: Buffer; revoked: boolean } | null;
  type Entry = { row: KeyRow; at: number };
  // Key ids that exist, and apart from them, ids that do not (so that a client repeating a bad key
  // is answered without Postgres). Unknown ids cost a client nothing to make up: kept with the
  // known ones, 10,000 of them emptied the cache, and every tenant's next request read Postgres.
  // Each map drops its oldest entries when full. Its order is that of the reads (an entry is
  // re-inserted when read again), and an entry in use is read again every KEY_CACHE_MS, so the
  // first entries are those unused the longest.
  const cache = new Map<string, Entry>();
  const unknown = new Map<string, Entry>();
  const remember = (id: string, entry: Entry) => {
    const [into, other, max] = entry.row
      ? [cache, unknown, MAX_KNOWN_KEYS]
      : [unknown, cache, MAX_UNKNOWN_KEYS];
    other.delete(id);
    into.delete(id);
    into.set(id, entry);
    if (into.size > max) into.delete(into.keys().next().value!);
  };
  // One database read per key at a time: the requests that find the entry too old share it. A
  // read that began before a clear() (a revocation here) answers its own requests but is not cached.
  // A read without an answer within `readTimeoutMs` fails as Postgres unavailable (503) and is
  // shared no more: one left waiting on a connection that went silent held every later request
  // of its key, for ever, after Postgres was back.
  const reading = new Map<string, Promise<{ row: KeyRow; at: number }>>();
  let epoch = 0;
  const within = <T>(p: Promise<T>): Promise<T> => {
    const ms = opts.readTimeoutMs ?? 0;
    if (!(ms > 0)) return p;
    let timer: NodeJS.Timeout | undefined;
    return Promise.race([
      p,
      new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(unavailable('postgres')), ms);
      }),
    ]).finally(() => clearTimeout(timer));
  };
  const read = (id: string) => {
    let p = reading.get(id);
    if (!p) {
      const at = now();
      const began = epoch;
      p = within(findApiKey(db, id))
        .then((r) => {
          const entry = {
            row: r ? { tenant_id: r.tenant_id, secret_hash: r.secret_hash, revoked: r.revoked } : null,
            at,
          };
          if (began === epoch) remember(id, entry);
          return entry;
        })
        .finally(() => {
          if (reading.get(id) === p) reading.delete(id);
        });
      reading.set(id, p);
    }
    return p;
  };
  const touched = new Map<string, number>();
  return {
    async authenticate(presented, maxAgeMs = KEY_CACHE_MS) {
      const m = KEY_RE.exec(presented);
      const given = hashSecret(m?.[2] ?? presented);
      let row: KeyRow = null;
      let verifiedAt = now();
      if (m) {
        const id = m[1]!;
        const hit = cache.get(id) ?? unknown.get(id);
        const entry = hit && now() - hit.at < Math.min(maxAgeMs, KEY_CACHE_MS) ? hit : await read(id);
        row = entry.row;
        verifiedAt = entry.at;
      }
      const ok = timingSafeEqual(given, row ? row.secret_hash : DUMMY_HASH) && row !== null && !row.revoked;
      if (!ok || !row || !m) return null;
      const keyId = m[1]!;
      if ((touched.get(keyId) ?? 0) < now() - TOUCH_EVERY_MS) {
        // Bounded like the cache: forgetting a touch costs one more UPDATE of last_used_at.
        if (touched.size >= 10_000) touched.clear();
        touched.set(keyId, now());
        void touchApiKey(db, keyId).catch(() => undefined);
      }
      return { tenantId: row.tenant_id, keyId, verifiedAt };
    },
    clear() {
      epoch++;
      cache.clear();
      unknown.clear();
      reading.clear();
    },
  };
}

/** Constant-time comparison of the admin token. */
export function isAdminToken(expected: string | undefined, presented: string | undefined): boolean {
  if (!expected || presented === undefined) return false;
  return timingSafeEqual(hashSecret(expected), hashSecret(presented));
}
