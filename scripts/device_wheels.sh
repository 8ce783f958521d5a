#!/usr/bin/env bash
# Prepares here, where the package registries are reachable, what the device check carries to the
# GPU machine, which reaches no network (docs/device.md):
#   .device/wheels/     the pins of scripts/device_requirements.txt as wheels for the image's CPython
#                       3.12, manylinux x86_64; --no-deps, so every dependency is a pin of its own
#   .device/tokenizer/  SmolLM2's tokenizer from the embedded GGUF's metadata (scripts/device_tokenizer.py)
# With --host, also .device-host/wheels/: the compiled pins again, for this machine's python (the CI
# dry run installs the same pins here). Wheels already there are not fetched again; stray ones
# (an old pin) are removed. Exit 0 done, 1 a pin cannot be had (pip says which), 75 the registry
# could not be reached (a transient failure, told apart by pip's connection errors).
set -uo pipefail
cd "$(dirname "$0")/.."
host=0
[[ "${1:-}" == "--host" ]] && host=1
EX_TEMPFAIL=75
REQUIREMENTS=scripts/device_requirements.txt
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# fetch DEST PIP-ARGS...: the wheels the arguments name into DEST, from DEST itself when it holds them.
fetch() {
  local dest=$1
  shift
  mkdir -p "$dest"
  python -m scripts.device_env prune "$dest"
  if python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --no-index --find-links "$dest" -d "$dest" "$@" >/dev/null 2>&1; then
    return 0
  fi
  if python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --timeout 20 --retries 2 -d "$dest" "$@" >"$log" 2>&1; then
    return 0
  fi
  if grep -qE 'NewConnectionError|Temporary failure in name resolution|Name or service not known|Network is unreachable|ConnectTimeoutError|Connection refused|ReadTimeoutError' "$log"; then
    echo "device_wheels: the package registry could not be reached: $(grep -m1 -oE '(NewConnectionError|Temporary failure in name resolution|Name or service not known|Network is unreachable|ConnectTimeoutError|Connection refused|ReadTimeoutError)[^)]*' "$log")" >&2
    return $EX_TEMPFAIL
  fi
  grep -v '^WARNING: Location' "$log" >&2
  echo "device_wheels: pip could not download the pins of $REQUIREMENTS into $dest" >&2
  return 1
}

mapfile -t target < <(python -m scripts.device_env target)
fetch .device/wheels -r "$REQUIREMENTS" "${target[@]}" || exit $?
if [[ ! -s .device/tokenizer/tokenizer.json ]]; then
  python -m scripts.device_tokenizer .device/tokenizer || { echo "device_wheels: the tokenizer could not be exported" >&2; exit 1; }
fi
if ((host)); then
  mapfile -t compiled < <(python -m scripts.device_env compiled .device/wheels)
  if ((${#compiled[@]})); then
    fetch .device-host/wheels "${compiled[@]}" || exit $?
  fi
fi
echo "device_wheels: $(find .device -type f | wc -l) files, $(du -sh .device | cut -f1) in .device (carry it)"
