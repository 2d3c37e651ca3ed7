import { createRequire } from 'node:module';

/**
 * The only module that loads better-sqlite3 (used to read Agenvoy's `.store/history.db`). Loaded
 * lazily so processes that never import Agenvoy data never load the native addon.
 */

export interface SqliteStatement {
  /** Integers as BigInt (unix ns exceed 2^53). */
  safeIntegers(toggle?: boolean): SqliteStatement;
  all(...params: unknown[]): unknown[];
  get(...params: unknown[]): unknown;
  run(...params: unknown[]): unknown;
}

export interface SqliteDb {
  prepare(sql: string): SqliteStatement;
  exec(sql: string): void;
  close(): void;
}

type SqliteCtor = new (
  filename: string,
  options?: { readonly?: boolean; fileMustExist?: boolean },
) => SqliteDb;

let ctor: SqliteCtor | null = null;

export function openSqlite(filename: string, opts: { readonly?: boolean } = {}): SqliteDb {
  ctor ??= createRequire(import.meta.url)('better-sqlite3') as SqliteCtor;
  return new ctor(filename, opts.readonly ? { readonly: true, fileMustExist: true } : {});
}
