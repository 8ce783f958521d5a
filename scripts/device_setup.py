"""The device check's first part, in seconds: what the GPU machine has, before any GPU part runs.

Nothing is installed here (scripts/device_check.sh installed the carried wheels, offline). It reports
torch's version and CUDA's, refuses a torch older than the runtime's floor, checks that every carried
pin is installed at its version and every image package the check relies on is there, and imports
the runtime's processes' modules and every part's module, naming whatever is missing. Exit 0 when the
GPU parts can run, 1 when something is missing, 2 when there is no GPU on this machine (after every
other check, so that a dry run without a GPU proves the rest).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.device_env import GPU_ONLY_MODULES, IMAGE_PACKAGES, RUNTIME_MODULES, normalize, pins  # noqa: E402

EXIT_NO_DEVICE = 2
PART_MODULES = ("scripts.device_check_clear", "scripts.device_decode", "scripts.device_runtime", "scripts.device_serving")


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_problems() -> list[str]:
    problems = []
    for pin in pins():
        have = installed_version(pin.name)
        if have is None:
            problems.append(f"{pin} is not installed: it is not among the carried wheels (.device/wheels)")
        elif normalize(have) != normalize(pin.version):
            problems.append(f"{pin} is wanted but {pin.name} {have} comes first on the path")
    problems += [f"{name} is not in this image: carry its wheel (scripts/device_requirements.txt)" for name in IMAGE_PACKAGES if installed_version(name) is None]
    return problems


def import_problems(modules: tuple[str, ...]) -> list[str]:
    problems = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            problems.append(f"{module} cannot be imported: {type(exc).__name__}: {exc}")
    return problems


def main() -> int:
    started = time.monotonic()
    from tp_runtime import torch_floor

    import torch

    report: dict[str, object] = {"section": "setup", "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    problems = package_problems()
    try:
        torch_floor.check_torch(torch.__version__)
    except torch_floor.TorchVersionError as exc:
        problems.append(str(exc))
    problems += import_problems(RUNTIME_MODULES + PART_MODULES)
    gpu = torch.cuda.is_available()
    if gpu:
        problems += import_problems(GPU_ONLY_MODULES)
        report["gpu"] = torch.cuda.get_device_name()
        report["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    report.update(seconds=round(time.monotonic() - started, 1), problems=problems, ok=not problems and gpu)
    if not problems and not gpu:
        report["error"] = "no GPU on this machine: every module imported, no GPU part can run"
    print(json.dumps(report), flush=True)
    if problems:
        return 1
    return 0 if gpu else EXIT_NO_DEVICE


if __name__ == "__main__":
    sys.exit(main())
