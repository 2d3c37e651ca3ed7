/**
 * Error memory (SPEC §4): tool errors and their fixes, per tenant and across sessions. Part of
 * the client made by `createMnemosClient`; kept in its own file for size.
 */
import { callOpts, deleteOrFalse, requestJson } from './transport.js';
import type { CallOptions, RequestSpec, Transport } from './transport.js';
import type { ErrorRecord, ErrorWriteInput } from './types.js';

const enc = encodeURIComponent;

export function makeErrorMemoryMethods(http: Transport) {
  const call = <T>(spec: RequestSpec): Promise<T> => requestJson<T>(http, spec);
  const remove = (spec: RequestSpec): Promise<boolean> => deleteOrFalse(http, spec);
  const methods = {
    /** 201 new record, or merged into the record with the same tool and symptom. */
    writeError(
      input: ErrorWriteInput,
      opts: CallOptions = {},
    ): Promise<{ id: string; deduplicated: boolean }> {
      return call({ ...callOpts(opts), method: 'POST', path: '/v1/errors', json: input, idempotent: false });
    },

    async searchErrors(
      opts: CallOptions & { query: string; toolName?: string; limit?: number },
    ): Promise<ErrorRecord[]> {
      const body = await call<{ records: ErrorRecord[] }>({
        ...callOpts(opts),
        method: 'POST',
        path: '/v1/errors/search',
        json: { query: opts.query, tool_name: opts.toolName, limit: opts.limit },
        idempotent: true,
      });
      return body.records;
    },

    /** The hint to append to a failed tool result: `related_errors` is compact text or "NONE". */
    lookupError(
      opts: CallOptions & { toolName: string; error: string },
    ): Promise<{ related_errors: string; records: ErrorRecord[] }> {
      return call({
        ...callOpts(opts),
        method: 'POST',
        path: '/v1/errors/lookup',
        json: { tool_name: opts.toolName, error: opts.error },
        idempotent: true,
      });
    },

    getError(id: string, opts: CallOptions = {}): Promise<ErrorRecord> {
      return call({ ...callOpts(opts), method: 'GET', path: `/v1/errors/${enc(id)}`, idempotent: true });
    },

    listErrors(
      opts: CallOptions & { cursor?: string; limit?: number } = {},
    ): Promise<{ records: ErrorRecord[]; next: string | null }> {
      return call({
        ...callOpts(opts),
        method: 'GET',
        path: '/v1/errors',
        query: { cursor: opts.cursor, limit: opts.limit },
        idempotent: true,
      });
    },

    async *iterateErrors(opts: CallOptions & { pageSize?: number } = {}): AsyncGenerator<ErrorRecord> {
      let cursor: string | undefined;
      for (;;) {
        const page = await methods.listErrors({ ...callOpts(opts), cursor, limit: opts.pageSize ?? 500 });
        yield* page.records;
        if (page.next === null) return;
        cursor = page.next;
      }
    },

    deleteError(id: string, opts: CallOptions = {}): Promise<boolean> {
      return remove({ ...callOpts(opts), method: 'DELETE', path: `/v1/errors/${enc(id)}`, idempotent: true });
    },

    /** Deletes the records of one tool (or all); resolves with how many. */
    async purgeErrors(opts: CallOptions & { toolName?: string } = {}): Promise<number> {
      const body = await call<{ deleted: number }>({
        ...callOpts(opts),
        method: 'DELETE',
        path: '/v1/errors',
        query: { tool_name: opts.toolName },
        idempotent: true,
      });
      return body.deleted;
    },
  };
  return methods;
}
