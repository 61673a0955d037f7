#!/usr/bin/env bash
# The course's GPU checks on a machine with one GPU (the `device` tool's machine; see README "On a GPU node").
# Usage, from the repository root, with the wheels of what the machine lacks in .whl/:
#   bash tests/gpu_node/on_a_gpu.sh OUTDIR
# Every step runs in parallel with its own log and time limit (tests/gpu_node/steps.py, run_steps.py);
# the whole script ends within 8 minutes. A line per step goes to stdout; OUTDIR/record_entry.json holds
# what was seen: add it to the record and the README's table here with
#   python tests/gpu_node/record_table.py --add OUTDIR/record_entry.json
# The CPU dry run of the same steps is in the suite (tests/test_gpu_node_script.py).
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
# 16 cores: 12 steps at a time (a lesson's nbval keeps 2-4 ranks busy for part of its run).
python3 tests/gpu_node/run_steps.py "$OUT" --jobs 12 --budget-s 420
grep -h "FACT" "$OUT/nccl_facts.log" 2>/dev/null
