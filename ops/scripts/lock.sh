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
pins="$(mktemp)"
trap 'rm -rf "$venv" "$pins"' EXIT
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
pip_install_workspace "$venv"
# written aside and moved in whole: a failure leaves the old pins, never a file of comments
{
  echo "# Tested versions of every third-party package \`make setup\` installs (bootstrap.sh"
  echo "# and the Dockerfile install with -c). Rewritten by ops/scripts/lock.sh on $(date -u +%F)"
  echo "# with $("$venv/bin/python" -c 'import platform; print("Python", platform.python_version())')."
  "$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^#' | LC_ALL=C sort -f
} > "$pins"
chmod 644 "$pins"
mv "$pins" "$root/constraints.txt"
echo "lock: wrote $(grep -vc '^#' "$root/constraints.txt") pins to constraints.txt; now run make test"
