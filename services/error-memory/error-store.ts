import { createHash } from 'node:crypto';
import { createRequire } from 'node:module';
import { Repository, Schema } from 'redis-om';
import type { RedisClientConnection } from 'redis-om';
import { AppError, unavailable } from '../errors.js';
import type { Logger } from '../logger.js';
import { KEYWORD_SEPARATOR, classifyError, normaliseKeywords, normaliseSymptom } from './normalise.js';
import {
  buildQuery,
  indexTerms,
  rankRecords,
  renderRelated,
  toApiRecord,
  RELATED_MAX_RECORDS,
} from './ranking.js';
import {
  COMPARE_AND_DELETE_SCRIPT,
  DELETE_SCRIPT,
  FORGET_TENANT_SCRIPT,
  MERGE_SCRIPT,
  RENEW_SCRIPT,
  SWEEP_KEY_SCRIPT,
} from './redis-scripts.js';
import { TENANT_RE, errorKeys, tenantsRegistryKey } from './error-keys.js';
import type { ErrorKeys } from './error-keys.js';
import { newErrorId, toStoredError } from './stored-error.js';
import { ERROR_ID_RE, LIST_CURSOR_RE } from './types.js';
import type { ErrorMemory, ErrorWriteInput, StoredError } from './types.js';

/**
 * The error-memory store: the only module that talks to redis-om. Records are redis-om HASH
 * entities; since plain Redis has no search module, lookups go through index keys kept here.
 * Key layout: `error-keys.ts`.
 */

const MAX_KEYWORDS_STORED = 64;
export const CANDIDATES_PER_TERM = 1000;
export const MAX_FETCHED = 256;
const WRITE_ATTEMPTS = 5;
const BATCH = 500;

export type ErrorMemoryOptions = {
  redisUrl: string;
  prefix: string;
  ttlDays: number;
  embed?: (text: string) => number[];
  now?: () => number;
  logger?: Pick<Logger, 'warn'>;
  /** Deadline of one request-path operation; past it the caller gets a 503. */
  opTimeoutMs?: number;
  /**
   * How long opening waits for the first connection (default 5 s). Past it the store opens
   * anyway and keeps reconnecting in the background; until then every call answers 503 and
   * `ping()` is false, so a Redis outage at start-up does not keep the API from starting.
   */
  connectWaitMs?: number;
};

type CreateClient = (options: {
  url: string;
  disableOfflineQueue?: boolean;
  socket?: { connectTimeout?: number; reconnectStrategy?: (retries: number) => number };
}) => RedisClientConnection;

// The node-redis major redis-om was built for (v4), resolved from redis-om's own dependencies
// so that a different top-level `redis` cannot slip in.
function loadCreateClient(): CreateClient {
  const omEntry = createRequire(import.meta.url).resolve('redis-om');
  return (createRequire(omEntry)('redis') as { createClient: CreateClient }).createClient;
}

const sha1 = (text: string) => createHash('sha1').update(text).digest('hex');

const TRANSIENT_REPLY = /^(?:LOADING|BUSY|OOM|MISCONF|READONLY|MASTERDOWN|TRYAGAIN|CLUSTERDOWN)\b/;

export async function openErrorMemory(opts: ErrorMemoryOptions): Promise<ErrorMemory> {
  const ttlMs = Math.max(1, Math.round(opts.ttlDays * 86_400_000));
  const now = opts.now ?? Date.now;
  const opTimeoutMs = opts.opTimeoutMs ?? 10_000;
  const tenantsKey = tenantsRegistryKey(opts.prefix);

  const client = loadCreateClient()({
    url: opts.redisUrl,
    disableOfflineQueue: true,
    socket: { connectTimeout: 5000, reconnectStrategy: (retries) => Math.min(100 * 2 ** retries, 2000) },
  });
  client.on('error', (err: unknown) => opts.logger?.warn({ err }, 'error-memory redis connection error'));
  const connecting = client.connect().then(
    () => true,
    (err: unknown) => {
      opts.logger?.warn({ err }, 'error-memory redis connection failed');
      return false;
    },
  );
  let waiting: NodeJS.Timeout | undefined;
  await Promise.race([
    connecting,
    new Promise((resolve) => {
      waiting = setTimeout(resolve, opts.connectWaitMs ?? 5000);
    }),
  ]);
  clearTimeout(waiting);

  const schema = new Schema(
    `${opts.prefix}:err`,
    {
      tool_name: { type: 'string' },
      symptom: { type: 'string' },
      cause: { type: 'string' },
      action: { type: 'string' },
      outcome: { type: 'string' },
      keywords: { type: 'string[]', separator: KEYWORD_SEPARATOR },
      hits: { type: 'number' },
      created_ms: { type: 'number' },
      last_hit_ms: { type: 'number' },
      error_class: { type: 'string' },
      dedupe: { type: 'string' },
      session_id: { type: 'string' },
      embedding: { type: 'string' },
    },
    { dataStructure: 'HASH' },
  );
  const repo = new Repository(schema, client);

  const keys = (tenantId: string) => errorKeys(opts.prefix, tenantId);

  async function guard<T>(fn: () => Promise<T>, deadline = true): Promise<T> {
    if (!client.isReady) throw unavailable('redis');
    let timer: NodeJS.Timeout | undefined;
    try {
      if (!deadline) return await fn();
      const expired = new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(unavailable('redis')), opTimeoutMs);
      });
      return await Promise.race([fn(), expired]);
    } catch (err) {
      if (err instanceof AppError) throw err;
      const message = err instanceof Error ? err.message : '';
      if (!client.isReady || TRANSIENT_REPLY.test(message)) throw unavailable('redis');
      throw err;
    } finally {
      clearTimeout(timer);
    }
  }

  const evalScript = (script: string, keyList: string[], args: string[]) =>
    client.eval(script, { keys: keyList, arguments: args });

  /** Reads records; ids whose record is gone come back as null. */
  async function fetchMany(k: ErrorKeys, ids: readonly string[]): Promise<Array<StoredError | null>> {
    if (ids.length === 0) return [];
    const entities = await repo.fetch(ids.map(k.entity));
    return entities.map((e, i) => toStoredError(ids[i] ?? '', e));
  }

  /** Lazily drops ids found gone from the keys they were found in; the sweep does the rest. */
  async function forget(
    k: ErrorKeys,
    ids: readonly string[],
    foundIn: readonly string[] = [],
  ): Promise<void> {
    if (ids.length === 0) return;
    const m = client.multi();
    for (const key of [k.all, ...foundIn]) m.zRem(key, [...ids]);
    m.sAdd(k.dead, [...ids]);
    await m.exec();
  }

  async function index(tenantId: string, k: ErrorKeys, rec: StoredError): Promise<void> {
    const toolKey = k.tool(rec.tool_name);
    const termKeys = indexTerms(rec).map(k.term);
    const m = client.multi();
    m.zAdd(k.all, { score: rec.created_ms, value: rec.id });
    m.zAdd(toolKey, { score: rec.created_ms, value: rec.id });
    for (const key of termKeys) m.zAdd(key, { score: rec.last_hit_ms, value: rec.id });
    m.sAdd(k.ikeys, [toolKey, ...termKeys]);
    m.sAdd(tenantsKey, tenantId);
    await m.exec();
  }

  /** Renews the records (a hit); returns the ids that still existed. */
  async function renew(k: ErrorKeys, ids: readonly string[], at: number): Promise<Set<string>> {
    const alive = await Promise.all(
      ids.map((id) => evalScript(RENEW_SCRIPT, [k.rec(id)], [id, String(ttlMs), String(at), k.dedupePrefix])),
    );
    return new Set(ids.filter((_, i) => alive[i] === 1));
  }

  async function write(tenantId: string, input: ErrorWriteInput) {
    const k = keys(tenantId);
    const tool = input.tool_name.trim();
    const symptom = input.symptom.trim();
    const action = input.action.trim();
    const cause = input.cause?.trim() || null;
    const keywords = normaliseKeywords(input.keywords ?? []);
    const dedupe = `${encodeURIComponent(tool)}:${sha1(normaliseSymptom(symptom))}`;
    const dedupeKey = k.dedupePrefix + dedupe;
    for (let attempt = 0; attempt < WRITE_ATTEMPTS; attempt++) {
      const at = now();
      const existing = await client.get(dedupeKey);
      if (existing !== null) {
        const merged = await evalScript(
          MERGE_SCRIPT,
          [k.rec(existing), dedupeKey],
          [
            existing,
            String(ttlMs),
            String(at),
            action,
            input.outcome,
            cause === null ? '0' : '1',
            cause ?? '',
            keywords.join(KEYWORD_SEPARATOR),
            String(MAX_KEYWORDS_STORED),
            input.session_id ?? '',
          ],
        );
        if (merged === 1) {
          // Re-indexing on every merge also heals a record whose creator died before indexing it.
          const [rec] = await fetchMany(k, [existing]);
          if (rec) await index(tenantId, k, rec);
          return { id: existing, deduplicated: true };
        }
        // The key outlived its record by a moment (or the record was deleted): clear it, retry.
        await evalScript(COMPARE_AND_DELETE_SCRIPT, [dedupeKey], [existing]);
        continue;
      }
      const id = newErrorId();
      const errorClass = classifyError(`${symptom}\n${cause ?? ''}`);
      const vector = opts.embed?.(`${symptom}\n${cause ?? ''}`);
      const fields = {
        tool_name: tool,
        symptom,
        action,
        outcome: input.outcome,
        keywords,
        hits: 1,
        created_ms: at,
        last_hit_ms: at,
        error_class: errorClass,
      };
      await repo.save(k.entity(id), {
        ...fields,
        cause: cause ?? undefined,
        dedupe,
        session_id: input.session_id,
        embedding: vector ? JSON.stringify(vector.map((x) => Math.round(x * 1e5) / 1e5)) : undefined,
      });
      await client.pExpire(k.rec(id), ttlMs);
      // The record exists before its dedupe key does, so a duplicate that finds the key always
      // finds the record; the loser of this race drops its unindexed copy and merges instead.
      const won = await client.set(dedupeKey, id, { NX: true, PX: ttlMs });
      if (won === 'OK') {
        const rec = toStoredError(id, { ...fields, cause });
        if (rec) await index(tenantId, k, rec);
        return { id, deduplicated: false };
      }
      await client.unlink(k.rec(id));
    }
    throw new AppError(503, 'busy', 'error memory is busy with this record, retry', undefined, {
      'retry-after': '1',
    });
  }

  async function rankedSearch(tenantId: string, text: string, toolName: string | undefined, limit: number) {
    const k = keys(tenantId);
    const q = buildQuery(text, toolName, opts.embed);
    if (q.terms.length === 0) return [];
    const termKeys = q.terms.map(k.term);
    const lists = await Promise.all(
      termKeys.map((key) => client.zRange(key, 0, CANDIDATES_PER_TERM - 1, { REV: true })),
    );
    const seen = new Map<string, { count: number; keys: string[] }>();
    lists.forEach((ids, i) => {
      for (const id of ids) {
        const c = seen.get(id) ?? { count: 0, keys: [] };
        c.count++;
        c.keys.push(termKeys[i] ?? '');
        seen.set(id, c);
      }
    });
    let ids = [...seen.keys()];
    if (toolName !== undefined && ids.length > 0) {
      const toolKey = k.tool(toolName);
      const kept: string[] = [];
      for (let i = 0; i < ids.length; i += BATCH) {
        const chunk = ids.slice(i, i + BATCH);
        const scores = await client.zmScore(toolKey, chunk);
        chunk.forEach((id, j) => scores[j] !== null && scores[j] !== undefined && kept.push(id));
      }
      ids = kept;
    }
    // Bounded work: read only the candidates that share the most query terms.
    ids.sort((a, b) => (seen.get(b)?.count ?? 0) - (seen.get(a)?.count ?? 0));
    ids = ids.slice(0, MAX_FETCHED);
    const fetched = await fetchMany(k, ids);
    const gone = ids.filter((_, i) => fetched[i] === null);
    await forget(k, gone, [...new Set(gone.flatMap((id) => seen.get(id)?.keys ?? []))]);
    const ranked = rankRecords(
      fetched.filter((r): r is StoredError => r !== null),
      q,
      limit,
    );
    const at = now();
    const alive = await renew(
      k,
      ranked.map((r) => r.id),
      at,
    );
    return ranked.filter((r) => alive.has(r.id)).map((r) => ({ ...r, last_hit_ms: at }));
  }

  async function list(tenantId: string, input: { cursor?: string | undefined; limit: number }) {
    const k = keys(tenantId);
    let after: { ms: number; id: string } | null = null;
    if (input.cursor !== undefined) {
      const m = LIST_CURSOR_RE.exec(input.cursor);
      if (!m)
        throw new AppError(400, 'validation_failed', 'cursor: invalid cursor', {
          problems: [{ path: 'cursor', message: 'invalid cursor' }],
        });
      after = { ms: Number(m[1]), id: m[2] ?? '' };
    }
    const out: StoredError[] = [];
    const gone: string[] = [];
    let offset = 0;
    while (out.length <= input.limit) {
      const count = input.limit + 1 - out.length + 16;
      const entries = await client.zRangeWithScores(k.all, after ? String(after.ms) : '+inf', '-inf', {
        BY: 'SCORE',
        REV: true,
        LIMIT: { offset, count },
      });
      offset += entries.length;
      const page = entries.filter(
        (e) => !after || e.score < after.ms || (e.score === after.ms && e.value < after.id),
      );
      const fetched = await fetchMany(
        k,
        page.map((e) => e.value),
      );
      page.forEach((e, i) => {
        const rec = fetched[i];
        if (rec) out.push(rec);
        else gone.push(e.value);
      });
      if (entries.length < count) break;
    }
    await forget(k, gone);
    const records = out.slice(0, input.limit);
    const last = records[records.length - 1];
    const next = out.length > input.limit && last ? `${last.created_ms}_${last.id}` : null;
    return { records: records.map(toApiRecord), next };
  }

  async function removeIds(k: ErrorKeys, ids: readonly string[]): Promise<number> {
    const tools = await Promise.all(
      ids.map((id) => evalScript(DELETE_SCRIPT, [k.rec(id)], [id, k.dedupePrefix])),
    );
    const m = client.multi();
    m.zRem(k.all, [...ids]);
    for (const tool of new Set(tools)) if (typeof tool === 'string') m.zRem(k.tool(tool), [...ids]);
    m.sAdd(k.dead, [...ids]);
    await m.exec();
    return tools.filter((t) => typeof t === 'string').length;
  }

  async function purge(tenantId: string, input: { tool_name?: string | undefined }) {
    const k = keys(tenantId);
    const source = input.tool_name === undefined ? k.all : k.tool(input.tool_name.trim());
    let deleted = 0;
    for (;;) {
      const ids = await client.zRange(source, 0, BATCH - 1);
      if (ids.length === 0) break;
      deleted += await removeIds(k, ids);
      await client.zRem(source, ids);
    }
    return deleted;
  }

  async function sweepTenant(tenantId: string): Promise<number> {
    const k = keys(tenantId);
    const indexed: string[] = [];
    for await (const { value } of client.zScanIterator(k.all, { COUNT: BATCH })) indexed.push(value);
    const dead = new Set<string>();
    for (let i = 0; i < indexed.length; i += BATCH) {
      const chunk = indexed.slice(i, i + BATCH);
      const exists = await Promise.all(chunk.map((id) => client.exists(k.rec(id))));
      chunk.forEach((id, j) => exists[j] === 0 && dead.add(id));
    }
    const marked = await client.sMembers(k.dead);
    for (const id of marked) dead.add(id);
    if (dead.size > 0) {
      const ids = [...dead];
      const indexKeys = [k.all, ...(await client.sMembers(k.ikeys))];
      for (let i = 0; i < ids.length; i += 2000) {
        const chunk = ids.slice(i, i + 2000);
        await Promise.all(indexKeys.map((key) => evalScript(SWEEP_KEY_SCRIPT, [key, k.ikeys], chunk)));
      }
      if (marked.length > 0) await client.sRem(k.dead, marked);
    }
    await evalScript(FORGET_TENANT_SCRIPT, [k.all, k.ikeys, k.dead, tenantsKey], [tenantId]);
    return dead.size;
  }

  return {
    write: (tenantId, input) => guard(() => write(tenantId, input)),

    search: (tenantId, input) =>
      guard(async () =>
        (await rankedSearch(tenantId, input.query, input.tool_name?.trim(), input.limit)).map(toApiRecord),
      ),

    lookup: (tenantId, input) =>
      guard(async () => {
        const found = await rankedSearch(tenantId, input.error, input.tool_name.trim(), RELATED_MAX_RECORDS);
        return { related_errors: renderRelated(found), records: found.map(toApiRecord) };
      }),

    get: (tenantId, id) =>
      guard(async () => {
        if (!ERROR_ID_RE.test(id)) return null;
        const k = keys(tenantId);
        const alive = await renew(k, [id], now());
        if (!alive.has(id)) return null;
        const [rec] = await fetchMany(k, [id]);
        return rec ? toApiRecord(rec) : null;
      }),

    list: (tenantId, input) => guard(() => list(tenantId, input)),

    remove: (tenantId, id) =>
      guard(async () => (ERROR_ID_RE.test(id) ? (await removeIds(keys(tenantId), [id])) === 1 : false)),

    purge: (tenantId, input) => guard(() => purge(tenantId, input), false),

    purgeTenant: (tenantId) =>
      guard(async () => {
        const k = keys(tenantId);
        let deleted = await purge(tenantId, {});
        // Sweep up what no index knows of (a record whose writer died before indexing it).
        for await (const key of client.scanIterator({ MATCH: `${k.base}:*`, COUNT: 1000 })) {
          if (await client.unlink(key)) if (key.startsWith(`${k.base}:rec:`)) deleted++;
        }
        await client.sRem(tenantsKey, tenantId);
        return deleted;
      }, false),

    sweepExpired: () =>
      guard(async () => {
        let cleaned = 0;
        for (const tenantId of await client.sMembers(tenantsKey)) {
          if (TENANT_RE.test(tenantId)) cleaned += await sweepTenant(tenantId);
        }
        return cleaned;
      }, false),

    ping: async () => {
      try {
        return client.isReady && (await client.ping()) === 'PONG';
      } catch {
        return false;
      }
    },

    close: async () => {
      if (!client.isOpen) return;
      if (client.isReady) await client.quit();
      else await client.disconnect();
    },
  };
}
