#!/usr/bin/env bash
# The device check: every CUDA path of the runtime on one GPU, offline, in one call of under five
# minutes (docs/device.md says how to call it through the device tool, and what each line means).
#
#   bash scripts/device_check.sh [--only PART ...] [--list]   on the GPU machine
#   bash scripts/device_check.sh --dry-run                     anywhere else (CI): the offline install
#                                                              and every part's imports, without a GPU
#
# On the GPU machine it installs the carried wheels (.device/wheels, made by scripts/device_wheels.sh)
# with --no-index into a target folder on PYTHONPATH, next to the image's torch, which it never
# installs or replaces; then scripts/device_check.py runs the parts. JSON lines on stdout; the
# summary and the logs under $OUT (or --out DIR). Exit 0 only if every part passed; 2 without a GPU;
# 3 when the carried wheels cannot be installed (named).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--dry-run" ]]; then
  shift
  exec python3 scripts/device_dry_run.py "$@"
fi
SITE=${TP_RUNTIME_DEVICE_SITE:-/tmp/tp-runtime-device-site}
if [[ ! -d .device/wheels ]]; then
  echo '{"part": "install", "ok": false, "error": "no .device/wheels here: run bash scripts/device_wheels.sh where pip reaches a registry, and carry .device"}'
  exit 3
fi
started=$(date +%s.%N)
# No index, no pip.conf: nothing to reach. --no-deps: the pins name every dependency.
if ! out=$(PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
  --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  --find-links .device/wheels -r scripts/device_requirements.txt 2>&1); then
  python3 -c 'import json, sys; print(json.dumps({"part": "install", "ok": False, "error": sys.argv[1].strip()[-2000:]}))' "$out"
  exit 3
fi
python3 -c 'import json, sys, time; print(json.dumps({"part": "install", "ok": True, "site": sys.argv[1], "seconds": round(time.time() - float(sys.argv[2]), 1)}))' "$SITE" "$started"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 scripts/device_check.py "$@"
