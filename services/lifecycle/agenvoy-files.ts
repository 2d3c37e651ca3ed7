import { existsSync } from 'node:fs';
import { readFile, stat } from 'node:fs/promises';
import path from 'node:path';
import { AppError } from '../errors.js';

/**
 * Reading an Agenvoy session's text files (`import agenvoy`): UTF-8 or a refusal that names the
 * byte, JSON or an error that names line and column.
 */

/** The offset of the first byte that is not part of valid UTF-8, or -1. */
export function badUtf8At(b: Uint8Array): number {
  for (let i = 0; i < b.length;) {
    const c = b[i]!;
    // Continuation bytes that must follow a lead byte; -1: no lead byte (0x80-0xC1, 0xF5-0xFF).
    let more = -1;
    if (c < 0x80) more = 0;
    else if (c >= 0xc2 && c <= 0xdf) more = 1;
    else if (c >= 0xe0 && c <= 0xef) more = 2;
    else if (c >= 0xf0 && c <= 0xf4) more = 3;
    if (more < 0) return i;
    if (more > 0) {
      // Overlong forms, surrogates and code points past U+10FFFF are invalid too.
      const lo = c === 0xe0 ? 0xa0 : c === 0xf0 ? 0x90 : 0x80;
      const hi = c === 0xed ? 0x9f : c === 0xf4 ? 0x8f : 0xbf;
      const c1 = b[i + 1];
      if (c1 === undefined || c1 < lo || c1 > hi) return i;
      for (let k = 2; k <= more; k++) if (((b[i + k] ?? 0) & 0xc0) !== 0x80) return i;
    }
    i += more + 1;
  }
  return -1;
}

/**
 * A session file's text, or undefined when it does not exist. Bytes that are not UTF-8 refuse the
 * session (replacing them would store altered text, and a re-run would skip the session).
 */
export async function readText(file: string): Promise<string | undefined> {
  if (!existsSync(file)) return undefined;
  const info = await stat(file);
  if (!info.isFile()) {
    const what = info.isDirectory() ? 'is a directory, not a file' : 'is not a regular file';
    throw new AppError(400, 'invalid_file', `${path.basename(file)} ${what} (${file})`, { file });
  }
  const bytes = await readFile(file);
  try {
    // Strips a byte-order mark (editors on Windows write one).
    return new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    const at = badUtf8At(bytes);
    const line = bytes.subarray(0, at).filter((c) => c === 0x0a).length + 1;
    throw new AppError(
      400,
      'invalid_utf8',
      `${path.basename(file)} is not valid UTF-8 (byte offset ${at}, line ${line}): convert it to UTF-8 (for Big5: iconv -f BIG5 -t UTF-8) and import again`,
      { file, offset: at, line },
    );
  }
}

export async function readJson(file: string): Promise<unknown> {
  const text = await readText(file);
  if (text === undefined) return undefined;
  try {
    return JSON.parse(text) as unknown;
  } catch (err) {
    const reason = (err as Error).message;
    const at = / in JSON at position (\d+)/.exec(reason);
    let where = '';
    if (at) {
      const before = text.slice(0, Number(at[1])).split('\n');
      where = ` at line ${before.length}, column ${before.at(-1)!.length + 1}`;
    }
    const why = reason.replace(/ in JSON at position \d+.*$/, '');
    throw new AppError(400, 'invalid_file', `${path.basename(file)} is not valid JSON${where} (${why})`);
  }
}
