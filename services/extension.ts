import type { Processor } from 'bullmq';
import type { ExtraRoutes } from './app.js';
import type { CoreDeps } from './deps.js';
import type { AfterArchive } from '../workers/ingest.js';
import type { QueueName } from '../workers/queues.js';

/**
 * A capability module (error memory, recent index, summaries, search, …) plugs into a process
 * through one of these: the routers it mounts under /v1, the queue processors it owns, periodic
 * maintenance tasks, schedules, and a hook after messages are archived. Each module opens and
 * closes its own resources.
 */
export interface Extension {
  name: string;
  routes?: ExtraRoutes[];
  /** Processors by queue (one module owns a queue). */
  processors?: Partial<Record<Exclude<QueueName, 'maintenance'>, Processor>>;
  /** Tasks run by the shared `maintenance` queue, by kind. */
  maintenance?: Record<string, () => Promise<unknown>>;
  /** Called once in worker processes after the workers start (job schedulers). */
  schedule?(): Promise<void>;
  /** Called by the ingest worker after each committed batch (must not throw for long). */
  afterArchive?: AfterArchive;
  /** Removes everything the module keeps for a session or a tenant (delete, tenant erasure). */
  purgeSession?(tenantId: string, sessionId: string): Promise<void>;
  purgeTenant?(tenantId: string): Promise<void>;
  close?(): Promise<void>;
  /** Objects other modules may use (e.g. the error-memory store for the agent tools). */
  provides?: Record<string, unknown>;
}

/** `opened` holds the extensions listed before this one, already opened. */
export type ExtensionFactory = (deps: CoreDeps, opened: readonly Extension[]) => Promise<Extension>;
