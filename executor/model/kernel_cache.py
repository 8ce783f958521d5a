"""The on-disk cache of compiled layer libraries (kernel_dir()) and the process that fills it.

One package of ~2 MB per library (a model needs one per row range and, at TP > 1, two per range and
rank), named by its LayerSpec's key; a failed build leaves a log beside the key instead, and is not
retried. Inductor's own cache of compiler checks and headers lives beside them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from executor.disk_cache import cache_root, file_lock, write_atomically
from executor.model.aot_layer import LayerSpec, build


def kernel_dir() -> Path:
    return cache_root() / "kernels"


def compiler_available() -> bool:
    """AOTInductor compiles C++ with $CXX or the first of g++ / clang++ on PATH."""
    return any(shutil.which(name) for name in filter(None, (os.environ.get("CXX"), "g++", "clang++", "c++")))


def package_path(spec: LayerSpec) -> Path:
    return kernel_dir() / f"{spec.key()}.pt2"


def unpack_dir() -> Path:
    """This process's folder for the libraries AOTInductor's loader unpacks (it makes a temporary
    folder under TMPDIR per library and removes it only in its destructor, which a killed rank, or
    one that ends with os._exit, never runs: /tmp filled with ~2 MB copies, one set per group a
    recovery restarts). Folders of processes of this host that are gone are removed here, so the
    next load cleans up after the last. Named by host too: a cache folder may be shared by hosts."""
    root = kernel_dir() / "unpacked"
    root.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    for entry in root.iterdir():
        owner, _, pid = entry.name.rpartition("-")
        if owner == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
    mine = root / f"{host}-{os.getpid()}"
    mine.mkdir(exist_ok=True)
    return mine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def failure_log(spec: LayerSpec) -> Path:
    return kernel_dir() / f"{spec.key()}.failed.log"


def build_log() -> Path:
    return kernel_dir() / "build.log"


def start_build(specs: list[LayerSpec], *, background: bool) -> subprocess.Popen | None:
    """A build of `specs` in its own process (`build_main`).

    In the background it is detached (it outlives a short `generate`, as `git gc --auto` does) and
    runs at the lowest priority; it is not started while another build holds the machine's build
    lock (None). Builds take the lock in turn, so the ranks of one launch, which each ask for their
    own shapes, build one after the other."""
    if background:
        with file_lock(kernel_dir() / "build.lock", blocking=False) as free:
            if not free:
                return None
    request = kernel_dir() / f".request-{os.getpid()}-{time.monotonic_ns()}.json"
    write_atomically(request, json.dumps([asdict(spec) for spec in specs]).encode())
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    with open(build_log(), "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _BUILD_MAIN, str(request), *(["--nice"] if background else [])],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=background,
        )


# The build process's entry: not `-m executor.model.kernel_cache`, which would run this module a
# second time as __main__ beside the copy that the package import brings in.
_BUILD_MAIN = "import sys; from executor.model.kernel_cache import build_main; sys.exit(build_main(sys.argv[1:]))"


def build_main(argv: list[str]) -> int:
    """The build process: each spec of the request that is not in the cache yet, under the lock."""
    if "--nice" in argv:
        os.nice(19)
    request = Path(argv[0])
    specs = [LayerSpec(**{**fields, "matmuls": tuple(fields["matmuls"])}) for fields in json.loads(request.read_text())]
    request.unlink()
    with file_lock(kernel_dir() / "build.lock"):
        # Inductor's own cache (compiler checks, precompiled headers: a build after the first takes
        # half the time) lives beside the packages.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(kernel_dir() / "inductor")
        status = 0
        for spec in specs:
            path = package_path(spec)
            if path.is_file():
                continue
            begin = time.monotonic()
            torch.set_num_threads(spec.threads)
            print(f"building {path.name}: {json.dumps(asdict(spec))}", flush=True)
            try:
                build(spec, path)
            except Exception as exc:  # recorded, and not retried on every start
                write_atomically(failure_log(spec), f"{json.dumps(asdict(spec))}\n{exc!r}\n".encode())
                print(f"failed: {exc!r}", flush=True)
                status = 1
                continue
            print(f"built {path.name} in {time.monotonic() - begin:.1f} s", flush=True)
        return status
