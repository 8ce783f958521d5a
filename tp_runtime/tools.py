"""`tp-runtime soak` and `tp-runtime bench` run the scripts of the same names from the checkout."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_script(name: str, argv: list[str]) -> int:
    path = SCRIPTS / f"{name}.py"
    if not path.exists():
        sys.stderr.write(f"tp-runtime: error: {path} is missing: `tp-runtime {name}` runs from a checkout (pip install -e .)\n")
        return 2
    sys.argv = [str(path), *argv]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
