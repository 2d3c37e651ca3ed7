import { execFile } from 'node:child_process';
import { chown, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { freePort } from './private-redis.js';

const run = promisify(execFile);

/** Where Debian puts the server binaries of the machine's PostgreSQL (15 here, FACTS.md). */
async function binDir(): Promise<string> {
  const { stdout } = await run('pg_config', ['--bindir']).catch(() => ({ stdout: '' }));
  return stdout.trim() || '/usr/lib/postgresql/15/bin';
}

export interface PrivatePostgres {
  /** A URL of the cluster's `postgres` database, as its superuser `postgres`. */
  adminUrl: string;
  /** The URL of another database of the cluster. */
  urlOf(database: string): string;
  /** Fast shutdown: sessions are terminated, as in a restart or failover. */
  stop(): Promise<void>;
  start(): Promise<void>;
  /** Stops it and removes its data directory. */
  destroy(): Promise<void>;
}

/**
 * A PostgreSQL cluster of the test's own on a free port (never the shared one), for tests that
 * must stop Postgres. Built with the machine's binaries, so the extensions installed for the shared
 * cluster (pgvector) load here too. The server refuses to run as root: as root, its commands run
 * as the `postgres` user that Debian's package creates. initdb takes 1–3 s.
 */
export async function startPrivatePostgres(): Promise<PrivatePostgres> {
  const bin = await binDir();
  const port = await freePort();
  const dir = await mkdtemp(join(tmpdir(), 'mnemos-pg-'));
  const asRoot = process.getuid?.() === 0;
  if (asRoot) {
    const { stdout } = await run('id', ['-u', 'postgres']);
    const { stdout: gid } = await run('id', ['-g', 'postgres']);
    await chown(dir, Number(stdout.trim()), Number(gid.trim()));
  }
  const pg = (tool: string, args: string[]) =>
    asRoot ? run('runuser', ['-u', 'postgres', '--', join(bin, tool), ...args]) : run(join(bin, tool), args);
  const data = join(dir, 'data');
  await pg('initdb', ['-D', data, '-U', 'postgres', '-A', 'trust', '-E', 'UTF8', '--locale=C.UTF-8', '-N']);
  const options = `-p ${port} -k ${dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50`;
  const start = async () => {
    await pg('pg_ctl', ['-D', data, '-l', join(dir, 'log'), '-o', options, '-w', '-t', '30', 'start']);
  };
  const stop = async () => {
    await pg('pg_ctl', ['-D', data, '-m', 'fast', '-w', '-t', '30', 'stop']).catch(() => undefined);
  };
  await start();
  const urlOf = (database: string) => `postgres://postgres@127.0.0.1:${port}/${database}`;
  return {
    adminUrl: urlOf('postgres'),
    urlOf,
    stop,
    start,
    async destroy() {
      await stop();
      await rm(dir, { recursive: true, force: true });
    },
  };
}
