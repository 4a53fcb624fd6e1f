#!/usr/bin/env bash
# Installs everything the local stack needs (Redis, Kafka, Jaeger) under $GPUSCHED_CACHE;
# idempotent and quiet: prints one line per component actually installed.
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"

"$here/install-redis.sh"
"$here/install-kafka.sh"
"$here/install-jaeger.sh"
