import { connect, createServer } from 'node:net';
import type { Socket } from 'node:net';

export interface TcpProxy {
  port: number;
  /**
   * Every connection open now goes silent, as in a partition: what either side sends is dropped,
   * and neither is closed or reset. New connections are accepted and silent too, until heal().
   */
  hole(): void;
  /**
   * New connections to Postgres forward its startup, up to its first ReadyForQuery, and then go
   * silent: a server (or a pooler) that lets clients in and answers nothing more. Until heal().
   */
  stallAfterStartup(): void;
  /** New connections are forwarded again; the silent ones stay silent (a flow conntrack dropped). */
  heal(): void;
  /** Closes every connection open now (as a reset would): their clients reconnect. */
  reset(): void;
  /** Connections open through the proxy, and how many of them are silent. */
  counts(): { open: number; silent: number };
  close(): Promise<void>;
}

/** A TCP proxy on loopback to 127.0.0.1:`targetPort` whose connections a test can make silent. */
export async function startTcpProxy(targetPort: number): Promise<TcpProxy> {
  let holed = false;
  let stallingAfterStartup = false;
  const conns = new Set<{ client: Socket; server: Socket; silent: boolean }>();
  const proxy = createServer((client) => {
    const server = connect(targetPort, '127.0.0.1');
    const c = { client, server, silent: holed };
    conns.add(c);
    // What Postgres has sent and not yet been read as whole messages (a type byte, then a length
    // that counts itself), while the connection waits for the end of its startup to go silent.
    let startup = stallingAfterStartup && !holed ? Buffer.alloc(0) : null;
    client.on('data', (d) => {
      if (!c.silent) server.write(d);
    });
    server.on('data', (d) => {
      if (c.silent) return;
      client.write(d);
      if (!startup) return;
      startup = Buffer.concat([startup, d]);
      while (startup.length >= 5 && startup.length >= 1 + startup.readInt32BE(1)) {
        if (startup[0] === 0x5a /* ReadyForQuery */) {
          c.silent = true;
          return;
        }
        startup = startup.subarray(1 + startup.readInt32BE(1));
      }
    });
    const end = () => {
      conns.delete(c);
      client.destroy();
      server.destroy();
    };
    // The client closing ends it; the server's side only while the connection forwards (a silent
    // one's client learns of nothing).
    client.on('error', end).on('close', end);
    server
      .on('error', () => (c.silent ? undefined : end()))
      .on('close', () => (c.silent ? undefined : end()));
  });
  await new Promise<void>((resolve) => proxy.listen(0, '127.0.0.1', resolve));
  const addr = proxy.address();
  return {
    port: typeof addr === 'object' && addr ? addr.port : 0,
    hole() {
      holed = true;
      for (const c of conns) c.silent = true;
    },
    stallAfterStartup() {
      stallingAfterStartup = true;
    },
    heal() {
      holed = false;
      stallingAfterStartup = false;
    },
    reset() {
      for (const c of conns) {
        c.client.destroy();
        c.server.destroy();
      }
      conns.clear();
    },
    counts: () => ({ open: conns.size, silent: [...conns].filter((c) => c.silent).length }),
    close: () =>
      new Promise<void>((resolve) => {
        for (const c of conns) {
          c.client.destroy();
          c.server.destroy();
        }
        conns.clear();
        proxy.close(() => resolve());
      }),
  };
}
