/**
 * Error memory at scale: the redis-om store (services/error-memory) loaded with `--records`
 * generated tool errors in one tenant over 50 tools, then `lookup` and `search` latency against
 * a baseline that reads the same candidates with plain pipelined Redis commands, plus Redis
 * memory per record and write throughput.
 *
 *   node --import tsx bench/errors.ts [--records 100000] [--queries 2000] [--concurrency 32]
 *     [--hot 4000] [--budget 120]
 *
 * The store is opened exactly as the extension opens it (ttlDays 90, the 256-d local embedder).
 * Records: error messages with paths, numbers, URLs, hosts, ids and quoted values (which dedupe
 * masks), ~25 % Traditional Chinese; a share of writes repeats a "hot" error with new paths and
 * numbers so that dedupe merges a realistic fraction. Baseline per query: the store's own index
 * keys (ZRANGE REV 0..999 of each query term's key, with a tool its per-tool key and the
 * tenant-wide one, ZMSCORE against the tool set for what only the tenant-wide one found, the 256
 * candidates sharing the most terms) in pipelines, then one pipelined HGETALL of those 256 records;
 * no decoding, no scoring, no TTL renewal. Store and baseline alternate call by call. The store's
 * CPU steps (decoding, query terms and embedding, ranking) are re-run on the baseline's records
 * and timed apart, so the report says where a lookup's time goes. `--budget` caps each
 * timed query phase in seconds. A scratch Redis prefix (`mb_<time>_<hex>`) on the shared Redis
 * is removed at the end and on Ctrl-C.
 */
import { performance } from 'node:perf_hooks';
import { Redis } from 'ioredis';
import { errorKeys } from '../services/error-memory/error-keys.js';
// The baseline reads what the store reads, within the store's own limits.
import {
  CANDIDATES_PER_TERM,
  MAX_FETCHED,
  dedupeOf,
  openErrorMemory,
} from '../services/error-memory/error-store.js';
import { KEYWORD_SEPARATOR, normaliseSymptom } from '../services/error-memory/normalise.js';
import { buildQuery, rankRecords } from '../services/error-memory/ranking.js';
import { toStoredError } from '../services/error-memory/stored-error.js';
import type { ErrorWriteInput, Outcome, StoredError } from '../services/error-memory/types.js';
import { localEmbed } from '../services/llm/local-embedder.js';
import { makeRandom } from './lib/corpus.js';
import { cpuDiff, cpuSnapshot, pidsByName } from './lib/cpu.js';
import { fmtInt, fmtMs, fmtRatio, markdownTable, note } from './lib/format.js';
import { REDIS_URL, cleanupOnSignals, cleanupScratch, onCleanup, scratchPrefix } from './lib/scratch.js';
import { percentile, perSecond, ratio } from './lib/stats.js';
import { intArg } from './lib/args.js';

const RECORDS = intArg('records', 100_000);
const QUERIES = intArg('queries', 2000);
const CONCURRENCY = intArg('concurrency', 32);
const HOT_POOL = intArg('hot', 4000);
const BUDGET_MS = intArg('budget', 120) * 1000;
const TENANT = 'bench-tenant';
const TOOL_COUNT = 50;
const TEMPLATES_PER_TOOL = 10;
const HOT_SHARE = 0.35;
const WARMUP = 50;

// ---------------------------------------------------------------------------------------------
// Generated errors. A signature (tool, template, two vocabulary slots) is what dedupe should see
// as one error; everything else in the rendered text (paths, numbers, URLs, ids, quoted values)
// varies per occurrence and is masked by normaliseSymptom.

const TOOLS = (
  'fs.read_file fs.write_file fs.list_dir fs.delete shell.exec shell.run_script git.clone git.push ' +
  'git.commit git.checkout http.get http.post web.fetch web.search browser.open browser.click ' +
  'browser.screenshot sql.query sql.migrate pg.dump redis.get redis.set s3.upload s3.download gcs.list ' +
  'docker.build docker.run k8s.apply k8s.logs k8s.exec npm.install pip.install python.run node.eval ' +
  'pdf.extract image.resize ocr.scan email.send slack.post calendar.create_event jira.create_issue ' +
  'github.create_pr github.list_issues stripe.charge translate.text weather.lookup maps.geocode ' +
  'vector.upsert vector.query crm.update_contact'
).split(' ');

const V = {
  op: 'reading writing listing uploading downloading deleting exporting importing syncing indexing renaming copying archiving validating rendering parsing compressing signing scheduling publishing'.split(
    ' ',
  ),
  res: 'invoice report customer-record order attachment thumbnail backup manifest changelog playlist ticket contract dataset snapshot template webhook session-log audit-trail price-list shipment profile avatar certificate keyfile migration notebook payload transcript receipt calendar-feed sitemap inventory ledger quota feature-flag policy schedule bundle build-artifact'.split(
    ' ',
  ),
  svc: 'postgres billing-api auth-gateway search-cluster payments-core media-store mailer notifier geo-service ledger-svc inventory-api crm-sync analytics-db cache-tier queue-broker ocr-engine pdf-renderer translator vector-db scheduler sso-proxy file-gateway webhooks-out audit-log rate-keeper tenant-admin export-worker image-proxy metrics-store'.split(
    ' ',
  ),
  param:
    'limit offset page_size cursor timeout_ms region bucket branch commit_sha query top_k language currency amount recipient due_date file_id channel tags priority assignee encoding format width height dpi namespace replicas image_tag'.split(
      ' ',
    ),
  table:
    'invoices customers orders payments sessions audit_events api_keys webhooks subscriptions shipments products price_rules tenants users accounts refunds jobs attachments contracts notes tickets events schedules ledgers quotas'.split(
      ' ',
    ),
  col: 'tenant_id created_at amount_cents status external_ref due_at email owner_id currency deleted_at region sku version priority checksum locale'.split(
    ' ',
  ),
  cmd: 'pdftotext ffmpeg convert jq rg terraform helm kubectl psql pg_restore aws gsutil wkhtmltopdf tesseract poetry yarn pnpm make cargo rsync'.split(
    ' ',
  ),
  scope:
    'repo:write issues:read files.write calendar.events chat:write payments.refund admin.users storage.objects.create contacts.write mail.send pull_requests:write secrets:read deployments:write billing.read labels:write'.split(
      ' ',
    ),
  zhop: '讀取 寫入 上傳 下載 刪除 匯出 匯入 同步 建立 更新 封存 驗證'.split(' '),
  zhres:
    '報表 客戶資料 發票 訂單 附件 縮圖 備份 合約 工單 帳號設定 出貨單 價目表 排程 稽核紀錄 會議紀錄 庫存 收據 通知範本 資料集 憑證'.split(
      ' ',
    ),
} as const;
type Slot = keyof typeof V;

type Ctx = { a: string; b: string; r: () => number };
const pick = <T>(r: () => number, xs: readonly T[]): T => xs[Math.floor(r() * xs.length)]!;
const num = (r: () => number, lo: number, hi: number) => lo + Math.floor(r() * (hi - lo + 1));
const hex = (r: () => number, n: number) =>
  `a1${Array.from({ length: n - 2 }, () => '0123456789abcdef'[Math.floor(r() * 16)]).join('')}`;
const uuid = (r: () => number) => {
  const h = hex(r, 32);
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
};
const path = (r: () => number) =>
  `/${pick(r, ['srv', 'var/lib', 'home/agent', 'tmp', 'mnt/data'])}/${pick(r, ['acme', 'orion', 'kite', 'delta', 'atlas'])}/${pick(r, ['data', 'exports', 'in', 'cache', 'uploads'])}/${pick(r, ['q3', 'batch', 'daily', 'user', 'tmp'])}-${num(r, 1, 99999)}.${pick(r, ['json', 'csv', 'pdf', 'png', 'yaml', 'txt'])}`;
const ip = (r: () => number) => `10.${num(r, 0, 255)}.${num(r, 0, 255)}.${num(r, 1, 254)}`;
const host = (r: () => number, svc: string) => `${svc}-${num(r, 1, 12)}.internal`;
const url = (r: () => number, svc: string) =>
  `https://${svc}.example.com/v${num(r, 1, 3)}/${pick(r, ['items', 'objects', 'records', 'files'])}/${num(r, 1000, 9_999_999)}`;

type Kind =
  | 'missing'
  | 'permission'
  | 'timeout'
  | 'auth'
  | 'notfound'
  | 'invalid'
  | 'required'
  | 'sql'
  | 'ratelimit'
  | 'parse'
  | 'toolmissing'
  | 'server'
  | 'tls'
  | 'oom'
  | 'toolarge'
  | 'deadlock';

/** [kind, slot a, slot b, render]; the last six are Traditional Chinese. */
const TEMPLATES: ReadonlyArray<readonly [Kind, Slot, Slot, (c: Ctx) => string]> = [
  [
    'missing',
    'op',
    'res',
    (c) => `ENOENT: no such file or directory, open '${path(c.r)}' while ${c.a} the ${c.b}`,
  ],
  ['permission', 'op', 'res', (c) => `EACCES: permission denied, mkdir '${path(c.r)}' (${c.a} ${c.b})`],
  [
    'timeout',
    'svc',
    'res',
    (c) =>
      `connect ETIMEDOUT ${ip(c.r)}:${num(c.r, 1024, 65000)} - ${c.a} did not answer while loading the ${c.b}`,
  ],
  [
    'timeout',
    'op',
    'svc',
    (c) => `${c.a} failed: request to ${url(c.r, c.b)} timed out after ${num(c.r, 1, 120) * 500} ms`,
  ],
  [
    'auth',
    'scope',
    'res',
    (c) => `HTTP 403 Forbidden: token lacks scope ${c.a} needed for ${c.b} (request ${uuid(c.r)})`,
  ],
  ['notfound', 'res', 'svc', (c) => `HTTP 404 Not Found: ${c.a} ${uuid(c.r)} does not exist in ${c.b}`],
  [
    'invalid',
    'param',
    'res',
    (c) =>
      `invalid parameter ${c.a} for ${c.b}: expected integer between 1 and ${num(c.r, 10, 1000)}, got "${pick(c.r, ['abc', '-1', 'null', '1e9', ''])}"`,
  ],
  [
    'required',
    'param',
    'op',
    (c) => `missing required parameter ${c.a} when ${c.b} (call ${num(c.r, 1, 9999)})`,
  ],
  [
    'sql',
    'col',
    'table',
    (c) => `ERROR: column ${c.a} of relation ${c.b} does not exist at character ${num(c.r, 8, 400)}`,
  ],
  [
    'sql',
    'table',
    'col',
    (c) =>
      `duplicate key value violates unique constraint ${c.a}_${c.b}_key: Key (${c.b})=(${num(c.r, 1, 1e7)}) already exists`,
  ],
  [
    'ratelimit',
    'svc',
    'op',
    (c) =>
      `429 Too Many Requests from ${c.a} while ${c.b}: limit ${num(c.r, 10, 600)} requests per minute, retry after ${num(c.r, 1, 90)} s`,
  ],
  [
    'parse',
    'res',
    'svc',
    (c) =>
      `SyntaxError: Unexpected token < in JSON at position ${num(c.r, 0, 5000)} parsing the ${c.a} response from ${host(c.r, c.b)}`,
  ],
  [
    'toolmissing',
    'cmd',
    'res',
    (c) => `/bin/sh: 1: ${c.a}: command not found (exit code 127) while building the ${c.b}`,
  ],
  [
    'server',
    'svc',
    'op',
    (c) => `${c.a} returned 500 Internal Server Error while ${c.b} (trace ${hex(c.r, 16)})`,
  ],
  [
    'tls',
    'svc',
    'op',
    (c) =>
      `certificate has expired for ${host(c.r, c.a)} during ${c.b}: unable to verify the first certificate (depth ${num(c.r, 0, 3)})`,
  ],
  [
    'oom',
    'op',
    'res',
    (c) => `container OOMKilled while ${c.a} the ${c.b}: memory limit ${num(c.r, 1, 16) * 256} MiB exceeded`,
  ],
  [
    'toolarge',
    'res',
    'svc',
    (c) =>
      `413 Payload Too Large: ${c.a} is ${num(c.r, 11, 900)} MB, ${c.b} accepts at most ${num(c.r, 1, 10)} MB`,
  ],
  [
    'deadlock',
    'op',
    'table',
    (c) =>
      `deadlock detected while ${c.a} rows of ${c.b}: process ${num(c.r, 100, 99999)} waits for ShareLock on transaction ${num(c.r, 1e5, 1e8)}`,
  ],
  ['permission', 'zhop', 'zhres', (c) => `${c.a}${c.b}失敗：權限不足，無法存取 ${path(c.r)}`],
  [
    'timeout',
    'svc',
    'zhres',
    (c) => `連線到 ${host(c.r, c.a)} 逾時（${num(c.r, 1, 60) * 1000} 毫秒），無法取得${c.b}`,
  ],
  ['notfound', 'table', 'zhop', (c) => `找不到資料表 ${c.a}，${c.b}第 ${num(c.r, 1, 500)} 筆資料時失敗`],
  [
    'invalid',
    'param',
    'zhres',
    (c) => `參數 ${c.a} 格式錯誤：${c.b}需要整數，收到 "${pick(c.r, ['abc', '十二', '-', '0x1f'])}"`,
  ],
  ['server', 'svc', 'zhop', (c) => `${c.a} 服務回應 503，${c.b}暫時無法完成（追蹤碼 ${hex(c.r, 12)}）`],
  ['required', 'param', 'zhres', (c) => `缺少必填欄位 ${c.a}，無法建立${c.b}（第 ${num(c.r, 1, 80)} 列）`],
];

const CAUSES: Record<Kind, ReadonlyArray<(a: string, b: string, r: () => number) => string>> = {
  missing: [
    (a, b) => `the ${b} was moved by the nightly cleanup before ${a} finished`,
    (_a, b) => `the working directory was not mounted, so the ${b} path did not exist`,
  ],
  permission: [
    (a) => `the agent runs as uid ${1000} without write access to the export volume during ${a}`,
    () => `the directory is owned by root after the last deploy`,
    () => '檔案目錄屬於 root，代理程式沒有寫入權限',
  ],
  timeout: [
    (a) => `${a} was overloaded by a batch job and dropped connections`,
    (_a, _b, r) => `the default client timeout is ${num(r, 1, 10)} s, too short for large payloads`,
    () => '服務在尖峰時段回應過慢',
  ],
  auth: [
    (a) => `the token was issued without the ${a} scope`,
    () => `the OAuth app was re-created and old tokens lost their grants`,
  ],
  notfound: [
    (a) => `the ${a} was deleted by another agent a few minutes earlier`,
    (_a, b) => `the id belongs to another environment of ${b}`,
  ],
  invalid: [
    (a) => `the model passed ${a} as a string instead of a number`,
    (a) => `${a} was taken from the user message without validation`,
  ],
  required: [
    (a) => `the tool schema marks ${a} optional but the API requires it`,
    (a) => `the previous step returned no ${a} and the agent went on anyway`,
  ],
  sql: [
    (a, b) => `the migration adding ${a} to ${b} has not run on this database`,
    (_a, b) => `two writers inserted the same natural key into ${b}`,
  ],
  ratelimit: [
    (a) => `parallel tool calls exceeded the per-key quota of ${a}`,
    () => `retries without backoff multiplied the request rate`,
  ],
  parse: [
    (_a, b) => `${b} returned an HTML error page instead of JSON`,
    () => `a proxy in front of the service answered with a login page`,
  ],
  toolmissing: [
    (a) => `${a} is not installed in the sandbox image`,
    (a) => `the PATH of the sandbox does not include the directory of ${a}`,
  ],
  server: [
    (a) => `${a} had a bad deploy and was rolled back later`,
    () => `an upstream dependency was down for maintenance`,
  ],
  tls: [
    (a) => `the certificate of ${a} was not renewed by the cron job`,
    () => `the sandbox CA bundle is outdated`,
  ],
  oom: [
    (_a, b) => `the whole ${b} was loaded into memory instead of streamed`,
    () => `the memory limit of the container is too small for this input`,
  ],
  toolarge: [
    (a, b) => `the ${a} was sent in one request; ${b} wants multipart uploads`,
    () => `images were not compressed before upload`,
  ],
  deadlock: [
    (_a, b) => `two agents updated ${b} rows in opposite order`,
    () => `a long transaction held row locks during a slow external call`,
  ],
};
const ACTIONS: Record<Kind, ReadonlyArray<(a: string, b: string, r: () => number) => string>> = {
  missing: [
    (_a, b) => `listed the parent directory, found the renamed ${b} and retried with its new path`,
    () => `recreated the directory with mkdir -p and wrote the file again`,
  ],
  permission: [
    () => `wrote to the agent's own scratch directory instead and copied the result`,
    () => `asked the operator to chown the export directory; retried successfully`,
    () => '改寫到代理程式自己的暫存目錄後成功',
  ],
  timeout: [
    (_a, _b, r) => `raised the timeout to ${num(r, 20, 120)} s and retried with exponential backoff`,
    () => `split the request into pages of 100 items`,
    () => '將逾時設為 60 秒並分批重試',
  ],
  auth: [
    (a) => `requested a new token with the ${a} scope and retried`,
    () => `switched to the service account that has the grant`,
  ],
  notfound: [
    () => `searched by name to get the current id, then retried`,
    () => `reported to the user that the record no longer exists`,
  ],
  invalid: [
    (a) => `converted ${a} to an integer and clamped it to the allowed range`,
    (a) => `removed ${a} and let the API use its default`,
  ],
  required: [
    (a) => `asked the user for ${a} before calling the tool again`,
    (a) => `filled ${a} from the previous tool result`,
  ],
  sql: [
    () => `ran the pending migration, then repeated the query`,
    () => `switched to INSERT ... ON CONFLICT DO NOTHING`,
  ],
  ratelimit: [
    (_a, _b, r) => `waited ${num(r, 5, 60)} s and reduced parallel calls to 2`,
    () => `batched the requests into one bulk call`,
  ],
  parse: [
    () => `checked the content type first and retried after the login`,
    () => `called the JSON endpoint with an explicit Accept header`,
  ],
  toolmissing: [
    (a) => `installed ${a} with the package manager and reran the command`,
    () => `used the pure-Python fallback instead`,
  ],
  server: [
    () => `retried three times with backoff; the third attempt succeeded`,
    () => `gave up and told the user the service is down`,
  ],
  tls: [
    () => `updated the CA bundle in the sandbox`,
    () => `reported the expired certificate to the operator`,
  ],
  oom: [() => `streamed the input in chunks of 10 MB`, () => `asked for a larger container and reran`],
  toolarge: [
    () => `compressed the file and uploaded it in 5 MB parts`,
    () => `uploaded to object storage and sent a link instead`,
  ],
  deadlock: [
    () => `retried the transaction after a random delay`,
    (_a, b) => `locked ${b} rows in primary key order`,
  ],
};

type Signature = { tool: number; template: number; a: number; b: number };
const sigKey = (s: Signature) => `${s.tool}/${s.template}/${s.a}/${s.b}`;

function randomSignature(r: () => number): Signature {
  const tool = Math.floor(r() * TOOL_COUNT);
  // Each tool meets its own 10 of the 24 templates.
  const template = (tool * 7 + Math.floor(r() * TEMPLATES_PER_TOOL) * 5) % TEMPLATES.length;
  const [, sa, sb] = TEMPLATES[template]!;
  return { tool, template, a: Math.floor(r() * V[sa].length), b: Math.floor(r() * V[sb].length) };
}

const FRAMES =
  'runTool invokeHandler callApi withRetry readStream flushBatch parseBody executeQuery uploadPart spawnChild'.split(
    ' ',
  );

/**
 * Some errors carry a stack trace. Whether one does, and its frames, follow from the signature
 * (so dedupe still sees one error); its line numbers vary.
 */
function renderSymptom(s: Signature, r: () => number): string {
  const [, sa, sb, render] = TEMPLATES[s.template]!;
  const text = render({ a: V[sa][s.a]!, b: V[sb][s.b]!, r });
  const h = (s.tool * 131 + s.template * 31 + s.a * 7 + s.b) % 10;
  if (h >= 3) return text;
  const frames = Array.from(
    { length: 2 + h },
    (_, i) =>
      `    at ${FRAMES[(s.a + s.b + i * 3) % FRAMES.length]} (/app/src/tools/${TOOLS[s.tool]!.split('.')[0]!}.js:${num(r, 10, 900)}:${num(r, 3, 60)})`,
  );
  return `${text}\n${frames.join('\n')}`;
}

const OUTCOME_DRAW: Outcome[] = [
  'resolved',
  'resolved',
  'resolved',
  'resolved',
  'resolved',
  'resolved',
  'resolved',
  'failed',
  'failed',
  'abandoned',
];

function renderWrite(s: Signature, r: () => number): ErrorWriteInput {
  const [kind, sa, sb] = TEMPLATES[s.template]!;
  const a = V[sa][s.a]!;
  const b = V[sb][s.b]!;
  const keywords: string[] = [];
  const nk = num(r, 0, 3);
  for (let i = 0; i < nk; i++) keywords.push(pick(r, [a, b, kind, TOOLS[s.tool]!.split('.')[0]!]));
  return {
    tool_name: TOOLS[s.tool]!,
    symptom: renderSymptom(s, r),
    cause: r() < 0.15 ? null : pick(r, CAUSES[kind])(a, b, r),
    action: pick(r, ACTIONS[kind])(a, b, r),
    outcome: pick(r, OUTCOME_DRAW),
    keywords,
    session_id: `sess-${num(r, 1, 5000)}`,
  };
}

/** A free-text search query about a signature: a few of its words, sometimes an error class word. */
function renderSearch(s: Signature, r: () => number): string {
  const [kind, sa, sb] = TEMPLATES[s.template]!;
  const words = [V[sa][s.a]!, V[sb][s.b]!];
  const classWords: Record<Kind, string[]> = {
    missing: ['file not found', 'no such file'],
    permission: ['permission denied', '權限'],
    timeout: ['timeout', 'timed out', '逾時'],
    auth: ['forbidden scope', '403'],
    notfound: ['not found', '找不到'],
    invalid: ['invalid parameter', '格式錯誤'],
    required: ['missing parameter', '缺少'],
    sql: ['column does not exist', 'duplicate key'],
    ratelimit: ['rate limit', '429'],
    parse: ['unexpected token json'],
    toolmissing: ['command not found'],
    server: ['500 internal error', '503'],
    tls: ['certificate expired'],
    oom: ['out of memory'],
    toolarge: ['payload too large'],
    deadlock: ['deadlock'],
  };
  const parts = r() < 0.5 ? [pick(r, words)] : words;
  if (r() < 0.7) parts.push(pick(r, classWords[kind]));
  return parts.join(' ');
}

// ---------------------------------------------------------------------------------------------

type Lat = number[];
const p = (xs: Lat, q: number) =>
  percentile(
    [...xs].sort((x, y) => x - y),
    q,
  );

async function main(): Promise<void> {
  cleanupOnSignals();
  const prefix = scratchPrefix();
  const k = errorKeys(prefix, TENANT);
  const redis = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 });
  onCleanup(async () => redis.disconnect());
  const usedMemory = async () => Number(/used_memory:(\d+)/.exec(await redis.info('memory'))?.[1]);

  note(
    `prefix ${prefix}; ${fmtInt(RECORDS)} records, ${fmtInt(QUERIES)} queries, ${CONCURRENCY} writes in flight`,
  );
  const memBefore = await usedMemory();
  const store = await openErrorMemory({
    redisUrl: REDIS_URL,
    prefix,
    ttlDays: 90,
    embed: (t) => localEmbed(t, 256),
  });
  onCleanup(() => store.close());

  // --- load ---------------------------------------------------------------------------------
  const gen = makeRandom(0xe770);
  const hot = Array.from({ length: HOT_POOL }, () => randomSignature(gen));
  const idOf = new Map<string, string>();
  const written: Signature[] = [];
  let next = 0;
  let merged = 0;
  let symptomChars = 0;
  const normalised = new Set<string>();
  const probes = [
    { label: 'bench (node)', pids: () => Promise.resolve([process.pid]) },
    { label: 'redis-server', pids: () => pidsByName('redis-server') },
  ];
  const cpu0 = await cpuSnapshot(probes);
  const t0 = performance.now();
  let lastNote = t0;
  await Promise.all(
    Array.from({ length: CONCURRENCY }, async () => {
      while (next < RECORDS) {
        next++;
        // Skewed reuse of hot errors (squared draw: a few are very common), else a fresh draw.
        const sig = gen() < HOT_SHARE ? hot[Math.floor(HOT_POOL * gen() ** 2)]! : randomSignature(gen);
        const input = renderWrite(sig, gen);
        symptomChars += input.symptom.length;
        normalised.add(`${input.tool_name}\n${normaliseSymptom(input.symptom)}`);
        const r = await store.write(TENANT, input);
        if (r.deduplicated) merged++;
        else idOf.set(sigKey(sig), r.id);
        written.push(sig);
        if (performance.now() - lastNote > 10_000) {
          lastNote = performance.now();
          note(`  ${fmtInt(written.length)} written (${fmtInt(perSecond(written.length, lastNote - t0))}/s)`);
        }
      }
    }),
  );
  const loadMs = performance.now() - t0;
  const loadCpu = cpuDiff(cpu0, await cpuSnapshot(probes));
  const memAfter = await usedMemory();
  const distinct = await redis.zcard(k.all);
  note(`load: ${fmtInt(RECORDS)} writes in ${(loadMs / 1000).toFixed(1)} s, ${fmtInt(distinct)} records`);

  // --- memory -------------------------------------------------------------------------------
  const groups = { rec: [] as string[], dedupe: [] as string[], index: [] as string[] };
  let cursor = '0';
  do {
    const [nextCursor, keys] = await redis.scan(cursor, 'MATCH', `${prefix}:*`, 'COUNT', 2000);
    cursor = nextCursor;
    for (const key of keys) {
      if (key.startsWith(`${k.base}:rec:`)) groups.rec.push(key);
      else if (key.startsWith(k.dedupePrefix)) groups.dedupe.push(key);
      else groups.index.push(key);
    }
  } while (cursor !== '0');
  async function memoryOf(keys: string[]): Promise<number[]> {
    const out: number[] = [];
    for (let i = 0; i < keys.length; i += 500) {
      const pl = redis.pipeline();
      for (const key of keys.slice(i, i + 500)) pl.call('MEMORY', 'USAGE', key, 'SAMPLES', '0');
      for (const [err, v] of (await pl.exec()) ?? []) if (!err) out.push(Number(v));
    }
    return out;
  }
  const sum = (xs: number[]) => xs.reduce((x, y) => x + y, 0);
  const mean = (xs: number[]) => (xs.length ? sum(xs) / xs.length : Number.NaN);
  const recSample = groups.rec.slice(0, 2000);
  const recBytes = mean(await memoryOf(recSample));
  const embPl = redis.pipeline();
  for (const key of recSample) embPl.hstrlen(key, 'embedding');
  const embBytes = mean(((await embPl.exec()) ?? []).map(([, v]) => Number(v)));
  const dedupeBytes = mean(await memoryOf(groups.dedupe.slice(0, 2000)));
  const indexMem = await memoryOf(groups.index);
  const indexTotal = sum(indexMem);
  // Term sets holding a single id: mostly numbers, ids and file names from one error message.
  const cardPl = redis.pipeline();
  for (const key of groups.index) cardPl.call('ZCARD', key);
  const cards = ((await cardPl.exec()) ?? []).map(([err, v]) => (err ? -1 : Number(v)));
  const singles = cards.map((c, i) => (c === 1 ? (indexMem[i] ?? 0) : -1)).filter((b) => b >= 0);
  const isTerm = groups.index.map((x) => x.startsWith(`${k.base}:term:`));
  const termKeys = isTerm.filter(Boolean).length;
  const termEntries = sum(cards.filter((c, i) => isTerm[i] && c > 0));

  // --- queries ------------------------------------------------------------------------------
  const qr = makeRandom(0x10c0);
  type Lookup = { tool: string; error: string; expect: string | undefined; seen: boolean };
  const lookups: Lookup[] = Array.from({ length: QUERIES + WARMUP }, () => {
    const seen = qr() < 0.7;
    const sig = seen ? written[Math.floor(qr() * written.length)]! : randomSignature(qr);
    return { tool: TOOLS[sig.tool]!, error: renderSymptom(sig, qr), expect: idOf.get(sigKey(sig)), seen };
  });
  const searches = Array.from({ length: QUERIES + WARMUP }, () => {
    const sig = written[Math.floor(qr() * written.length)]!;
    return { query: renderSearch(sig, qr), tool: qr() < 0.5 ? TOOLS[sig.tool] : undefined };
  });

  type Breakdown = {
    idx: number;
    fetch: number;
    decode: number;
    query: number;
    embed: number;
    rank: number;
  };
  const upgraded = (await redis.exists(k.version)) === 1;
  /** The same candidates the store reads, with pipelined plain commands; CPU steps timed apart. */
  async function baseline(
    text: string,
    tool: string | undefined,
  ): Promise<Breakdown & { ids: number; cand: number; read: number }> {
    const b0 = performance.now();
    // The store's query terms (both ends of a long text); with a tool, its own term key, and the
    // tenant-wide one too while the tenant has no layout mark (not in this bench: a new tenant).
    const perTerm = buildQuery(text, tool, undefined).terms.map((t) =>
      tool === undefined ? [k.term(t)] : upgraded ? [k.toolTerm(tool, t)] : [k.toolTerm(tool, t), k.term(t)],
    );
    const pl = redis.pipeline();
    for (const key of perTerm.flat()) pl.zrevrange(key, 0, CANDIDATES_PER_TERM - 1);
    // With a tool, the record of exactly this error (its dedupe key) is a candidate too.
    if (tool !== undefined) pl.get(k.dedupePrefix + dedupeOf(tool, text.trim()));
    const replies = ((await pl.exec()) ?? []).map(([, v]) => v);
    const exact = tool === undefined ? null : (replies.pop() as string | null);
    const flat = replies as string[][];
    const count = new Map<string, number>();
    const ofTool = new Set<string>();
    let at = 0;
    for (const keys of perTerm) {
      const seen = new Set<string>();
      keys.forEach((_, j) => {
        for (const id of flat[at + j] ?? []) {
          if (!seen.has(id)) count.set(id, (count.get(id) ?? 0) + 1);
          seen.add(id);
          if (j === 0) ofTool.add(id);
        }
      });
      at += keys.length;
    }
    let ids = [...count.keys()];
    const cand = ids.length;
    const read = flat.reduce((n, l) => n + l.length, 0);
    const unchecked = ids.filter((id) => !ofTool.has(id));
    if (tool !== undefined && unchecked.length > 0) {
      const tl = redis.pipeline();
      for (let i = 0; i < unchecked.length; i += 500)
        tl.zmscore(k.tool(tool), ...unchecked.slice(i, i + 500));
      const scores = ((await tl.exec()) ?? []).flatMap(([, v]) => v as Array<string | null>);
      const other = new Set(unchecked.filter((_, i) => scores[i] === null));
      ids = ids.filter((id) => !other.has(id));
    }
    const byCount = (x: string, y: string) => (count.get(y) ?? 0) - (count.get(x) ?? 0);
    ids.sort(byCount);
    if (ids.length > MAX_FETCHED) {
      // Of the candidates sharing as many terms, resolved ones first.
      const head = ids.slice(0, CANDIDATES_PER_TERM);
      const scores = await redis.zmscore(k.resolved, ...head);
      const fixes = new Set(head.filter((_, i) => scores[i] !== null));
      ids.sort((x, y) => byCount(x, y) || Number(fixes.has(y)) - Number(fixes.has(x)));
    }
    if (exact !== null) ids = [exact, ...ids.filter((id) => id !== exact)];
    ids = ids.slice(0, MAX_FETCHED);
    const b1 = performance.now();
    const hp = redis.pipeline();
    for (const id of ids) hp.hgetall(k.rec(id));
    const hashes = ((await hp.exec()) ?? []).map(([, v]) => v as Record<string, string>);
    const b2 = performance.now();
    // Not part of the baseline: what the store does on top, in CPU (redis-om's own decoding aside).
    const recs = hashes
      .map((h, i) =>
        toStoredError(ids[i]!, {
          ...h,
          keywords: (h.keywords ?? '').split(KEYWORD_SEPARATOR),
          hits: Number(h.hits),
          created_ms: Number(h.created_ms),
          last_hit_ms: Number(h.last_hit_ms),
        }),
      )
      .filter((x): x is StoredError => x !== null);
    const b3 = performance.now();
    const q = buildQuery(text, tool, (t) => localEmbed(t, 256));
    const b4 = performance.now();
    localEmbed(text, 256);
    const b5 = performance.now();
    rankRecords(recs, q, 4);
    const b6 = performance.now();
    return {
      idx: b1 - b0,
      fetch: b2 - b1,
      decode: b3 - b2,
      query: b4 - b3,
      embed: b5 - b4,
      rank: b6 - b5,
      ids: ids.length,
      cand,
      read,
    };
  }

  type Phase = {
    name: string;
    store: Lat;
    base: Lat;
    fetch: Lat;
    bd: Breakdown[];
    cand: number[];
    read: number[];
    fetched: number[];
    n: number;
    extra: string;
  };
  async function runPhase(
    name: string,
    n: number,
    call: (i: number) => Promise<number>,
    text: (i: number) => { text: string; tool: string | undefined },
  ): Promise<Phase> {
    const ph: Phase = {
      name,
      store: [],
      base: [],
      fetch: [],
      bd: [],
      cand: [],
      read: [],
      fetched: [],
      n: 0,
      extra: '',
    };
    const start = performance.now();
    for (let i = 0; i < n + WARMUP; i++) {
      if (i >= WARMUP && performance.now() - start > BUDGET_MS) break;
      const { text: t, tool } = text(i);
      const runStore = async () => {
        const s0 = performance.now();
        await call(i);
        return performance.now() - s0;
      };
      let sMs: number;
      let b: Awaited<ReturnType<typeof baseline>>;
      if (i % 2 === 0) {
        sMs = await runStore();
        b = await baseline(t, tool);
      } else {
        b = await baseline(t, tool);
        sMs = await runStore();
      }
      if (i < WARMUP) continue;
      ph.store.push(sMs);
      ph.base.push(b.idx + b.fetch);
      ph.fetch.push(b.fetch);
      ph.bd.push(b);
      ph.cand.push(b.cand);
      ph.read.push(b.read);
      ph.fetched.push(b.ids);
      ph.n++;
    }
    return ph;
  }

  let found = 0;
  let recalled = 0;
  let seenWithId = 0;
  const lookupPhase = await runPhase(
    'lookup',
    QUERIES,
    async (i) => {
      const q = lookups[i]!;
      const r = await store.lookup(TENANT, { tool_name: q.tool, error: q.error });
      if (i >= WARMUP) {
        if (r.records.length > 0) found++;
        if (q.seen && q.expect) {
          seenWithId++;
          if (r.records.some((x) => x.id === q.expect)) recalled++;
        }
      }
      return r.records.length;
    },
    (i) => ({ text: lookups[i]!.error, tool: lookups[i]!.tool }),
  );
  lookupPhase.extra = `${fmtInt(found)}/${fmtInt(lookupPhase.n)} answered ≥1 record; the record of a seen error was in the top 4 for ${fmtInt(recalled)}/${fmtInt(seenWithId)}`;
  note(`lookup: ${lookupPhase.extra}`);

  const searchPhase = await runPhase(
    'search',
    QUERIES,
    async (i) =>
      (await store.search(TENANT, { query: searches[i]!.query, tool_name: searches[i]!.tool, limit: 4 }))
        .length,
    (i) => ({ text: searches[i]!.query, tool: searches[i]!.tool }),
  );

  // --- report -------------------------------------------------------------------------------
  const f = (x: number) => fmtMs(x);
  process.stdout.write(
    `\n## Error memory: ${fmtInt(RECORDS)} writes, 1 tenant, ${TOOL_COUNT} tools\n\n` +
      markdownTable(
        ['measure', 'value'],
        [
          ['writes (concurrency)', `${fmtInt(RECORDS)} (${CONCURRENCY})`],
          [
            'distinct records after dedupe',
            `${fmtInt(distinct)} (${fmtInt(merged)} writes merged, ${((merged / RECORDS) * 100).toFixed(1)} %)`,
          ],
          [
            'distinct generated errors: signatures / (tool, normalised symptom)',
            `${fmtInt(new Set(written.map(sigKey)).size)} / ${fmtInt(normalised.size)}`,
          ],
          [
            'write throughput',
            `${fmtInt(perSecond(RECORDS, loadMs))} writes/s (${(loadMs / 1000).toFixed(1)} s)`,
          ],
          [
            'CPU per write: bench+store (node) / redis-server',
            `${(((loadCpu.groups['bench (node)'] ?? 0) * 1000) / RECORDS).toFixed(3)} / ${(((loadCpu.groups['redis-server'] ?? 0) * 1000) / RECORDS).toFixed(3)} core-ms`,
          ],
          ['mean symptom length', `${(symptomChars / RECORDS).toFixed(0)} chars`],
          [
            'record HASH, MEMORY USAGE (mean of 2,000)',
            `${fmtInt(recBytes)} B, of which embedding JSON ${fmtInt(embBytes)} B`,
          ],
          ['dedupe key, MEMORY USAGE (mean of 2,000)', `${fmtInt(dedupeBytes)} B`],
          [
            `index keys (${fmtInt(groups.index.length)}, ${fmtInt(termKeys)} term sets), total / records`,
            `${fmtInt(indexTotal / distinct)} B (total ${(indexTotal / 2 ** 20).toFixed(1)} MiB)`,
          ],
          [
            'term-set entries per record (mean terms a record is indexed under)',
            (termEntries / distinct).toFixed(1),
          ],
          [
            `term sets holding one id: count / their bytes / records`,
            `${fmtInt(singles.length)} / ${fmtInt(sum(singles) / distinct)} B`,
          ],
          [
            'sum per record (hash + dedupe + index share)',
            `${fmtInt(recBytes + dedupeBytes + indexTotal / distinct)} B`,
          ],
          [
            'INFO used_memory delta / records (shared Redis)',
            `${fmtInt((memAfter - memBefore) / distinct)} B (${((memAfter - memBefore) / 2 ** 20).toFixed(1)} MiB)`,
          ],
        ],
      ) +
      '\n\n',
  );
  const rows = [lookupPhase, searchPhase].map((ph) => [
    ph.name,
    fmtInt(ph.n),
    `${f(p(ph.store, 50))} / ${f(p(ph.store, 95))}`,
    `${f(p(ph.base, 50))} / ${f(p(ph.base, 95))}`,
    `${fmtRatio(ratio(p(ph.store, 50), p(ph.base, 50)))} / ${fmtRatio(ratio(p(ph.store, 95), p(ph.base, 95)))}`,
    `${f(p(ph.fetch, 50))} / ${f(p(ph.fetch, 95))}`,
    `${fmtRatio(ratio(p(ph.store, 50), p(ph.fetch, 50)))}`,
    `${fmtInt(p(ph.read, 50))} / ${fmtInt(p(ph.cand, 50))}`,
    `${fmtInt(p(ph.fetched, 50))}`,
  ]);
  process.stdout.write(
    markdownTable(
      [
        'call',
        'n',
        'store p50 / p95',
        'baseline p50 / p95',
        'store/baseline',
        'HGETALL batch alone',
        'store/HGETALL p50',
        'ids read / distinct p50',
        'records read p50',
      ],
      rows,
    ) + `\n\nlookup: ${lookupPhase.extra}\n\n`,
  );
  const us = (x: number) => `${(x * 1000).toFixed(0)} µs`;
  const bdRow = (ph: Phase) => {
    const m = (key: keyof Breakdown) => mean(ph.bd.map((x) => x[key]));
    return [
      ph.name,
      f(mean(ph.store)),
      f(m('idx')),
      f(m('fetch')),
      us(m('decode')),
      us(m('query')),
      us(m('embed')),
      us(m('rank')),
    ];
  };
  process.stdout.write(
    'Mean cost of the steps (baseline steps timed in the baseline; CPU steps re-run on its records):\n\n' +
      markdownTable(
        [
          'call',
          'store total',
          'index reads (pipelined)',
          'HGETALL ×≤256',
          'decode (JSON.parse embedding…)',
          'buildQuery (incl. embed)',
          'query embed alone',
          'rankRecords',
        ],
        [bdRow(lookupPhase), bdRow(searchPhase)],
      ) +
      '\n',
  );
}

// After Ctrl-C the store is closed under the running writes; their errors are expected.
let interrupted = false;
for (const sig of ['SIGINT', 'SIGTERM'] as const) process.on(sig, () => (interrupted = true));

main()
  .catch((err: unknown) => {
    process.exitCode = 1;
    if (interrupted) return;
    process.stderr.write(`${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
  })
  .finally(async () => {
    for (const line of await cleanupScratch()) note(`cleanup: ${line}`);
  });
