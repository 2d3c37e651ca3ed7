import { createHash } from 'node:crypto';
import { createRequire } from 'node:module';
import { Repository, Schema } from 'redis-om';
import type { RedisClientConnection } from 'redis-om';
import { AppError, REDIS_TRANSIENT_REPLY, REDIS_WRITE_REFUSED, unavailable } from '../errors.js';
import { errorMessage, throttledWarn, watchOutage } from '../logger.js';
import { watchSilence } from '../redis.js';
import { orNull } from '../deadline.js';
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
  DROP_STALE_TERMS_SCRIPT,
  FORGET_TENANT_SCRIPT,
  MERGE_SCRIPT,
  PENDING_SCRIPT,
  READ_BY_DEDUPE_SCRIPT,
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
/** The tenant layout mark (`T:v`) of this build: see upgradeLayout. */
const LAYOUT_VERSION = '3';
/** A record pending longer than this lost its writer (a write's deadline is seconds). */
const PENDING_GRACE_MS = 60_000;

export type ErrorMemoryOptions = {
  redisUrl: string;
  prefix: string;
  ttlDays: number;
  embed?: (text: string) => number[];
  now?: () => number;
  logger?: Pick<Logger, 'warn' | 'info'>;
  /** Deadline of one request-path operation; past it the caller gets a 503. */
  opTimeoutMs?: number;
  /**
   * How long opening waits for the first connection (default 5 s). Past it the store opens
   * anyway and keeps reconnecting in the background; until then every call answers 503 and
   * `ping()` is false, so a Redis outage at start-up does not keep the API from starting.
   */
  connectWaitMs?: number;
  /** Called for each upkeep step skipped because Redis refused its writes (see bestEffort). */
  onSkipped?: (step: UpkeepStep) => void;
};

/**
 * Upkeep a read or a delete does beside its answer, whose loss costs little: a hit's renewal
 * (the record expires sooner), dropping ids found without a record from the index keys (a later
 * read or the sweep does it), marking deleted ids for the sweep (what a racing merge indexed, or
 * the term entries of an id whose record had already expired, stay until a read drops them).
 */
export type UpkeepStep = 'renew' | 'forget' | 'mark';

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

const CLOSE_WAIT_MS = 2000;

/**
 * A connection that dies without a reset (a partition, a proxy or NAT that keeps acknowledging)
 * stays "ready" in node-redis: every error-memory call timed out as a 503 for as long as the
 * process ran, while the API's own connections (services/redis.ts) had reconnected. The same
 * watch as theirs (watchSilence): a ping with no answer within `answerMs` (node-redis has no
 * command timeout of its own) closes the socket and connects again. A ping answered with an error
 * (a busy or loading Redis) is an answer. Returns the function that stops the watch.
 */
function watchSilentClient(
  client: ReturnType<CreateClient>,
  answerMs: number,
  onSilent: () => void,
): () => void {
  let stopped = false;
  const answered = () => true;
  const stop = watchSilence({
    ready: () => client.isReady,
    // A ping answered with an error is an answer; null is no answer within answerMs.
    silent: async () => (await orNull(client.ping().then(answered, answered), answerMs)) === null,
    reconnect: async () => {
      onSilent();
      await client.disconnect().catch(() => undefined);
      if (!stopped) await client.connect().catch(() => undefined);
    },
  });
  return () => {
    stopped = true;
    stop();
  };
}

/** What a log line says of a connection error: its message and code, no stack and no other fields. */
const connectionErrorFields = (err: Error) => {
  const code = (err as { code?: unknown }).code;
  return { message: errorMessage(err), ...(typeof code === 'string' ? { code } : {}) };
};

const sha1 = (text: string) => createHash('sha1').update(text).digest('hex');
/** What a record's dedupe key is named by: its tool and normalised symptom (both trimmed). */
export const dedupeOf = (tool: string, symptom: string) =>
  `${encodeURIComponent(tool)}:${sha1(normaliseSymptom(symptom))}`;
/** An embedding as the record stores it: JSON, five decimals. */
const storedEmbedding = (vector: readonly number[]) =>
  JSON.stringify(vector.map((x) => Math.round(x * 1e5) / 1e5));

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
  // Every reconnect attempt is an error event (each with its stack, five a second while Redis was
  // gone): one line per 5 s with the count left out, its message and code only, as
  // services/redis.ts logs the API's connections. Once ready again, one line says so.
  const warnError = throttledWarn(opts.logger, 'error-memory redis connection error');
  const outage = watchOutage(client, opts.logger, 'error-memory redis connection restored');
  let lastError: Error | undefined;
  client.on('error', (err: unknown) => {
    lastError = err instanceof Error ? err : new Error(String(err));
    outage.failed();
    warnError({ err: connectionErrorFields(lastError) });
  });
  client.on('ready', () => {
    lastError = undefined;
  });
  const stopWatch = watchSilentClient(client, opTimeoutMs, () => {
    opts.logger?.warn('error-memory redis connection gave no answer to a ping: reconnecting');
    outage.failed();
  });
  const connecting = client.connect().then(
    () => true,
    (err: unknown) => {
      opts.logger?.warn(
        { err: connectionErrorFields(err instanceof Error ? err : new Error(String(err))) },
        'error-memory redis connection failed',
      );
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

  /**
   * Runs a request-path operation with a deadline of opTimeoutMs: `op` for the whole operation,
   * `progress` restarted by each `progress()` call (a purge of many records may take longer than
   * one deadline while it makes progress, but a hung Redis still gets a 503), `none` for
   * maintenance.
   */
  async function guard<T>(
    fn: (progress: () => void) => Promise<T>,
    deadline: 'op' | 'progress' | 'none' = 'op',
  ): Promise<T> {
    // The last connection error goes with the 503, for its log line (redis_error).
    if (!client.isReady) throw Object.assign(unavailable('redis'), { cause: lastError });
    let timer: NodeJS.Timeout | undefined;
    let settled = false;
    try {
      if (deadline === 'none') return await fn(() => {});
      let expire: (err: unknown) => void = () => {};
      const expired = new Promise<never>((_, reject) => {
        expire = reject;
      });
      const arm = () => {
        if (settled) return;
        clearTimeout(timer);
        timer = setTimeout(() => expire(unavailable('redis')), opTimeoutMs);
      };
      arm();
      return await Promise.race([fn(deadline === 'progress' ? arm : () => {}), expired]);
    } catch (err) {
      if (err instanceof AppError) throw err;
      const message = err instanceof Error ? err.message : '';
      if (!client.isReady || REDIS_TRANSIENT_REPLY.test(message))
        throw Object.assign(unavailable('redis'), { cause: err });
      throw err;
    } finally {
      settled = true;
      clearTimeout(timer);
    }
  }

  const evalScript = (script: string, keyList: string[], args: string[]) =>
    client.eval(script, { keys: keyList, arguments: args });

  const warnSkipped = throttledWarn(opts.logger, 'error-memory redis refused a write: upkeep skipped');
  /**
   * Runs an upkeep step (UpkeepStep); while Redis refuses writes (full under `noeviction`,
   * read-only) it is skipped, so that the read or delete it belongs to still answers: a full
   * Redis had every lookup that found a record answer 503, and a delete answer 503 after it had
   * deleted the record. Any other failure (a lost connection, a busy script) fails the call as
   * before. Returns undefined when skipped.
   */
  async function bestEffort<T>(step: UpkeepStep, fn: () => Promise<T>): Promise<T | undefined> {
    try {
      return await fn();
    } catch (err) {
      const message = err instanceof Error ? err.message : '';
      if (!REDIS_WRITE_REFUSED.test(message)) throw err;
      opts.onSkipped?.(step);
      warnSkipped({ step, err: { message } });
      return undefined;
    }
  }

  /** Reads records; ids whose record is gone come back as null. */
  async function fetchMany(k: ErrorKeys, ids: readonly string[]): Promise<Array<StoredError | null>> {
    if (ids.length === 0) return [];
    const entities = await repo.fetch(ids.map(k.entity));
    return entities.map((e, i) => toStoredError(ids[i] ?? '', e));
  }

  /**
   * A record a script returned (HGETALL's field, value, … list), converted as redis-om converts
   * the hashes fetchMany reads, so that a script can hand back the record it found or changed in
   * the same round trip. An empty list (no hash) is null.
   */
  function fromHashReply(id: string, reply: unknown): StoredError | null {
    if (!Array.isArray(reply)) return null;
    const hash = new Map<string, string>();
    for (let i = 0; i + 1 < reply.length; i += 2) hash.set(String(reply[i]), String(reply[i + 1]));
    const entity: Record<string, unknown> = Object.fromEntries(hash);
    for (const field of schema.fields) {
      const value = hash.get(field.hashField);
      delete entity[field.hashField];
      if (value === undefined) {
        if (field.type === 'string[]') entity[field.name] = [];
      } else if (field.type === 'number') {
        if (Number.isNaN(Number(value)))
          throw new Error(`error memory: ${field.name} of ${id} is not a number`);
        entity[field.name] = Number.parseFloat(value);
      } else {
        entity[field.name] = field.type === 'string[]' ? value.split(field.separator) : value;
      }
    }
    return toStoredError(id, entity);
  }

  /**
   * Lazily drops ids found gone from the keys they were found in; the sweep does the rest. One
   * step with their dead mark, as the sweep finds them by it once they leave `all`: refused
   * (upkeep), the ids stay where they are for a later read or the sweep.
   */
  async function forget(
    k: ErrorKeys,
    ids: readonly string[],
    foundIn: readonly string[] = [],
  ): Promise<void> {
    if (ids.length === 0) return;
    const m = client.multi();
    for (const key of [k.all, ...foundIn]) m.zRem(key, [...ids]);
    m.sAdd(k.dead, [...ids]);
    await bestEffort('forget', () => m.exec());
  }

  /** Every term key a record is indexed under: the tenant-wide one and its tool's, per term. */
  const termKeysOf = (k: ErrorKeys, rec: StoredError, terms = indexTerms(rec)) =>
    terms.flatMap((t) => [k.term(t), k.toolTerm(rec.tool_name, t)]);

  /** Indexes the record; it is no longer pending once it is indexed. */
  async function index(tenantId: string, k: ErrorKeys, rec: StoredError): Promise<void> {
    const toolKey = k.tool(rec.tool_name);
    const termKeys = termKeysOf(k, rec);
    const m = client.multi();
    m.zAdd(k.all, { score: rec.created_ms, value: rec.id });
    m.zAdd(toolKey, { score: rec.created_ms, value: rec.id });
    for (const key of termKeys) m.zAdd(key, { score: rec.last_hit_ms, value: rec.id });
    // A merge re-indexes, so a record that became resolved joins here; none ever leaves but by
    // the sweep, as a failed attempt never replaces a fix.
    const resolved = rec.outcome === 'resolved' ? [k.resolved] : [];
    for (const key of resolved) m.zAdd(key, { score: rec.created_ms, value: rec.id });
    m.sAdd(k.ikeys, [toolKey, ...termKeys, ...resolved]);
    m.sAdd(tenantsKey, tenantId);
    m.zRem(k.pending, rec.id);
    await m.exec();
  }

  /** After a merge: drop the record from the term keys its previous state had and this one lacks. */
  async function dropStaleTerms(k: ErrorKeys, before: StoredError, after: StoredError): Promise<void> {
    const current = new Set(indexTerms(after));
    const stale = indexTerms(before).filter((t) => !current.has(t));
    if (stale.length === 0) return;
    await evalScript(
      DROP_STALE_TERMS_SCRIPT,
      [k.rec(after.id), k.ikeys, ...termKeysOf(k, after, stale)],
      [after.id, String(after.hits)],
    );
  }

  /**
   * Renews the records (a hit), per id: `renewed`, `gone`, or `kept` as it was when Redis refused
   * the renewal (upkeep: a missed renewal only shortens the record's life). A record given as read
   * also moves up in the term keys it is found through (scores are the last write or hit), so a
   * record that keeps helping stays among the newest candidates of a term; in the same script,
   * so that a hit costs one round trip.
   */
  async function renew(
    k: ErrorKeys,
    recs: ReadonlyArray<string | StoredError>,
    at: number,
  ): Promise<Array<'renewed' | 'gone' | 'kept'>> {
    return Promise.all(
      recs.map(async (rec) => {
        const id = typeof rec === 'string' ? rec : rec.id;
        const termKeys = typeof rec === 'string' ? [] : termKeysOf(k, rec);
        const r = await bestEffort('renew', () =>
          evalScript(RENEW_SCRIPT, [k.rec(id), ...termKeys], [id, String(ttlMs), String(at), k.dedupePrefix]),
        );
        return r === undefined ? 'kept' : r === 1 ? 'renewed' : 'gone';
      }),
    );
  }

  async function write(tenantId: string, input: ErrorWriteInput) {
    const k = keys(tenantId);
    const tool = input.tool_name.trim();
    const symptom = input.symptom.trim();
    const action = input.action.trim();
    const cause = input.cause?.trim() || null;
    const keywords = normaliseKeywords(input.keywords ?? []);
    const dedupe = dedupeOf(tool, symptom);
    const dedupeKey = k.dedupePrefix + dedupe;
    for (let attempt = 0; attempt < WRITE_ATTEMPTS; attempt++) {
      const at = now();
      const found = await evalScript(READ_BY_DEDUPE_SCRIPT, [dedupeKey], [k.rec('')]);
      if (Array.isArray(found)) {
        const existing = String(found[0]);
        const before = fromHashReply(existing, found[1]);
        // What the record's class and embedding become if this attempt's cause replaces its own.
        const text = `${before?.symptom ?? symptom}\n${cause ?? ''}`;
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
            classifyError(text),
            opts.embed ? storedEmbedding(opts.embed(text)) : '',
          ],
        );
        if (Array.isArray(merged)) {
          // Re-indexing on every merge also heals a record whose creator died before indexing it.
          // Indexing and dropping stale terms touch different term keys: one round trip.
          const rec = fromHashReply(existing, merged);
          if (rec) await Promise.all([index(tenantId, k, rec), before && dropStaleTerms(k, before, rec)]);
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
      // Pending until indexed: a writer that dies before then leaves a record without an expiry
      // or in no index, and this entry is how the sweep and purge find it. Each pair below is
      // sent together, one round trip instead of two: Redis runs a connection's commands in
      // order, so what a lost connection leaves done is still the steps up to some point.
      await Promise.all([
        evalScript(
          PENDING_SCRIPT,
          [k.pending, tenantsKey, k.all, k.version],
          [String(at), id, tenantId, LAYOUT_VERSION],
        ),
        repo.save(k.entity(id), {
          ...fields,
          cause: cause ?? undefined,
          dedupe,
          session_id: input.session_id,
          embedding: vector ? storedEmbedding(vector) : undefined,
        }),
      ]);
      // The record exists (with its expiry) before its dedupe key does, so a duplicate that finds
      // the key always finds the record; the loser of this race drops its unindexed copy and
      // merges instead.
      const [, won] = await Promise.all([
        client.pExpire(k.rec(id), ttlMs),
        client.set(dedupeKey, id, { NX: true, PX: ttlMs }),
      ]);
      if (won === 'OK') {
        const rec = toStoredError(id, { ...fields, cause });
        if (rec) await index(tenantId, k, rec);
        return { id, deduplicated: false };
      }
      await client.multi().unlink(k.rec(id)).zRem(k.pending, id).exec();
    }
    throw new AppError(503, 'busy', 'error memory is busy with this record, retry', undefined, {
      'retry-after': '1',
    });
  }

  async function rankedSearch(tenantId: string, text: string, toolName: string | undefined, limit: number) {
    const k = keys(tenantId);
    const q = buildQuery(text, toolName, opts.embed);
    // Without a term, only the record of exactly this text can match (`127.0.0.1:5432`, `第12行`):
    // with a tool, it is read below.
    if (q.terms.length === 0 && toolName === undefined) return [];
    // With a tool, its own term keys: the newest candidates of a term are then that tool's. Until
    // the sweep has upgraded a tenant whose records predate those keys (no layout mark), the
    // tenant-wide keys are read too; what only those find must pass the tool filter.
    const read = (key: string) => client.zRange(key, 0, CANDIDATES_PER_TERM - 1, { REV: true });
    const own = q.terms.map((t) => (toolName === undefined ? k.term(t) : k.toolTerm(toolName, t)));
    // The record of exactly this error (its dedupe key): a candidate however many newer records
    // share its terms, and a match even when the text has none. Without a tool there is no such key.
    const [upgraded, ownLists, exact] = await Promise.all([
      toolName === undefined ? true : client.exists(k.version).then((n) => n === 1),
      Promise.all(own.map(read)),
      toolName === undefined ? null : client.get(k.dedupePrefix + dedupeOf(toolName, text.trim())),
    ]);
    const wide = upgraded ? [] : q.terms.map((t) => k.term(t));
    const wideLists = await Promise.all(wide.map(read));
    const perTerm = q.terms.map((_, i) => (upgraded ? [own[i]!] : [own[i]!, wide[i]!]));
    const lists = q.terms.map((_, i) => (upgraded ? [ownLists[i]!] : [ownLists[i]!, wideLists[i]!]));
    const seen = new Map<string, { count: number; keys: string[]; ofTool: boolean }>();
    lists.forEach((forTerm, i) => {
      const counted = new Set<string>();
      forTerm.forEach((found, j) => {
        for (const id of found) {
          const c = seen.get(id) ?? { count: 0, keys: [], ofTool: false };
          if (!counted.has(id)) {
            counted.add(id);
            c.count++;
          }
          c.keys.push(perTerm[i]![j]!);
          // The first key of a term is the tool's own (or, without a tool, the only one).
          if (j === 0) c.ofTool = true;
          seen.set(id, c);
        }
      });
    });
    let ids = [...seen.keys()];
    const unchecked = ids.filter((id) => !seen.get(id)!.ofTool);
    if (toolName !== undefined && unchecked.length > 0) {
      const toolKey = k.tool(toolName);
      const otherTools = new Set<string>();
      for (let i = 0; i < unchecked.length; i += BATCH) {
        const chunk = unchecked.slice(i, i + BATCH);
        const scores = await client.zmScore(toolKey, chunk);
        chunk.forEach((id, j) => (scores[j] === null || scores[j] === undefined) && otherTools.add(id));
      }
      ids = ids.filter((id) => !otherTools.has(id));
    }
    // Bounded work: read only the candidates that share the most query terms, and of those that
    // share as many, resolved ones first (of the first CANDIDATES_PER_TERM; the sort is stable,
    // so newest first after that): newer failed attempts at an error must not crowd its fix out.
    const byCount = (a: string, b: string) => (seen.get(b)?.count ?? 0) - (seen.get(a)?.count ?? 0);
    ids.sort(byCount);
    if (ids.length > MAX_FETCHED) {
      const head = ids.slice(0, CANDIDATES_PER_TERM);
      const scores = await client.zmScore(k.resolved, head);
      const fixes = new Set(head.filter((_, i) => scores[i] !== null && scores[i] !== undefined));
      ids.sort((a, b) => byCount(a, b) || Number(fixes.has(b)) - Number(fixes.has(a)));
    }
    if (exact !== null) ids = [exact, ...ids.filter((id) => id !== exact)];
    ids = ids.slice(0, MAX_FETCHED);
    const fetched = await fetchMany(k, ids);
    const gone = ids.filter((_, i) => fetched[i] === null);
    const ranked = rankRecords(
      fetched.filter((r): r is StoredError => r !== null),
      q,
      limit,
      exact,
    );
    const at = now();
    // Dropping the gone ids and renewing the hits touch different ids: one round trip.
    const [, states] = await Promise.all([
      forget(k, gone, [...new Set(gone.flatMap((id) => seen.get(id)?.keys ?? []))]),
      renew(k, ranked, at),
    ]);
    // A record whose renewal Redis refused is answered as read, its last hit unchanged.
    return ranked.flatMap((r, i) =>
      states[i] === 'gone' ? [] : states[i] === 'renewed' ? [{ ...r, last_hit_ms: at }] : [r],
    );
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

  /**
   * Deletes one record with its dedupe key and its index entries (DELETE_SCRIPT), the term keys
   * computed from `rec` as read (null: unknown, the sweep finds them). Re-read when a merge
   * changed it in between; after a few such rounds it goes whatever its terms, and the dead mark
   * (removeIds) has the sweep finish. Returns its tool name, or null when it did not exist.
   */
  async function deleteRecord(k: ErrorKeys, id: string, rec: StoredError | null): Promise<string | null> {
    for (let attempt = 0; ; attempt++) {
      const indexKeys = rec ? [k.tool(rec.tool_name), k.resolved, ...termKeysOf(k, rec)] : [];
      const hits = rec && attempt < 3 ? String(rec.hits) : '';
      const r = await evalScript(
        DELETE_SCRIPT,
        [k.rec(id), k.ikeys, ...indexKeys],
        [id, k.dedupePrefix, hits],
      );
      if (r !== -1) return typeof r === 'string' ? r : null;
      rec = (await fetchMany(k, [id]))[0] ?? null;
    }
  }

  /**
   * Deletes the records and marks them for the sweep (which finishes what a merge racing the
   * delete indexed). Ids without a record are marked only when
   * `indexed` (read from an index, whose term keys still hold them): an id a client made up must
   * leave nothing behind, as the dead set has no expiry and a tenant without records is never swept.
   */
  async function removeIds(
    k: ErrorKeys,
    ids: readonly string[],
    indexed: 'indexed' | 'given',
    progress: () => void = () => {},
  ): Promise<{ deleted: number; kept: string[] }> {
    const recs = await fetchMany(k, ids);
    // Reading the records (for their index keys) is a step of its own: a purge on a slow Redis
    // that keeps making progress must not run out of its deadline.
    progress();
    const tools = await Promise.all(ids.map((id, i) => deleteRecord(k, id, recs[i] ?? null)));
    const deleted = ids.filter((_, i) => typeof tools[i] === 'string');
    const marked = indexed === 'indexed' ? ids : deleted;
    let kept: string[] = [];
    if (marked.length > 0) {
      // Not one MULTI: a full Redis refuses whatever a MULTI queues, and the mark takes memory,
      // so a delete it had done answered 503 (a retry 404) and left the id in `all`. The mark is
      // upkeep; the removals are plain ZREMs, which a full Redis allows. Marked first, so that a
      // connection lost in between leaves the ids where the sweep finds them.
      const markedOk = (await bestEffort('mark', () => client.sAdd(k.dead, [...marked]))) !== undefined;
      // Unmarked, the ids of records that had expired before this delete stay in the indexes:
      // their term entries (which only the record named) are found by the sweep through `all`,
      // or by no one (a purge on a full Redis left them for good). Deleted records took theirs.
      const done = new Set(deleted);
      if (!markedOk) kept = marked.filter((id) => !done.has(id));
      const removed = markedOk ? marked : deleted;
      const toolKeys = [...new Set(tools)].flatMap((tool) =>
        typeof tool === 'string' ? [k.tool(tool)] : [],
      );
      if (removed.length > 0)
        await Promise.all([k.all, ...toolKeys].map((key) => client.zRem(key, [...removed])));
    }
    return { deleted: deleted.length, kept };
  }

  async function purge(
    tenantId: string,
    input: { tool_name?: string | undefined },
    progress: () => void = () => {},
  ) {
    const k = keys(tenantId);
    const tool = input.tool_name?.trim();
    const source = tool === undefined ? k.all : k.tool(tool);
    let deleted = 0;
    // Ids kept in the index (removeIds) are passed over, not read again.
    let skip = 0;
    for (;;) {
      const ids = await client.zRange(source, skip, skip + BATCH - 1);
      if (ids.length === 0) break;
      const r = await removeIds(k, ids, 'indexed', progress);
      deleted += r.deleted;
      const kept = new Set(r.kept);
      const gone = ids.filter((id) => !kept.has(id));
      if (gone.length > 0) await client.zRem(source, gone);
      skip += kept.size;
      progress();
    }
    // Records in no index yet: being written now, or left by a writer that died.
    let offset = 0;
    for (;;) {
      const ids = await client.zRange(k.pending, offset, offset + BATCH - 1);
      if (ids.length === 0) break;
      let doomed = ids;
      if (tool !== undefined) {
        const tools = await Promise.all(ids.map((id) => client.hGet(k.rec(id), 'tool_name')));
        doomed = ids.filter((_, i) => tools[i] === tool);
      }
      if (doomed.length > 0) {
        deleted += (await removeIds(k, doomed, 'given', progress)).deleted;
        await client.zRem(k.pending, doomed);
      }
      offset += ids.length - doomed.length;
      progress();
    }
    return deleted;
  }

  /**
   * Settles records pending for longer than PENDING_GRACE_MS, whose writer died: one without an
   * expiry, or that its dedupe key does not name, was never acknowledged and is deleted; one the
   * dedupe key names (a duplicate may have merged into it) is indexed. Returns how many were deleted.
   */
  async function settlePending(tenantId: string, k: ErrorKeys): Promise<number> {
    const ids = await client.zRange(k.pending, '-inf', now() - PENDING_GRACE_MS, { BY: 'SCORE' });
    const doomed: string[] = [];
    for (let i = 0; i < ids.length; i += BATCH) {
      const chunk = ids.slice(i, i + BATCH);
      const states = await Promise.all(
        chunk.map(async (id) => {
          const ttl = await client.pTTL(k.rec(id));
          if (ttl === -2) return 'gone';
          const dedupe = ttl === -1 ? null : await client.hGet(k.rec(id), 'dedupe');
          const named =
            dedupe !== null && dedupe !== undefined && (await client.get(k.dedupePrefix + dedupe)) === id;
          return named ? 'live' : 'orphan';
        }),
      );
      const live = chunk.filter((_, j) => states[j] === 'live');
      for (const rec of await fetchMany(k, live)) if (rec) await index(tenantId, k, rec);
      doomed.push(...chunk.filter((_, j) => states[j] === 'orphan'));
      await client.zRem(k.pending, chunk);
    }
    return doomed.length > 0 ? (await removeIds(k, doomed, 'given')).deleted : 0;
  }

  /**
   * Re-indexes every record of a tenant written under an older layout, then sets the tenant's
   * layout mark (LAYOUT_VERSION): before "2", records were not under their tool's term keys (with
   * the mark, a lookup by tool reads its tool's keys only); before "3", resolved records were not
   * in the tenant's resolved set, which ranking reads first (a fix written before the upgrade was
   * crowded out by newer failed attempts).
   */
  async function upgradeLayout(tenantId: string, k: ErrorKeys): Promise<void> {
    if ((await client.get(k.version)) === LAYOUT_VERSION) return;
    let batch: string[] = [];
    const flush = async () => {
      for (const rec of await fetchMany(k, batch)) if (rec) await index(tenantId, k, rec);
      batch = [];
    };
    for await (const { value } of client.zScanIterator(k.all, { COUNT: BATCH })) {
      batch.push(value);
      if (batch.length >= BATCH) await flush();
    }
    await flush();
    await client.set(k.version, LAYOUT_VERSION);
  }

  async function purgeTenant(tenantId: string, progress: () => void, sweepUnindexed = true): Promise<number> {
    const k = keys(tenantId);
    let deleted = await purge(tenantId, {}, progress);
    // Sweep up what no index knows of (a record whose writer died before indexing it).
    if (sweepUnindexed) {
      for await (const key of client.scanIterator({ MATCH: `${k.base}:*`, COUNT: 1000 })) {
        if (await client.unlink(key)) if (key.startsWith(`${k.base}:rec:`)) deleted++;
        progress();
      }
    }
    await client.sRem(tenantsKey, tenantId);
    return deleted;
  }

  async function sweepTenant(tenantId: string): Promise<number> {
    const k = keys(tenantId);
    await upgradeLayout(tenantId, k);
    const orphans = await settlePending(tenantId, k);
    const indexed: string[] = [];
    for await (const { value } of client.zScanIterator(k.all, { COUNT: BATCH })) indexed.push(value);
    const dead = new Set<string>();
    for (let i = 0; i < indexed.length; i += BATCH) {
      const chunk = indexed.slice(i, i + BATCH);
      const ttls = await Promise.all(chunk.map((id) => client.pTTL(k.rec(id))));
      // A record written under a longer ERROR_MEMORY_TTL_DAYS than today's gets today's: a lowered
      // lifetime (for retention) reached only records written or hit since.
      const longLived = chunk.filter((_, j) => ttls[j]! > ttlMs);
      await Promise.all(longLived.map((id) => client.pExpire(k.rec(id), ttlMs)));
      chunk.forEach((id, j) => ttls[j] === -2 && dead.add(id));
      // And so do their dedupe keys, which name the tool and outlived the records they point to
      // (also those a sweep before this one shortened).
      const live = chunk.filter((_, j) => ttls[j] !== -2);
      const dedupes = await Promise.all(live.map((id) => client.hGet(k.rec(id), 'dedupe')));
      const dedupeKeys = dedupes.filter((d): d is string => Boolean(d)).map((d) => k.dedupePrefix + d);
      const dedupeTtls = await Promise.all(dedupeKeys.map((key) => client.pTTL(key)));
      await Promise.all(
        dedupeKeys.filter((_, j) => dedupeTtls[j]! > ttlMs).map((key) => client.pExpire(key, ttlMs)),
      );
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
    await evalScript(
      FORGET_TENANT_SCRIPT,
      [k.all, k.ikeys, k.dead, k.pending, tenantsKey, k.version],
      [tenantId],
    );
    return dead.size + orphans;
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
        // Sent together, in this order: the record is read as renewed, in one round trip.
        const [[state], [rec]] = await Promise.all([renew(k, [id], now()), fetchMany(k, [id])]);
        if (state === 'gone') return null;
        return rec ? toApiRecord(rec) : null;
      }),

    list: (tenantId, input) => guard(() => list(tenantId, input)),

    remove: (tenantId, id) =>
      guard(async () =>
        ERROR_ID_RE.test(id) ? (await removeIds(keys(tenantId), [id], 'given')).deleted === 1 : false,
      ),

    purge: (tenantId, input) => guard((progress) => purge(tenantId, input, progress), 'progress'),

    purgeTenant: (tenantId, opts) =>
      guard((progress) => purgeTenant(tenantId, progress, opts?.sweepUnindexed ?? true), 'progress'),

    sweepExpired: (existing) =>
      guard(async () => {
        let cleaned = 0;
        const tenants = (await client.sMembers(tenantsKey)).filter((t) => TENANT_RE.test(t));
        const kept = existing ? await existing(tenants) : new Set(tenants);
        for (const tenantId of tenants) {
          cleaned += kept.has(tenantId) ? await sweepTenant(tenantId) : await purgeTenant(tenantId, () => {});
        }
        return cleaned;
      }, 'none'),

    ping: async () => {
      try {
        return client.isReady && (await client.ping()) === 'PONG';
      } catch {
        return false;
      }
    },

    close: async () => {
      stopWatch();
      if (!client.isOpen) return;
      // QUIT waits for its answer: on a connection gone silent, for ever (shutdown then waited
      // out its whole deadline and exited 1).
      if (client.isReady && (await orNull(client.quit(), CLOSE_WAIT_MS)) !== null) return;
      if (client.isOpen) await client.disconnect().catch(() => undefined);
    },
  };
}
