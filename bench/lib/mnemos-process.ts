// `mnemos serve` for the benches, in its own OS process so the load generator does not share the
// server's event loop. Production worker settings (no test-tuned lock durations). Config comes from
// the environment like the real CLI; BENCH_MODE=serve|api|worker (default serve);
// BENCH_EXTENSIONS=none starts the core (ingestion) only.
// Usage: node --import tsx bench/lib/mnemos-process.ts   (prints one {"ready":…} line on stdout)
import { loadConfig } from '../../services/config.js';
import { defaultExtensions } from '../../services/extensions.js';
import { makeLogger } from '../../services/logger.js';
import { startService } from '../../services/main.js';
import type { Mode } from '../../services/main.js';
import { announceReady } from '../../test/support/child-service.js';

const mode = (process.env.BENCH_MODE ?? 'serve') as Mode;
if (!['serve', 'api', 'worker'].includes(mode)) throw new Error(`BENCH_MODE must be serve, api or worker`);

const config = loadConfig(process.env);
const svc = await startService(mode, config, {
  logger: makeLogger(config.logLevel),
  extensions: process.env.BENCH_EXTENSIONS === 'none' ? [] : defaultExtensions,
});
announceReady(svc);
