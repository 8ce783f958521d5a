"""What the device check needs on the GPU machine, and where the wheels it carries there live.

The GPU machine reaches no network: its image has torch and some packages (IMAGE_PACKAGES), and
what else the check needs travels as wheels in CARRY/wheels (scripts/device_requirements.txt,
downloaded by scripts/device_wheels.sh). Standard library only: this runs before anything is
installed, on the device and in the CI dry run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "scripts" / "device_requirements.txt"
CARRY = REPO / ".device"  # git-ignored; the device tool's `carry` names it
WHEELS = CARRY / "wheels"  # CPython 3.12 manylinux x86_64: the image's python
TOKENIZER = CARRY / "tokenizer"  # SmolLM2's tokenizer.json and tokenizer_config.json, from the GGUF
HOST_WHEELS = REPO / ".device-host" / "wheels"  # the compiled pins again, for this machine's python
CARRY_LIMIT_BYTES = 16 << 20  # of the device tool's 64 MiB for the whole tree
# The device's interpreter, as pip's download and resolution options name it.
DEVICE_PYTHON = ("--python-version", "3.12", "--implementation", "cp")
# llguidance ships only manylinux_2_31 wheels; the image (CUDA 13, Python 3.12) has a newer glibc.
DEVICE_PLATFORMS = tuple(
    arg
    for tag in ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
    for arg in ("--platform", tag)
)

# What the image provides that the check imports (KINDS.md of the device tool lists the image);
# torch, and anything CUDA, is never installed or replaced.
IMAGE_PACKAGES = ("torch", "numpy", "msgpack", "tokenizers", "safetensors", "jinja2", "tqdm", "prometheus-client", "httpx")
# Imported by the setup part before any GPU part runs: the runtime's processes (executor, worker,
# frontend with its HTTP server) and every part's own module, so that a missing package is named
# in seconds, not found by a server that fails to start.
RUNTIME_MODULES = (
    "executor.worker",
    "executor.cuda_graphs",
    "executor.cuda_memset",
    "tp_runtime.worker_process",
    "tp_runtime.frontend",
    "tp_runtime.http.app",
    "tp_runtime.http.header_deadline",
    "uvicorn",  # the frontend imports it when it starts the server
    "tp_runtime.engine",
    "scripts.harness.executors",
    "scripts.harness.runtime",
)
GPU_ONLY_MODULES = ("cuda.bindings.driver",)  # cuda-python, for clear_pages' memsets: the image's
# The runtime's declared dependencies (pyproject: the core ones and `serve`) that the device check
# neither carries nor finds in the image, each with why it is not needed there.
NOT_NEEDED_ON_DEVICE = {"gguf": "reads GGUF files only; the check's checkpoints are safetensors it writes there"}


@dataclass(frozen=True)
class Pin:
    name: str  # normalized: lower case, runs of -_. as one '-'
    version: str

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path = REQUIREMENTS) -> list[Pin]:
    """The pinned requirements, one `name==version` a line; anything else is refused."""
    found = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()) or not version.strip():
            raise ValueError(f"{path.name}:{number}: {raw!r} is not a pin (name==version)")
        found.append(Pin(normalize(name.strip()), version.strip()))
    return found


def wheel_pin(filename: str) -> Pin:
    """The distribution and version a wheel's file name says (PEP 427: name-version-...-tags.whl)."""
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) < 5 or not filename.endswith(".whl"):
        raise ValueError(f"{filename} is not a wheel's file name")
    return Pin(normalize(parts[0]), parts[1])


def is_pure(filename: str) -> bool:
    return filename.endswith("-none-any.whl")


def strays(directory: Path, wanted: list[Pin]) -> list[Path]:
    """Wheels in `directory` that no pin asks for (an old version, another package)."""
    return sorted(p for p in directory.glob("*.whl") if wheel_pin(p.name) not in wanted)


def missing(directory: Path, wanted: list[Pin]) -> list[Pin]:
    held = {wheel_pin(p.name) for p in directory.glob("*.whl")}
    return [pin for pin in wanted if pin not in held]


def compiled_pins(directory: Path, wanted: list[Pin]) -> list[Pin]:
    """The pins whose wheel in `directory` is built for one interpreter and platform."""
    return sorted({wheel_pin(p.name) for p in directory.glob("*.whl") if not is_pure(p.name)} & set(wanted), key=str)


def unprovided_dependencies(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The runtime's declared dependencies (core and `serve`) that are neither pinned to travel, in
    the image, nor named in NOT_NEEDED_ON_DEVICE: each would be missing on the GPU machine."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["serve"]]
    names = {normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line).group(0)) for line in declared}
    provided = {pin.name for pin in pins()} | {normalize(n) for n in IMAGE_PACKAGES} | set(NOT_NEEDED_ON_DEVICE)
    return sorted(names - provided)


def main(argv: list[str]) -> int:
    """`prune DIR` removes stray wheels; `compiled DIR` prints the compiled pins; `missing DIR`
    prints the pins without a wheel (exit 1 if any); `target` prints pip's options naming the
    device's interpreter and platforms, one a line."""
    if argv[0] == "target":
        print("\n".join((*DEVICE_PYTHON, *DEVICE_PLATFORMS)))
        return 0
    command, directory = argv[0], Path(argv[1])
    wanted = pins()
    if command == "prune":
        for path in strays(directory, wanted):
            path.unlink()
        return 0
    if command == "compiled":
        print("\n".join(map(str, compiled_pins(directory, wanted))))
        return 0
    if command == "missing":
        lacking = missing(directory, wanted)
        print("\n".join(map(str, lacking)))
        return 1 if lacking else 0
    raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
