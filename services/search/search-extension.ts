import type { ExtensionFactory } from '../extension.js';
import { makeSearchRoutes, searchRoutesMeta } from '../routes/search-routes.js';
import { searchDuration } from './search-session.js';

/** Search over the archive and the recent index: `POST /v1/sessions/{sid}/search`. */
export const searchExtension: ExtensionFactory = async (deps) => {
  // Registered up front so /metrics shows the histogram before the first search.
  searchDuration(deps.metrics.registry);
  return {
    name: 'search',
    routes: [{ prefix: '/v1/sessions', router: makeSearchRoutes(deps), meta: searchRoutesMeta }],
  };
};
