import { randomBytes } from 'node:crypto';
import { ERROR_CLASSES, OUTCOMES } from './types.js';
import type { ErrorClass, Outcome, StoredError } from './types.js';

/** `err_` + 20 base32 characters of 100 random bits. */
export function newErrorId(): string {
  const alphabet = 'abcdefghijklmnopqrstuvwxyz234567';
  let bits = 0n;
  for (const byte of randomBytes(13)) bits = (bits << 8n) | BigInt(byte);
  let out = '';
  for (let i = 0; i < 20; i++) out += alphabet[Number((bits >> BigInt(5 * i)) & 31n)];
  return `err_${out}`;
}

/** Maps a redis-om HASH entity to a record; null when the hash is gone or not a whole record. */
export function toStoredError(id: string, e: Record<string, unknown>): StoredError | null {
  const { tool_name, symptom, action, outcome, hits, created_ms, last_hit_ms } = e;
  if (
    typeof tool_name !== 'string' ||
    typeof symptom !== 'string' ||
    typeof action !== 'string' ||
    !OUTCOMES.includes(outcome as Outcome) ||
    typeof hits !== 'number' ||
    typeof created_ms !== 'number' ||
    typeof last_hit_ms !== 'number'
  ) {
    return null;
  }
  const cls = ERROR_CLASSES.includes(e.error_class as ErrorClass) ? (e.error_class as ErrorClass) : 'other';
  let embedding: number[] | null = null;
  if (typeof e.embedding === 'string') {
    try {
      const parsed: unknown = JSON.parse(e.embedding);
      if (Array.isArray(parsed) && parsed.every((x) => typeof x === 'number')) embedding = parsed;
    } catch {
      embedding = null;
    }
  }
  return {
    id,
    tool_name,
    symptom,
    cause: typeof e.cause === 'string' ? e.cause : null,
    action,
    outcome: outcome as Outcome,
    keywords: Array.isArray(e.keywords)
      ? e.keywords.filter((k): k is string => typeof k === 'string' && k !== '')
      : [],
    hits,
    created_ms,
    last_hit_ms,
    error_class: cls,
    embedding,
  };
}
