#!/usr/bin/env bash
# Installs Apache Kafka (broker jars + log4j2 binding) from Maven Central into
# $GPUSCHED_CACHE/kafka-<version>/libs, the version pinned in ops/stack/kafka/pom.xml; idempotent.
set -euo pipefail
# shellcheck source=ops/scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pom="$REPO_ROOT/ops/stack/kafka/pom.xml"
version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$pom")"
[[ -n $version ]] || die "no <kafka.version> property in $pom"
dest="$GPUSCHED_CACHE/kafka-$version"
# .complete holds the pom's hash: another pin in it (log4j, ...) installs again
pom_hash="$(sha256sum "$pom" | cut -d' ' -f1)"
installed() { [[ "$(cat "$dest/.complete" 2>/dev/null)" == "$pom_hash" ]]; }

installed && exit 0
with_lock "kafka-$version"
installed && exit 0

command -v java >/dev/null 2>&1 || apt_install openjdk-17-jre-headless
command -v mvn >/dev/null 2>&1 || apt_install maven

# Resolve in a scratch copy so Maven never writes target/ into the repository.
work="$GPUSCHED_CACHE/kafka-$version.partial"
rm -rf "$work"
mkdir -p "$work"
cp "$pom" "$work/pom.xml"
run_quiet mvn -q -B -f "$work/pom.xml" dependency:copy-dependencies \
  -DincludeScope=runtime -DoutputDirectory="$work/libs"
rm -f "$work/pom.xml"
rm -rf "$dest"
mv "$work" "$dest"
echo "$pom_hash" >"$dest/.complete"
jars=("$dest"/libs/*.jar)
echo "installed kafka $version (${#jars[@]} jars) in $dest"
