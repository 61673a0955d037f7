#!/usr/bin/env bash
# Run a course script on this machine, one process per rank:
#   NPROC=4 bash launch/run_local.sh launch/scripts/hello.py
# The script picks its backend itself (course_lib.init: NCCL with one GPU per
# rank, else gloo on CPU), exactly as in a %%torchrun notebook cell.
set -euo pipefail
NPROC=${NPROC:-"2"}
PYTHON=${PYTHON:-"python"}
if [ $# -lt 1 ]; then
  echo "usage: NPROC=2 bash launch/run_local.sh SCRIPT.py [ARGS...]" >&2
  exit 2
fi
# One OpenMP thread per rank unless told otherwise: ranks share the cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-"1"}
# --tee 3 --role rank: every line of stdout and stderr arrives whole, prefixed
# with its local rank ("[rank0]:"), instead of ranks' writes mixing mid-line.
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" --tee 3 --role rank "$@"
