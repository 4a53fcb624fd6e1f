#!/usr/bin/env bash
# Builds Jaeger v2 (cmd/jaeger of Go module github.com/jaegertracing/jaeger v1.76.0 = Jaeger 2.13.0)
# into $GPUSCHED_CACHE/bin/jaeger from a wrapper module in $GPUSCHED_CACHE/jaeger-src; idempotent.
set -euo pipefail
# shellcheck source=ops/scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

module_version="v1.76.0"
bin="$GPUSCHED_CACHE/bin/jaeger"
src="$GPUSCHED_CACHE/jaeger-src"

# the binary counts only beside a stamp of the version it was built from (a version bump
# here builds again)
built() { [[ -x $bin && "$(cat "$bin.version" 2>/dev/null)" == "$module_version" ]]; }
built && exit 0
with_lock jaeger
built && exit 0

command -v go >/dev/null 2>&1 || die "go is not on PATH; Jaeger is built from source and needs Go >= 1.24.6"

mkdir -p "$src" "$(dirname "$bin")"
# (Re)write the wrapper module unless it already pins this version; `go mod tidy` fills in the rest.
if ! grep -q "github.com/jaegertracing/jaeger $module_version" "$src/go.mod" 2>/dev/null; then
  cat >"$src/go.mod" <<GOMOD
module gpusched.local/jaegerbuild

go 1.24

require github.com/jaegertracing/jaeger $module_version

// Copied from jaeger's own go.mod: replace directives of dependencies are not inherited.
replace github.com/Shopify/sarama => github.com/Shopify/sarama v1.33.0
GOMOD
  rm -f "$src/go.sum"
fi
cat >"$src/tools.go" <<'GOFILE'
//go:build tools

package tools

import _ "github.com/jaegertracing/jaeger/cmd/jaeger"
GOFILE

export GOFLAGS=-mod=mod GOTOOLCHAIN=local
(cd "$src" && run_quiet go mod tidy)
(cd "$src" && run_quiet go build -o "$bin.partial" github.com/jaegertracing/jaeger/cmd/jaeger)
mv "$bin.partial" "$bin"
echo "$module_version" >"$bin.version"
echo "installed jaeger $module_version (v2) in $bin"
