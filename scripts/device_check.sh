#!/usr/bin/env bash
# Device check for one CUDA GPU; finishes in well under 8 minutes. Prints JSON lines; exits non-zero
# on any failed check. Run from anywhere: bash scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
# cuda-python is what clear_pages uses on CUDA; install it quietly if it is not there yet.
if ! python -c "import cuda.bindings.driver" 2>/dev/null && ! python -c "from cuda import cuda" 2>/dev/null; then
    python -m pip install -q cuda-python >/dev/null 2>&1 || echo '{"warning": "pip install cuda-python failed; clear_pages on CUDA will report it"}'
fi
python -m pip install -q pyzmq msgpack >/dev/null 2>&1 || true

status=0
timeout 240 python scripts/device_check_clear.py || status=$?

# The attention kernels CUDA picks must still let a NaN in a masked slot reach the output.
python -m pip install -q pytest hypothesis >/dev/null 2>&1 || true
timeout 180 python -m pytest -q -p no:cacheprovider tests/model/test_attention.py -k cuda || status=$?

# ---- MODEL DECODE BENCHMARK --------------------------------------------------------------------
# Llama-3-8B-shaped random bf16 weights, eager vs CUDA graphs (executor.model + executor.cuda_graphs),
# batch 1/16/64 at 512 tokens of context. The model's owner may extend it; keep it under 3 minutes.
timeout 180 python scripts/device_decode.py || status=$?
# -----------------------------------------------------------------------------------------------

exit $status
