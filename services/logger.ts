import { pino } from 'pino';
import type { Logger } from 'pino';

export type { Logger };

/**
 * One structured logger; children per request and per job. Message bodies, prompts and keys are
 * never logged. Services log to stdout; CLI commands pass `stderr: true`, since their stdout is
 * data (an export, `--json` output) that a log line would corrupt.
 */
export function makeLogger(level: string, opts: { name?: string; stderr?: boolean } = {}): Logger {
  const options = {
    name: opts.name ?? 'mnemos',
    level,
    redact: {
      paths: ['req.headers.authorization', '*.authorization', '*.apiKey', '*.api_key'],
      censor: '[redacted]',
    },
  };
  // Synchronous, so a line logged just before the CLI's process.exit is not lost.
  return opts.stderr ? pino(options, pino.destination({ fd: 2, sync: true })) : pino(options);
}
