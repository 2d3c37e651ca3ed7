import { parseSentAt } from '../time.js';
import type { ImportCursor } from './import-input.js';

/** Agenvoy's time notations: message headers and summary cursors (local wall-clock time). */

const NAIVE_TIME = String.raw`(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})`;
const FENCED = /^---[ \t]*\r?\n([\s\S]*?)\r?\n---[ \t]*(?:\r?\n|$)/;
const TIME_LINE = new RegExp(
  String.raw`^[ \t]*(?:sendAt|send_at|當前時間)[ \t]*[:：][ \t]*${NAIVE_TIME}[ \t]*$`,
  'm',
);
const WORKDIR_LINE = /^[ \t]*(?:工作目錄|workDir|work_dir)[ \t]*[:：][ \t]*(.*?)[ \t]*$/m;
const HEADER_LINE = /^[ \t]*(sendAt|send_at|當前時間|工作目錄|workDir|work_dir)[ \t]*[:：][ \t]*(.*?)[ \t]*$/;

export interface SplitHeader {
  text: string;
  /** The header's time in local wall-clock form, when the text started with one. */
  time: string | null;
  workDir: string | null;
}

/**
 * Strips a leading time header (fenced `---` block or bare lines) from a user message's text (the
 * only role Agenvoy stamps). Bare lines: one time line, with `工作目錄:` lines before or after it;
 * a second time line ends the header and stays in the text (the user wrote it).
 */
export function splitTimeHeader(text: string): SplitHeader {
  const fenced = FENCED.exec(text);
  if (fenced) {
    const time = TIME_LINE.exec(fenced[1]!);
    if (time) {
      return {
        text: text.slice(fenced[0].length),
        time: time[1]!,
        workDir: WORKDIR_LINE.exec(fenced[1]!)?.[1] || null,
      };
    }
  }
  const lines = text.split('\n');
  let time: string | null = null;
  let workDir: string | null = null;
  let n = 0;
  for (; n < lines.length; n++) {
    const m = HEADER_LINE.exec(lines[n]!.replace(/\r$/, ''));
    if (!m) break;
    if (m[1] === '工作目錄' || m[1] === 'workDir' || m[1] === 'work_dir') workDir = m[2] || null;
    else {
      if (time !== null) break;
      const t = new RegExp(`^${NAIVE_TIME}$`).exec(m[2]!);
      if (!t) break;
      time = t[1]!;
    }
  }
  if (time === null) return { text, time: null, workDir: null };
  return {
    text: lines
      .slice(n)
      .join('\n')
      .replace(/^\r?\n/, ''),
    time,
    workDir,
  };
}

/** `.summary_cursor`: local `YYYY-MM-DD HH:MM:SS`, or unix time (s, ms or ns by its length). */
export function parseCursorValue(raw: string, timeZone: string): ImportCursor | null {
  const v = raw.trim();
  if (/^\d+$/.test(v)) {
    const n = BigInt(v);
    if (v.length <= 11) return { kind: 'sent_at', ns: n * 1_000_000_000n, wholeSeconds: true };
    if (v.length <= 14) return { kind: 'sent_at', ns: n * 1_000_000n, wholeSeconds: false };
    return { kind: 'sent_at', ns: n, wholeSeconds: n % 1_000_000_000n === 0n };
  }
  const ns = parseSentAt(v, timeZone);
  if (typeof ns === 'string') return null;
  // Agenvoy keeps the cursor to the second (the time of the last summarised message).
  return { kind: 'sent_at', ns, wholeSeconds: true };
}
