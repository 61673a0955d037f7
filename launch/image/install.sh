#!/usr/bin/env bash
# Installs the course (this repository, editable) into the Python on PATH, keeping the torch it has.
#   bash launch/image/install.sh [PIP_OPTIONS...]
# The image's one install step (launch/image/Dockerfile); tests/test_launch_cluster.py runs it in a fresh venv.
# torch stays the base image's build (CUDA or CPU): pip may not replace it, only fail if something needs another.
set -euo pipefail
course=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}
if ! torch_version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null); then
  where=$(command -v "$PYTHON" || echo "$PYTHON")
  echo "install.sh: no torch in $where; start from an image that has it (launch/image/Dockerfile) or install torch first" >&2
  exit 1
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_version" > "$constraints"
"$PYTHON" -m pip install --no-cache-dir --constraint "$constraints" "$@" -e "$course"
# Checked from elsewhere (/): course_lib is found as installed, not only from a checkout; torch is the one it was.
(cd / && "$PYTHON" -c 'import course_lib, importlib.metadata as m, os
print(f"install.sh: course_lib from {os.path.dirname(course_lib.__file__)}, torch", m.version("torch"))')
