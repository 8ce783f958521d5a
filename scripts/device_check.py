"""Every CUDA path of the runtime, checked in one call of under five minutes on one GPU.

Run by scripts/device_check.sh once it has installed the carried wheels (or directly: python
scripts/device_check.py [--only PART ...] [--out DIR]). Each part is a separate process with a hard
time budget; the budgets add up to at most TOTAL_BUDGET_S, and a part that runs past its budget (or
past the whole call's deadline) is killed and fails. Parts print JSON lines, passed through as they
come; a line with "ok": false or an "error" fails its part as surely as a non-zero exit. The last
line is a summary. Under --out (default $OUT, which the device tool brings back) go check.jsonl
(every JSON line), summary.json and one <part>.log per part (all its output): 7 files, within what
the tool returns. Exit 0 only if every part passed, 2 if there is no GPU (set-up says so).

This file imports only the standard library: set-up checks what the parts need before they run.
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
TOTAL_BUDGET_S = 285  # under 5 minutes with room for the install, the interpreter and the summary
EXIT_NO_DEVICE = 2
# The parts run with this interpreter as it was started: `python -S` (the CI dry run's stand-in for
# the image, scripts/device_dry_run.py) must not bring back the site packages for the parts.
PYTHON = (sys.executable, *(("-S",) if sys.flags.no_site else ()))


@dataclass(frozen=True)
class Part:
    name: str
    argv: tuple[str, ...]
    budget_s: float
    what: str


def plan(python: tuple[str, ...] = PYTHON) -> tuple[Part, ...]:
    return (
        Part("setup", (*python, "scripts/device_setup.py"), 15,
             "torch's version and floor, the GPU, every carried pin and image package, every module the parts import"),
        Part("clears", (*python, "scripts/device_check_clear.py"), 30,
             "clear_pages exact in every KV dtype; clears ordered on the model stream before the real forward and before a "
             "CUDA graph replay; pinned offload and restore; memset bandwidth"),
        Part("decode", (*python, "scripts/device_decode.py"), 55,
             "Llama-3-8B-shaped bf16 decode at batch 1, 8, 64, eager and CUDA graphs: ms per step, greedy agreement, "
             "HBM roofline at batch 1, clears' cost as a fraction of a step"),
        Part("poison", (*python, "scripts/device_runtime.py"), 75,
             "NCCL; poison both ways with and without CUDA graphs through the real executor loop: TP=1 (the real server) "
             "and TP=2 (two processes on the one GPU over gloo); fp8 KV end to end against bf16; pressure with pinned offload"),
        Part("serving", (*python, "scripts/device_serving.py"), 110,
             "the control plane around a real Llama-3-8B-shaped forward: the gap between two forwards, and the served "
             "time per output token against the step"),
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


def run_part(part: Part, deadline: float, env: dict[str, str], out=sys.stdout, log=None) -> Outcome:  # noqa: ANN001
    """Runs one part until it exits or until min(its budget, the deadline); echoes its JSON lines,
    and writes all its output to `log`."""
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
        if log is not None:
            log.write(line)
        if line.startswith("{"):
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


class Tee:
    """Writes to the console and to check.jsonl under the output folder."""

    def __init__(self, *streams) -> None:  # noqa: ANN002
        self.streams = streams

    def write(self, text: str) -> None:
        for stream in self.streams:
            stream.write(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def run(parts: Sequence[Part], total_s: float, env: dict[str, str], out=sys.stdout, out_dir: Path | None = None) -> int:  # noqa: ANN001
    deadline = time.monotonic() + total_s
    outcomes: list[Outcome] = []
    jsonl = (out_dir / "check.jsonl").open("w") if out_dir is not None else None
    out = Tee(out, jsonl) if jsonl is not None else out
    try:
        for part in parts:
            out.write(json.dumps({"part": part.name, "starts": part.what, "budget_s": part.budget_s}) + "\n")
            if out_dir is not None:
                with (out_dir / f"{part.name}.log").open("w") as log:
                    outcome = run_part(part, deadline, env, out, log)
            else:
                outcome = run_part(part, deadline, env, out)
            outcomes.append(outcome)
            out.write(json.dumps({"part": part.name, "ok": outcome.ok, "seconds": round(outcome.seconds, 1),
                                  "failures": outcome.failures}) + "\n")
            if part.name == "setup" and not outcome.ok:
                break  # nothing else can run without it
        skipped = [p.name for p in parts[len(outcomes):]]
        ok = all(o.ok for o in outcomes) and not skipped
        summary = {
            "summary": {o.part: "ok" if o.ok else "FAILED" for o in outcomes}, "skipped": skipped,
            "seconds": round(sum(o.seconds for o in outcomes), 1), "ok": ok,
            "failures": {o.part: o.failures for o in outcomes if o.failures},
        }
        out.write(json.dumps(summary) + "\n")
        out.flush()
        if out_dir is not None:
            (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        if jsonl is not None:
            jsonl.close()
    if any(o.returncode == EXIT_NO_DEVICE for o in outcomes):
        return EXIT_NO_DEVICE
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parts = plan()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=[p.name for p in parts], help="run these parts (setup always runs)")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/tp-runtime-device-check"),
        help="where check.jsonl, summary.json and the parts' logs go (default: $OUT, which the device tool brings back)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for part in parts:
            print(json.dumps({"part": part.name, "budget_s": part.budget_s, "argv": list(part.argv), "what": part.what}))
        print(json.dumps({"total_budget_s": sum(p.budget_s for p in parts), "limit_s": TOTAL_BUDGET_S}))
        return 0
    if args.only:
        parts = tuple(p for p in parts if p.name == "setup" or p.name in args.only)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(REPO)))), PYTHONUNBUFFERED="1")
    args.out.mkdir(parents=True, exist_ok=True)
    return run(parts, TOTAL_BUDGET_S, env, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
