import type { ErrorClass } from './types.js';
import { takeCodePoints } from '../text/code-points.js';

/**
 * Text rules of error memory, all pure: keyword clean-up, the normalised symptom that decides
 * dedupe, significant terms (what "shares a term" means for search and the term index), and
 * the automatic error class.
 */

/** Keywords are stored joined by this character, so it (and every control character) is stripped. */
export const KEYWORD_SEPARATOR = '\u001f';

export function normaliseKeywords(keywords: readonly string[]): string[] {
  const out: string[] = [];
  const seen = new Set<string>();
  for (const raw of keywords) {
    const k = raw
      .normalize('NFKC')
      .replace(/[\p{Cc}\s]+/gu, ' ')
      .trim()
      .toLowerCase();
    if (k === '' || seen.has(k)) continue;
    seen.add(k);
    out.push(k);
  }
  return out;
}

// Words whose value identifies the error, as in `{"code":"NoSuchKey"}`, `code: 'ERR_REQUIRE_ESM'`,
// `"message":"Unauthorized"`: a quoted token after one is kept, a number after one of the code
// words too (`"code":429`, `status: 404`, `HTTP/1.1 503`, `exit code 127`, `errno 13`,
// `signal 9`, `SQLSTATE 42703`, `curl: (7)`, `ORA-00942`, `错误代码 404`).
const NAME_WORDS =
  'code|error|errorcode|error_code|error_type|type|reason|status|state|message|msg|detail|kind|title';
const CODE_WORDS =
  'status_code|statuscode|http_status|status|code|errorcode|error_code|exitcode|exit_code|exit|errno|rc|signal|sqlstate|hresult|curl: \\(|ora-|' +
  'http(?:\\/\\d+(?:\\.\\d+)?)?|错误代码|錯誤代碼|错误码|錯誤碼|状态码|狀態碼|エラーコード|ステータスコード|상태 코드|오류 코드';
const VALUE_BEFORE = new RegExp(`(?<![\\p{L}\\p{N}_])(?:${NAME_WORDS})["'\`]?\\s*[:=]\\s*$`, 'u');
// The code may be negative (`exit code -11`, `"code":-32601`) and follow its word in brackets
// (`SQLSTATE[08006]`, `exit(1)`).
const CODE_BEFORE = new RegExp(
  `(?<![\\p{L}\\p{N}_])(?:${CODE_WORDS})(?:["'\`]?[ \\t]*[:=]?[ \\t]*|[\\[(])-?$`,
  'u',
);
// After `error`, `returned`, `responded (with)`, `status of`... only a number of three or more
// digits is a code (an HTTP status, `ERROR 1045`): `Error 1 of 3` and `error: 3 tests failed` are
// counts.
const ERROR_BEFORE =
  /(?<![\p{L}\p{N}_])(?:error|returned|responded|response|answered|status[ \t]+of)(?:[ \t]+with)?["'`]?[ \t]*[:=]?[ \t([]*-?$/u;
// `got 403 from server`: a status between `got` and `from`.
const GOT_BEFORE = /(?<![\p{L}\p{N}_])got[ \t]+$/u;
const FROM_AFTER = /^[ \t]+from\b/u;
// An HTTP status is also known by the reason phrase after it: `404 Client Error`, `(502) Bad Gateway`.
const REASON_AFTER =
  /^[)\]]?[ \t]*(?:client error|server error|not found|forbidden|unauthori[sz]ed|bad request|bad gateway|internal server error|service unavailable|gateway time-?out|too many requests|conflict|method not allowed|not acceptable|unprocessable|payment required|gone|precondition failed|request time-?out|not implemented)\b/u;
// A quoted text that starts like a path is a value even with spaces in it.
const PATH_START = /^(?:[a-z]:[\\/]|\\\\|~?\/|\.\.?[\\/])/;

/**
 * A quoted value is one token between quotes, or a quoted path: quoted text with whitespace in it
 * is a message (kept as text); a quoted token that opens a JSON or Python-dict member (after `{`
 * or `,`, followed by `:`) is a key, and one after a word naming the error (VALUE_BEFORE) is what
 * tells errors apart: both are kept. `cannot access 'build.log':` and `parsing "12a":` are values.
 */
function maskQuoted(quoted: string, offset: number, whole: string, hold: (kept: string) => string): string {
  const inner = quoted.slice(1, -1);
  if (PATH_START.test(inner)) return '<q>';
  if (/\s/u.test(inner)) return quoted;
  const before = whole.slice(Math.max(0, offset - 200), offset);
  const after = whole.slice(offset + quoted.length, offset + quoted.length + 200);
  const isKey = /^[ \t]*:/.test(after) && /[{,]\s*$/u.test(before);
  // The whole value of such a word (`{"error":"invalid_grant"}`, `code: 'ERR_X'`), not a name
  // inside a sentence after it (`error: 'foo' undeclared`).
  const isValue = VALUE_BEFORE.test(before) && /^[ \t]*(?:[,;}\])]|\r?\n|$)/.test(after);
  if (!(isKey || isValue)) return '<q>';
  // Kept as written: the masks after this one must not read ids or numbers into it
  // (`"err_http2_stream_cancel"`). A key or value of letters alone is left in place, as no mask
  // changes it and CODE_BEFORE reads the key before a number (`{"code":429}`).
  return /^[\p{L}\p{M}_]*$/u.test(inner) ? quoted : `${quoted[0]}${hold(inner)}${quoted.slice(-1)}`;
}

/**
 * Whether the number at `offset` of `whole` is a code that tells errors apart (a status, exit or
 * error code by its word or its reason phrase), rather than a count, port, line or address.
 * Also what makes a number a significant term.
 */
function isCodeNumber(n: string, offset: number, whole: string): boolean {
  const before = whole.slice(Math.max(0, offset - 24), offset);
  if (CODE_BEFORE.test(before)) return true;
  if (/^\d{3,}$/.test(n) && ERROR_BEFORE.test(before)) return true;
  if (!/^[1-5]\d\d$/.test(n)) return false;
  const after = whole.slice(offset + n.length, offset + n.length + 40);
  return REASON_AFTER.test(after) || (GOT_BEFORE.test(before) && FROM_AFTER.test(after));
}

// A version of three parts after the word it is a version of: `numpy 1.24.0`, `foo@1.2.3`,
// `requests==2.31.0`, `node >= 18.0.0`. Not after a stop word (`on 1.2.3`), not a date
// (`12.05.2024`); four parts are an IPv4 address and two may be any decimal (`took 1.5 s`).
const VERSION = /^\d{1,4}\.\d{1,4}\.\d{1,6}$/;
const DATE_LIKE = /^(?:\d{1,2}\.\d{1,2}\.\d{4}|\d{4}\.\d{1,2}\.\d{1,2})$/;
const VERSION_BEFORE =
  /(?<![\p{L}\p{N}_<])(\p{L}[\p{L}\p{N}_-]*)(?:[ \t]*(?:[<>=~^!]=?|==|@)[ \t]*|[ \t]+)$/u;

function isVersion(n: string, offset: number, whole: string): boolean {
  if (!VERSION.test(n) || DATE_LIKE.test(n)) return false;
  const word = VERSION_BEFORE.exec(whole.slice(Math.max(0, offset - 40), offset))?.[1];
  return word !== undefined && !STOP_WORDS.has(word);
}

function maskNumber(n: string, offset: number, whole: string): string {
  return isCodeNumber(n, offset, whole) || isVersion(n, offset, whole) ? n : '<n>';
}

/** `0x80070005` after `error`, `hresult`... is an error code, elsewhere an address or an id. */
function maskHex(hex: string, offset: number, whole: string): string {
  const before = whole.slice(Math.max(0, offset - 24), offset);
  return CODE_BEFORE.test(before) || ERROR_BEFORE.test(before) ? hex : '<id>';
}

// A URL starts at the first letter of its scheme's run that starts a word. The lookbehind lets
// only that letter try (it finds an earlier one within the run, at most back to the previous
// letter that could start), so a long run without `://` (`a.a.a.…`) is scanned once rather than
// once from each of its letters.
const URL_RE = /\b(?=[a-z])(?<!(?:^|\W)[a-z][a-z0-9+.-]*?)[a-z][a-z0-9+.-]*:\/\/[^\s'"`<>]+/g;
// A single quote only opens after a non-word character and closes before one, so the
// apostrophes of "can't" and "don't" are not taken for quotes (a CJK particle may follow one:
// `'a.txt'을`). Typographic and CJK quotes count too; a quoted text of these does not contain
// its opening quote (the innermost pair is taken), so that an opening quote that is never closed
// stops the scan at the next one instead of each of them scanning to the end of the line.
const QUOTED_RE =
  /"[^"\n]*"|`[^`\n]*`|(?<![\p{L}\p{N}])'[^'\n]*'(?![\p{Script=Latin}\p{N}])|‘[^‘’\n]*’|“[^“”\n]*”|「[^「」\n]*」|『[^『』\n]*』/gu;
// Timestamps and durations before anything else reads their digits: `2024-05-01t12:00:00z`,
// `jan  1 12:00:00`, `1m30s`, `250ms` (their letters would otherwise make `t12`, `m30s` words).
const TIMESTAMP_RE =
  /\b\d{4}-\d{2}-\d{2}(?:[t ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:z|[+-]\d{2}:?\d{2})?)?\b|\b(?:(?:mon|tue|wed|thu|fri|sat|sun)[a-z]*,?\s+)?(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\s+\d{1,2},?\s+(?:\d{4}\s+)?\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:\s+[a-z]{2,5}(?=\s+\d{4}\b))?(?:\s+\d{4}\b)?/g;
const DURATION_RE = /(?<![\p{L}\p{N}.])(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h|d))+(?![\p{L}\p{N}])/gu;
// Digits glued to a Latin, Greek or Cyrillic letter are part of a word (`python3`, `ipv6`), and
// so are the dotted parts after them (`v1.2.3`, `python3.12`: a number does not start after a
// digit and a dot); CJK text has no spaces, so a number beside a CJK character is still a number
// (`第12行`).
const NUMBER_RE =
  /(?<![\p{Script=Latin}\p{Script=Greek}\p{Script=Cyrillic}\p{N}_])(?<!\p{N}\.)\d+(?:\.\d+)*/gu;

// Applied after URLs, quoted values, timestamps and durations (they may contain paths and
// numbers); numbers last.
const MASKS: ReadonlyArray<readonly [RegExp, string]> = [
  [/\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b/g, '<id>'],
  [/[a-z]:\\(?:[^\s\\'"`<>|?*]+\\?)*/g, '<path>'],
  [/(?<![\w./\\-])(?:~|\.{1,2})?(?:\/[\w.@%+~-]+)+\/?/g, '<path>'],
  // `HTTP/1.1` is a protocol version, not a relative path.
  [
    /(?<![\w./\\-])(?!https?\/\d)(?:[\w.-]+(?:\/[\w.@%+~-]+){2,}|[\w.-]+\/[\w@%+~-]+\.[a-z0-9]{1,8}\b)/g,
    '<path>',
  ],
  // Hex ids (commit hashes from 7 characters, object ids) and long mixed tokens (request ids,
  // base32/64 keys). A mixed token is tried only from the first word character of its run of
  // [a-z0-9_-] (the lookbehind): a later start of the same run cannot match where the first did
  // not, and letting each start after a `-` try scanned the rest of the run again (`a-a-a-…`).
  [/\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,}\b/g, '<id>'],
  [/\b(?<![a-z0-9_]-*)(?=[a-z_-]*\d)(?=[\d_-]*[a-z])[a-z0-9_-]{16,}\b/g, '<id>'],
];

/**
 * The most of a symptom, in code points after NFKC and lower-casing, that dedupe reads. The API
 * takes symptoms of up to 4,000 characters, but NFKC expands some characters (U+FDFA becomes 18,
 * `㏂` becomes `a.m.`), and the masks below must not run on what that makes of them (up to 72,000
 * characters). Twice the API's limit leaves every symptom whole that NFKC does not more than
 * double. What a cut means for dedupe: symptoms of a tool that differ only past this point are
 * taken for the same error and merge.
 */
export const MAX_SYMPTOM_CHARS = 8000;

/**
 * The symptom as dedupe sees it: numbers, ids, paths, URLs and quoted values masked, but not the
 * numbers that tell errors apart (status and exit codes, digits that are part of a word) nor
 * quoted text that is a message or a key rather than a value. At most MAX_SYMPTOM_CHARS of it
 * are read.
 */
export function normaliseSymptom(symptom: string): string {
  const text = takeCodePoints(symptom.normalize('NFKC').toLowerCase(), MAX_SYMPTOM_CHARS);
  const held = holder(text);
  let s = text
    .replace(URL_RE, '<url>')
    .replace(QUOTED_RE, (q: string, offset: number, whole: string) => maskQuoted(q, offset, whole, held.hold))
    .replace(TIMESTAMP_RE, '<time>')
    .replace(DURATION_RE, '<n>');
  s = s.replace(/\b0x[0-9a-f]+\b/g, maskHex);
  for (const [re, mask] of MASKS) s = s.replace(re, mask);
  // A masked number's sign goes with it (`index -1` is `index 5`); a dash between words or
  // numbers (`a-1`, `5-10`) stays.
  s = s.replace(NUMBER_RE, maskNumber).replace(/(?<=^|[\s([{=,:])-(?=<n>)/g, '');
  return held.restore(s.replace(/\s+/g, ' ').trim());
}

const PRIVATE_USE = /\p{Co}/gu;

/**
 * Sets kept text aside while the masks run: each piece becomes one private-use character that
 * does not occur in `text` (no mask reads or changes it), and `restore` puts the pieces back. An
 * 8,000-character text leaves thousands of the 137,000 private-use characters free.
 */
function holder(text: string): { hold: (kept: string) => string; restore: (s: string) => string } {
  const held = new Map<string, string>();
  let used: Set<string> | undefined;
  let next = 0xe000;
  const step = (cp: number) => (cp === 0xf8ff ? 0xf0000 : cp === 0xffffd ? 0x100000 : cp + 1);
  return {
    hold: (kept) => {
      used ??= new Set(text.match(PRIVATE_USE) ?? []);
      while (used.has(String.fromCodePoint(next))) next = step(next);
      const ch = String.fromCodePoint(next);
      next = step(next);
      held.set(ch, kept);
      return ch;
    },
    restore: (s) => (held.size === 0 ? s : s.replace(PRIVATE_USE, (ch) => held.get(ch) ?? ch)),
  };
}

const CJK = /[\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Hangul}]/u;
const RUN =
  /[\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Hangul}]+|(?:(?![\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Hangul}])[\p{L}\p{N}\p{M}])+/gu;

const STOP_WORDS = new Set(
  (
    'a an the and or but if then else of to in on at by for with from into onto as is are was were be been ' +
    'being am it its this that these those not no nor do does did done has have had can could should would ' +
    'will shall may might must so than too very just also we you he she they me my our your their them us ' +
    'there here what when where which who whom how why all any some such only own same other about after ' +
    'before over under again up down out off while during per via'
  ).split(' '),
);

/**
 * Significant terms, in order of first appearance, without repeats: lower-cased words of two or
 * more characters that are not stop words, plus overlapping bigrams of CJK runs (CJK is written
 * without spaces, so words cannot be split on them). No stemming: "timeouts" is not "timeout".
 * A number is a term only where dedupe keeps it as a code (`status 404`, `ORA-12541`, `exit code
 * 137`): line numbers, ports, years and counts would make unrelated records share a term. Index
 * and queries both take their terms from here; a query (`query`) keeps numbers of three or more
 * digits too, so that a bare code (`403`, `137`, `-32601`) finds the records that hold it as one.
 */
export function significantTerms(text: string, max = Infinity, query = false): string[] {
  const terms = new Set<string>();
  const norm = text.normalize('NFKC').toLowerCase();
  for (const match of norm.matchAll(RUN)) {
    const run = match[0];
    if (CJK.test(run)) {
      // Stops at `max` within a run too: a CJK run of thousands of characters is one match.
      const chars = Array.from(run);
      for (let i = 0; i + 1 < chars.length && terms.size < max; i++) terms.add(`${chars[i]}${chars[i + 1]}`);
    } else if (
      Array.from(run).length >= 2 &&
      !STOP_WORDS.has(run) &&
      !(/^[0-9]+$/.test(run) && !(query && run.length >= 3) && !isCodeNumber(run, match.index, norm))
    ) {
      terms.add(run);
    }
    if (terms.size >= max) break;
  }
  return [...terms].slice(0, max);
}

// First rule that matches wins: "command not found" is a missing tool, not a missing file.
const CLASS_RULES: ReadonlyArray<readonly [ErrorClass, RegExp]> = [
  [
    'tool_missing',
    /\b(?:unknown|unsupported|unregistered|undefined) (?:tool|function|command)\b|\b(?:tool|function) (?:is )?(?:not found|not available|unavailable|not registered|does not exist)\b|\bno (?:such )?tool\b|command not found|is not recognized as an? (?:internal or external )?command|not installed|找不到工具|未安裝/,
  ],
  ['timeout', /\btimed? ?out\b|timeout|deadline exceeded|etimedout|took too long|超時|逾時/],
  [
    'permission',
    /permission|\bdenied\b|forbidden|unauthori[sz]ed|not authori[sz]ed|not allowed|eacces|eperm|\b40[13]\b|權限|拒絕存取/,
  ],
  [
    'missing_parameter',
    /\bmissing\b.{0,40}\b(?:param(?:eter)?|arg(?:ument)?|field|option|property|properties|key|value|input)s?\b|\b(?:param(?:eter)?|arg(?:ument)?|field|option|property|key|value|input)s? (?:is |are )?required\b|\brequired (?:param(?:eter)?|arg(?:ument)?|field|option|property)s?\b|缺少|必填/,
  ],
  [
    'not_found',
    /not found|no such (?:file|directory|key|entity|resource|object|table|column)|enoent|\b404\b|does ?n[o']t exist|\b(?:cannot|can't|could not|unable to) find|找不到|不存在/,
  ],
  [
    'invalid_parameter',
    /invalid|malformed|bad request|\b400\b|unexpected (?:token|type|value|argument)|must be (?:a|an|one of)\b|\bexpected\b.{1,40}\b(?:got|but|received)\b|out of range|not a valid|wrong type|格式錯誤|無效|不合法/,
  ],
];

export function classifyError(text: string): ErrorClass {
  const t = text.normalize('NFKC').toLowerCase();
  for (const [cls, re] of CLASS_RULES) if (re.test(t)) return cls;
  return 'other';
}
