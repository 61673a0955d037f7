#!/usr/bin/env bash
# Run a training script on this machine, one process per rank:
#   NPROC=4 bash launch/local.sh launch/train.py --parallel 2d --tp 2
# The script picks its backend itself (course_lib.init: NCCL with one GPU per
# rank, else gloo on CPU), exactly as in a %%torchrun notebook cell.
# MAX_RESTARTS=1 lets torchrun restart the whole group once after a crash.
set -euo pipefail
NPROC=${NPROC:-"2"}
MAX_RESTARTS=${MAX_RESTARTS:-"0"}
PYTHON=${PYTHON:-"python"}
if [ $# -lt 1 ]; then
  echo "usage: NPROC=2 bash launch/local.sh SCRIPT.py [ARGS...]" >&2
  exit 2
fi
# One OpenMP thread per rank unless told otherwise: ranks share the cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-"1"}
# A script that checks its own flags (--check-only, as train.py does) is asked first, with the world size
# torchrun is about to start: a mistake is one line and exit 2 here, before any rank starts.
if grep -q -e "--check-only" "$1" 2>/dev/null; then
  "$PYTHON" "$1" --check-only "$NPROC" "${@:2}" || exit $?
fi
# --standalone: torchrun hosts its own rendezvous on a free local port.
# --tee 3 --role rank: every line of stdout and stderr arrives whole, prefixed
# with its local rank ("[rank0]:"), instead of ranks' writes mixing mid-line.
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  --max-restarts "$MAX_RESTARTS" --tee 3 --role rank "$@"
