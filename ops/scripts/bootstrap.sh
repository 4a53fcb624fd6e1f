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
manifest="$(cat "$root"/libs/common/pyproject.toml "$root"/services/*/pyproject.toml \
  "$root"/ops/pyproject.toml "$root/constraints.txt" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$manifest" ]]; then
  echo "bootstrap: installing Python packages into $venv"
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  # gpu-agent[torch]: the torch executor, whose tests run it on CPU. PyPI's build carries
  # the CUDA libraries (~3.5 GB, about 2.5 min cold): the same wheel then runs on a GPU node.
  # scheduler[bench]: OR-Tools, for the solver's distance-to-optimal and LP-price tests.
  # constraints.txt pins every third-party package to the versions the suite last passed
  # with (ops/scripts/lock.sh moves them), so an upstream release can't break a clean clone.
  "$venv/bin/pip" install --quiet -c "$root/constraints.txt" \
    -e "$root/libs/common" -e "$root/services/router" -e "$root/services/scheduler[bench]" \
    -e "$root/services/gpu-agent[torch]" -e "$root/services/accounting" -e "$root/ops[dev]"
  echo "$manifest" > "$stamp"
fi
bash "$root/ops/scripts/install-all.sh"
