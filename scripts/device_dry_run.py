"""The device check's dry run, for CI and any machine without a GPU: `bash scripts/device_check.sh --dry-run`.

It proves, in about a minute, what the GPU machine will do offline with the carried wheels:
1. scripts/device_wheels.sh --host: the carried set (.device: wheels for CPython 3.12 manylinux, and
   the tokenizer), and the compiled pins again for this machine's python (.device-host); wheels
   already there are reused, so only the first run downloads.
2. Every dependency the runtime declares travels or is in the image, and the carried folder holds
   one wheel per pin and nothing else, within CARRY_LIMIT_BYTES.
3. pip resolves the whole set for the device's python and platform from that folder alone
   (--no-index, --dry-run, with dependencies): a dependency that is not pinned fails here.
4. The same pins install offline (--no-index --no-deps) for this machine's python into a fresh
   folder, and scripts/device_check.py runs under `python -S` with only that folder, the checkout
   and a stand-in for the image (links to this machine's torch and the image's packages, with their
   own dependencies), so the site packages where CI installed everything cannot hide a missing pin.
   It must import every part and the runtime's modules and stop at "no GPU on this machine" (exit 2).
Prints JSON lines; exit 0 when all of it holds, 75 when the registry could not be reached (step 1,
a transient failure that CI reports and passes over), 1 otherwise.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.device_env import (  # noqa: E402
    CARRY,
    CARRY_LIMIT_BYTES,
    DEVICE_PLATFORMS,
    DEVICE_PYTHON,
    HOST_WHEELS,
    IMAGE_PACKAGES,
    REQUIREMENTS,
    TOKENIZER,
    WHEELS,
    missing,
    normalize,
    pins,
    strays,
    unprovided_dependencies,
)

EX_TEMPFAIL = 75
EXIT_NO_DEVICE = 2


class DryRunFailure(Exception):
    pass


def report(step: str, **values: object) -> None:
    print(json.dumps({"dry_run": step, **values}), flush=True)


def offline_pip_env() -> dict[str, str]:
    """pip as it runs on the GPU machine: no configuration file, no find-links or index of this one's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run((sys.executable, "-m", "pip", *args), env=offline_pip_env(), capture_output=True, text=True)


def check_carried() -> None:
    unprovided = unprovided_dependencies()
    if unprovided:
        raise DryRunFailure(
            f"the runtime depends on {', '.join(unprovided)}, which neither travels (scripts/device_requirements.txt) nor is "
            "in the image (scripts/device_env.py IMAGE_PACKAGES)"
        )
    wanted = pins()
    lacking, extra = missing(WHEELS, wanted), strays(WHEELS, wanted)
    if lacking or extra:
        raise DryRunFailure(f"{WHEELS} lacks {', '.join(map(str, lacking)) or 'nothing'} and holds strays {', '.join(p.name for p in extra) or 'none'}")
    if not (TOKENIZER / "tokenizer.json").is_file():
        raise DryRunFailure(f"{TOKENIZER} holds no tokenizer.json")
    size = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    if size > CARRY_LIMIT_BYTES:
        raise DryRunFailure(f"{CARRY} is {size / 2**20:.1f} MiB, over the {CARRY_LIMIT_BYTES / 2**20:.0f} MiB it may take of the device tool's 64")
    report("carried", wheels=len(wanted), mib=round(size / 2**20, 1), ok=True)


def resolve_for_device(work: Path) -> None:
    """Resolution with dependencies, from the carried folder alone, for the device's interpreter."""
    report_file = work / "resolution.json"
    done = pip(
        "install", "--dry-run", "--ignore-installed", "--no-index", "--find-links", str(WHEELS), "--only-binary=:all:",
        *DEVICE_PYTHON, *DEVICE_PLATFORMS, "--target", str(work / "never"), "--report", str(report_file), "-q",
        "-r", str(REQUIREMENTS),
    )
    if done.returncode:
        raise DryRunFailure(f"pip cannot resolve the carried set for CPython 3.12 manylinux offline: {done.stderr.strip()[-1500:]}")
    resolved = {
        f"{normalize(item['metadata']['name'])}=={item['metadata']['version']}" for item in json.loads(report_file.read_text())["install"]
    }
    wanted = {str(pin) for pin in pins()}
    if resolved != wanted:
        raise DryRunFailure(f"pip resolved {sorted(resolved ^ wanted)} differently from the pins")
    report("resolution", python="3.12", packages=len(resolved), ok=True)


def install_for_host(site: Path) -> None:
    done = pip(
        "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site), "--find-links", str(HOST_WHEELS),
        "--find-links", str(WHEELS), "-r", str(REQUIREMENTS),
    )
    if done.returncode:
        raise DryRunFailure(f"the pins do not install offline for this python: {done.stderr.strip()[-1500:]}")
    report("install", python=".".join(map(str, sys.version_info[:2])), site=str(site), ok=True)


def image_closure(names: tuple[str, ...]) -> set[str]:
    """The distributions that the image's packages need here, each with its own dependencies."""
    seen: set[str] = set()
    todo = [normalize(name) for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency this machine lacks
        seen.add(name)
        for line in requirements:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(normalize(requirement.name))
    return seen


def stand_in_image(directory: Path) -> list[str]:
    """Links to this machine's installed image packages and their dependencies, and nothing else."""
    directory.mkdir()
    linked = []
    for name in sorted(image_closure(IMAGE_PACKAGES)):
        distribution = importlib.metadata.distribution(name)
        for top in sorted({Path(f).parts[0] for f in distribution.files or () if not str(f).startswith("..")}):
            target, link = Path(distribution.locate_file(top)), directory / top
            if target.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(target)
        linked.append(name)
    return linked


def run_check(site: Path, image: Path, out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=os.pathsep.join((str(site), str(REPO), str(image))), CUDA_VISIBLE_DEVICES="")
    started = time.monotonic()
    done = subprocess.run(
        (sys.executable, "-S", "scripts/device_check.py", "--out", str(out)), cwd=REPO, env=env, capture_output=True, text=True,
        timeout=240,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    setup = next((line for line in lines if line.get("section") == "setup"), None)
    if done.returncode != EXIT_NO_DEVICE or setup is None or setup.get("problems"):
        raise DryRunFailure(
            f"the check did not import everything and stop at 'no GPU' (exit {done.returncode}): "
            f"{json.dumps(setup) if setup else (done.stdout + done.stderr)[-2000:]}"
        )
    if not (out / "summary.json").is_file() or not (out / "setup.log").is_file():
        raise DryRunFailure(f"the check wrote no summary.json or setup.log under {out}")
    report("check", torch=setup["torch"], exit=done.returncode, said=setup["error"], seconds=round(time.monotonic() - started, 1), ok=True)


def main() -> int:
    started = time.monotonic()
    wheels = subprocess.run(("bash", str(REPO / "scripts" / "device_wheels.sh"), "--host"), cwd=REPO, capture_output=True, text=True)
    if wheels.returncode == EX_TEMPFAIL:
        report("wheels", skipped=True, reason=wheels.stderr.strip()[-500:], ok=True)
        return EX_TEMPFAIL
    try:
        if wheels.returncode:
            raise DryRunFailure(f"scripts/device_wheels.sh failed ({wheels.returncode}): {wheels.stderr.strip()[-1500:]}")
        report("wheels", said=wheels.stdout.strip(), ok=True)
        check_carried()
        with tempfile.TemporaryDirectory(prefix="tp-runtime-dry-run-") as tmp:
            work = Path(tmp)
            resolve_for_device(work)
            install_for_host(work / "site")
            linked = stand_in_image(work / "image")
            report("image", packages=len(linked), ok=True)
            run_check(work / "site", work / "image", work / "out")
    except DryRunFailure as exc:
        report("failed", error=str(exc), ok=False)
        return 1
    report("summary", seconds=round(time.monotonic() - started, 1), ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
