/**
 * NUL and lone surrogates: characters Postgres cannot store (text, jsonb) and that strict JSON
 * decoders refuse once JSON.stringify has written them as `\u` escapes (serde_json rejects a lone
 * surrogate). Requests holding them are refused (message-input.ts); an answer that quoted them back
 * (a 400 naming a refused key, a tool's "unknown field" text) was itself undecodable for such
 * clients, so answers show them as the six characters of their escape instead.
 */
// eslint-disable-next-line no-control-regex
export const UNSTORABLE = /\u0000|[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;
const EVERY_UNSTORABLE = new RegExp(UNSTORABLE.source, 'g');

export function escapeUnstorable(s: string): string {
  return s.replace(EVERY_UNSTORABLE, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

/** escapeUnstorable over every string of a JSON value, keys included. */
export function escapeUnstorableDeep(v: unknown): unknown {
  if (typeof v === 'string') return escapeUnstorable(v);
  if (Array.isArray(v)) return v.map(escapeUnstorableDeep);
  if (v !== null && typeof v === 'object') {
    const out: Record<string, unknown> = {};
    for (const [k, x] of Object.entries(v)) out[escapeUnstorable(k)] = escapeUnstorableDeep(x);
    return out;
  }
  return v;
}

/** Whether any string of a JSON value, keys included, holds UNSTORABLE characters. */
export function holdsUnstorable(v: unknown): boolean {
  if (typeof v === 'string') return UNSTORABLE.test(v);
  if (Array.isArray(v)) return v.some(holdsUnstorable);
  if (v !== null && typeof v === 'object') {
    return Object.entries(v).some(([k, x]) => UNSTORABLE.test(k) || holdsUnstorable(x));
  }
  return false;
}
