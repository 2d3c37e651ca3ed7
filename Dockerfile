# syntax=docker/dockerfile:1
# mnemos: one image for every process (`serve`, `api`, `worker`, `migrate`). TypeScript runs
# through tsx, a runtime dependency, so there is no build step: the first stage only installs the
# production dependencies, the second copies them beside the sources and runs as a non-root user.

FROM node:22-bookworm-slim AS deps
WORKDIR /app
COPY package.json package-lock.json ./
RUN npm ci --omit=dev --no-audit --no-fund && npm cache clean --force

FROM node:22-bookworm-slim AS runtime
ENV NODE_ENV=production \
    HOST=0.0.0.0 \
    PORT=8080 \
    MNEMOS_DATA_DIR=/data
WORKDIR /app
COPY --from=deps --chown=root:root /app/node_modules ./node_modules
COPY package.json package-lock.json tsconfig.json ./
COPY bin ./bin
COPY db ./db
COPY services ./services
COPY workers ./workers
# /data holds the embedded database when the container runs without DATABASE_URL
# (mount a volume there); the sources stay read-only to the service user.
RUN mkdir -p /data && chown node:node /data
USER node
EXPOSE 8080
# Liveness only (/readyz also checks Postgres and Redis: an outage there should not restart the API).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["node", "-e", "fetch('http://127.0.0.1:' + (process.env.PORT || 8080) + '/healthz').then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))"]
CMD ["node", "bin/mnemos.js", "serve"]
