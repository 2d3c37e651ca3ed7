/**
 * The admin API (SPEC §4 "Admin API"): tenants and their API keys, and the retry of stalled
 * summaries, behind `MNEMOS_ADMIN_TOKEN`.
 * A tenant key is never an admin key, and without the token configured the server answers 404.
 * API keys are shown once, in the answers of `createTenant` and `createKey`.
 */
import { callOpts, deleteOrFalse, makeTransport, requestJson } from './transport.js';
import type { CallOptions, RequestSpec, TransportOptions } from './transport.js';
import type { KeyView, TenantView } from './types.js';

export interface MnemosAdminOptions extends Omit<TransportOptions, 'token'> {
  baseUrl: string;
  adminToken: string;
}

const enc = encodeURIComponent;

export function createMnemosAdmin(options: MnemosAdminOptions) {
  const { adminToken, ...rest } = options;
  const http = makeTransport({ ...rest, token: adminToken });
  const call = <T>(spec: RequestSpec): Promise<T> => requestJson<T>(http, spec);
  /** A list route's items, every page (the server pages at most 500 at a time). */
  const all = async <K extends string, T>(path: string, items: K, opts: CallOptions): Promise<T[]> => {
    const out: T[] = [];
    let cursor: string | undefined;
    for (;;) {
      const page = await call<Record<K, T[]> & { next: string | null }>({
        ...callOpts(opts),
        method: 'GET',
        path,
        query: { cursor, limit: 500 },
        idempotent: true,
      });
      out.push(...page[items]);
      if (page.next === null) return out;
      cursor = page.next;
    }
  };

  return {
    /** Not repeated after a network error: a repeat would answer 409 `tenant_exists`. */
    createTenant(name: string, opts: CallOptions = {}): Promise<{ tenant_id: string; api_key: string }> {
      return call({
        ...callOpts(opts),
        method: 'POST',
        path: '/v1/admin/tenants',
        json: { name },
        idempotent: false,
      });
    },

    /** Every tenant, oldest first (pages of 500 followed to the end). */
    listTenants(opts: CallOptions = {}): Promise<TenantView[]> {
      return all('/v1/admin/tenants', 'tenants', opts);
    },

    /** Erases the tenant and all its data; false when there was no such tenant. */
    deleteTenant(tenantId: string, opts: CallOptions = {}): Promise<boolean> {
      return deleteOrFalse(http, {
        ...callOpts(opts),
        method: 'DELETE',
        path: `/v1/admin/tenants/${enc(tenantId)}`,
        idempotent: true,
      });
    },

    createKey(
      tenantId: string,
      opts: CallOptions & { name?: string } = {},
    ): Promise<{ key_id: string; tenant_id: string; api_key: string }> {
      return call({
        ...callOpts(opts),
        method: 'POST',
        path: `/v1/admin/tenants/${enc(tenantId)}/keys`,
        json: opts.name === undefined ? {} : { name: opts.name },
        idempotent: false,
      });
    },

    /** Every key of the tenant (pages of 500 followed to the end; it used to return the first 100 only). */
    listKeys(tenantId: string, opts: CallOptions = {}): Promise<KeyView[]> {
      return all(`/v1/admin/tenants/${enc(tenantId)}/keys`, 'keys', opts);
    },

    /**
     * False when there was no such key or it was revoked already (so also for a revoke repeated
     * after a lost answer).
     */
    revokeKey(keyId: string, opts: CallOptions = {}): Promise<boolean> {
      return deleteOrFalse(http, {
        ...callOpts(opts),
        method: 'DELETE',
        path: `/v1/admin/keys/${enc(keyId)}`,
        idempotent: true,
      });
    },

    /**
     * Clears the back-off of every failed or stalled summary (of one tenant, by id or name, or of
     * all) and has the sweep retry them now: after a fix the service cannot see, such as a new API
     * key at the same LLM endpoint. Returns how many sessions were cleared; repeating it is harmless.
     */
    async retrySummaries(opts: CallOptions & { tenantId?: string } = {}): Promise<number> {
      const r = await call<{ sessions: number }>({
        ...callOpts(opts),
        method: 'POST',
        path: '/v1/admin/summaries/retry',
        json: opts.tenantId === undefined ? {} : { tenant_id: opts.tenantId },
        idempotent: true,
      });
      return r.sessions;
    },
  };
}

export type MnemosAdmin = ReturnType<typeof createMnemosAdmin>;
