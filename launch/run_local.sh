#!/usr/bin/env bash
# The name lesson 00 uses for launch/local.sh (same behaviour, same variables):
#   NPROC=4 bash launch/run_local.sh launch/scripts/hello.py
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/local.sh" "$@"
