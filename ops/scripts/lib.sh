# shellcheck shell=bash
# Shared helpers for the ops/scripts/install-*.sh scripts (sourced, never executed).
# Contract: quiet on success, the captured output of a failing step on stderr.

GPUSCHED_CACHE="${GPUSCHED_CACHE:-$HOME/.cache/gpusched}"
# shellcheck disable=SC2034  # used by the scripts that source this file
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# run_quiet CMD...: runs CMD with output captured; on failure prints it and returns CMD's status.
run_quiet() {
  local log rc=0
  log="$(mktemp)"
  "$@" >"$log" 2>&1 || rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "error: '$*' failed with status $rc:" >&2
    tail -n 60 "$log" >&2
  fi
  rm -f "$log"
  return "$rc"
}

# die MESSAGE: prints MESSAGE on stderr and exits 1.
die() {
  echo "error: $*" >&2
  exit 1
}

# with_lock NAME: holds an exclusive lock on $GPUSCHED_CACHE/NAME.lock until the script exits,
# so two concurrent installs of the same component never interleave.
with_lock() {
  mkdir -p "$GPUSCHED_CACHE"
  exec {lock_fd}>"$GPUSCHED_CACHE/$1.lock"
  flock "$lock_fd"
}

# apt_install PACKAGE...: installs Debian packages non-interactively (runs apt-get update once).
apt_install() {
  [[ $(id -u) -eq 0 ]] || die "need root to apt-get install $*; install it by hand or rerun as root"
  if [[ -z "${_GPUSCHED_APT_UPDATED:-}" ]]; then
    run_quiet env DEBIAN_FRONTEND=noninteractive apt-get update -q
    _GPUSCHED_APT_UPDATED=1
  fi
  run_quiet env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

# pip_install_workspace VENV [PIP_OPTION...]: every package of the workspace into VENV,
# editable, with the extras `make setup` needs: gpu-agent[torch], the torch executor, whose
# tests run it on CPU (PyPI's build carries the CUDA libraries, ~3.5 GB, about 2.5 min
# cold: the same wheel then runs on a GPU node); scheduler[bench], OR-Tools, for the
# solver's distance-to-optimal and LP-price tests. bootstrap.sh and lock.sh install so.
pip_install_workspace() {
  local venv="$1"
  shift
  "$venv/bin/python" -m pip install --quiet "$@" \
    -e "$REPO_ROOT/libs/common" -e "$REPO_ROOT/services/router" \
    -e "$REPO_ROOT/services/scheduler[bench]" -e "$REPO_ROOT/services/gpu-agent[torch]" \
    -e "$REPO_ROOT/services/accounting" -e "$REPO_ROOT/ops[dev]"
}
