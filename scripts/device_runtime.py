"""The whole runtime on one CUDA GPU: NCCL, and the real server (torchrun, the frontend, an executor
with CUDA graphs, cuda-python clears) with the poison proof in bf16 and fp8 KV.

Sections (one JSON line each, "ok" false on any failed check; exit 1 if any failed, 2 without CUDA):
- nccl: a one-rank NCCL process group (one GPU holds one rank: NCCL refuses two on the same
  device): all_reduce on the device and the gloo bootstrap group's broadcast that the launcher uses.
  TP>1 over NCCL needs two GPUs and is not checked here.
- for each KV dtype, three servers with the same pool (40 pages, a 32 MiB pinned offload buffer)
  and CUDA graphs on: `clean`; `poisoned` (the cache and every freed page filled with 0xFF, NaN in
  bf16 and in fp8-e4m3) whose greedy answers must equal clean's token for token, on requests sent
  one at a time so both servers plan the same steps; and `skipped` (poisoned, clears skipped),
  whose answers must all fail as non-finite. Then 8 concurrent long streams on `poisoned`: the
  pool is preempted by offload to the pinned buffer and restored, and every stream must finish.
- bf16's clean answer to the README's question must be the reference text (transformers, same GGUF).
- fp8 KV end to end: every answer finite, and on average the first MIN_FP8_AGREEMENT of each
  answer's tokens equal to bf16's (a greedy answer that flips one token diverges after it).

`--model`, `--kv-dtypes` and `--device cpu` run it against another model or on the CPU (slowly):
the comparisons are the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import httpx

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:  # run as a file: the checkout's root makes `scripts` importable
    sys.path.insert(0, REPO_ROOT)

from scripts.harness.metrics import parse_metrics  # noqa: E402
from scripts.harness.runtime import RuntimeServer, ServerOptions  # noqa: E402

PROMPTS = ("The quick brown fox", "The quick brown fox jumps over", "Hello", "1, 2, 3, 4, 5, 6, 7, 8,", "Hello")
REFERENCE = ("What is 2+2?", "The answer to this classic math problem is 4.")
MIN_FP8_AGREEMENT = 0.5
POOL = {"num_kv_pages": 40, "max_num_seqs": 8, "max_model_len": 256, "swap_space": "32MiB"}
FAILURES: list[str] = []


@dataclass(frozen=True)
class Answer:
    prompt: str
    status: int
    text: str | None  # None when the request failed
    error: str | None
    token_ids: tuple[int, ...] = ()


def check(condition: bool, what: str) -> bool:
    if not condition:
        FAILURES.append(what)
    return condition


def report(section: str, **values: object) -> None:
    print(json.dumps({"section": section, **values}), flush=True)


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


def complete(url: str, prompt: str, *, chat: bool = False, max_tokens: int = 24) -> Answer:
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt, "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{url}{path}", json={**body, "max_tokens": max_tokens, "temperature": 0}, timeout=120)
    data = response.json()
    if response.status_code != 200:
        return Answer(prompt, response.status_code, None, str(data.get("error", {}).get("message", data)))
    choice = data["choices"][0]
    if chat:
        return Answer(prompt, 200, choice["message"]["content"], None)
    return Answer(prompt, 200, choice["text"], None, tuple(choice.get("token_ids") or ()))


def rounds(url: str) -> list[Answer]:
    """PROMPTS twice, one request at a time: the second round reads pages freed (and, on a poisoned
    server, poisoned) by the first."""
    return [complete(url, prompt) for _round in range(2) for prompt in PROMPTS]


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

    from tp_runtime.launch import _broadcast_bytes

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
        broadcast = check(_broadcast_bytes(payload, group) == payload, "nccl: the gloo bootstrap broadcast")
        report("nccl", backend=dist.get_backend(), nccl=".".join(map(str, torch.cuda.nccl.version())), ok=reduced and broadcast)
    finally:
        dist.destroy_process_group()


def servers_for(kv_dtype: str, model: str | None, logs: Path) -> dict[str, RuntimeServer]:
    base = ServerOptions(model=model, dtype="bf16", kv_cache_dtype=kv_dtype, **POOL)
    poisoned = replace(base, poison_kv_cache=True, poison_freed_pages=True)
    variants = {"clean": base, "poisoned": poisoned, "skipped": replace(poisoned, skip_clears=True)}
    return {name: RuntimeServer(options, logs / f"{kv_dtype}-{name}.log") for name, options in variants.items()}


def check_kv_dtype(kv_dtype: str, model: str | None, logs: Path) -> list[Answer]:
    """The three servers of one KV dtype, started together; returns the clean answers."""
    servers = servers_for(kv_dtype, model, logs)
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            for future in [pool.submit(s.start, 240.0) for s in servers.values()]:
                future.result()
        start_s = time.perf_counter() - started
        clean, poisoned, skipped = (rounds(servers[name].url) for name in ("clean", "poisoned", "skipped"))
        mismatches = answers_match(clean, poisoned)
        undetected = poison_detected(skipped)
        for problem in mismatches + undetected:
            check(False, f"{kv_dtype}: {problem}")
        loaded = asyncio.run(pressure(servers["poisoned"].url))
        after = metrics(servers["poisoned"].url)
        unfinished = [f"stream {i}: {tokens} tokens, {error}" for i, (tokens, error) in enumerate(loaded) if error or tokens != 200]
        for problem in unfinished:
            check(False, f"{kv_dtype} under pressure: {problem}")
        offloaded = check(after.get("tp_runtime_kv_offloads_total", 0) > 0, f"{kv_dtype}: no page was offloaded under pressure")
        restored = check(after.get("tp_runtime_kv_restores_total", 0) > 0, f"{kv_dtype}: no offloaded page was restored")
        report(
            "poison", kv_dtype=kv_dtype, start_s=round(start_s, 1), answers=len(clean),
            identical_with_clears=not mismatches, detected_without_clears=not undetected,
            pages_cleared=after.get("tp_runtime_kv_pages_cleared_total"), preemptions=after.get("tp_runtime_preemptions_total"),
            offloads=after.get("tp_runtime_kv_offloads_total"), restores=after.get("tp_runtime_kv_restores_total"),
            pressure_streams_finished=len(loaded) - len(unfinished), problems=(mismatches + undetected + unfinished)[:6],
            ok=not (mismatches or undetected or unfinished) and offloaded and restored,
        )
        if kv_dtype == "bf16" and model is None:
            question, expected = REFERENCE
            answer = complete(servers["clean"].url, question, chat=True)
            report("reference", question=question, answer=answer.text, ok=check(answer.text == expected, f"bf16 answered {answer.text!r}"))
        return clean
    finally:
        for server in servers.values():
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--kv-dtypes", nargs="+", default=["bf16", "fp8-e4m3"])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: skip NCCL (the servers pick their device)")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/tp-runtime-device-check"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(json.dumps({"error": "no CUDA device visible to torch"}))
            return 2
        try:
            check_nccl()
        except Exception as exc:  # noqa: BLE001 - the server sections still run
            report("nccl", error=f"{type(exc).__name__}: {exc}", ok=check(False, f"nccl raised {exc!r}"))
    clean: dict[str, list[Answer]] = {}
    for kv_dtype in args.kv_dtypes:
        try:
            clean[kv_dtype] = check_kv_dtype(kv_dtype, args.model, args.logs)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next dtype
            report("poison", kv_dtype=kv_dtype, error=f"{type(exc).__name__}: {exc}", ok=check(False, f"{kv_dtype} raised {exc!r}"))
    if "fp8-e4m3" in clean and "bf16" in clean:
        share = agreement(clean["bf16"], clean["fp8-e4m3"])
        failed = [a.prompt for a in clean["fp8-e4m3"] if a.text is None]
        ok = check(not failed, f"fp8 KV failed {failed}")
        if args.model is None:  # a random test model's logits are too close for any dtype to keep its argmax
            ok = check(share >= MIN_FP8_AGREEMENT, f"fp8 KV repeats {share:.0%} of bf16's tokens") and ok
        report("fp8", token_agreement_with_bf16=round(share, 2), failed=failed, ok=ok)
    report("runtime_summary", seconds=round(time.perf_counter() - started, 1), failures=FAILURES, ok=not FAILURES)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
