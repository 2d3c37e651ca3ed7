import type { Router } from 'express';
import { z } from 'zod';
import { SESSION_ID_RE } from './messages/message-input.js';

/**
 * The OpenAPI document is derived from the routers that are actually mounted (so a route cannot
 * exist undocumented without the completeness test noticing) plus the zod schemas the handlers
 * validate with.
 */
export interface RouteMeta {
  summary: string;
  body?: z.ZodType;
  /** The body may be left out (context: every field has a default). */
  bodyOptional?: boolean;
  /** Media types the body may come in (default JSON only); the schema is the JSON form's. */
  bodyTypes?: string[];
  query?: z.ZodType;
  auth?: 'tenant' | 'admin' | 'none';
  /** Success status(es); default 200. */
  success?: number | number[];
  /**
   * The JSON body per status (success statuses, and others whose body is not the error shape,
   * like /readyz's 503). A success status without one has no JSON body (204, text, JSON Lines).
   */
  responses?: Record<number, z.ZodType>;
  /** Media type of a success answer that is not JSON (metrics, export). */
  produces?: string;
  /** Response headers a client reads, per status: name → what it says (a string value). */
  headers?: Record<number, Record<string, { description: string; enum?: string[] }>>;
}

export interface Mounted {
  prefix: string;
  router: Router;
  meta: Record<string, RouteMeta>;
}

interface Layer {
  route?: { path: string | string[]; methods: Record<string, boolean> };
}

export function listRoutes(
  mounts: Mounted[],
): Array<{ method: string; path: string; meta: RouteMeta | undefined }> {
  const out: Array<{ method: string; path: string; meta: RouteMeta | undefined }> = [];
  for (const m of mounts) {
    for (const layer of (m.router as unknown as { stack: Layer[] }).stack) {
      if (!layer.route) continue;
      const paths = Array.isArray(layer.route.path) ? layer.route.path : [layer.route.path];
      for (const p of paths) {
        for (const [method, on] of Object.entries(layer.route.methods)) {
          if (!on || method === '_all') continue;
          const path = (m.prefix + (p === '/' ? '' : p)).replace(/\/$/, '') || '/';
          out.push({ method: method.toUpperCase(), path, meta: m.meta[`${method.toUpperCase()} ${p}`] });
        }
      }
    }
  }
  return out;
}

const toOpenApiPath = (p: string) => p.replace(/:([A-Za-z_]+)/g, '{$1}');

function jsonSchema(s: z.ZodType, io: 'input' | 'output' = 'input'): unknown {
  try {
    return z.toJSONSchema(s, { io, unrepresentable: 'any' });
  } catch {
    return { type: 'object' };
  }
}

function responseEntry(meta: RouteMeta | undefined, code: number): Record<string, unknown> {
  const description = code < 300 ? 'success' : `answer with status ${code}`;
  const named = meta?.headers?.[code];
  const headers = named && {
    headers: Object.fromEntries(
      Object.entries(named).map(([name, h]) => [
        name,
        { description: h.description, schema: { type: 'string', ...(h.enum ? { enum: h.enum } : {}) } },
      ]),
    ),
  };
  const schema = meta?.responses?.[code];
  if (schema)
    return {
      description,
      ...headers,
      content: { 'application/json': { schema: jsonSchema(schema, 'output') } },
    };
  if (meta?.produces && code < 300) return { description, ...headers, content: { [meta.produces]: {} } };
  return { description, ...headers };
}

export function buildOpenApi(mounts: Mounted[], version: string): Record<string, unknown> {
  const paths: Record<string, Record<string, unknown>> = {};
  for (const r of listRoutes(mounts)) {
    const p = toOpenApiPath(r.path);
    const meta = r.meta;
    const op: Record<string, unknown> = {
      summary: meta?.summary ?? 'undocumented',
      parameters: [...p.matchAll(/\{([A-Za-z_]+)\}/g)].map((x) => ({
        name: x[1],
        in: 'path',
        required: true,
        // A session id is the client's: its rule is part of the contract.
        schema:
          x[1] === 'sid'
            ? { type: 'string', pattern: SESSION_ID_RE.source, not: { enum: ['.', '..'] } }
            : { type: 'string' },
      })),
      responses: {
        ...Object.fromEntries(
          [...new Set([...[meta?.success ?? 200].flat(), ...Object.keys(meta?.responses ?? {}).map(Number)])]
            .sort((a, b) => a - b)
            .map((code) => [String(code), responseEntry(meta, code)]),
        ),
        default: {
          description: 'error',
          content: { 'application/json': { schema: { $ref: '#/components/schemas/Error' } } },
        },
      },
    };
    if (meta?.auth !== 'none') op.security = [{ [meta?.auth === 'admin' ? 'adminToken' : 'apiKey']: [] }];
    if (meta?.body) {
      const schema = jsonSchema(meta.body);
      const types = meta.bodyTypes ?? ['application/json'];
      op.requestBody = {
        required: !meta.bodyOptional,
        content: Object.fromEntries(
          types.map((t) => [t, t === 'application/json' ? { schema } : { schema: { type: 'string' } }]),
        ),
      };
    }
    if (meta?.query) {
      const q = jsonSchema(meta.query) as { properties?: Record<string, unknown> };
      for (const [name, schema] of Object.entries(q.properties ?? {})) {
        (op.parameters as unknown[]).push({ name, in: 'query', required: false, schema });
      }
    }
    (paths[p] ??= {})[r.method.toLowerCase()] = op;
  }
  return {
    openapi: '3.1.0',
    info: {
      title: 'mnemos',
      version,
      description: 'Tiered conversation memory for multi-agent LLM backends',
    },
    paths,
    components: {
      securitySchemes: {
        apiKey: { type: 'http', scheme: 'bearer', description: 'tenant API key mn_<key id>_<secret>' },
        adminToken: { type: 'http', scheme: 'bearer', description: 'MNEMOS_ADMIN_TOKEN' },
      },
      schemas: {
        Error: {
          type: 'object',
          required: ['error'],
          properties: {
            error: {
              type: 'object',
              required: ['code', 'message', 'details'],
              properties: { code: { type: 'string' }, message: { type: 'string' }, details: {} },
            },
          },
        },
      },
    },
  };
}
