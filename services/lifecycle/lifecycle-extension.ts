import type { Extension, ExtensionFactory } from '../extension.js';
import { forRequests } from '../deps.js';
import { lifecycleRoutesMeta, makeLifecycleRoutes } from '../routes/lifecycle-routes.js';
import { reconcileGenerations } from './session-lifecycle.js';
import { TEMP_REAPER_EVERY_MS, reapTempSessions } from './temp-reaper.js';
import { eraseTenant, resumeTenantErasures } from './tenant-erasure.js';
import { scheduleMaintenance } from '../../workers/queues.js';

const RECONCILE_EVERY_MS = 60_000;
const ERASURE_RESUME_EVERY_MS = 60_000;

/**
 * Session lifecycle: reset, delete, export, import (routes), the temp reaper, the generation
 * reconciler and the resumption of interrupted tenant erasures (maintenance tasks), and tenant
 * erasure (offered to the admin API as `provides.eraseTenant`). It purges through every other
 * module's purgeSession/purgeTenant hooks, so it is listed last in services/extensions.ts; the
 * list it reads is the process's live one.
 */
export const lifecycleExtension: ExtensionFactory = async (deps, opened): Promise<Extension> => {
  const extensions = () => opened;
  // schedule() runs again every minute (workers/main.ts re-asserts the schedulers): the reconcile
  // at start-up is once per process, the maintenance task every minute does the rest.
  let reconciledAtStart = false;
  return {
    name: 'lifecycle',
    routes: [
      {
        prefix: '/v1/sessions',
        router: makeLifecycleRoutes(forRequests(deps), { extensions }),
        meta: lifecycleRoutesMeta,
      },
    ],
    maintenance: {
      'temp-reaper': () => reapTempSessions(deps, extensions),
      'lifecycle-reconcile': () => reconcileGenerations(deps, extensions),
      'tenant-erasures': () => resumeTenantErasures(deps, extensions),
    },
    async schedule() {
      // A worker (re)starting after a crash finishes interrupted resets/deletes at once.
      if (!reconciledAtStart) {
        reconciledAtStart = true;
        void reconcileGenerations(deps, extensions).catch((err: unknown) =>
          deps.logger.warn({ err: { message: (err as Error).message } }, 'generation reconcile failed'),
        );
      }
      await scheduleMaintenance(deps.queues, 'temp-reaper', TEMP_REAPER_EVERY_MS);
      await scheduleMaintenance(deps.queues, 'lifecycle-reconcile', RECONCILE_EVERY_MS);
      await scheduleMaintenance(deps.queues, 'tenant-erasures', ERASURE_RESUME_EVERY_MS);
    },
    provides: { eraseTenant: (tenantId: string) => eraseTenant(deps, extensions, tenantId) },
  };
};
