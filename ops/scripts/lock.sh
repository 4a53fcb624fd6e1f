#!/usr/bin/env bash
# Rewrites constraints.txt: the third-party packages `make setup` installs, at the newest
# releases that install together today. It builds a throwaway virtual environment without
# the old pins (torch's CUDA wheels make that a few minutes), so run `make test` after it
# and commit the new pins only when the suite passes. bootstrap.sh installs with
# `-c constraints.txt`, so a clean clone (and CI) gets exactly the tested versions.
set -euo pipefail
# shellcheck source=ops/scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root="$REPO_ROOT"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
venv="$(mktemp -d)"
trap 'rm -rf "$venv"' EXIT
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
pip_install_workspace "$venv"
{
  echo "# Tested versions of every third-party package \`make setup\` installs (bootstrap.sh"
  echo "# and the Dockerfile install with -c). Rewritten by ops/scripts/lock.sh on $(date -u +%F)"
  echo "# with $("$venv/bin/python" -c 'import platform; print("Python", platform.python_version())')."
  "$venv/bin/pip" freeze --exclude-editable | grep -v '^#' | LC_ALL=C sort -f
} > "$root/constraints.txt"
echo "lock: wrote $(grep -vc '^#' "$root/constraints.txt") pins to constraints.txt; now run make test"
