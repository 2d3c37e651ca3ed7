/**
 * Deterministic chat messages of realistic size for the benches: English prose of 200–800
 * characters built from sentences about agent work, about 15 % Traditional Chinese messages and
 * about 10 % English with a Chinese sentence in it. The same seed gives the same corpus, so every
 * system in a bench stores the same text.
 */

/** mulberry32: a small seeded PRNG (Math.random cannot be replayed). */
export function makeRandom(seed: number): () => number {
  let s = seed | 0;
  return () => {
    s = (s + 0x6d2b79f5) | 0;
    let t = Math.imul(s ^ (s >>> 15), 1 | s);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const SUBJECTS = [
  'The deployment script',
  'Our staging cluster',
  'The billing service',
  'This migration',
  'The nightly report job',
  'The search index',
  'Your pull request',
  'The customer dashboard',
  'The retry policy',
  'The cache layer',
  'The onboarding flow',
  'The export endpoint',
  'The Postgres replica',
  'The rate limiter',
  'The mobile release',
];
const VERBS = [
  'fails intermittently when',
  'should be rolled back before',
  'needs another review because',
  'became noticeably slower after',
  'was rewritten last week so that',
  'still logs a warning whenever',
  'can be simplified once',
  'times out under load when',
  'returns stale results if',
  'was approved on the condition that',
];
const CLAUSES = [
  'the connection pool is exhausted by long transactions',
  'two workers pick up the same job within a few milliseconds',
  'the configuration file is missing the new environment variable',
  'we upgrade the client library to the next major version',
  'the queue backs up during the Monday morning traffic peak',
  'the customer uploads a spreadsheet with more than ten thousand rows',
  'the feature flag is turned on for only half of the tenants',
  'the certificate expires and nobody notices the alert',
  'someone changes the schema without updating the documentation',
  'the integration tests run against an empty database',
  'the timezone of the server differs from the timezone of the user',
  'the summary is generated before the conversation has finished',
];
const FOLLOW = [
  'Could you check the logs from yesterday and tell me what you find?',
  'I think we should add a regression test before touching anything else.',
  'Please keep the answer short and list the concrete steps.',
  'Let me know whether the fix also covers the older API version.',
  'We agreed to prefer small, reversible changes over a big rewrite.',
  'I ran the command again and got the same error message as before.',
  'The metrics dashboard shows a spike around three in the afternoon.',
  'Remember that the release is planned for Thursday evening.',
  'Here is the stack trace: TypeError: cannot read properties of undefined (reading "id").',
  'After restarting the worker the backlog drained within two minutes.',
];
const ZH = [
  '請幫我檢查昨天的部署紀錄，看看有沒有錯誤訊息。',
  '我們決定先修正資料庫連線池的問題，再處理效能調校。',
  '這個功能上線之前需要再做一次完整的回歸測試。',
  '使用者反映搜尋結果不正確，尤其是中文關鍵字的部分。',
  '下週三之前要完成報表匯出的功能，請優先處理。',
  '伺服器在尖峰時段回應變慢，可能和快取失效有關。',
  '請用繁體中文回答，並且條列出具體的步驟。',
  '之前討論過的重試策略已經套用到所有的背景工作。',
  '這次的錯誤是因為設定檔少了一個環境變數。',
  '我們需要把舊的訊息歸檔，但是不能刪除任何資料。',
  '測試環境的資料庫是空的，所以整合測試沒有發現問題。',
  '客戶希望在儀表板上看到每個租戶的使用量。',
];

export interface CorpusMessage {
  role: 'user' | 'assistant';
  content: string;
}

export interface Corpus {
  /** The message at position i of a session (role alternates user/assistant). */
  message(sessionIndex: number, position: number): CorpusMessage;
  /** Mean UTF-8 bytes and characters of a sample, for the report. */
  stats(sample?: number): {
    meanChars: number;
    meanBytes: number;
    minChars: number;
    maxChars: number;
    cjkShare: number;
  };
}

function englishText(rand: () => number, targetChars: number): string {
  const pick = <T>(xs: readonly T[]): T => xs[Math.floor(rand() * xs.length)]!;
  const parts: string[] = [];
  let len = 0;
  while (len < targetChars) {
    const s = rand() < 0.6 ? `${pick(SUBJECTS)} ${pick(VERBS)} ${pick(CLAUSES)}.` : pick(FOLLOW);
    parts.push(s);
    len += s.length + 1;
  }
  return parts.join(' ');
}

function chineseText(rand: () => number, targetChars: number): string {
  const parts: string[] = [];
  let len = 0;
  while (len < targetChars) {
    const s = ZH[Math.floor(rand() * ZH.length)]!;
    parts.push(s);
    len += s.length;
  }
  return parts.join('');
}

/**
 * Builds a pool of `poolSize` distinct texts from `seed`; message (session, position) takes text
 * number (session * 7919 + position) mod poolSize, so sessions differ and the corpus is cheap.
 */
export function makeCorpus(seed = 0x3e3e, poolSize = 4096): Corpus {
  const rand = makeRandom(seed);
  const texts: string[] = [];
  for (let i = 0; i < poolSize; i++) {
    const target = 200 + Math.floor(rand() * 600);
    const kind = rand();
    if (kind < 0.15) texts.push(chineseText(rand, Math.floor(target / 3)));
    else if (kind < 0.25) {
      const en = englishText(rand, target - 40);
      texts.push(`${en} ${chineseText(rand, 20)}`);
    } else texts.push(englishText(rand, target));
  }
  const textAt = (sessionIndex: number, position: number) =>
    texts[(sessionIndex * 7919 + position) % poolSize]!;
  return {
    message: (sessionIndex, position) => ({
      role: position % 2 === 0 ? 'user' : 'assistant',
      content: textAt(sessionIndex, position),
    }),
    stats(sample = poolSize) {
      const xs = texts.slice(0, sample);
      const chars = xs.map((t) => Array.from(t).length);
      const bytes = xs.map((t) => Buffer.byteLength(t, 'utf8'));
      const cjk = xs.filter((t) => /\p{Script=Han}/u.test(t)).length;
      return {
        meanChars: chars.reduce((a, b) => a + b, 0) / xs.length,
        meanBytes: bytes.reduce((a, b) => a + b, 0) / xs.length,
        minChars: Math.min(...chars),
        maxChars: Math.max(...chars),
        cjkShare: cjk / xs.length,
      };
    },
  };
}
