import { pino } from 'pino';
import type { Logger } from 'pino';
import { monotonicNow } from './time.js';

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

/**
 * A warning logged at most once per `everyMs` (5 s), the next line counting those left out
 * (`suppressed`). For error events a library emits per poll or per reconnect attempt: BullMQ
 * emitted 1,000–3,000 a second while Redis refused commands, 1.5 GB of log an hour.
 */
export function throttledWarn(
  logger: { warn(obj: object, msg: string): void } | undefined,
  msg: string,
  everyMs = 5000,
): (fields: object) => void {
  return throttledLog(logger && ((obj, m) => logger.warn(obj, m)), msg, everyMs);
}

/**
 * An error's message for a log line; of an AggregateError without one of its own (a refused
 * connect to several addresses), its first error's.
 */
export function errorMessage(err: Error): string {
  const inner = err instanceof AggregateError ? (err.errors[0] as unknown) : undefined;
  return err.message || (inner instanceof Error ? inner.message : '');
}

/**
 * One throttle per kind of line (throttledLog, `make` building it on the kind's first line): at
 * most one line of each kind per 5 s. Kinds should be bounded (codes, error classes, route
 * patterns); past `maxKinds` the throttles start again, so that a bug cannot grow the map.
 */
export function throttledKinds(
  maxKinds: number,
): (kind: string, make: () => (fields: object) => void) => (fields: object) => void {
  const throttles = new Map<string, (fields: object) => void>();
  return (kind, make) => {
    let write = throttles.get(kind);
    if (!write) {
      if (throttles.size >= maxKinds) throttles.clear();
      write = make();
      throttles.set(kind, write);
    }
    return write;
  };
}

/**
 * throttledWarn at any level: `write` logs the line (`(obj, msg) => logger.error(obj, msg)`).
 * The line that is written is the first of its window, with its own fields (a request's id).
 * Events left out are not lost from the count when the flood stops: at the end of a window that
 * left some out and wrote none, the last of them is written (its own fields, `suppressed` the
 * others), so that every event is a line or counted in one. Without it, a flood that ended
 * 4 s into a window showed its last line as the flood's end.
 */
export function throttledLog(
  write: ((obj: object, msg: string) => void) | undefined,
  msg: string,
  everyMs = 5000,
): (fields: object) => void {
  let last = 0;
  let suppressed = 0;
  let lastLeftOut: object = {};
  let timer: NodeJS.Timeout | undefined;
  const emit = (fields: object, leftOut: number) => {
    write?.({ ...fields, suppressed: leftOut }, msg);
    last = monotonicNow();
    suppressed = 0;
  };
  return (fields) => {
    // Monotonic: a wall clock stepping back an hour would have silenced the line for that hour.
    const now = monotonicNow();
    if (now - last < everyMs) {
      suppressed++;
      lastLeftOut = fields;
      // Unref'd: a pending count never keeps a process alive.
      timer ??= setTimeout(
        () => {
          timer = undefined;
          if (suppressed > 0) emit(lastLeftOut, suppressed - 1);
        },
        Math.max(0, last + everyMs - now),
      ).unref();
      return;
    }
    if (timer) clearTimeout(timer);
    timer = undefined;
    emit(fields, suppressed);
  };
}

/**
 * Once connection errors were reported (each by `failed()`), one line `msg` when a connection
 * works again (`restored()`), saying how long it was down and how many errors it had: the
 * throttled error lines alone never say that the outage ended.
 */
export function outageLog(
  logger: Pick<Logger, 'info'> | undefined,
  msg: string,
  fields: object = {},
): { failed(): void; restored(): void } {
  let since = 0;
  let errors = 0;
  return {
    failed() {
      if (errors++ === 0) since = monotonicNow();
    },
    restored() {
      if (errors === 0) return;
      logger?.info({ ...fields, down_ms: Math.round(monotonicNow() - since), errors }, msg);
      errors = 0;
    },
  };
}

/** outageLog restored by a client's `ready` event: for ioredis and node-redis clients alike. */
export function watchOutage(
  client: { on(event: 'ready', listener: () => void): unknown },
  logger: Pick<Logger, 'info'> | undefined,
  msg: string,
  fields: object = {},
): { failed(): void } {
  const outage = outageLog(logger, msg, fields);
  client.on('ready', () => outage.restored());
  return outage;
}
