import { TOOL_CALL_SEPARATOR } from '../../db/queries/summaries.js';
import { codePoints, isHighSurrogate, isLowSurrogate, takeCodePoints } from '../text/code-points.js';
import { oneLine } from '../text/one-line.js';
import { wallClock } from '../time.js';

/**
 * How archived messages appear in summary prompts. Every size here is in Unicode code points
 * (SUMMARY_RUNES), never UTF-16 units (`.length`) or bytes: an emoji is one, a CJK character is one.
 */

export const truncationMarker = (omitted: number) => `…[truncated ${omitted} characters]`;

/** `2026-01-02 10:03:04 +08:00`: the message's wall-clock time in the configured zone. */
export function formatMessageTime(sentAtNs: string, timeZone: string): string {
  const p = wallClock(timeZone, Number(BigInt(sentAtNs) / 1_000_000n));
  return `${p.year}-${p.month}-${p.day} ${p.hour}:${p.minute}:${p.second} ${p.offset}`;
}

/** One archived message, content already capped by the query. */
export interface SourceMessage {
  seq: number;
  role: string;
  name: string | null;
  sentAtNs: string;
  /** Text content, possibly a prefix of the stored text. */
  content: string;
  /** Code points of the whole stored text. */
  contentChars: number;
  /** Tool calls as `name(arguments)`, separated by TOOL_CALL_SEPARATOR. */
  toolCalls: string | null;
}

/** A message rendered for a prompt. `size` counts its code points plus the blank-line separator. */
export interface Block {
  seq: number;
  role: string;
  text: string;
  size: number;
  source: SourceMessage;
  /** Cut to fit the size it was rendered for (`…[truncated N characters]`). */
  cut?: boolean;
}

export const BLOCK_SEPARATOR = '\n\n';
const SEPARATOR_SIZE = 2;

// A message is rendered again when its chunk is re-planned; its header does not change.
const headers = new WeakMap<SourceMessage, string>();

function header(m: SourceMessage, timeZone: string): string {
  let h = headers.get(m);
  if (h === undefined) {
    // Names are client-chosen: a long one must not eat the message's share of a chunk, and one
    // with a newline must not end the header (oneLine).
    const who = m.name ? `${m.role} (${takeCodePoints(oneLine(m.name), 64)})` : m.role;
    h = `[${formatMessageTime(m.sentAtNs, timeZone)}] ${who}:\n`;
    headers.set(m, h);
  }
  return h;
}

const BODY_INDENT = '  ';
// Line breaks as a model may read them: CRLF, LF, a lone CR, VT, FF, NEL, U+2028, U+2029.
const LINE_BREAK = /\r\n|[\n\r\v\f\u0085\u2028\u2029]/g;
const LINE_BREAK_CHARS = new Set(['\n', '\r', '\v', '\f', '\u0085', '\u2028', '\u2029']);

/**
 * Every line of a body indented by BODY_INDENT: only headers start a line, so a message (a tool
 * result, a web page) cannot write a `[time] user:` header of its own and pass its text off as
 * another turn, the user's (a tester's tool result did, and its "user" asked for a standing rule).
 */
const indented = (body: string) => BODY_INDENT + body.replace(LINE_BREAK, `\n${BODY_INDENT}`);

/**
 * Renders a message as `[time] role:` + newline + its body indented (`indented`), in at most
 * `maxSize` (separator included). A body that does not fit is cut with `…[truncated N
 * characters]`, N counting what the prompt leaves out of the stored message.
 */
export function renderBlock(m: SourceMessage, timeZone: string, maxSize: number): Block {
  const head = header(m, timeZone);
  const calls = m.toolCalls ? m.toolCalls.split(TOOL_CALL_SEPARATOR).map((c) => `→ tool call: ${c}`) : [];
  const content = m.content;
  const body = [content, ...calls].filter((x) => x !== '').join('\n') || '(empty)';
  // What the stored message holds beyond what the query returned.
  const hidden = Math.max(0, m.contentChars - codePoints(content));
  const bodyChars = codePoints(body);
  const room = maxSize - SEPARATOR_SIZE - codePoints(head);
  // Indented, the body takes at least BODY_INDENT more: a body past that is not indented whole.
  const whole = hidden === 0 && bodyChars + BODY_INDENT.length <= room ? indented(body) : null;
  let text: string;
  let cut = false;
  if (whole !== null && codePoints(whole) <= room) {
    text = head + whole;
  } else {
    cut = true;
    // Cut the body, then indent what is kept: N counts the stored message's characters. No more
    // than `room` less the indentation and the shortest marker can fit; from there the cut walks
    // back a code point at a time, taking off what each renders as (a line break is one more
    // indentation), to the longest prefix that fits with its marker, however many line breaks it
    // holds (taking off what was over in one go overshot: `ok\n\n` lines shrank by 2 per code
    // point, and a cut meant for 500 kept nothing).
    const marker = (keep: number) => codePoints(truncationMarker(bodyChars + hidden - keep));
    let keep = Math.min(bodyChars, Math.max(0, room - BODY_INDENT.length - marker(bodyChars)));
    const prefix = takeCodePoints(body, keep);
    let end = prefix.length;
    let size = codePoints(indented(prefix));
    while (keep > 0 && size + marker(keep) > room) {
      const pair =
        end >= 2 && isLowSurrogate(prefix.charCodeAt(end - 1)) && isHighSurrogate(prefix.charCodeAt(end - 2));
      const c = prefix[end - 1]!;
      end -= pair ? 2 : 1;
      keep--;
      // The LF of a CRLF adds nothing: a lone CR is a line break as well.
      if (c === '\n' && prefix[end - 1] === '\r') continue;
      size -= !pair && LINE_BREAK_CHARS.has(c) ? 1 + BODY_INDENT.length : 1;
    }
    text = head + indented(prefix.slice(0, end)) + truncationMarker(bodyChars + hidden - keep);
  }
  return { seq: m.seq, role: m.role, text, size: codePoints(text) + SEPARATOR_SIZE, source: m, cut };
}

/** The transcript of a chunk as sent to the model. */
export const joinBlocks = (blocks: Block[]) => blocks.map((b) => b.text).join(BLOCK_SEPARATOR);
