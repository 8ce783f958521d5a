"""Start-up benchmark: where the seconds of a one-shot `tp-runtime generate` go, up to its first token.

    python scripts/bench_startup.py [--json] [--tp 1,2] [--runs 5]
    python scripts/bench_startup.py --baseline /tmp/base --runs 5      # side by side, in turn

Each run is a real `python -m tp_runtime generate PROMPT --stream` in a session of its own, with the
caches warm (one untimed run of each tree and TP size first). The first byte on its stdout is the
first token. Every process of the launch imports scripts/startup_trace/sitecustomize.py, which
stamps the first entry to and exit from the functions in TRACE_POINTS (the same names in any
checkout, the one before a change included: a point a tree lacks is simply missing) with the
host's monotonic clock and the process's CPU time. PHASES turns the stamps into the breakdown:
imports, the launcher's checks, the spawn of the ranks (torchrun's agent and its rendezvous, where
a tree goes through it), the process group, the frontend's start, the load, the handshake, the
tokenizer, the first step, the first token. Phases run in parallel across processes, so they do
not add up to the total; `critical_path` names the ones the first token waited on.

With `--baseline DIR` the two trees run in turn (baseline, ours, baseline, ...), so that a busy
machine slows both alike; the report gives per-phase medians of each and their ratios, and the
load average before and after. The machine these sessions share is noisy: quote medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.harness.processes import ProcessTracker, child_env  # noqa: E402

TRACER = REPO / "scripts" / "startup_trace"
PROMPT = "What is 2+2?"

# module:qualname of every function whose first entry and exit are stamped.
TRACE_POINTS = (
    "tp_runtime.cli:main",
    "tp_runtime.cli.checks:validate",
    "tp_runtime.launcher:launch",
    "tp_runtime.worker_process:run_worker",
    "tp_runtime.resolve:resolve",
    "tp_runtime.worker_process:_init_process_group",
    "tp_runtime.bootstrap:start_frontend",
    "tp_runtime.bootstrap:read_bootstrap",
    "executor.worker:run_executor",
    "executor.worker:load_executor",
    "executor.model.load:load_model",
    "executor.worker:Worker.run",
    "executor.steps:StepRunner.run",
    "tp_runtime.tokenizer:load_tokenizer",
    "tp_runtime.engine:Engine.start",
    "tp_runtime.engine:Engine.wait_ready",
    "tp_runtime.engine:Engine.submit",
)

# A mark: (process, event). Processes: launcher, rank0, frontend, or `ranks` (the first rank to
# reach the event for a start, the last for an end). `spawn` is the bench's start of the command,
# `first_token` its first byte on stdout.
Mark = tuple[str, str]


@dataclass(frozen=True)
class Phase:
    name: str
    start: Mark
    end: Mark
    what: str


PHASES = (
    Phase("launcher_imports", ("bench", "spawn"), ("launcher", "tp_runtime.cli:main:enter"),
          "the interpreter and the CLI's imports, to main()"),
    Phase("launcher_torch", ("launcher", "tp_runtime.cli:main:enter"), ("launcher", "tp_runtime.cli.checks:validate:enter"),
          "main() to the checks: the parser and the executor's imports (torch)"),
    Phase("launcher_checks", ("launcher", "tp_runtime.cli.checks:validate:enter"),
          ("launcher", "tp_runtime.cli.checks:validate:exit"), "every check before a rank starts (resolve included)"),
    Phase("spawn_ranks", ("launcher", "tp_runtime.launcher:launch:enter"), ("ranks", "process:start"),
          "launch() to the first rank's interpreter: torchrun's agent and rendezvous where it is used"),
    Phase("rank_imports", ("rank0", "process:start"), ("rank0", "tp_runtime.worker_process:run_worker:enter"),
          "rank 0's interpreter and imports (torch)"),
    Phase("rank_resolve", ("rank0", "tp_runtime.resolve:resolve:enter"), ("rank0", "tp_runtime.resolve:resolve:exit"),
          "rank 0 resolves the configuration again (probe cache, model metadata)"),
    Phase("process_group", ("ranks", "tp_runtime.worker_process:_init_process_group:enter"),
          ("ranks", "tp_runtime.worker_process:_init_process_group:exit"), "torch.distributed's group (TP > 1)"),
    Phase("frontend_start", ("rank0", "tp_runtime.bootstrap:start_frontend:enter"),
          ("rank0", "tp_runtime.bootstrap:start_frontend:exit"), "rank 0 starts its frontend and waits for its endpoint"),
    Phase("bootstrap_wait", ("rank0", "tp_runtime.bootstrap:read_bootstrap:enter"),
          ("rank0", "tp_runtime.bootstrap:read_bootstrap:exit"), "rank 0 waits for the frontend's endpoint"),
    Phase("frontend_imports", ("frontend", "process:start"), ("frontend", "tp_runtime.tokenizer:load_tokenizer:enter"),
          "the frontend's interpreter, imports and bind"),
    Phase("tokenizer", ("frontend", "tp_runtime.tokenizer:load_tokenizer:enter"),
          ("frontend", "tp_runtime.tokenizer:load_tokenizer:exit"), "the frontend builds the tokenizer"),
    Phase("load", ("ranks", "executor.model.load:load_model:enter"), ("ranks", "executor.model.load:load_model:exit"),
          "the weights, from the first rank's start to the last rank's end"),
    Phase("cache_and_connect", ("ranks", "executor.model.load:load_model:exit"), ("ranks", "executor.worker:Worker.run:enter"),
          "KV cache, runner, endpoint"),
    Phase("handshake", ("ranks", "executor.worker:Worker.run:enter"), ("frontend", "tp_runtime.engine:Engine.wait_ready:exit"),
          "the last rank's connect to the engine's WELCOME"),
    Phase("first_step", ("rank0", "executor.steps:StepRunner.run:enter"), ("rank0", "executor.steps:StepRunner.run:exit"),
          "rank 0's first step (the prefill)"),
    Phase("submit_to_first_token", ("frontend", "tp_runtime.engine:Engine.submit:enter"), ("bench", "first_token"),
          "the request, its prefill, the first text on stdout"),
    Phase("first_token", ("bench", "spawn"), ("bench", "first_token"), "the command's start to its first token"),
    Phase("total", ("bench", "spawn"), ("bench", "exit"), "the command's start to its exit"),
)
REQUIRED = ("launcher_imports", "launcher_torch", "launcher_checks", "spawn_ranks", "rank_imports", "rank_resolve", "frontend_imports",
            "tokenizer", "load", "cache_and_connect", "handshake", "first_step", "submit_to_first_token",
            "first_token", "total")


@dataclass
class Run:
    """One command's stamps: process -> event -> (time, cpu), and the bench's own."""

    stamps: dict[str, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    returncode: int = 0
    stdout: str = ""
    stderr_tail: str = ""

    def times(self, process: str, event: str) -> list[float]:
        if process == "ranks":
            return [t for name, events in self.stamps.items() if name.startswith("rank") for t, _ in events.get(event, [])]
        return [t for t, _ in self.stamps.get(process, {}).get(event, [])]

    def timeline(self) -> dict[str, dict[str, float]]:
        """Every stamp of this run, in seconds from the command's start, by process."""
        origin = self.stamps["bench"]["spawn"][0][0]
        return {
            process: {event: round(stamps[0][0] - origin, 3) for event, stamps in sorted(events.items(), key=lambda e: e[1][0][0])}
            for process, events in self.stamps.items()
        }

    def cpu_s(self) -> dict[str, float]:
        """Each process's CPU seconds at its last stamp."""
        return {name: max(c for stamps in events.values() for _, c in stamps) for name, events in self.stamps.items() if name != "bench"}


def phase_seconds(run: Run, phase: Phase) -> float | None:
    starts, ends = run.times(*phase.start), run.times(*phase.end)
    if not starts or not ends:
        return None
    return max(ends) - min(starts)


def generate_command(args: argparse.Namespace, tp: int) -> list[str]:
    command = [sys.executable, "-m", "tp_runtime", "generate", args.prompt, "--stream",
               "--max-tokens", str(args.max_tokens), "--tensor-parallel-size", str(tp)]
    if args.model:
        command += ["--model", args.model]
    return command + args.extra


def run_once(tree: Path, command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Run:
    """One traced command from `tree`; every process it left is killed by pid."""
    tracker = ProcessTracker()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as scratch:
        trace = Path(scratch) / "trace.jsonl"
        stderr_path = Path(scratch) / "stderr"
        extra = {
            **(env or {}),
            "PYTHONPATH": os.pathsep.join((str(TRACER), str(tree))),
            "TP_RUNTIME_STARTUP_TRACE": str(trace),
            "TP_RUNTIME_STARTUP_TRACE_POINTS": ",".join(TRACE_POINTS),
        }
        run = Run()
        with open(stderr_path, "wb") as stderr:
            spawned = time.monotonic()
            child = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, cwd=tree,
                env=child_env(tracker.tag, extra, tree), start_new_session=True,
            )
        bench = {"spawn": [(spawned, 0.0)]}
        out = bytearray()
        try:
            deadline = spawned + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{' '.join(command)} did not finish within {timeout_s:g} s")
                ready, _, _ = select.select([child.stdout], [], [], min(left, 1.0))
                if not ready:
                    continue
                chunk = os.read(child.stdout.fileno(), 65536)
                if not chunk:
                    break
                if not out:
                    bench["first_token"] = [(time.monotonic(), 0.0)]
                out += chunk
            run.returncode = child.wait(timeout=max(1.0, deadline - time.monotonic()))
            bench["exit"] = [(time.monotonic(), 0.0)]
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            tracker.kill_survivors()
            child.stdout.close()
        run.stdout = out.decode(errors="replace")
        run.stderr_tail = stderr_path.read_text(errors="replace")[-3000:]
        run.stamps["bench"] = bench
        if trace.exists():
            # A forked rank's first stamps are taken before it knows its rank: a process's role is
            # the one its last stamp gives.
            entries = [json.loads(line) for line in trace.read_text().splitlines()]
            role = {entry["pid"]: entry["role"] for entry in entries}
            for entry in entries:
                process = run.stamps.setdefault(role[entry["pid"]], {})
                process.setdefault(entry["event"], []).append((entry["t"], entry["cpu"]))
    return run


def summarize(runs: list[Run]) -> dict:
    """Per-phase medians (seconds) over the runs, and each process's median CPU seconds."""
    phases = {}
    for phase in PHASES:
        values = [v for v in (phase_seconds(run, phase) for run in runs) if v is not None]
        phases[phase.name] = round(statistics.median(values), 3) if values else None
    cpus: dict[str, list[float]] = {}
    for run in runs:
        for process, seconds in run.cpu_s().items():
            cpus.setdefault(process, []).append(seconds)
    return {
        "phases_s": phases,
        "timeline_s": runs[-1].timeline(),
        "cpu_s": {name: round(statistics.median(values), 3) for name, values in sorted(cpus.items())},
        "first_token_s": [round(v, 3) for v in (phase_seconds(r, PHASES[-2]) for r in runs) if v is not None],
        "critical_path": critical_path(phases),
    }


def critical_path(phases: dict[str, float | None]) -> list[str]:
    """The phases the first token waits on, in order, in a tree that has them (the others run
    beside them: the frontend's start and tokenizer while the ranks load)."""
    order = ("launcher_imports", "launcher_torch", "launcher_checks", "spawn_ranks", "rank_imports", "rank_resolve", "process_group",
             "frontend_start", "bootstrap_wait", "load", "cache_and_connect", "handshake", "submit_to_first_token")
    return [name for name in order if phases.get(name) is not None]


def bench(args: argparse.Namespace) -> dict:
    trees = {"ours": REPO}
    if args.baseline is not None:
        trees = {"baseline": args.baseline.resolve(), "ours": REPO}
    report: dict = {
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_before": [round(v, 2) for v in os.getloadavg()],
        "trees": {name: str(path) for name, path in trees.items()},
        "tp": {},
    }
    for tp in args.tp:
        command = generate_command(args, tp)
        runs: dict[str, list[Run]] = {name: [] for name in trees}
        for index in range(args.runs + args.warmup):
            for name, tree in trees.items():
                run = run_once(tree, command, args.timeout)
                if run.returncode != 0:
                    raise SystemExit(f"{name} ({tree}) TP={tp}: exit {run.returncode}:\n{run.stderr_tail}")
                if index >= args.warmup:
                    runs[name].append(run)
                print(f"TP={tp} {name} run {index + 1}: first token {phase_seconds(run, PHASES[-2]):.2f} s",
                      file=sys.stderr, flush=True)
        entry = {name: summarize(tree_runs) for name, tree_runs in runs.items()}
        entry["text"] = runs["ours"][-1].stdout.strip()
        if "baseline" in entry:
            base, ours = entry["baseline"]["phases_s"], entry["ours"]["phases_s"]
            entry["speedup"] = {
                name: round(base[name] / ours[name], 2) for name in base if base[name] and ours.get(name)
            }
        report["tp"][str(tp)] = entry
    report["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    return report


def print_report(report: dict) -> None:
    print(f"{report['cpu']} ({report['cores']} cores), load average {report['load_average_before']} -> "
          f"{report['load_average_after']}; medians of {report['runs']} runs, seconds")
    for tp, entry in report["tp"].items():
        sides = [name for name in ("baseline", "ours") if name in entry]
        print(f"\nTP={tp}" + "".join(f"{side:>12}" for side in sides) + ("     ratio" if len(sides) == 2 else ""))
        for phase in PHASES:
            values = [entry[side]["phases_s"][phase.name] for side in sides]
            cells = "".join(f"{v:12.3f}" if v is not None else f"{'-':>12}" for v in values)
            ratio = entry.get("speedup", {}).get(phase.name)
            print(f"  {phase.name:24}{cells}" + (f"{ratio:9.2f}x" if ratio else ""))
        for side in sides:
            print(f"  cpu seconds ({side}): {entry[side]['cpu_s']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--baseline", type=Path, default=None, metavar="DIR", help="another checkout, run in turn with this one")
    parser.add_argument("--tp", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2], help="TP sizes (default 1,2)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each tree and TP size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (warm caches)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one command may take")
    parser.add_argument("extra", nargs="*", help="more `generate` options, after --")
    args = parser.parse_args(argv)
    if args.baseline is not None and not (args.baseline / "tp_runtime" / "__main__.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a tp-runtime checkout (no tp_runtime/__main__.py)")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = bench(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


if __name__ == "__main__":
    main()
