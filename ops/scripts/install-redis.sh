#!/usr/bin/env bash
# Installs redis-server (Debian package) for the local stack, which runs its own redis process;
# idempotent, and makes sure the distribution's redis service is neither running nor enabled.
set -euo pipefail
# shellcheck source=ops/scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if ! command -v redis-server >/dev/null 2>&1; then
  apt_install redis-server
  echo "installed redis-server $(redis-server --version | grep -o 'v=[0-9.]*' | cut -d= -f2)"
fi

# The Debian package may start a system redis on 127.0.0.1:6379, the port `gpusched up` uses.
# Stop it via its own service manager and pid file only; our stack's processes are untouched.
if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
  if systemctl is-enabled --quiet redis-server 2>/dev/null \
    || systemctl is-active --quiet redis-server 2>/dev/null; then
    run_quiet systemctl disable --now redis-server
    echo "disabled system redis-server service"
  fi
else
  system_pid_file=/run/redis/redis-server.pid
  if [[ -f $system_pid_file ]] && kill -0 "$(cat "$system_pid_file")" 2>/dev/null; then
    run_quiet service redis-server stop
    echo "stopped system redis-server service"
  fi
  if [[ -x /etc/init.d/redis-server ]] && command -v update-rc.d >/dev/null 2>&1 \
    && compgen -G "/etc/rc[2-5].d/S*redis-server" >/dev/null; then
    run_quiet update-rc.d redis-server disable
    echo "disabled system redis-server autostart"
  fi
fi
