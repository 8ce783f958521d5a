"""How many streams match their solo run, with and without the deterministic mode (docs/invariance.md).

For each mode a server starts; a workload of mixed requests (prompts of many lengths, some sharing
a prefix, greedy and seeded) is sent at once at `--concurrency`, and then every request again
alone, one after another. A stream matches when its token ids are the solo run's; it matches
bitwise when its logprobs are too. Prints JSON.

    python scripts/bench_invariance.py --requests 200 --concurrency 16 --modes default deterministic
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.harness.runtime import RuntimeServer, ServerOptions  # noqa: E402

MODES = {"default": ("--no-deterministic",), "deterministic": ("--deterministic",)}
WORDS = "the of and a to in is you that it he was for on are as with his they at be this from".split()


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int
    seed: int | None  # None: greedy

    def body(self) -> dict:
        sampled = {"temperature": 0.8, "top_p": 0.95, "seed": self.seed} if self.seed is not None else {"temperature": 0}
        return {
            "prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True, **sampled,
        }


@dataclass(frozen=True)
class ModeResult:
    mode: str
    requests: int
    tokens_match: int
    bitwise_match: int
    greedy_tokens_match: int
    greedy: int
    batched_wall_s: float
    solo_wall_s: float

    @property
    def fractions(self) -> dict[str, float]:
        return {
            "tokens": self.tokens_match / self.requests,
            "bitwise": self.bitwise_match / self.requests,
            "greedy_tokens": self.greedy_tokens_match / max(1, self.greedy),
        }


def workload(count: int, seed: int, lengths: tuple[int, int], outputs: tuple[int, int]) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(4)]
    requests = []
    for index in range(count):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*lengths)))
        prompt = f"{rng.choice(prefixes)} {words}" if index % 3 == 0 else words
        requests.append(Request(prompt, rng.randint(*outputs), rng.randint(0, 2**31) if index % 4 == 0 else None))
    return requests


def run(url: str, request: Request, timeout: float) -> tuple[list[int], list[float]]:
    response = httpx.post(f"{url}/v1/completions", json=request.body(), timeout=timeout)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def measure(mode: str, args: argparse.Namespace, requests: list[Request], out: Path) -> ModeResult:
    options = ServerOptions(
        model=args.model, dtype=args.dtype, weight_format=args.weight_format, tensor_parallel_size=args.tp,
        max_num_seqs=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens, extra_args=MODES[mode],
    )
    with RuntimeServer(options, out / f"server-{mode}.log") as server:
        begin = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            batched = list(pool.map(lambda r: run(server.url, r, args.timeout), requests))
        middle = time.perf_counter()
        solo = [run(server.url, r, args.timeout) for r in requests]
        end = time.perf_counter()
        server.stop()
    pairs = list(zip(requests, batched, solo))
    return ModeResult(
        mode=mode,
        requests=len(requests),
        tokens_match=sum(b[0] == s[0] for _, b, s in pairs),
        bitwise_match=sum(b == s for _, b, s in pairs),
        greedy_tokens_match=sum(b[0] == s[0] for r, b, s in pairs if r.seed is None),
        greedy=sum(r.seed is None for r in requests),
        batched_wall_s=round(middle - begin, 1),
        solo_wall_s=round(end - middle, 1),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--dtype", default=None)
    p.add_argument("--weight-format", default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--prompt-words", type=int, nargs=2, default=(4, 120), metavar=("MIN", "MAX"))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(4, 16), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path(f"reports/invariance-{time.strftime('%Y%m%d-%H%M%S')}"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    requests = workload(args.requests, args.seed, tuple(args.prompt_words), tuple(args.output_tokens))
    results = [measure(mode, args, requests, args.out) for mode in args.modes]
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "modes": [{**asdict(r), "fractions": r.fractions} for r in results],
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
