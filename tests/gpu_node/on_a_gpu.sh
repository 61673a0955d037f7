#!/usr/bin/env bash
# The course's GPU checks on a machine with one GPU (the `device` tool's machine; see README "Hardware").
# Usage, from the repository root, with the wheels of what the machine lacks in .whl/:
#   bash tests/gpu_node/on_a_gpu.sh OUTDIR
# Each step has its own time limit and log in OUTDIR; a summary line per step goes to stdout.
set -u
OUT=${1:?OUTDIR}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "STEP $name: rc=$? in $((SECONDS - start)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
step nccl_facts 60 python3 -m torch.distributed.run --standalone --nproc-per-node 1 tests/gpu_node/nccl_facts.py
grep -h "FACT" "$OUT/nccl_facts.log"
step lesson00_nbval 150 python3 -m pytest -p no:cacheprovider -q --nbval notebooks/00_setup.ipynb
tail -3 "$OUT/lesson00_nbval.log"
step grader_solutions 120 python3 -m course_lib.grade solutions/ --out "$OUT/grades" --jobs 8
tail -8 "$OUT/grader_solutions.log"
step one_rank_nccl 200 python3 tests/gpu_node/one_rank_nccl.py notebooks/00_setup.ipynb notebooks/01_process_groups.ipynb notebooks/02_ddp.ipynb notebooks/05_fsdp2.ipynb notebooks/04_fsdp1.ipynb notebooks/03_join.ipynb
cat "$OUT/one_rank_nccl.log"
