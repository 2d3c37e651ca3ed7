// A mnemos api or worker process for multi-process tests: like `mnemos api|worker`, but with the
// short job locks the tests need (a SIGKILLed worker's job is re-run within seconds).
// Usage: node --import tsx test/support/service-process.ts <api|worker|serve>  (config from env)
import { loadConfig } from '../../services/config.js';
import { defaultExtensions } from '../../services/extensions.js';
import { makeLogger } from '../../services/logger.js';
import { startService } from '../../services/main.js';
import type { Mode } from '../../services/main.js';
import { announceReady } from './child-service.js';

const mode = (process.argv[2] ?? 'serve') as Mode;
const config = loadConfig(process.env);
const svc = await startService(mode, config, {
  logger: makeLogger(config.logLevel),
  extensions: defaultExtensions,
  worker: {
    lockDurationMs: 3000,
    stalledIntervalMs: 1000,
    ingestSweepAfterMs: 2000,
    ingestSweepEveryMs: 1000,
  },
});
announceReady(svc);
