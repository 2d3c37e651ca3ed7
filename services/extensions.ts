import { errorMemoryExtension } from './error-memory/error-memory-extension.js';
import { lifecycleExtension } from './lifecycle/lifecycle-extension.js';
import { contextExtension } from './context/context-extension.js';
import type { ExtensionFactory } from './extension.js';
import { recentIndexExtension } from './recent-index/recent-index-extension.js';
import { searchExtension } from './search/search-extension.js';
import { summaryExtension } from './summary/summary-extension.js';
import { toolsExtension } from './tools/tools-extension.js';

/** Capability modules every mnemos process opens (each adds routes and owns its resources). */
export const defaultExtensions: ExtensionFactory[] = [
  contextExtension,
  errorMemoryExtension,
  searchExtension,
  recentIndexExtension,
  summaryExtension,
  // Needs error memory (and search) opened before it.
  toolsExtension,
  // Purges through every module above: keep it last.
  lifecycleExtension,
];
