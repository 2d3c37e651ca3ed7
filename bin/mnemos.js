#!/usr/bin/env node
// Runs the TypeScript sources directly through tsx's loader: no build step between a fresh clone
// and a running service.
import { accessSync, constants, mkdirSync } from 'node:fs';
import { tmpdir, userInfo } from 'node:os';
import path from 'node:path';
import { register } from 'tsx/esm/api';

// tsx keeps its compile cache in $TMPDIR/tsx-<uid> and throws (a stack trace, before even
// `--help`) when it cannot create or write it: a TMPDIR that is read-only, another user's, or not
// a directory. Checked here once, the same way (create it, then ask for write access); without a
// usable cache every start compiles afresh, which is slower but works.
if (!process.env.TSX_DISABLE_CACHE) {
  const cache = path.join(tmpdir(), `tsx-${process.geteuid ? process.geteuid() : userInfo().username}`);
  try {
    mkdirSync(cache, { recursive: true, mode: 0o700 });
    accessSync(cache, constants.W_OK);
  } catch (err) {
    process.env.TSX_DISABLE_CACHE = '1';
    process.stderr.write(
      `mnemos: note: no compile cache (${cache}: ${err.code ?? err.message}; set TMPDIR to a writable directory for faster starts)\n`,
    );
  }
}

register();
await import('../services/cli.ts');
