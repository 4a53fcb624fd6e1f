#!/usr/bin/env bash
# Sets up a fresh machine for gpusched: a virtual environment with every package of the
# workspace installed editable (plus test tools), then Kafka, Redis and Jaeger (cached in
# ${GPUSCHED_CACHE:-~/.cache/gpusched}). Idempotent; fast when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VENV:-$root/.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
"$python" - <<'PY'
import sys
if sys.version_info[:2] < (3, 11):
    sys.exit(f"gpusched needs Python 3.11+, found {sys.version.split()[0]}")
PY

stamp="$venv/.gpusched-installed"
# shellcheck source=ops/scripts/lib.sh
source "$root/ops/scripts/lib.sh"
manifest="$(cat "$root"/libs/common/pyproject.toml "$root"/services/*/pyproject.toml \
  "$root"/ops/pyproject.toml "$root/constraints.txt" "$root/ops/scripts/lib.sh" \
  "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
installed() { [[ -f "$stamp" && "$(cat "$stamp")" == "$manifest" ]]; }
if ! installed; then
  with_lock "venv-$(printf %s "$venv" | sha256sum | cut -c1-12)"  # make demo beside make test
fi
if ! installed; then
  echo "bootstrap: installing Python packages into $venv"
  # a venv whose creation stopped half-way (no pip: python3-venv missing, an interrupt)
  # is made again
  "$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$python" -m venv --clear "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # constraints.txt pins every third-party package to the versions the suite last passed
  # with (ops/scripts/lock.sh moves them), so an upstream release can't break a clean clone.
  pip_install_workspace "$venv" -c "$root/constraints.txt"
  echo "$manifest" > "$stamp"
fi
bash "$root/ops/scripts/install-all.sh"
