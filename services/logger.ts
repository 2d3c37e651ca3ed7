import { pino } from 'pino';
import type { Logger } from 'pino';

export type { Logger };

/** One structured logger; children per request and per job. Message bodies, prompts and keys are never logged. */
export function makeLogger(level: string, name = 'mnemos'): Logger {
  return pino({
    name,
    level,
    redact: {
      paths: ['req.headers.authorization', '*.authorization', '*.apiKey', '*.api_key'],
      censor: '[redacted]',
    },
  });
}
