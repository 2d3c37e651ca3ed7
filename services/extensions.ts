import { errorMemoryExtension } from './error-memory/error-memory-extension.js';
import type { ExtensionFactory } from './extension.js';

/** Capability modules every mnemos process opens (each adds routes and owns its resources). */
export const defaultExtensions: ExtensionFactory[] = [
  errorMemoryExtension,
];
