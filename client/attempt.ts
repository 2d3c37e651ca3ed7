/**
 * One attempt of a client request (client/transport.ts): its abort signal and timer, a streamed
 * upload body, and reads that end when the attempt does.
 */

export interface Attempt {
  /** Aborted by the caller's signal or by the attempt's timer. */
  signal: AbortSignal;
  readonly timedOut: boolean;
  /** (Re)starts the timer: `timeoutMs` from now. */
  arm(): void;
  pause(): void;
  /** Stops the timer and stops listening to the caller's signal. */
  end(): void;
}

/**
 * One attempt's signal. It listens to the caller's signal only while the attempt lasts: with
 * AbortSignal.any, a long-lived caller signal (an app's shutdown signal passed to every call)
 * kept every attempt reachable, about 60 bytes a call in Node 20 (1.6 M calls, 93 MB of heap).
 */
export function startAttempt(caller: AbortSignal | undefined, timeoutMs: number): Attempt {
  const ac = new AbortController();
  let timedOut = false;
  let ended = false;
  let timer: ReturnType<typeof setTimeout> | undefined;
  const onAbort = () => ac.abort(caller?.reason);
  const pause = () => clearTimeout(timer);
  const arm = () => {
    clearTimeout(timer);
    // An upload's late pull must not start a timer for an attempt that is over.
    if (ended) return;
    timer = setTimeout(() => {
      timedOut = true;
      ac.abort(new DOMException(`no answer within ${timeoutMs} ms`, 'TimeoutError'));
    }, timeoutMs);
  };
  if (caller?.aborted) ac.abort(caller.reason);
  else if (caller) onCallerAbort(caller, onAbort);
  arm();
  return {
    signal: ac.signal,
    get timedOut() {
      return timedOut;
    },
    arm,
    pause,
    end() {
      ended = true;
      pause();
      if (caller) offCallerAbort(caller, onAbort);
    },
  };
}

/**
 * The attempts listening to each caller signal, behind one listener of its own: a listener per
 * attempt made Node warn of a leak (MaxListenersExceededWarning) once 11 calls sharing an app's
 * shutdown signal ran at once. The entry goes when its last attempt ends.
 */
const listening = new WeakMap<AbortSignal, { attempts: Set<() => void>; fire: () => void }>();

function onCallerAbort(caller: AbortSignal, onAbort: () => void): void {
  let entry = listening.get(caller);
  if (!entry) {
    const attempts = new Set<() => void>();
    const fire = () => {
      listening.delete(caller);
      for (const a of attempts) a();
    };
    entry = { attempts, fire };
    listening.set(caller, entry);
    caller.addEventListener('abort', fire, { once: true });
  }
  entry.attempts.add(onAbort);
}

function offCallerAbort(caller: AbortSignal, onAbort: () => void): void {
  const entry = listening.get(caller);
  if (!entry) return;
  entry.attempts.delete(onAbort);
  if (entry.attempts.size > 0) return;
  listening.delete(caller);
  caller.removeEventListener('abort', entry.fire);
}

/**
 * An upload as a stream that fetch pulls as it sends, so memory holds a chunk or two, not the
 * body (a 70 MB import buffered whole peaked at 354 MB). Each chunk pulled restarts the
 * attempt's timer: `timeoutMs` bounds a pause, and the answer gets all of it after the last byte.
 */
export function uploadStream(source: AsyncIterable<Uint8Array>, live: Attempt) {
  const it = source[Symbol.asyncIterator]();
  let finished = false;
  let failure: { error: unknown } | undefined;
  const stop = () => {
    if (finished) return;
    finished = true;
    // Not awaited: an async generator's return waits for a pending next (a stalled export).
    Promise.resolve()
      .then(() => it.return?.())
      .catch(() => undefined);
  };
  const body = new ReadableStream<Uint8Array>(
    {
      async pull(controller) {
        let next: IteratorResult<Uint8Array>;
        try {
          next = await it.next();
        } catch (err) {
          finished = true;
          failure = { error: err };
          controller.error(err);
          return;
        }
        if (finished) return;
        live.arm();
        if (next.done) {
          finished = true;
          controller.close();
        } else controller.enqueue(next.value);
      },
      cancel: stop,
    },
    { highWaterMark: 0 },
  );
  return {
    body,
    stop,
    get failure() {
      return failure;
    },
  };
}

/**
 * Whether this platform's fetch sends a ReadableStream body (Node ≥ 20, Chrome over HTTP/2);
 * others (Firefox, Safari) would send the text "[object ReadableStream]". The usual check: such a
 * Request reads `duplex` and does not take the stream for a string (no text/plain content type).
 */
export function canStreamRequests(): boolean {
  try {
    let duplexRead = false;
    const init = {
      method: 'POST',
      body: new ReadableStream(),
      get duplex() {
        duplexRead = true;
        return 'half' as const;
      },
    };
    const hasType = new Request('http://localhost/', init).headers.has('content-type');
    return duplexRead && !hasType;
  } catch {
    return false;
  }
}

/**
 * The whole upload in one buffer of its own (where fetch cannot stream a body): typed on a plain
 * ArrayBuffer, which is what a DOM lib's Blob takes.
 */
export async function collect(source: AsyncIterable<Uint8Array>): Promise<Uint8Array<ArrayBuffer>> {
  const chunks: Uint8Array[] = [];
  let size = 0;
  for await (const chunk of source) {
    chunks.push(chunk);
    size += chunk.length;
  }
  const out = new Uint8Array(size);
  let at = 0;
  for (const c of chunks) {
    out.set(c, at);
    at += c.length;
  }
  return out;
}

/** A read that also ends when `signal` aborts (a custom fetch may not tie its body to it). */
export function readOrAbort<T>(
  reader: ReadableStreamDefaultReader<T>,
  signal: AbortSignal,
): Promise<Awaited<ReturnType<ReadableStreamDefaultReader<T>['read']>>> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) {
      reject(signal.reason as Error);
      return;
    }
    const onAbort = () => reject(signal.reason as Error);
    signal.addEventListener('abort', onAbort, { once: true });
    void reader
      .read()
      .then(resolve, reject)
      .finally(() => signal.removeEventListener('abort', onAbort));
  });
}
