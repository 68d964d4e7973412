#!/usr/bin/env bash
# Groups across simulated hosts (namespaces made by the team's multihost.sh: own network,
# hostname, /dev/shm, PID namespace and boot id per host; between hosts UCX over TCP where the
# build has it, and again gloo, the fallback of a build without UCX): every collective and point-to-point op at 2 hosts x 2 ranks and 3 hosts x 1 rank
# checked against the reference, MoE dispatch / combine and the Buffer with experts on every
# host, KV transfer (push, pull), RL weight transfer and AFD between hosts over UCX, and a rank that
# dies on one host makes the ranks of every host raise; large ops over a shaped link each followed
# by another group's barrier finish; nothing may be left in any host's /dev/shm.
#   bash tests/test_multihost.sh [python]      (default .venv/bin/python)
# Needs root (namespaces); skips with a message where it is not root or has no multihost.sh
# (TORCH_CAM_MULTIHOST names it; else ../shared/tools/multihost.sh beside the checkout).
set -uo pipefail
PY=${1:-.venv/bin/python}
cd "$(dirname "$0")/.."
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
tool=${TORCH_CAM_MULTIHOST:-}
for t in "$tool" ../shared/tools/multihost.sh /work/shared/tools/multihost.sh; do
  if [ -n "$t" ] && [ -x "$t" ]; then tool=$t; break; fi
  tool=""
done
if [ -z "$tool" ]; then echo "SKIPPED: multihost.sh not found (set TORCH_CAM_MULTIHOST)"; exit 0; fi
if [ "$(id -u)" != 0 ]; then echo "SKIPPED: simulated hosts need root (network and mount namespaces)"; exit 0; fi
if ! unshare --net --mount true 2>/dev/null; then echo "SKIPPED: unshare is not permitted here"; exit 0; fi
status=0
check() {  # check <hosts> <ranks per host> <script> [args]
  echo "-- $1 hosts x $2 ranks, $TORCH_CAM_INTER_HOST_ENGINE between hosts: ${*:3} ($SECONDS s)"
  MULTIHOST_PYTHON=$PY "$tool" --torchrun --timeout 240 ${shape:-} "$1" "$2" -- "${@:3}" >"$log" 2>&1
  local rc=$?
  grep -E "\] rank [0-9]+ raised after|\] rank [0-9]+: |^multihost: (ok|FAIL)" "$log"
  if [ $rc != 0 ]; then
    # torchrun's report of a failed child fills the log's tail; what the ranks said (tracebacks as
    # "[rankN]:" lines, the checks' "rank N:" verdicts) comes last, beside the verdict, so that
    # an excerpt around it names the cause.
    local said="\[rank[0-9]+\]:|\] rank [0-9]+: "
    if grep -q -E "$said" "$log"; then
      echo "-- what the ranks said:"; grep -E "$said" "$log" | tail -n 40
    else
      tail -n 40 "$log"
    fi
    echo "FAILED: $1 x $2 ${*:3} (exit $rc)"; status=1
  fi
}
log=$(mktemp "${TMPDIR:-/tmp}/torch_cam_multihost.XXXXXX")
trap 'rm -f "$log"' EXIT
engines=gloo
if "$PY" -c "import sys, torch_cam; sys.exit(torch_cam._C.ucx_version is None)"; then
  engines="ucx gloo"
else
  echo "NOTE: this build of torch_cam has no UCX: only the gloo fallback is checked"
fi
for engine in $engines; do
  export TORCH_CAM_INTER_HOST_ENGINE=$engine
  check 2 2 tests/multihost/check_collectives.py
  check 3 1 tests/multihost/check_collectives.py
  check 2 2 tests/multihost/check_dead_rank.py
  check 3 1 tests/multihost/check_dead_rank.py
  check 2 2 tests/multihost/check_moe.py  # over the group's collectives: both engines
  check 3 1 tests/multihost/check_moe.py
  if [ "$engine" = ucx ]; then  # KV between hosts is UCX's whatever engine the collectives use
    check 2 2 tests/multihost/check_kv.py
    check 3 1 tests/multihost/check_kv.py
    check 2 2 tests/multihost/check_kv.py --dead-peer
    check 2 2 tests/multihost/check_moe.py --dead-peer
    check 2 2 tests/multihost/check_weights.py  # weights between hosts: UCX gets, whatever the engine
    check 3 1 tests/multihost/check_weights.py
    check 2 2 tests/multihost/check_weights.py --dead-trainer
    check 2 2 tests/multihost/check_afd.py  # AFD between hosts: UCX puts and gets, whatever the engine
    check 3 1 tests/multihost/check_afd.py
    check 2 2 tests/multihost/check_afd.py --dead-ffn
    # A shaped link keeps the tail of each large exchange in the sender's socket after the op.
    shape="--rate 1gbit" check 2 2 tests/multihost/check_shaped_link.py
  fi
done
exit $status
