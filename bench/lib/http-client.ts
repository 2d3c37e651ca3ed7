/**
 * A lean keep-alive HTTP/1.1 JSON client on node:http for load generation (fetch costs several
 * times more client CPU per request, which on a 2-core machine is taken from the server).
 * Loopback only: the benches never send traffic anywhere else.
 */
import http from 'node:http';

export interface HttpResponse {
  status: number;
  body: string;
}

export interface JsonClient {
  request(method: 'GET' | 'POST', path: string, body?: string): Promise<HttpResponse>;
  close(): void;
}

export function makeJsonClient(baseUrl: string, opts: { token?: string; maxSockets: number }): JsonClient {
  const base = new URL(baseUrl);
  if (!['127.0.0.1', 'localhost', '[::1]'].includes(base.hostname)) {
    throw new Error(`bench HTTP client refuses non-loopback host ${base.hostname}`);
  }
  const agent = new http.Agent({ keepAlive: true, maxSockets: opts.maxSockets });
  const headers: Record<string, string> = { accept: 'application/json' };
  if (opts.token) headers.authorization = `Bearer ${opts.token}`;
  return {
    request(method, path, body) {
      return new Promise((resolve, reject) => {
        const h: Record<string, string | number> = { ...headers };
        if (body !== undefined) {
          h['content-type'] = 'application/json';
          h['content-length'] = Buffer.byteLength(body);
        }
        const req = http.request(
          { host: base.hostname, port: base.port, path, method, agent, headers: h },
          (res) => {
            const chunks: Buffer[] = [];
            res.on('data', (c: Buffer) => chunks.push(c));
            res.on('end', () =>
              resolve({ status: res.statusCode ?? 0, body: Buffer.concat(chunks).toString('utf8') }),
            );
            res.on('error', reject);
          },
        );
        req.setTimeout(60_000, () => req.destroy(new Error('request timed out after 60 s')));
        req.on('error', reject);
        req.end(body);
      });
    },
    close: () => agent.destroy(),
  };
}
