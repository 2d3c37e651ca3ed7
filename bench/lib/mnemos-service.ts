/**
 * Starts mnemos (`serve`: API and workers) for a bench against a scratch database and a scratch
 * Redis prefix: by default in a child process (bench/lib/mnemos-process.ts), or in the bench's own
 * process with `inProcess` (then the load generator shares the server's event loop: slower, but
 * the only way to read in-process state). Either way `stop()` is registered for cleanup.
 */
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { loadConfig } from '../../services/config.js';
import { defaultExtensions } from '../../services/extensions.js';
import { makeLogger } from '../../services/logger.js';
import { startService } from '../../services/main.js';
import type { Mode } from '../../services/main.js';
import { waitExit, waitReady } from '../../test/support/child-service.js';
import { REDIS_URL, onCleanup } from './scratch.js';

export interface BenchService {
  /** Null for a worker-only process. */
  url: string | null;
  /** OS process running the server (this process when in-process). */
  pid: number;
  metricsText(): Promise<string>;
  stop(): Promise<void>;
}

export interface BenchServiceOptions {
  databaseUrl: string;
  prefix: string;
  mode?: Mode;
  inProcess?: boolean;
  /** 'none' = ingestion core only (no recent index, context, search, error memory). */
  extensions?: 'default' | 'none';
  env?: Record<string, string>;
  /** Extra node flags for the child process, e.g. ['--cpu-prof', '--cpu-prof-dir=/tmp/prof']. */
  nodeArgs?: string[];
}

const ROOT = fileURLToPath(new URL('../../', import.meta.url));

export async function startBenchService(o: BenchServiceOptions): Promise<BenchService> {
  const env: Record<string, string> = {
    DATABASE_URL: o.databaseUrl,
    REDIS_URL,
    MNEMOS_PREFIX: o.prefix,
    PORT: '0',
    HOST: '127.0.0.1',
    LOG_LEVEL: 'error',
    // The per-key limiter stays on (its Redis INCR is part of every request) with a budget the
    // bench never reaches: the default 6000/min would cap the bench, not measure mnemos.
    RATE_LIMIT_PER_MIN: '10000000',
    ...o.env,
  };
  let svc: BenchService;
  if (o.inProcess) {
    const config = loadConfig(env);
    const s = await startService(o.mode ?? 'serve', config, {
      logger: makeLogger(config.logLevel),
      extensions: o.extensions === 'none' ? [] : defaultExtensions,
    });
    svc = {
      url: s.url,
      pid: process.pid,
      metricsText: () => s.deps.metrics.registry.metrics(),
      stop: () => s.stop(),
    };
  } else {
    const child = spawn(
      process.execPath,
      [...(o.nodeArgs ?? []), '--import', 'tsx', 'bench/lib/mnemos-process.ts'],
      {
        cwd: ROOT,
        // Only what the service needs: no LLM key or other setting leaks in from the caller's shell,
        // so embeddings stay on the built-in local embedder and no traffic leaves the machine.
        env: {
          PATH: process.env.PATH ?? '',
          HOME: process.env.HOME ?? '',
          ...env,
          BENCH_MODE: o.mode ?? 'serve',
          BENCH_EXTENSIONS: o.extensions ?? 'default',
        },
        stdio: ['ignore', 'pipe', 'inherit'],
      },
    );
    const ready = await waitReady(child, 'mnemos bench');
    const exited = waitExit(child);
    svc = {
      url: ready.url,
      pid: ready.pid,
      async metricsText() {
        if (!ready.url) throw new Error('a worker-only process has no metrics endpoint');
        const r = await fetch(`${ready.url}/metrics`);
        return r.text();
      },
      async stop() {
        if (child.exitCode !== null || child.signalCode !== null) return;
        child.kill('SIGTERM');
        const t = setTimeout(() => child.kill('SIGKILL'), 30_000);
        await exited;
        clearTimeout(t);
      },
    };
  }
  onCleanup(() => svc.stop());
  return svc;
}

/** Sum of a Prometheus sample family, optionally filtered by a label substring (e.g. `queue="ingest"`). */
export function metricSum(text: string, name: string, labelFilter?: string): number {
  let sum = 0;
  for (const line of text.split('\n')) {
    if (!line.startsWith(name)) continue;
    const rest = line.slice(name.length);
    if (rest[0] !== ' ' && rest[0] !== '{') continue;
    if (labelFilter && !rest.includes(labelFilter)) continue;
    const v = Number(line.slice(line.lastIndexOf(' ') + 1));
    if (Number.isFinite(v)) sum += v;
  }
  return sum;
}
