#!/usr/bin/env bash
# RAYTRAIN_RAY_BIN for tests: Ray's CLI everywhere except on $RAYTRAIN_TEST_BAD_NODE, where `ray start`
# either hangs (never joins) or exits at once, as a node with a broken install or network would; and,
# with RAYTRAIN_TEST_NO_DRAIN=1, a Ray whose hidden `drain-node` command is gone. With
# RAYTRAIN_TEST_BAD_WHILE=FILE, the node is bad only while FILE exists (a node that comes back);
# RAYTRAIN_TEST_BAD_HOW=exit-once removes FILE as it fails (a start that fails once, as Ray's does when
# its dashboard agent is slow to start on a busy node).
set -euo pipefail
if [[ "${1:-}" == "drain-node" && "${RAYTRAIN_TEST_NO_DRAIN:-0}" == "1" ]]; then
  echo "Error: No such command 'drain-node'." >&2
  exit 2
fi
bad_now() {
  [[ "${SLURMD_NODENAME:-}" == "${RAYTRAIN_TEST_BAD_NODE:-}" ]] || return 1
  [[ -z "${RAYTRAIN_TEST_BAD_WHILE:-}" || -e "${RAYTRAIN_TEST_BAD_WHILE}" ]]
}
if [[ "${1:-}" == "start" ]] && bad_now; then
  echo "ray_that_fails_on: ${RAYTRAIN_TEST_BAD_HOW:-hang} on ${SLURMD_NODENAME}" >&2
  case "${RAYTRAIN_TEST_BAD_HOW:-hang}" in
    exit) exit 1 ;;
    exit-once)
      rm -f "${RAYTRAIN_TEST_BAD_WHILE:?exit-once needs RAYTRAIN_TEST_BAD_WHILE}"
      exit 1
      ;;
    late-exit) timeout 1.5 tail -f /dev/null || exit 1 ;;
  esac
  exec tail -f /dev/null
fi
# Inside the job's image (raytrain marks its processes there) Ray is the image's python3's; on a host, raytrain's.
if [[ "${RAYTRAIN_CONTAINED:-0}" == "1" ]]; then
  exec python3 -m ray.scripts.scripts "$@"
fi
exec "${RAYTRAIN_PYTHON:-python3}" -m ray.scripts.scripts "$@"
