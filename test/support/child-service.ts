/**
 * The protocol between a mnemos service run as a child process (test/support/service-process.ts,
 * bench/lib/mnemos-process.ts) and its parent: the child prints one `{"ready":true,…}` line on
 * stdout once it serves, and stops cleanly on SIGTERM/SIGINT.
 */
import type { ChildProcess } from 'node:child_process';

export interface ReadyLine {
  ready: true;
  url: string | null;
  pid: number;
}

/** Child side: announces readiness and stops the service on SIGTERM or SIGINT. */
export function announceReady(svc: { url: string | null; stop(): Promise<void> }): void {
  process.stdout.write(`${JSON.stringify({ ready: true, url: svc.url, pid: process.pid })}\n`);
  const stop = () => {
    svc.stop().then(
      () => process.exit(0),
      () => process.exit(1),
    );
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

/** Parent side: the child's ready line, or an error naming `label` if it exits first. */
export function waitReady(child: ChildProcess, label: string): Promise<ReadyLine> {
  return new Promise((resolve, reject) => {
    let buf = '';
    const onData = (d: Buffer) => {
      buf += d.toString();
      const line = buf.split('\n').find((l) => l.startsWith('{"ready"'));
      if (line) {
        child.stdout!.off('data', onData);
        child.off('exit', onExit);
        resolve(JSON.parse(line) as ReadyLine);
      }
    };
    const onExit = (code: number | null) => reject(new Error(`${label} process exited early (${code})`));
    child.stdout!.on('data', onData);
    child.once('exit', onExit);
  });
}

/** Resolves once the child has exited (at once if it already has). */
export function waitExit(child: ChildProcess): Promise<void> {
  return new Promise((resolve) => {
    if (child.exitCode !== null || child.signalCode !== null) return resolve();
    child.once('exit', () => resolve());
  });
}
