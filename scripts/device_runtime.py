"""Poison both ways, with and without CUDA graphs, through the real executor loop on one GPU.

A tiny random Llama (scripts/device_models.py TINY, SmolLM2's vocabulary and tokenizer) is written
on the device; then, all started together:
- TP=1, the real server (torchrun, the frontend, one executor), for CUDA graphs on and off
  (--enforce-eager) in bf16 KV, and with graphs in fp8-e4m3 KV: three servers each, `clean`,
  `poisoned` (the cache and every freed page 0xFF: NaN in bf16 and fp8) and `skipped` (poisoned,
  clears skipped);
- TP=2, two executor processes on the one GPU over gloo (NCCL refuses two ranks on one device)
  driven by the engine in this process (scripts/device_loop.py), graphs on and off, the same three.
Each group answers PROMPTS twice, one request at a time, so that its members plan the same steps and
the second round reads pages the first freed (and poisoned): `poisoned` must repeat `clean` token for
token, and every `skipped` answer must fail as non-finite. Then 8 concurrent long streams on the
poisoned bf16 and fp8 servers overflow the pool: pages are offloaded to the pinned host buffer and
restored, and every stream must finish. fp8 KV end to end: every fp8 answer finite, and fp8's clean
answers repeat on average at least MIN_FP8_AGREEMENT of each bf16 answer's tokens before the first
difference (random weights: a floor to revise from measured runs, docs/device.md). Also a one-rank
NCCL group: all_reduce, and the gloo bootstrap broadcast the launcher uses.

JSON lines, one per group and check; exit 1 if any check failed, 2 without CUDA. `--device cpu
--groups loop-eager` runs the loop's group on the CPU, as the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a file: the checkout's root makes `scripts` importable
    sys.path.insert(0, REPO_ROOT)

from scripts.device_env import TOKENIZER  # noqa: E402
from scripts.device_report import Checks, report  # noqa: E402
from scripts.device_loop import Loop, LoopSpec  # noqa: E402
from scripts.device_models import TINY, write_checkpoint  # noqa: E402
from scripts.harness.metrics import parse_metrics  # noqa: E402
from scripts.harness.runtime import RuntimeServer, ServerOptions  # noqa: E402
from tp_runtime.tokenizer import Tokenizer  # noqa: E402

PROMPTS = ("The quick brown fox", "The quick brown fox jumps over", "Hello", "1, 2, 3, 4, 5, 6, 7, 8,", "Hello")
MAX_TOKENS = 24
MIN_FP8_AGREEMENT = 0.5
POOL = {"num_kv_pages": 40, "max_num_seqs": 8, "max_model_len": 256, "swap_space": "32MiB"}
START_TIMEOUT_S = 60.0
CHECKS = Checks()
FAILURES, check = CHECKS.failures, CHECKS.check


@dataclass(frozen=True)
class Answer:
    prompt: str
    status: int
    text: str | None  # None when the request failed
    error: str | None
    token_ids: tuple[int, ...] = ()


def answers_match(clean: list[Answer], dirty: list[Answer]) -> list[str]:
    """Why a poisoned server's answers are not the clean server's, token for token (none: they are)."""
    problems = []
    for a, b in zip(clean, dirty, strict=True):
        if a.text is None:
            problems.append(f"the clean server failed {a.prompt!r}: {a.error}")
        elif b.text != a.text or b.token_ids != a.token_ids:
            problems.append(f"{a.prompt!r}: poisoned {b.text!r} (error {b.error}) != clean {a.text!r}")
    return problems


def poison_detected(answers: list[Answer]) -> list[str]:
    """Why the answers of a server with skipped clears do not all fail as non-finite."""
    return [
        f"{a.prompt!r} was answered ({a.status}: {a.text!r}) from a poisoned cache"
        for a in answers
        if a.text is not None or "finite" not in (a.error or "").lower()
    ]


def agreement(reference: list[Answer], other: list[Answer]) -> float:
    """The mean share of each reference answer's tokens that `other` repeats before it first differs."""
    shares = []
    for x, y in zip(reference, other, strict=True):
        common = 0
        for p, q in zip(x.token_ids, y.token_ids):  # noqa: B905 - the shorter answer ends the prefix
            if p != q:
                break
            common += 1
        shares.append(common / max(1, len(x.token_ids)))
    return sum(shares) / max(1, len(shares))


def complete(url: str, prompt: str, *, max_tokens: int = MAX_TOKENS) -> Answer:
    body = {"prompt": prompt, "ignore_eos": True, "return_token_ids": True, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    data = response.json()
    if response.status_code != 200:
        return Answer(prompt, response.status_code, None, str(data.get("error", {}).get("message", data)))
    choice = data["choices"][0]
    return Answer(prompt, 200, choice["text"], None, tuple(choice.get("token_ids") or ()))


async def pressure(url: str, streams: int = 8, max_tokens: int = 200) -> list[tuple[int, str | None]]:
    """(completion tokens, error) of `streams` concurrent long requests that overflow the pool."""

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        response = await client.post(f"{url}/v1/completions", json=body, timeout=300)
        if response.status_code != 200:
            return 0, response.text[:300]
        return int(response.json()["usage"]["completion_tokens"]), None

    async with httpx.AsyncClient() as client:
        return await asyncio.gather(*(one(client, i) for i in range(streams)))


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def check_nccl() -> None:
    import torch
    import torch.distributed as dist

    from tp_runtime.bootstrap import broadcast_bytes

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30))
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device, timeout=timedelta(seconds=60))
    try:
        x = torch.full((4096,), 1.5, device=device, dtype=torch.bfloat16)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        reduced = check(bool((x == 1.5).all()), "nccl: all_reduce over one rank keeps the values")
        group = dist.new_group(backend="gloo")
        payload = b'{"run_id": "r", "address": "ipc:///x"}'
        broadcast = check(broadcast_bytes(payload, group) == payload, "nccl: the gloo bootstrap broadcast")
        report("nccl", backend=dist.get_backend(), nccl=".".join(map(str, torch.cuda.nccl.version())), ok=reduced and broadcast)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Group:
    """Three runtimes of one configuration: clean, poisoned, poisoned with clears skipped."""

    name: str
    tp: int
    graphs: bool
    kv_dtype: str = "bf16"
    pressure: bool = False  # also the long concurrent streams on its poisoned member

    def variants(self) -> dict[str, tuple[bool, bool]]:
        return {"clean": (False, False), "poisoned": (True, False), "skipped": (True, True)}


GROUPS = (
    Group("server-graphs", 1, True, pressure=True),
    Group("server-eager", 1, False),
    Group("server-fp8", 1, True, "fp8-e4m3", pressure=True),
    Group("loop-eager", 2, False),
)  # No TP=2 with graphs: on one GPU the two ranks talk over gloo, whose collectives cannot be captured.


class Member:
    """One runtime of a group, server or loop, with one way to answer a prompt."""

    def __init__(self, group: Group, variant: str, model: Path, device: str, logs: Path) -> None:
        poison, skip = group.variants()[variant]
        self.label = f"{group.name}/{variant}"
        self.server: RuntimeServer | None = None
        self.loop: Loop | None = None
        if group.tp == 1:
            extra = () if group.graphs else ("--enforce-eager",)
            options = ServerOptions(
                model=str(model), dtype="bf16", kv_cache_dtype=group.kv_dtype, poison_kv_cache=poison, poison_freed_pages=poison,
                skip_clears=skip, extra_args=("--device", device.split(":")[0], *extra), **POOL,
            )  # fmt: skip
            self.server = RuntimeServer(options, logs / f"{group.name}-{variant}.log")
        else:
            spec = LoopSpec(
                model=str(model), world_size=group.tp, device=device, kv_cache_dtype=group.kv_dtype, cuda_graphs=group.graphs,
                poison=poison, skip_clears=skip, num_kv_pages=POOL["num_kv_pages"], max_num_seqs=POOL["max_num_seqs"],
                max_model_len=POOL["max_model_len"],
            )  # fmt: skip
            self.loop = Loop(spec, logs / f"{group.name}-{variant}", run_id=f"{group.name}-{variant}")

    def start(self, timeout_s: float) -> None:
        if self.server is not None:
            self.server.start(timeout_s)
        else:
            self.loop.__enter__()
            self.loop.wait_ready(timeout_s)

    def answer(self, prompt: str, tokenizer: Tokenizer) -> Answer:
        if self.server is not None:
            return complete(self.server.url, prompt)
        generated = self.loop.generate(tokenizer.encode(prompt), MAX_TOKENS)
        if generated.error is not None:
            return Answer(prompt, 500, None, generated.error, generated.tokens)
        return Answer(prompt, 200, tokenizer.decode(generated.tokens), None, generated.tokens)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        elif self.loop is not None:
            self.loop.close()


def check_group(group: Group, members: dict[str, Member], tokenizer: Tokenizer) -> list[Answer]:
    """The group's rounds, its poison checks and (if asked) pressure; returns the clean answers."""
    answers = {variant: [member.answer(prompt, tokenizer) for _ in range(2) for prompt in PROMPTS] for variant, member in members.items()}
    mismatches = answers_match(answers["clean"], answers["poisoned"])
    undetected = poison_detected(answers["skipped"])
    for problem in mismatches + undetected:
        check(False, f"{group.name}: {problem}")
    values: dict[str, object] = {}
    unfinished: list[str] = []
    if group.pressure:
        url = members["poisoned"].server.url
        loaded = asyncio.run(pressure(url))
        after = metrics(url)
        unfinished = [f"stream {i}: {tokens} tokens, {error}" for i, (tokens, error) in enumerate(loaded) if error or tokens != 200]
        for problem in unfinished:
            check(False, f"{group.name} under pressure: {problem}")
        check(after.get("tp_runtime_kv_offloads_total", 0) > 0, f"{group.name}: no page was offloaded under pressure")
        check(after.get("tp_runtime_kv_restores_total", 0) > 0, f"{group.name}: no offloaded page was restored")
        values = {
            "pressure_streams_finished": len(loaded) - len(unfinished), "offloads": after.get("tp_runtime_kv_offloads_total"),
            "restores": after.get("tp_runtime_kv_restores_total"), "preemptions": after.get("tp_runtime_preemptions_total"),
        }  # fmt: skip
    report(
        "poison", group=group.name, tp=group.tp, cuda_graphs=group.graphs, kv_dtype=group.kv_dtype, answers=len(answers["clean"]),
        identical_with_clears=not mismatches, detected_without_clears=not undetected, **values,
        problems=(mismatches + undetected + unfinished)[:6], ok=not (mismatches or undetected or unfinished),
    )  # fmt: skip
    return answers["clean"]


def run_groups(groups: tuple[Group, ...], model: Path, device: str, logs: Path, tokenizer: Tokenizer) -> dict[str, list[Answer]]:
    members = {g.name: {v: Member(g, v, model, device, logs) for v in g.variants()} for g in groups}
    everyone = [m for by_variant in members.values() for m in by_variant.values()]
    started = time.perf_counter()
    clean: dict[str, list[Answer]] = {}
    try:
        with ThreadPoolExecutor(len(everyone)) as pool:
            starts = {m.label: (m, pool.submit(m.start, START_TIMEOUT_S)) for m in everyone}
        failed = {label: future.exception() for label, (_, future) in starts.items() if future.exception() is not None}
        report("started", runtimes=len(everyone), seconds=round(time.perf_counter() - started, 1), failed=sorted(failed))
        for label, exc in failed.items():
            # The group is not checked; its logs now, before a part's budget can cut the output short.
            check(False, f"{label} did not start: {type(exc).__name__}: {exc}")
            print_logs(logs, label.replace("/", "-"))
        ready = tuple(g for g in groups if not any(label.startswith(f"{g.name}/") for label in failed))
        with ThreadPoolExecutor(max(1, len(ready))) as pool:
            futures = {g.name: pool.submit(check_group, g, members[g.name], tokenizer) for g in ready}
            for name, future in futures.items():
                try:
                    clean[name] = future.result()
                except Exception as exc:  # noqa: BLE001 - report it and go on with the other groups
                    report("poison", group=name, error=f"{type(exc).__name__}: {exc}", ok=check(False, f"{name} raised {exc!r}"))
    finally:
        with ThreadPoolExecutor(len(everyone)) as pool:
            list(pool.map(Member.stop, everyone))
    return clean


def print_logs(logs: Path, prefix: str) -> None:
    """The tails of the logs under `logs` (servers' files and loops' rank folders) whose path
    starts with prefix."""
    for log in sorted(logs.rglob("*.log")):
        name = str(log.relative_to(logs))
        if name.startswith(prefix):
            print(f"--- {name}\n{log.read_text(errors='replace')[-2000:]}", flush=True)


def check_fp8(clean: dict[str, list[Answer]]) -> None:
    if "server-fp8" not in clean or "server-graphs" not in clean:
        return
    share = agreement(clean["server-graphs"], clean["server-fp8"])
    failed = [a.prompt for a in clean["server-fp8"] if a.text is None]
    ok = check(not failed, f"fp8 KV failed {failed}")
    ok = check(share >= MIN_FP8_AGREEMENT, f"fp8 KV repeats {share:.0%} of bf16's tokens, under {MIN_FP8_AGREEMENT:.0%}") and ok
    report("fp8", token_agreement_with_bf16=round(share, 3), floor=MIN_FP8_AGREEMENT, failed=failed, ok=ok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--groups", nargs="+", choices=[g.name for g in GROUPS], default=[g.name for g in GROUPS])
    parser.add_argument("--work", type=Path, default=Path("/tmp/tp-runtime-device-check/poison"))
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps({"error": "no CUDA device visible to torch"}))
            return 2
        try:
            check_nccl()
        except Exception as exc:  # noqa: BLE001 - the poison groups still run
            report("nccl", error=f"{type(exc).__name__}: {exc}", ok=check(False, f"nccl raised {exc!r}"))
    device = "cuda:0" if args.device == "cuda" else "cpu"
    model = write_checkpoint(args.work / "tiny", TINY, args.tokenizer, device=torch.device(device))
    tokenizer = Tokenizer.from_model_path(model)
    groups = tuple(g for g in GROUPS if g.name in args.groups)
    clean = run_groups(groups, model, device, args.work / "logs", tokenizer)
    check_fp8(clean)
    report("poison_summary", seconds=round(time.perf_counter() - started, 1), failures=FAILURES, ok=not FAILURES)
    if FAILURES:
        print_logs(args.work / "logs", "")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
