#!/usr/bin/env bash
# PID 1 of one simulated node: its own hostname, /tmp and /dev/shm, then slurmd in the foreground.
# Usage (from testbed.py): nsenter --net=... unshare --uts --mount --pid --fork --mount-proc node-init.sh NODE CONF [KEEP]
# KEEP: a path under /tmp that must stay visible on the node (a checkout or venv living in /tmp).
set -euo pipefail

readonly node="$1" conf="$2" keep="${3:-}"

private_dirs() {
  mount --make-rprivate /
  if [[ -n "${keep}" ]]; then
    local stash="/run/rt-keep-${node}"
    mkdir -p "${stash}"
    mount --rbind "${keep}" "${stash}"
    mount -t tmpfs -o mode=1777 tmpfs /tmp
    mkdir -p "${keep}"
    mount --rbind "${stash}" "${keep}"
  else
    mount -t tmpfs -o mode=1777 tmpfs /tmp
  fi
  mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm
}

main() {
  hostname "${node}"
  private_dirs
  export SLURM_CONF="${conf}"
  slurmd -D -N "${node}" -f "${conf}" &
  local pid=$!
  trap 'kill -TERM "${pid}" 2>/dev/null || true' TERM INT
  # As PID 1, this shell also reaps every orphan reparented to it.
  while kill -0 "${pid}" 2>/dev/null; do
    wait "${pid}" || true
  done
}

main "$@"
