import { z } from 'zod';
import { AppError } from './errors.js';

/** Renders a zod path the way clients write it: `messages[3].role`. */
export function fieldPath(path: ReadonlyArray<PropertyKey>): string {
  let out = '';
  for (const p of path) {
    if (typeof p === 'number') out += `[${p}]`;
    else out += out === '' ? String(p) : `.${String(p)}`;
  }
  return out;
}

/**
 * What a union's failure means to the client: zod says only "Invalid input" at the union's path.
 * When the value failed inside one of the union's forms (a content part of an array, not the
 * string or null beside it), that form's issues are the answer (`content[0].type: Invalid
 * discriminator value. Expected 'text' | 'image_url'`); when it matched no form's type, the answer
 * lists the types it may have.
 */
function closestIssues(
  issue: z.core.$ZodIssue,
  at: ReadonlyArray<PropertyKey>,
): { issue: z.core.$ZodIssue; at: ReadonlyArray<PropertyKey> }[] {
  if (issue.code !== 'invalid_union' || issue.errors.length === 0) return [{ issue, at }];
  const inner = [...at, ...issue.path];
  // How far a form got: into the value (its path's depth), or past the type check at the value
  // itself (an array of 20 items where 16 are allowed: 0.5), or not even that (-1).
  const reach = (issues: z.core.$ZodIssue[]) =>
    issues.some((i) => i.path.length > 0)
      ? Math.max(...issues.map((i) => i.path.length))
      : issues.every((i) => i.code === 'invalid_type')
        ? -1
        : 0.5;
  const closest = issue.errors.reduce((a, b) => (reach(b) > reach(a) ? b : a));
  if (reach(closest) > 0) return closest.flatMap((i) => closestIssues(i, inner));
  const expected = issue.errors.flatMap((e) =>
    e.length === 1 && e[0]!.code === 'invalid_type' ? [e[0]!.expected] : [],
  );
  if (expected.length !== issue.errors.length) return [{ issue, at }];
  const message = `Invalid input: expected ${expected.join(' or ')}`;
  return [{ issue: { ...issue, message }, at }];
}

/** Parses untrusted input; failures become a 400 whose details name every offending field path. */
export function parseInput<S extends z.ZodType>(
  schema: S,
  input: unknown,
  where = 'body',
  basePath: ReadonlyArray<PropertyKey> = [],
): z.output<S> {
  const r = schema.safeParse(input);
  if (r.success) return r.data;
  const problems = r.error.issues
    .flatMap((i) => closestIssues(i, []))
    .slice(0, 20)
    .map(({ issue: i, at }) => {
      const path = [...at, ...(i.code === 'unrecognized_keys' ? [...i.path, i.keys[0] ?? ''] : i.path)];
      return { path: fieldPath([...basePath, ...path]) || where, message: i.message };
    });
  const first = problems[0];
  throw new AppError(
    400,
    'validation_failed',
    first ? `${first.path}: ${first.message}` : `invalid ${where}`,
    { problems },
  );
}

/**
 * `?limit=` of a list: 1–500 (SPEC §4: default 100, max 500). Empty is the default, as an empty
 * `cursor=` is the first page: README's `?cursor=&limit=`, typed as it reads, was a 400.
 */
export const limitParam = z
  .string()
  .regex(/^\d*$/, 'must be an integer from 1 to 500')
  // What /openapi.json says: the regex alone read as up to 9999.
  .meta({ description: 'an integer from 1 to 500 (default 100; empty = the default)' })
  // Leading zeros are a number like any other (`00500` is 500); the pipe bounds the value.
  .transform((v) => (v === '' ? undefined : Number(v)))
  .pipe(z.number().min(1, 'must be at least 1').max(500, 'must be at most 500').int().optional());

/** The query of a route that takes no parameters: an unknown one is a 400, not silently ignored. */
export const noQuery = z.object({}).strict();

/** The `{}`s body-parser made of zero bytes (app.ts marks them): no body was sent. */
const zeroLengthBodies = new WeakSet<object>();
export const markZeroLengthBody = (body: object): void => void zeroLengthBodies.add(body);

/**
 * For a POST that takes no body: absent or `{}` is fine, anything else a 400 saying `message`. A
 * DELETE (`strict`) takes none at all: `{}` is what a client sends for `{tool_name: undefined}`,
 * and the purge it meant to filter then deleted every record.
 */
export function assertNoBody(body: unknown, message: string, opts: { strict?: boolean } = {}): void {
  const empty =
    body === undefined ||
    // A zero-length body is no body, whatever its content-type (body-parser reads it as `{}`).
    (typeof body === 'object' && body !== null && zeroLengthBodies.has(body)) ||
    (!opts.strict &&
      typeof body === 'object' &&
      body !== null &&
      !Array.isArray(body) &&
      Object.keys(body).length === 0);
  if (empty) return;
  throw new AppError(400, 'validation_failed', `body: ${message}`, { problems: [{ path: 'body', message }] });
}

/** An empty query parameter is an absent one: `?cursor=` is the first page, as no cursor is, on every list. */
export const emptyAsAbsent = <T extends string>(v: T | undefined): Exclude<T, ''> | undefined =>
  v === '' ? undefined : (v as Exclude<T, ''> | undefined);

/**
 * A page out of rows fetched with `limit + 1`: the first `limit`, and whether anything follows
 * (so `next` is null on a full last page, with no extra empty round trip for the client).
 */
export function pageOf<T>(rows: T[], limit: number): { items: T[]; more: boolean } {
  return { items: rows.slice(0, limit), more: rows.length > limit };
}

/** `?cursor=&limit=` of a list that pages by an opaque cursor. */
export const listQuery = z
  .object({ cursor: z.string().max(300).optional().transform(emptyAsAbsent), limit: limitParam.optional() })
  .strict();
