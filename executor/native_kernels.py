"""The C++ kernel of tp_runtime::dense_linear (native_kernels.cpp), built once per machine and torch
into the kernel cache beside the compiled layer libraries, and loaded before they run.

Why: the compiled layers call the dense matmul back through the dispatcher at every dense matrix,
and its only kernel was Python (executor/kernels.py), reached through torch's Python autograd layer
for custom operators. Each call took the GIL back; while a rank's link thread held it (decoding,
validating and staging the next step beside the forward) the model thread waited at the next
matmul, up to the interpreter's switch interval (5 ms), and the link thread in turn waited for the
model thread's next return to Python. AOTInductor's binding gives the GIL up while a library runs:
with this kernel a compiled layer runs from start to end without it
(tests/model/test_runners.py proves both).

Without a compiler, or until it is built, the Python kernel serves: the same results, with the GIL.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from executor.disk_cache import cpu_identity, digest, write_atomically

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.cpp")

_loaded: set[Path] = set()


def library_path(kernel_dir: Path) -> Path:
    """Named by the source, the CPU and torch's build: each is compiled into it."""
    return kernel_dir / f"native-{digest({'source': SOURCE.read_text(), **cpu_identity(), 'python': sys.version})}.so"


def failure_log(kernel_dir: Path) -> Path:
    return library_path(kernel_dir).with_suffix(".failed.log")


def compile_command(output: Path) -> list[str]:
    """torch's headers and libraries, its C++ ABI, and C++20, which its headers need."""
    root = Path(torch.__file__).parent
    return [
        os.environ.get("CXX") or "g++", "-O2", "-shared", "-fPIC", "-std=c++20", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        str(SOURCE), "-o", str(output),
        f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{root / 'lib'}",
    ]  # fmt: skip


def build(kernel_dir: Path) -> None:
    """Compiles the library into the cache (atomically: a loader never sees half of it)."""
    path = library_path(kernel_dir)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        done = subprocess.run(compile_command(partial), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed ({done.returncode}): {done.stderr[-4000:]}")
        write_atomically(path, partial.read_bytes())
    finally:
        partial.unlink(missing_ok=True)


def load(kernel_dir: Path) -> bool:
    """Registers the C++ kernel in this process if the library is built; False where it is not (or
    will not load)."""
    path = library_path(kernel_dir)
    if path in _loaded:
        return True
    if not path.is_file():
        return False
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        log.warning(f"{path} could not be loaded ({exc}); compiled layers take the GIL at every dense matmul")
        return False
    _loaded.add(path)
    return True
