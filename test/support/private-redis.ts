import { spawn } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import { Redis } from 'ioredis';

/** A free TCP port on loopback (bind to 0, read it, release it). */
export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const addr = s.address();
      const port = typeof addr === 'object' && addr ? addr.port : 0;
      s.close(() => resolve(port));
    });
  });
}

export interface PrivateRedis {
  url: string;
  port: number;
  /** Stops the server (SIGKILL: like a crash; nothing is kept, as on this machine's Redis). */
  kill(): Promise<void>;
  /** Starts it again on the same port (empty unless AOF was on). */
  start(): Promise<void>;
  stop(): Promise<void>;
  /** SIGSTOP / SIGCONT: a Redis that stalls (a long fork, a frozen VM) and then goes on. */
  pause(): void;
  resume(): void;
}

/** A Redis of the test's own, for tests that must stop or flush Redis (never the shared one). */
export async function startPrivateRedis(
  opts: { aof?: boolean; dir?: string; /** More redis-server options. */ args?: string[] } = {},
): Promise<PrivateRedis> {
  const port = await freePort();
  let child: ChildProcess | null = null;
  const args = ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--daemonize', 'no'];
  if (opts.aof) args.push('--appendonly', 'yes', '--appendfsync', 'always');
  else args.push('--appendonly', 'no');
  if (opts.aof || opts.dir) args.push('--dir', opts.dir ?? '/tmp');
  args.push(...(opts.args ?? []));
  const url = `redis://127.0.0.1:${port}`;
  const start = async () => {
    child = spawn('redis-server', args, { stdio: 'ignore' });
    const deadline = Date.now() + 10_000;
    for (;;) {
      const r = new Redis(url, { lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null });
      r.on('error', () => undefined);
      try {
        await r.connect();
        await r.ping();
        r.disconnect();
        return;
      } catch {
        r.disconnect();
        if (Date.now() > deadline) throw new Error('private redis did not start');
        await new Promise((res) => setTimeout(res, 50));
      }
    }
  };
  const kill = async () => {
    const c = child;
    // Killed already (a SIGKILL leaves exitCode null): its exit event has fired.
    if (!c || c.exitCode !== null || c.signalCode !== null) return;
    await new Promise<void>((resolve) => {
      c.once('exit', () => resolve());
      c.kill('SIGKILL');
    });
  };
  await start();
  const signal = (sig: NodeJS.Signals) => {
    if (child && child.exitCode === null && child.signalCode === null) child.kill(sig);
  };
  return {
    url,
    port,
    kill,
    start,
    stop: kill,
    pause: () => signal('SIGSTOP'),
    resume: () => signal('SIGCONT'),
  };
}
