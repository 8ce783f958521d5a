"""Every CUDA path of the runtime, checked in one call of under 8 minutes on one GPU.

Run by scripts/device_check.sh (or directly: python scripts/device_check.py [--only PART ...]).
Each part is a separate process with a time budget; the budgets add up to TOTAL_BUDGET_S, and a
part that runs past its budget (or past the whole call's deadline) is killed and fails. Parts print
JSON lines, passed through as they come; a line with "ok": false fails its part as surely as a
non-zero exit. The last line is a summary; the exit code is 0 only if every part passed, 2 if
there is no CUDA device after set-up.

This file imports only the standard library: it runs before set-up has installed torch.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOTAL_BUDGET_S = 470  # under 8 minutes with room for the interpreter and the summary
EXIT_NO_DEVICE = 2


@dataclass(frozen=True)
class Part:
    name: str
    argv: tuple[str, ...]
    budget_s: float
    what: str


def plan(python: str = sys.executable) -> tuple[Part, ...]:
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    return (
        Part("setup", (python, "scripts/device_setup.py"), 150,
             "a CUDA build of torch, cuda-python, the runtime's dependencies and the embedded model"),
        Part("clears", (python, "scripts/device_check_clear.py"), 45,
             "clear_pages exact in every KV dtype, ordered before a CUDA graph's replay, pinned offload, memset bandwidth"),
        Part("attention", (*pytest, "tests/model/test_attention.py", "-k", "cuda"), 40,
             "CUDA attention against its reference; a NaN in a masked slot still reaches the output"),
        Part("runtime", (python, "scripts/device_runtime.py"), 140,
             "NCCL; the real server under CUDA graphs: poison both ways in bf16 and fp8 KV, pressure with pinned offload, fp8 against bf16"),
        Part("decode", (python, "scripts/device_decode.py"), 95,
             "TP=1 Llama-3-8B-shaped decode, eager and CUDA graphs: tokens/s and the fraction of HBM bandwidth"),
    )


@dataclass
class Outcome:
    part: str
    ok: bool
    seconds: float
    returncode: int | None  # None: killed at its deadline
    failures: list[str] = field(default_factory=list)


def failed_lines(lines: Sequence[str]) -> list[str]:
    """The JSON lines of a part that report a failure ("ok": false, or an "error")."""
    failures = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (record.get("ok") is False or "error" in record):
            failures.append(line.strip())
    return failures


def run_part(part: Part, deadline: float, env: dict[str, str], out=sys.stdout) -> Outcome:  # noqa: ANN001
    """Runs one part until it exits or until min(its budget, the deadline); echoes its output."""
    started = time.monotonic()
    stop_at = min(started + part.budget_s, deadline)
    process = subprocess.Popen(
        part.argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        start_new_session=True,
    )
    lines: list[str] = []
    selector = selectors.DefaultSelector()
    assert process.stdout is not None
    selector.register(process.stdout, selectors.EVENT_READ)
    killed = False
    while True:
        left = stop_at - time.monotonic()
        if left <= 0:
            killed = True
            os.killpg(process.pid, 9)
            break
        if not selector.select(timeout=min(left, 1.0)):
            continue
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        out.write(line)
        out.flush()
    selector.close()
    code = process.wait()
    seconds = time.monotonic() - started
    failures = failed_lines(lines)
    if killed:
        failures.append(f"killed after {seconds:.0f} s: its budget is {part.budget_s:.0f} s")
        return Outcome(part.name, False, seconds, None, failures)
    if code != 0:
        failures.append(f"exited with code {code}")
    return Outcome(part.name, not failures, seconds, code, failures)


def run(parts: Sequence[Part], total_s: float, env: dict[str, str], out=sys.stdout) -> int:  # noqa: ANN001
    deadline = time.monotonic() + total_s
    outcomes: list[Outcome] = []
    for part in parts:
        out.write(json.dumps({"part": part.name, "starts": part.what, "budget_s": part.budget_s}) + "\n")
        outcome = run_part(part, deadline, env, out)
        outcomes.append(outcome)
        out.write(json.dumps({"part": part.name, "ok": outcome.ok, "seconds": round(outcome.seconds, 1),
                              "failures": outcome.failures}) + "\n")
        if part.name == "setup" and not outcome.ok:
            break  # nothing else can run without it
    skipped = [p.name for p in parts[len(outcomes):]]
    ok = all(o.ok for o in outcomes) and not skipped
    out.write(json.dumps({
        "summary": {o.part: "ok" if o.ok else "FAILED" for o in outcomes}, "skipped": skipped,
        "seconds": round(sum(o.seconds for o in outcomes), 1), "ok": ok,
    }) + "\n")
    out.flush()
    if any(o.returncode == EXIT_NO_DEVICE for o in outcomes):
        return EXIT_NO_DEVICE
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parts = plan()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=[p.name for p in parts], help="run these parts (setup always runs)")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    if args.list:
        for part in parts:
            print(json.dumps({"part": part.name, "budget_s": part.budget_s, "argv": list(part.argv), "what": part.what}))
        print(json.dumps({"total_budget_s": sum(p.budget_s for p in parts), "limit_s": TOTAL_BUDGET_S}))
        return 0
    if args.only:
        parts = tuple(p for p in parts if p.name == "setup" or p.name in args.only)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    return run(parts, TOTAL_BUDGET_S, env)


if __name__ == "__main__":
    sys.exit(main())
