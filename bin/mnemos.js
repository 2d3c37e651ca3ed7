#!/usr/bin/env node
// Runs the TypeScript sources directly through tsx's loader: no build step between a fresh clone
// and a running service.
import { register } from 'tsx/esm/api';

register();
await import('../services/cli.ts');
