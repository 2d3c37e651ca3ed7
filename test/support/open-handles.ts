/**
 * Reports what a test file left open once its last test has ended. A file whose tests all passed
 * once failed CI by not exiting: something its cleanups had not closed kept the process alive until
 * the file timeout (600 s). `npm test` now force-exits each file after its last test; this report,
 * on stderr, names what was left, so that a leak is seen and mended instead of hidden.
 */
import { after } from 'node:test';

interface HandleLike {
  constructor?: { name?: string };
  pid?: number;
  spawnargs?: string[];
  remoteAddress?: string;
  remotePort?: number;
  destroyed?: boolean;
  address?: () => unknown;
  _handle?: unknown;
  fd?: number;
}

const getHandles = (process as unknown as { _getActiveHandles?: () => HandleLike[] })._getActiveHandles;

/** What would keep the process alive, stdio aside, one line each. */
function openHandles(): string[] {
  if (!getHandles) return [];
  const out: string[] = [];
  for (const h of getHandles.call(process)) {
    const kind = h.constructor?.name ?? 'unknown';
    if (kind === 'ChildProcess') out.push(`child process ${h.pid}: ${(h.spawnargs ?? []).join(' ')}`);
    else if (kind === 'Server') out.push(`server listening on ${JSON.stringify(h.address?.())}`);
    else if (kind === 'Socket' || kind === 'TLSSocket') {
      if (h.remotePort !== undefined) out.push(`socket to ${h.remoteAddress}:${h.remotePort}`);
      // stdio and the child processes' pipes have no peer address
    } else if (kind !== 'WriteStream' && kind !== 'ReadStream' && kind !== 'Pipe') out.push(kind);
  }
  return out;
}

// Registered once the test file's module has run, so that it comes after the file's own top-level
// after() hooks (which close its services): hooks run in the order they were registered.
setImmediate(() =>
  after(async () => {
    if (openHandles().length === 0) return;
    // Sockets being closed by the last cleanup are gone a moment later.
    await new Promise((r) => setTimeout(r, 2000));
    const left = openHandles();
    if (left.length > 0) {
      process.stderr.write(
        `[open-handles] ${process.argv[process.argv.length - 1]}: left open after its last test:\n` +
          left.map((l) => `  ${l}\n`).join(''),
      );
    }
  }),
);
