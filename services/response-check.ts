import { appendFileSync } from 'node:fs';
import type { NextFunction, Request, Response } from 'express';
import type { Mounted } from './openapi.js';
import { errorAnswer } from './openapi-responses.js';

/**
 * A test hook: with MNEMOS_CHECK_RESPONSES set to a file path, every JSON answer is checked
 * against the schema `/openapi.json` documents for its route and status (error answers against
 * the error shape), and each mismatch is appended to that file as one JSON line. `npm test` sets
 * it and fails the run when the file is not empty. Unset (production), nothing is installed.
 */
export function responseChecker(mounts: Mounted[]) {
  const file = process.env.MNEMOS_CHECK_RESPONSES;
  if (!file) return null;
  return (req: Request, res: Response, next: NextFunction) => {
    const json = res.json.bind(res);
    res.json = (body: unknown) => {
      try {
        check(mounts, file, req, res.statusCode, body);
      } catch {
        // A checker that breaks must not change the answer.
      }
      return json(body);
    };
    next();
  };
}

function check(mounts: Mounted[], file: string, req: Request, status: number, body: unknown) {
  // Bull Board answers in its own shapes.
  if (req.originalUrl.startsWith('/admin/queues')) return;
  const routePath = (req.route as { path?: unknown } | undefined)?.path;
  const key = `${req.method === 'HEAD' ? 'GET' : req.method} ${String(routePath)}`;
  const meta =
    typeof routePath === 'string'
      ? mounts
          // Express matches paths case-insensitively: /V1/Sessions is /v1/sessions.
          .filter((m) => m.prefix === req.baseUrl.toLowerCase())
          .map((m) => m.meta[key])
          .find(Boolean)
      : undefined;
  const schema = meta?.responses?.[status] ?? (status >= 400 ? errorAnswer : undefined);
  const where = meta
    ? `${key.split(' ')[0]} ${req.baseUrl.toLowerCase()}${routePath === '/' ? '' : String(routePath)}`
    : `${req.method} ${req.originalUrl.split('?')[0]}`;
  if (!schema) {
    appendFileSync(
      file,
      `${JSON.stringify({ route: where, status, problem: 'no documented schema for this status' })}\n`,
    );
    return;
  }
  const r = schema.safeParse(body);
  if (!r.success) {
    appendFileSync(
      file,
      `${JSON.stringify({ route: where, status, problem: r.error.issues.slice(0, 5) })}\n`,
    );
  }
}
