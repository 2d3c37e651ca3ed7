import { readdirSync } from 'node:fs';
import { isIP } from 'node:net';
import path from 'node:path';
import { CronExpressionParser } from 'cron-parser';
import { z } from 'zod';
import { HNSW_MAX_DIMENSIONS } from '../db/queries/ann-indexes.js';

/**
 * Every environment variable of SPEC §2, parsed once. A malformed value stops start-up with the
 * variable's name and how to fix it; nothing else in the code base reads process.env.
 */

const int = (min: number, max: number, hint: string) =>
  z
    .string()
    .trim()
    .regex(/^-?\d+$/, `must be a whole number (${hint})`)
    .transform(Number)
    .pipe(z.number().min(min, `must be at least ${min} (${hint})`).max(max, `must be at most ${max}`).int());

const optionalText = z
  .string()
  .trim()
  .transform((v) => (v === '' ? undefined : v))
  .optional();

const decodes = (s: string): boolean => {
  try {
    decodeURIComponent(s);
    return true;
  } catch {
    return false;
  }
};

/** WHATWG's parse of `v`, or null. */
const parseUrl = (v: string): URL | null => {
  try {
    return new URL(v);
  } catch {
    return null;
  }
};

/**
 * A DATABASE_URL as node-postgres (pg-connection-string) reads it: also with an empty host before
 * the path, which WHATWG's parser refuses where libpq takes it, as with a Unix socket directory in
 * the query (`postgres://user@/db?host=/run/postgresql`). pg-connection-string parses those with a
 * placeholder host in its place, and so does this.
 */
const parsePgUrl = (v: string): URL | null => parseUrl(v) ?? parseUrl(v.replace('@/', '@___DUMMY___/'));

/**
 * A URL of one of `protocols` (read by `parse`); `more` names what else is wrong with one that
 * parses.
 */
const urlText = (
  protocols: string[],
  hint: string,
  more: (u: URL) => string[] = () => [],
  parse: (v: string) => URL | null = parseUrl,
) =>
  z
    .string()
    .trim()
    .superRefine((v, ctx) => {
      const starts = protocols.map((p) => `${p}//`);
      // Null when it starts right and does not parse: most often a password with / ? # @ or % in it.
      const parsed = parse(v);
      if (parsed && protocols.includes(parsed.protocol)) {
        for (const message of more(parsed)) ctx.addIssue({ code: 'custom', message });
        return;
      }
      ctx.addIssue({
        code: 'custom',
        message:
          !parsed && starts.some((p) => v.startsWith(p))
            ? `is not a valid URL: percent-encode special characters in the user name and password (/ as %2F, @ as %40, # as %23, ? as %3F, % as %25) (${hint})`
            : `must be a URL starting with ${starts.join(' or ')} (${hint})`,
      });
    });

// Five fields (minute precision) or six (with seconds, so tests can run the sweep quickly), read
// by the parser BullMQ's scheduler uses, so a value it would reject later (`99 * * * *`) stops the
// start instead of the first schedule.
const CRON_HINT = 'must be a cron pattern of 5 fields (or 6 with seconds), e.g. "*/15 * * * *"';
const cronPattern = z
  .string()
  .trim()
  .superRefine((v, ctx) => {
    if (![5, 6].includes(v.split(/\s+/).length)) {
      ctx.addIssue({ code: 'custom', message: CRON_HINT });
      return;
    }
    try {
      CronExpressionParser.parse(v);
    } catch (err) {
      ctx.addIssue({ code: 'custom', message: `${CRON_HINT} (${(err as Error).message})` });
    }
  });

/**
 * A host name: labels of letters, digits, `_` (container names have them; the resolver takes
 * them) and inner `-`, joined by `.` (a final `.` allowed).
 */
const HOST_NAME =
  /^(?=.{1,253}\.?$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$/;

const schema = z.object({
  PORT: int(0, 65535, 'TCP port of the HTTP listener').default(8080),
  // An IP address or a host name: anything else cannot be listened on, and failed only after
  // Redis and Postgres were reached (exit 1, not a configuration error). A name that does not
  // resolve still fails at the listen, naming HOST.
  HOST: z
    .string()
    .trim()
    .min(1)
    .refine((v) => isIP(v) !== 0 || HOST_NAME.test(v), {
      message:
        'must be an IP address (0.0.0.0, 127.0.0.1, or IPv6 without brackets: ::) or a host name (letters, digits, _, - and .)',
    })
    .default('127.0.0.1'),
  DATABASE_URL: urlText(
    ['postgres:', 'postgresql:'],
    'e.g. postgres://user@127.0.0.1:5432/mnemos, or postgres://user@/mnemos?host=/run/postgresql for a Unix socket',
    () => [],
    parsePgUrl,
  ).optional(),
  MNEMOS_DATA_DIR: z.string().trim().min(1).default('./data'),
  // What ioredis would otherwise meet at the first command (`select NaN`, a stack trace) or as a
  // bare "URI malformed". A query is refused: ioredis takes each of its parameters (`db`,
  // `password`, `username`) as an option and node-redis (error memory) ignores it, so `?db=5`
  // put the queues and inboxes in database 5 and error memory in database 0.
  REDIS_URL: urlText(['redis:', 'rediss:'], 'e.g. redis://127.0.0.1:6379', (u) => [
    ...(/^\/?\d*$/.test(u.pathname)
      ? []
      : ['the path is the database number (e.g. redis://127.0.0.1:6379/0)']),
    ...(u.search === ''
      ? []
      : [
          "has a ?query, which only some of mnemos's Redis clients read: put the database number in the path (redis://127.0.0.1:6379/5) and the user name and password before the host (redis://user:password@127.0.0.1:6379)",
        ]),
    ...(decodes(u.username) && decodes(u.password)
      ? []
      : ['has a malformed percent-escape in the user name or password (write % as %25)']),
  ]).default('redis://127.0.0.1:6379'),
  MNEMOS_PREFIX: z
    .string()
    .regex(/^[A-Za-z0-9_-]{1,64}$/, 'must be 1-64 characters of letters, digits, "_" or "-" (no ":")')
    .default('mnemos'),
  // Not trimmed: a token of spaces opened Bull Board with a blank password, and one with a
  // trailing space from a .env file could never match (a Bearer header carries no spaces).
  MNEMOS_ADMIN_TOKEN: z
    .string()
    .min(16, 'must be at least 16 characters (use e.g. `openssl rand -hex 24`)')
    .regex(
      /^[\x21-\x7e]*$/,
      'must be printable ASCII without spaces: it is sent in an Authorization header (use e.g. `openssl rand -hex 24`)',
    )
    .optional(),
  OPENAI_API_KEY: optionalText,
  // A query (Azure's `?api-version=...`) goes on every request; a fragment never reaches the
  // endpoint, so it is most likely a mistyped query or an unencoded `#` in a deployment name.
  OPENAI_BASE_URL: urlText(
    ['http:', 'https:'],
    'an OpenAI-compatible endpoint, e.g. http://127.0.0.1:11434/v1',
    (u) =>
      u.href.includes('#')
        ? [
            'has a #fragment, which is never sent to the endpoint: remove it (parameters such as api-version=... go in the ?query)',
          ]
        : [],
  )
    .optional()
    .or(z.literal('').transform(() => undefined)),
  EMBEDDING_MODEL: optionalText,
  EMBEDDING_DIMENSIONS: int(1, 16000, 'dimension of the embedding vectors').optional(),
  EMBED_ROLES: z
    .string()
    .default('user,assistant')
    .transform((v) =>
      v
        .split(',')
        .map((r) => r.trim())
        .filter(Boolean),
    )
    .pipe(
      z
        .array(z.enum(['user', 'assistant', 'system', 'developer', 'tool']), {
          error: 'must be a comma-separated list of user, assistant, system, developer, tool',
        })
        .min(1),
    ),
  SUMMARY_MODEL: z.string().trim().min(1).default('gpt-4o-mini'),
  DECISION_MODEL: optionalText,
  MAX_HISTORY_MESSAGES: int(1, 1000, 'messages in the context window').default(16),
  MAX_HISTORY_BYTES: int(1024, 1 << 30, 'hot-history bytes that trigger compaction').default(4194304),
  SUMMARY_RUNES: int(500, 1_000_000, 'code points per summary chunk').default(32000),
  SUMMARY_CRON: cronPattern.default('*/15 * * * *'),
  ERROR_MEMORY_TTL_DAYS: z
    .string()
    .trim()
    .regex(/^\d+(\.\d+)?$/, 'must be a positive number of days, e.g. 90')
    .transform(Number)
    .pipe(z.number().positive('must be a positive number of days').max(3650))
    .default(90),
  USAGE_RETENTION_DAYS: int(
    28,
    36500,
    'days LLM usage rows are kept; GET /v1/usage reads at most the last 28',
  ).default(35),
  // A BCP-47 tag in its canonical form (`EN-gb` is `en-GB`; extensions such as
  // `ja-JP-u-ca-japanese` are tags too), as Intl reads them.
  REPLY_LANG: z
    .string()
    .trim()
    .transform((v, ctx) => {
      if (v === '' || v.toLowerCase() === 'auto') return 'auto';
      try {
        const tag = Intl.getCanonicalLocales(v)[0]!;
        // A language of 2–3 letters: Intl also takes any word of 5–8 (`chinese`, `english`) and
        // `und`, which would reach the prompt as a language.
        if (/^[a-z]{2,3}$/.test(new Intl.Locale(tag).language) && !tag.startsWith('und')) return tag;
      } catch {
        // not a tag at all
      }
      ctx.addIssue({ code: 'custom', message: 'must be "auto" or a BCP-47 tag such as en or zh-TW' });
      return z.NEVER;
    })
    .default('auto'),
  TZ: optionalText,
  WORKER_CONCURRENCY: int(1, 1000, 'jobs per worker process').default(8),
  EMBED_CONCURRENCY: int(1, 1000, 'embed jobs per worker process').default(2),
  SUMMARY_CONCURRENCY: int(1, 1000, 'summary jobs per worker process').default(4),
  EMBED_MAX_DEFER_MS: int(
    0,
    3_600_000,
    'how long embedding may wait while archiving is behind, 0 = never',
  ).default(10_000),
  EMBED_DEFER_BEHIND_MS: int(
    1,
    3_600_000,
    'how long accepted messages may wait for their drain before embedding is deferred',
  ).default(250),
  PG_POOL_SIZE: int(1, 1000, 'Postgres connections per process').default(16),
  PG_IDLE_IN_TRANSACTION_TIMEOUT_MS: int(
    0,
    86_400_000,
    'how long Postgres lets a transaction of ours sit idle before ending it, 0 = never',
  ).default(60_000),
  PG_REQUEST_TIMEOUT_MS: int(
    0,
    3_600_000,
    'how long a request waits for Postgres to answer a statement before a 503, 0 = for ever',
  ).default(30_000),
  SEARCH_TIMEOUT_MS: int(0, 3_600_000, 'how long a search statement may run, 0 = no limit').default(10_000),
  ANN_MIN_VECTORS: int(0, 100_000_000, 'vectors of a session that get it an HNSW index, 0 = never').default(
    8000,
  ),
  PG_POOLER: z
    .enum(['none', 'transaction'], {
      message:
        'must be none or transaction (PgBouncer pool_mode = transaction, or another pooler that hands each transaction any connection)',
    })
    .default('none'),
  PG_PREPARED_STATEMENTS: z
    .enum(['true', 'false'], {
      message: 'must be true or false (false behind a pooler that drops prepared statements)',
    })
    .default('true')
    .transform((v) => v === 'true'),
  SEARCH_INDEX_MIN_MESSAGES: int(
    0,
    100_000_000,
    'messages of a session that get it its own full-text and trigram indexes, 0 = never',
  ).default(8000),
  SEARCH_INDEX_MAX_SESSIONS: int(0, 100_000, 'sessions that get each kind of search index').default(16),
  LLM_TIMEOUT_MS: int(100, 3_600_000, 'per-call LLM timeout').default(60000),
  RELEVANCE_TIMEOUT_MS: int(50, 600_000, 'timeout of the per-turn relevance call').default(2000),
  RATE_LIMIT_PER_MIN: int(0, 10_000_000, 'requests per API key per minute, 0 = off').default(6000),
  SHUTDOWN_TIMEOUT_MS: int(0, 600_000, 'grace period on SIGTERM').default(25000),
  LOG_LEVEL: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
});

export interface Config {
  port: number;
  host: string;
  databaseUrl: string | undefined;
  dataDir: string;
  redisUrl: string;
  prefix: string;
  adminToken: string | undefined;
  llm: { apiKey: string | undefined; baseURL: string | undefined; configured: boolean };
  embedding: { model: string; dimensions: number; local: boolean };
  embedRoles: string[];
  summaryModel: string;
  decisionModel: string | undefined;
  maxHistoryMessages: number;
  maxHistoryBytes: number;
  summaryRunes: number;
  summaryCron: string;
  errorMemoryTtlDays: number;
  /**
   * `llm_usage` rows older than this many days are deleted by the usage-retention task (at least
   * 28: the longest window GET /v1/usage reads).
   */
  usageRetentionDays: number;
  replyLang: string;
  timeZone: string;
  workerConcurrency: number;
  /** Embed jobs per worker process: below WORKER_CONCURRENCY so archiving keeps the pool and CPU. */
  embedConcurrency: number;
  /**
   * Summary jobs per worker process (at most WORKER_CONCURRENCY): each holds an LLM call in flight,
   * and the endpoint's limits, not the CPU, bound them.
   */
  summaryConcurrency: number;
  /**
   * While archiving is behind (some session's accepted messages have waited over
   * embedDeferBehindMs for their drain), an embed job younger than this goes back to the delayed
   * set instead of running (workers/embed.ts): archiving first, the recent index catches up after.
   */
  embedMaxDeferMs: number;
  /**
   * How long a session's accepted messages may wait for a drain before archiving counts as behind.
   * A drain takes several round trips to Postgres and Redis: on a slow link it must be above the
   * time an accept takes to be drained, or archiving always looks behind (workers/embed.ts).
   */
  embedDeferBehindMs: number;
  /** Postgres connections per process (jobs hold one for a whole transaction; requests need some too). */
  pgPoolSize: number;
  /** Postgres ends a transaction of ours left idle this long (0 = never): a stalled process's locks go. */
  pgIdleInTransactionTimeoutMs: number;
  /**
   * A request's Postgres statement without an answer this long (0 = no bound) closes its
   * connection and answers 503: a connection gone silent without a reset waited for ever.
   */
  pgRequestTimeoutMs: number;
  searchTimeoutMs: number;
  /** A session with at least this many vectors gets its own partial HNSW index (0 = never). */
  annMinVectors: number;
  /**
   * Semantic search runs as a named prepared statement with a generic plan (saves its planning);
   * false behind a connection pooler in transaction mode (PgBouncer).
   */
  pgPreparedStatements: boolean;
  /** Postgres is reached through a pooler in transaction mode: no SET on a connection (db/pool.ts). */
  pgTransactionPooler: boolean;
  /** A session with this many messages gets its own full-text and trigram indexes (0 = never). */
  searchIndexMinMessages: number;
  /** At most this many sessions get each kind of those indexes (each costs planning time). */
  searchIndexMaxSessions: number;
  llmTimeoutMs: number;
  relevanceTimeoutMs: number;
  rateLimitPerMin: number;
  shutdownTimeoutMs: number;
  logLevel: string;
  /** Settings that were given but have no effect, logged once at start. */
  warnings: string[];
}

export class ConfigError extends Error {
  constructor(readonly problems: string[]) {
    super(`Invalid configuration:\n${problems.map((p) => `  - ${p}`).join('\n')}`);
    this.name = 'ConfigError';
  }
}

/** `url` with its password masked, for messages and logs (SPEC §8: no secrets in logs). */
export function shownUrl(url: string): string {
  try {
    const u = new URL(url);
    if (u.password !== '') u.password = '***';
    // ioredis also takes `?password=` (and options alike) from the query.
    for (const name of [...u.searchParams.keys()]) {
      if (/pass|secret|token|key/i.test(name)) u.searchParams.set(name, '***');
    }
    return u.toString();
  } catch {
    return '(the configured URL)';
  }
}

/** Edit distance (insertions, deletions, substitutions) between two names. */
function editDistance(a: string, b: string): number {
  let prev = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const row = [i];
    for (let j = 1; j <= b.length; j++)
      row.push(Math.min(prev[j]! + 1, row[j - 1]! + 1, prev[j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1)));
    prev = row;
  }
  return prev[b.length]!;
}

/**
 * MNEMOS_* names that are not settings of the service but are read by something else beside it:
 * the client and the example agent (MNEMOS_URL, MNEMOS_API_KEY, MNEMOS_SESSION, which the Quick
 * start exports in the same shell), docker-compose.yml (MNEMOS_BIND, MNEMOS_PORT, often in the same
 * .env file) and the test runner.
 */
const READ_ELSEWHERE = new Set([
  'MNEMOS_URL',
  'MNEMOS_API_KEY',
  'MNEMOS_SESSION',
  'MNEMOS_BIND',
  'MNEMOS_PORT',
  'MNEMOS_CHECK_RESPONSES',
  'MNEMOS_TEST_RUN',
  'MNEMOS_TEST_TEMPLATE',
]);

/**
 * A warning for each MNEMOS_* variable that no setting reads: a typo (`MNEMOS_PREFX`) otherwise
 * starts on the default, and the default prefix is shared with every other deployment on the Redis.
 * The closest known name is suggested when it is a small edit away, also without the MNEMOS_ part
 * (`MNEMOS_REDIS_URL` is REDIS_URL).
 */
function unknownVariableWarnings(env: Record<string, string | undefined>): string[] {
  const known = Object.keys(schema.shape);
  const warnings: string[] = [];
  for (const [name, value] of Object.entries(env)) {
    if (!/^mnemos_/i.test(name) || value === undefined || value === '') continue;
    if (known.includes(name) || READ_ELSEWHERE.has(name)) continue;
    const upper = name.toUpperCase();
    let best: { name: string; distance: number } | null = null;
    for (const k of known) {
      const distance = Math.min(editDistance(upper, k), editDistance(upper.slice('MNEMOS_'.length), k));
      if (distance <= Math.max(1, Math.floor(k.length / 4)) && (!best || distance < best.distance))
        best = { name: k, distance };
    }
    warnings.push(
      `${name} is not a mnemos setting and is ignored (${best ? `did you mean ${best.name}?` : 'see README "Configuration"'})`,
    );
  }
  return warnings;
}

/**
 * A DATABASE_URL without a database name connects, by libpq's rule (node-postgres follows it), to
 * PGDATABASE or else the database named like the user: `postgres://postgres@host` is the shared
 * `postgres` database, which mnemos then fills with its tables. Said at start, naming that database.
 */
function databaseNameWarning(url: string, env: Record<string, string | undefined>): string | null {
  const u = parsePgUrl(url);
  if (!u || u.pathname.replace(/^\//, '') !== '') return null;
  const name = decodes(u.username) ? decodeURIComponent(u.username) : u.username;
  const user = u.searchParams.get('user') || name || env.PGUSER || env.USER;
  const database = env.PGDATABASE
    ? `"${env.PGDATABASE}" (PGDATABASE)`
    : user
      ? `"${user}" (named like the user)`
      : 'the one named like the user';
  return (
    `DATABASE_URL names no database: Postgres will use database ${database}; put the database in ` +
    `the path (e.g. postgres://user@127.0.0.1:5432/mnemos)`
  );
}

/** A Chinese tag other than Taiwan's Traditional (`zh-CN`, `zh-Hans-TW`; not `zh-TW-u-nu-hanidec`). */
function chineseOtherThanTaiwan(tag: string): boolean {
  const l = new Intl.Locale(tag);
  return l.language === 'zh' && !(l.region === 'TW' && (l.script === undefined || l.script === 'Hant'));
}

/** The zone Node's clock uses, as an IANA name; UTC when ICU cannot name it (TZ="" or invalid). */
function processTimeZone(): string {
  const zone = Intl.DateTimeFormat().resolvedOptions().timeZone as string | undefined;
  if (!zone || zone === 'Etc/Unknown') return 'UTC';
  return zone;
}

/**
 * What every Postgres connection of the deployment honours, the service's and the CLI's alike
 * (db/pool.ts makePgDb options): the database, Postgres's idle-in-transaction bound, and whether a
 * transaction pooler stands between (then nothing may be SET on a connection).
 */
export function pgConnectionOptions(config: Config, connectionString: string) {
  return {
    connectionString,
    idleInTransactionTimeoutMs: config.pgIdleInTransactionTimeoutMs,
    transactionPooler: config.pgTransactionPooler,
  };
}

/**
 * An embedded database (PGlite, the quick start's) in MNEMOS_DATA_DIR while DATABASE_URL names
 * Postgres: its tenants, keys and sessions are not there, and the old keys answered 401 without a
 * word at start.
 */
function unusedEmbeddedWarning(dataDir: string): string | null {
  const dir = path.resolve(dataDir);
  try {
    if (readdirSync(path.join(dir, 'pgdata')).length === 0) return null;
  } catch {
    return null;
  }
  return (
    `MNEMOS_DATA_DIR ${dir} holds an embedded database, which is not used while DATABASE_URL is set: ` +
    'its tenants, API keys and sessions are not in this Postgres (move sessions with mnemos export and ' +
    'import: docs/embedded.md)'
  );
}

export function loadConfig(env: Record<string, string | undefined>): Config {
  // Empty strings count as unset, as in most twelve-factor tooling (compose passes `VAR=` through).
  const present = Object.fromEntries(
    Object.keys(schema.shape)
      .map((k) => [k, env[k]] as const)
      .filter(([, v]) => v !== undefined && v !== ''),
  );
  const parsed = schema.safeParse(present);
  if (!parsed.success) {
    throw new ConfigError(
      parsed.error.issues.map((i) => {
        const [name, ...rest] = i.path;
        const where = rest.length
          ? ` (item ${rest.map((p) => (typeof p === 'number' ? p + 1 : String(p))).join('.')})`
          : '';
        return `${String(name)}: ${i.message}${where}`;
      }),
    );
  }
  const e = parsed.data;
  const configured = Boolean(e.OPENAI_API_KEY ?? e.OPENAI_BASE_URL);
  const local = !configured;
  const localEmbedder = local || e.EMBEDDING_MODEL === 'local-hash';
  const problems: string[] = [];
  // Unset or empty (what docker-compose.yml passes when the user sets none): the process's zone.
  // With TZ="" in the environment the C library and V8's clock read UTC, but ICU reports the zone
  // `Etc/Unknown`, which it then refuses: the service would not start at all.
  // POSIX's `:Zone` (AWS Lambda sets `:UTC`) and `:/etc/localtime` are the zone Node reads too.
  const zone = e.TZ?.startsWith(':') ? e.TZ.slice(1) : e.TZ;
  let timeZone = !zone || zone.startsWith('/') ? processTimeZone() : zone;
  try {
    new Intl.DateTimeFormat('en-US', { timeZone });
  } catch {
    problems.push(`TZ: unknown time zone "${e.TZ}" (use an IANA name such as Asia/Taipei or UTC)`);
    timeZone = 'UTC';
  }
  if (problems.length > 0) throw new ConfigError(problems);
  const warnings: string[] = [];
  if (e.REPLY_LANG !== 'auto' && chineseOtherThanTaiwan(e.REPLY_LANG)) {
    warnings.push(
      `REPLY_LANG=${e.REPLY_LANG}: Chinese summaries are always written in Taiwan Traditional Chinese (zh-TW)`,
    );
  }
  if (e.DATABASE_URL) {
    const unnamed = databaseNameWarning(e.DATABASE_URL, env);
    if (unnamed) warnings.push(unnamed);
    const unused = unusedEmbeddedWarning(e.MNEMOS_DATA_DIR);
    if (unused) warnings.push(unused);
    // Embedded mode builds no per-session index at all, so only Postgres has something to lose.
    if (e.ANN_MIN_VECTORS > 0 && (e.EMBEDDING_DIMENSIONS ?? 0) > HNSW_MAX_DIMENSIONS) {
      warnings.push(
        `EMBEDDING_DIMENSIONS=${e.EMBEDDING_DIMENSIONS}: pgvector builds HNSW indexes of at most ${HNSW_MAX_DIMENSIONS} ` +
          `dimensions, so ANN_MIN_VECTORS is ignored and huge sessions keep the exact (slower) semantic search; ` +
          `set ANN_MIN_VECTORS=0 to say so, or EMBEDDING_DIMENSIONS=${HNSW_MAX_DIMENSIONS} or fewer for an index`,
      );
    }
  }
  warnings.push(...unknownVariableWarnings(env));
  // SPEC §1: without an LLM, LLM-dependent work reports itself disabled rather than failing.
  if (e.DECISION_MODEL && !configured) {
    warnings.push(
      'DECISION_MODEL is ignored without OPENAI_API_KEY/OPENAI_BASE_URL: the decision model is disabled ' +
        '(summaries keep every message, context serves the whole summary)',
    );
  }
  return {
    port: e.PORT,
    host: e.HOST,
    databaseUrl: e.DATABASE_URL,
    dataDir: e.MNEMOS_DATA_DIR,
    redisUrl: e.REDIS_URL,
    prefix: e.MNEMOS_PREFIX,
    adminToken: e.MNEMOS_ADMIN_TOKEN,
    llm: { apiKey: e.OPENAI_API_KEY, baseURL: e.OPENAI_BASE_URL, configured },
    embedding: {
      model: e.EMBEDDING_MODEL ?? (local ? 'local-hash' : 'text-embedding-3-small'),
      // local-hash defaults to its own 384 with an LLM configured too (it got 1536 there, and the
      // start then refused an index built with local-hash/384).
      dimensions: e.EMBEDDING_DIMENSIONS ?? (localEmbedder ? 384 : 1536),
      local: localEmbedder,
    },
    embedRoles: e.EMBED_ROLES,
    summaryModel: e.SUMMARY_MODEL,
    decisionModel: configured ? e.DECISION_MODEL : undefined,
    maxHistoryMessages: e.MAX_HISTORY_MESSAGES,
    maxHistoryBytes: e.MAX_HISTORY_BYTES,
    summaryRunes: e.SUMMARY_RUNES,
    summaryCron: e.SUMMARY_CRON,
    errorMemoryTtlDays: e.ERROR_MEMORY_TTL_DAYS,
    usageRetentionDays: e.USAGE_RETENTION_DAYS,
    replyLang: e.REPLY_LANG,
    timeZone,
    workerConcurrency: e.WORKER_CONCURRENCY,
    embedConcurrency: e.EMBED_CONCURRENCY,
    summaryConcurrency: e.SUMMARY_CONCURRENCY,
    embedMaxDeferMs: e.EMBED_MAX_DEFER_MS,
    embedDeferBehindMs: e.EMBED_DEFER_BEHIND_MS,
    pgPoolSize: e.PG_POOL_SIZE,
    pgIdleInTransactionTimeoutMs: e.PG_IDLE_IN_TRANSACTION_TIMEOUT_MS,
    pgRequestTimeoutMs: e.PG_REQUEST_TIMEOUT_MS,
    searchTimeoutMs: e.SEARCH_TIMEOUT_MS,
    annMinVectors: e.ANN_MIN_VECTORS,
    // A named statement prepared on one server connection is missing (or already there) on the next.
    pgPreparedStatements: e.PG_PREPARED_STATEMENTS && e.PG_POOLER === 'none',
    pgTransactionPooler: e.PG_POOLER === 'transaction',
    searchIndexMinMessages: e.SEARCH_INDEX_MIN_MESSAGES,
    searchIndexMaxSessions: e.SEARCH_INDEX_MAX_SESSIONS,
    llmTimeoutMs: e.LLM_TIMEOUT_MS,
    relevanceTimeoutMs: e.RELEVANCE_TIMEOUT_MS,
    rateLimitPerMin: e.RATE_LIMIT_PER_MIN,
    shutdownTimeoutMs: e.SHUTDOWN_TIMEOUT_MS,
    logLevel: e.LOG_LEVEL,
    warnings,
  };
}
