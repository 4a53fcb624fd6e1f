#!/usr/bin/env bash
# Builds Prometheus's promtool (cmd/promtool of Go module github.com/prometheus/prometheus
# v0.316.0 = Prometheus 3.16) into $GPUSCHED_CACHE/bin/promtool; idempotent. The test suite
# runs the alerting rules in ops/prometheus through `promtool test rules`.
set -euo pipefail
# shellcheck source=ops/scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

module_version="v0.316.0"
bin="$GPUSCHED_CACHE/bin/promtool"

# the binary counts only beside a stamp of the version it was built from (a version bump
# here builds again)
built() { [[ -x $bin && "$(cat "$bin.version" 2>/dev/null)" == "$module_version" ]]; }
built && exit 0
with_lock promtool
built && exit 0

command -v go >/dev/null 2>&1 || die "go is not on PATH; promtool is built from source and needs Go >= 1.26.7"

mkdir -p "$GPUSCHED_CACHE/promtool-build"
export GOTOOLCHAIN=local GOBIN="$GPUSCHED_CACHE/promtool-build"
run_quiet go install "github.com/prometheus/prometheus/cmd/promtool@$module_version"
mkdir -p "$(dirname "$bin")"
mv "$GOBIN/promtool" "$bin"
echo "$module_version" >"$bin.version"
echo "installed promtool $module_version in $bin"
