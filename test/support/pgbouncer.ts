import { execFile, spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import type { ChildProcess } from 'node:child_process';
import { chmod, chown, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { connect } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { freePort } from './private-redis.js';

const run = promisify(execFile);

export interface PgBouncer {
  /** `url` of a database of the shared cluster, through the pooler. */
  urlOf(url: string): string;
  stop(): Promise<void>;
}

/**
 * PgBouncer in transaction mode on a free port, in front of the Postgres of `upstreamUrl`
 * (any database: `*`), with `serverConnections` server connections per database and user, so
 * that clients share them as in production. Debian's `pgbouncer` package (.ci/run installs it);
 * it refuses to run as root, so as root it runs as the `postgres` user.
 */
export async function startPgBouncer(upstreamUrl: string, serverConnections = 2): Promise<PgBouncer> {
  const upstream = new URL(upstreamUrl);
  const port = await freePort();
  const dir = await mkdtemp(join(tmpdir(), 'mnemos-pgbouncer-'));
  await chmod(dir, 0o755);
  const ini = join(dir, 'pgbouncer.ini');
  await writeFile(join(dir, 'users.txt'), `"${decodeURIComponent(upstream.username)}" ""\n`);
  await writeFile(
    ini,
    [
      '[databases]',
      `* = host=${upstream.hostname} port=${upstream.port || 5432}`,
      '[pgbouncer]',
      'listen_addr = 127.0.0.1',
      `listen_port = ${port}`,
      "unix_socket_dir = ''",
      'auth_type = trust',
      `auth_file = ${join(dir, 'users.txt')}`,
      'pool_mode = transaction',
      `default_pool_size = ${serverConnections}`,
      'max_client_conn = 200',
      `logfile = ${join(dir, 'log')}`,
      // Postgres's own server_reset_query does not run in transaction mode; said here for the reader.
      'server_reset_query =',
      '',
    ].join('\n'),
  );
  const asRoot = process.getuid?.() === 0;
  if (asRoot) {
    const uid = Number((await run('id', ['-u', 'postgres'])).stdout.trim());
    const gid = Number((await run('id', ['-g', 'postgres'])).stdout.trim());
    for (const f of [dir, ini, join(dir, 'users.txt')]) await chown(f, uid, gid);
  }
  // Debian installs it in /usr/sbin, which a user's PATH may lack.
  const bin = existsSync('/usr/sbin/pgbouncer') ? '/usr/sbin/pgbouncer' : 'pgbouncer';
  const child: ChildProcess = spawn(bin, asRoot ? ['-u', 'postgres', ini] : [ini], {
    stdio: 'ignore',
  });
  const exited = new Promise<number | null>((resolve) => child.once('exit', resolve));
  child.once('error', () => undefined);
  // Listening when a TCP connection is accepted.
  for (let i = 0; ; i++) {
    const ok = await new Promise<boolean>((resolve) => {
      const s = connect(port, '127.0.0.1', () => {
        s.destroy();
        resolve(true);
      });
      s.once('error', () => resolve(false));
    });
    if (ok) break;
    if (i > 100 || child.exitCode !== null)
      throw new Error(`pgbouncer did not start on port ${port} (see ${dir}/log)`);
    await new Promise((r) => setTimeout(r, 50));
  }
  return {
    urlOf(url: string) {
      const u = new URL(url);
      u.hostname = '127.0.0.1';
      u.port = String(port);
      return u.toString();
    },
    async stop() {
      child.kill('SIGTERM');
      await exited;
      await rm(dir, { recursive: true, force: true });
    },
  };
}
