"""Architecture rules a reviewer cannot keep by eye:
- protocol/ and scheduler/ never import torch, directly or through anything they import;
- no runtime package uses pickle (the wire is msgpack and raw buffers, nothing else);
- every exception class the runtime defines derives from protocol.errors.TPRuntimeError."""

from __future__ import annotations

import ast
import builtins
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH_FREE = ("protocol", "scheduler")
RUNTIME_PACKAGES = ("protocol", "scheduler", "executor", "tp_runtime")

# Import every module of the given packages in a fresh interpreter and report what got loaded.
_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    loaded = []
    for name in sys.argv[1:]:
        package = importlib.import_module(name)
        loaded.append(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            importlib.import_module(info.name)
            loaded.append(info.name)
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchvision", "triton"))
    print(json.dumps({"loaded": loaded, "heavy": heavy}))
    """
)


def heavy_modules_after_importing(*packages: str, extra_path: Path | None = None) -> tuple[list[str], list[str]]:
    paths = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *packages],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return report["loaded"], report["heavy"]


def test_protocol_and_scheduler_never_import_torch() -> None:
    loaded, heavy = heavy_modules_after_importing(*TORCH_FREE)
    assert "protocol.codec" in loaded and "protocol.transport" in loaded
    assert heavy == [], f"importing {TORCH_FREE} loaded {heavy[:5]}"


_IMPORT_MODULES = textwrap.dedent(
    """
    import importlib, json, sys
    for name in sys.argv[1:]:
        importlib.import_module(name)
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "torch")))
    """
)


def test_the_frontend_process_never_imports_torch() -> None:
    # The frontend (scheduler + HTTP) shares a core with rank 0's model step; torch there would
    # cost start-up time and memory, and tempt model work into the wrong process.
    frontend = ("tp_runtime.frontend", "tp_runtime.engine", "tp_runtime.http", "tp_runtime.tokenizer", "tp_runtime.cli")
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_MODULES, *frontend], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_torch_check_can_fail(tmp_path: Path) -> None:
    # A package whose submodule reaches torch through another module; a stub stands in for torch
    # so that the probe stays fast. The check above proves nothing unless this one sees it.
    (tmp_path / "probe_pkg").mkdir()
    (tmp_path / "probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "probe_pkg" / "deep.py").write_text("import probe_helper\n")
    (tmp_path / "probe_helper.py").write_text("import torch\n")
    (tmp_path / "torch.py").write_text("")
    loaded, heavy = heavy_modules_after_importing("probe_pkg", extra_path=tmp_path)
    assert "probe_pkg.deep" in loaded and heavy == ["torch"]


PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "joblib"}
# Calls that pickle under the hood.
PICKLING_CALLS = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "read_pickle",
    "to_pickle",
}


def pickle_uses(source: str, filename: str) -> list[str]:
    """Every place in `source` that imports a pickle module or calls something that pickles."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            found.append(f"{where} from {node.module} import")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            keywords = {k.arg: k.value for k in node.keywords}
            if name in PICKLING_CALLS:
                found.append(f"{where} {name}()")
            allow = keywords.get("allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value is True:
                found.append(f"{where} allow_pickle=True")
            if name == "save" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "torch":
                found.append(f"{where} torch.save()")
            if name == "load" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "torch":
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where} torch.load() without weights_only=True")
    return found


def test_no_runtime_package_uses_pickle() -> None:
    found = []
    files = [p for pkg in RUNTIME_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert any(p.name == "codec.py" for p in files)
    for path in files:
        found += pickle_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from pickle import dumps",
        "from _pickle import loads",
        "dist.broadcast_object_list(objs, src=0)",
        "torch.distributed.all_gather_object(out, obj)",
        "np.load(path, allow_pickle=True)",
        "torch.load(path)",
        "torch.load(path, weights_only=False)",
        "torch.save(obj, path)",
    ],
)
def test_the_pickle_scan_finds_each_pattern(source: str) -> None:
    assert pickle_uses(source, "sample.py")


def test_the_pickle_scan_passes_clean_code() -> None:
    clean = "import msgpack\nimport numpy as np\nnp.load(p)\ntorch.load(p, weights_only=True)\nmsgpack.packb(x)\n"
    assert pickle_uses(clean, "sample.py") == []


def exceptions_outside_the_base(sources: dict[str, str]) -> list[str]:
    """The exception classes defined in `sources` (path -> code) that do not derive from
    TPRuntimeError, judged by base names (a class's bases resolved through the classes the sources
    define; a builtin exception ends the chain)."""
    bases: dict[str, list[str]] = {}
    where: dict[str, str] = {}
    for path, code in sources.items():
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ClassDef):
                names = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, ast.Name | ast.Attribute)]
                bases[node.name] = names
                where[node.name] = f"{path}:{node.lineno}"

    def reaches(name: str, goal: object, seen: frozenset[str] = frozenset()) -> bool:
        if goal(name):
            return True
        return name in bases and name not in seen and any(reaches(b, goal, seen | {name}) for b in bases[name])

    def builtin_exception(name: str) -> bool:
        value = getattr(builtins, name, None)
        return isinstance(value, type) and issubclass(value, BaseException)

    return sorted(
        f"{where[name]} {name}"
        for name in bases
        if name != "TPRuntimeError"
        and reaches(name, builtin_exception)
        and not reaches(name, lambda n: n == "TPRuntimeError")
    )


def test_every_runtime_exception_derives_from_the_base() -> None:
    files = [p for pkg in RUNTIME_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in files}
    assert "TPRuntimeError" in sources["protocol/errors.py"]
    assert exceptions_outside_the_base(sources) == []


def test_the_exception_check_can_fail() -> None:
    code = (
        "class TPRuntimeError(Exception): ...\n"
        "class Good(TPRuntimeError, ValueError): ...\n"
        "class Later(Good): ...\n"
        "class Bad(ValueError): ...\n"
        "class Worse(Bad): ...\n"
        "class NotAnError: ...\n"
    )
    assert exceptions_outside_the_base({"m.py": code}) == ["m.py:4 Bad", "m.py:5 Worse"]
