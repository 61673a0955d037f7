#!/usr/bin/env bash
# Run a training script on several machines: start the same command on every node.
#   NNODES=2 NPROC=4 RDZV_ENDPOINT=node0.example:29500 bash launch/multinode.sh launch/train.py --parallel 2d --tp 2
# Elastic: NNODES=1:4 starts as soon as 1 node is there and lets up to 4 join
# (torchrun waits a little for more before it starts; a node that joins later
# restarts the group, which resumes from the newest complete checkpoint).
# A fixed node order instead of c10d's arrival order:
#   RDZV_BACKEND=static NODE_RANK=0 NNODES=2 ... (NODE_RANK 0 on the node of RDZV_ENDPOINT)
# Each node says what it waits for, then a line every ~15 s; nodes missing after JOIN_TIMEOUT seconds
# (default 120) end it with one line naming the endpoint and what to check.
#
# Network: gloo and NCCL pick an interface from the hostname. If ranks time out
# connecting to each other, name the interface that reaches the other nodes:
#   GLOO_SOCKET_IFNAME=eth0 (CPU ranks)   NCCL_SOCKET_IFNAME=eth0 (NCCL's bootstrap;
#   the data may still go over InfiniBand/NVLink). `ip -brief addr` lists them.
set -euo pipefail
NNODES=${NNODES:-"2"}                 # N, or MIN:MAX for an elastic job
NPROC=${NPROC:-"1"}                   # ranks per node: one per GPU on a GPU node
RDZV_ENDPOINT=${RDZV_ENDPOINT:-"127.0.0.1:29500"}  # host:port of one node, the same on every node
RDZV_ID=${RDZV_ID:-"course-train"}    # one id per job: agents with the same id form one group
RDZV_BACKEND=${RDZV_BACKEND:-"c10d"}
JOIN_TIMEOUT=${JOIN_TIMEOUT:-"120"}   # seconds to wait for the other nodes (c10d's join_timeout; torch's default 600)
MAX_RESTARTS=${MAX_RESTARTS:-"1"}     # restarts of the whole group after a worker fails
PYTHON=${PYTHON:-"python"}
if [ $# -lt 1 ]; then
  echo "usage: NNODES=2 NPROC=1 RDZV_ENDPOINT=HOST:PORT bash launch/multinode.sh SCRIPT.py [ARGS...]" >&2
  exit 2
fi
node_rank=()
if [ "$RDZV_BACKEND" = "static" ]; then
  # c10d numbers nodes in the order they arrive and ignores --node-rank; static needs it.
  node_rank=(--node-rank "${NODE_RANK:?RDZV_BACKEND=static needs NODE_RANK (0 to NNODES-1)}")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-"1"}
# A script that checks its own flags (--check-only, as train.py does) is asked first, for every world size this
# job may run on (NPROC x each node count): a mistake is one line and exit 2 here, before any rank starts.
if grep -q -e "--check-only" "$1" 2>/dev/null; then
  lo=${NNODES%%:*} hi=${NNODES##*:}
  "$PYTHON" "$1" --check-only "$(seq -s, $((lo * NPROC)) "$NPROC" $((hi * NPROC)))" "${@:2}" || exit $?
fi
# agent.py is torchrun (the same flags) that says what it waits for, every ~15 s while it waits, and a port
# taken or nodes that never arrive in one line. --tee 3 --role rank: whole lines, each prefixed with its
# local rank ("[rank0]:").
exec "$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/agent.py" \
  --nnodes "$NNODES" --nproc-per-node "$NPROC" "${node_rank[@]}" \
  --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
  --rdzv-conf "join_timeout=$JOIN_TIMEOUT" \
  --max-restarts "$MAX_RESTARTS" --tee 3 --role rank "$@"
