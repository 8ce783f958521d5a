#!/usr/bin/env bash
# Device check for one CUDA GPU: installs what it needs, then checks every CUDA path of the runtime
# (NCCL, cuMemsetD8Async clears on the model stream, CUDA graphs, pinned offload, fp8 KV) in one
# call of under 8 minutes (scripts/device_check.py holds the parts and their time budgets). Prints
# JSON lines and a summary; exits non-zero on any failed check, 2 if there is no GPU.
# Run from anywhere: bash scripts/device_check.sh [--only clears runtime ...] [--list]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python scripts/device_check.py "$@"
