import type { RequestHandler } from 'express';
import { AppError } from './errors.js';
import { isAdminToken } from './tenants.js';
import { monotonicNow } from './time.js';
import type { KeyAuthenticator } from './tenants.js';

function bearer(header: string | undefined): string | undefined {
  if (!header) return undefined;
  const m = /^Bearer\s+(\S+)\s*$/i.exec(header);
  return m?.[1];
}

/**
 * The one Authorization header. Node keeps the first of several and drops the rest; a proxy in
 * front may use the last, and then the two disagree on who the caller is: several are a 401.
 */
function authorization(req: Parameters<RequestHandler>[0]): string | undefined {
  const all = req.headersDistinct.authorization;
  if (all && all.length > 1) {
    throw new AppError(401, 'unauthorized', 'more than one Authorization header: send exactly one');
  }
  return all?.[0];
}

const MISSING_KEY = 'missing API key: send Authorization: Bearer <api key>';
const MALFORMED_KEY = 'malformed Authorization header: send Authorization: Bearer <api key>';

/**
 * Tenant API key → res.locals.tenantId. The tenant always comes from the key, never from input.
 * Several routers share a prefix, so a request may pass this guard more than once: it verifies once.
 */
export function requireTenant(keys: KeyAuthenticator): RequestHandler {
  return async (req, res, next) => {
    if (typeof res.locals.tenantId === 'string') return next();
    const header = authorization(req);
    const key = bearer(header);
    if (!key) throw new AppError(401, 'unauthorized', header ? MALFORMED_KEY : MISSING_KEY);
    const who = await keys.authenticate(key);
    if (!who) throw new AppError(401, 'unauthorized', 'invalid or revoked API key');
    res.locals.tenantId = who.tenantId;
    res.locals.keyId = who.keyId;
    verified.set(res, { key, keys, at: who.verifiedAt });
    next();
  };
}

const verified = new WeakMap<object, { key: string; keys: KeyAuthenticator; at: number }>();
/** How old the database's word on a key may be once the request's body is in. */
export const RECHECK_AFTER_MS = 1000;

/**
 * Verifies the request's key again, from the database, unless that was done in the last
 * RECHECK_AFTER_MS; called once the body is in, before anything is written. The key is verified
 * before the body is read (a caller without one never has us read 8 MiB), from a cache up to
 * KEY_CACHE_MS old, and a client can take as long as it likes to send the body: a tenant erased
 * meanwhile (its keys revoked, its data deleted) got a write after the erasure had finished, which
 * nothing would ever delete (an error record kept in Redis for 90 days), or a 500 from the missing
 * tenants row. A tenant's erasure waits out KEY_CACHE_MS before it deletes anything, longer than
 * RECHECK_AFTER_MS plus a handler's work, so a request that passes here writes before that.
 */
export async function recheckKey(res: object, tenantId: unknown): Promise<void> {
  const v = verified.get(res);
  if (!v || monotonicNow() - v.at <= RECHECK_AFTER_MS) return;
  const who = await v.keys.authenticate(v.key, RECHECK_AFTER_MS);
  if (!who || who.tenantId !== tenantId) {
    throw new AppError(401, 'unauthorized', 'the API key was revoked while the request was being sent');
  }
  v.at = who.verifiedAt;
}

/** recheckKey as the step after a JSON body is read (a JSON Lines import calls it itself). */
export const recheckTenant: RequestHandler = async (_req, res, next) => {
  await recheckKey(res, res.locals.tenantId);
  next();
};

/**
 * The admin token as a bearer token. With `basic` (Bull Board, which a browser opens) also as the
 * password of HTTP Basic, and a 401 asks for it. Nowhere else: a browser sends remembered Basic
 * credentials with any request to their origin, a form posted from another site's page included,
 * and such a form created a key through /v1/admin. With no MNEMOS_ADMIN_TOKEN the admin surface
 * does not exist (404).
 */
export function requireAdmin(adminToken: string | undefined, opts: { basic?: boolean } = {}): RequestHandler {
  return (req, res, next) => {
    if (!adminToken)
      throw new AppError(404, 'not_found', `no route for ${req.method} ${req.baseUrl}${req.path}`);
    const header = authorization(req) ?? '';
    let presented = bearer(header);
    const basic = /^Basic\s+([A-Za-z0-9+/=]+)\s*$/i.exec(header);
    if (!presented && basic) {
      if (!opts.basic) {
        throw new AppError(
          401,
          'unauthorized',
          'the admin API takes the admin token as a bearer token only: send Authorization: Bearer <admin token>',
        );
      }
      const decoded = Buffer.from(basic[1]!, 'base64').toString('utf8');
      presented = decoded.slice(decoded.indexOf(':') + 1);
    }
    if (isAdminToken(adminToken, presented)) return next();
    if (opts.basic) res.setHeader('www-authenticate', 'Basic realm="mnemos admin"');
    // Told by its form, not looked up: whatever key it is (live, revoked or made up), no `mn_`
    // credential is an admin's, and an admin route is no oracle of which keys exist.
    if (presented?.startsWith('mn_')) {
      throw new AppError(
        403,
        'forbidden',
        'an API key (mn_…, live or not) is a tenant credential and never opens admin routes: send the admin token (MNEMOS_ADMIN_TOKEN)',
      );
    }
    throw new AppError(401, 'unauthorized', presented ? 'invalid admin token' : 'missing admin token');
  };
}
