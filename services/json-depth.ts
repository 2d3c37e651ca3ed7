/**
 * A bound on JSON nesting checked on the bytes, before JSON.parse: the JSON bodies of every route
 * (services/app.ts) and each line of a JSON Lines import (services/lifecycle/import-input.ts).
 */

/**
 * How deep a JSON body may nest, counting every `{` and `[`. The deepest body a route takes is a
 * message's metadata at its limit (MAX_JSON_DEPTH: 63 objects holding a value) inside the
 * message, the `messages` array and the body's object: 66. Past this a body is refused before
 * JSON.parse sees it: parsing 8 MiB of nested arrays held the event loop for 6–16 s (every other
 * tenant's request waited) only for the metadata check after it to refuse them.
 */
export const MAX_BODY_DEPTH = 128;

/**
 * True when the JSON in `buf` nests deeper than `limit`. Brackets inside strings do not count; a
 * backslash escapes the byte after it, so `\"` does not end a string. Bytes, not characters: no
 * byte of a multi-byte UTF-8 character is a quote, a backslash or a bracket. One plain pass, about
 * 10–20 ms for 8 MiB whatever its shape: jumping to a string's closing quote with `indexOf` was
 * faster on long strings but 4–7 times slower on many short ones or escaped quotes (73 ms). A
 * body that is not JSON is left to JSON.parse, which stops at its first error.
 */
export function jsonNestedDeeperThan(buf: Uint8Array, limit: number): boolean {
  let depth = 0;
  let inString = false;
  for (let i = 0; i < buf.length; i++) {
    const c = buf[i]!;
    if (inString) {
      if (c === 0x5c) i++;
      else if (c === 0x22) inString = false;
    } else if (c === 0x22) inString = true;
    else if (c === 0x5b || c === 0x7b) {
      if (++depth > limit) return true;
    } else if (c === 0x5d || c === 0x7d) depth--;
  }
  return false;
}
