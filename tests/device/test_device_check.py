"""What of scripts/device_check.sh runs without a GPU: the plan and its budgets, the orchestration
(a part that fails, prints a failure, or runs past its budget fails the check; what comes back under
--out), set-up's checks of what the GPU machine has, the carried set against the runtime's declared
dependencies, and the parts' own logic and use of the runtime's API on the CPU, with comparisons
that can fail there too. The offline install itself is proven by `bash scripts/device_check.sh
--dry-run`, which scripts/test.sh runs."""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from scripts import device_check, device_decode, device_env, device_runtime, device_setup
from scripts.device_check import Part, plan, run

PY = sys.executable


def fake(name: str, code: str, budget_s: float = 20) -> Part:
    return Part(name, (PY, "-c", code), budget_s, f"fake part {name}")


def test_the_plan_fits_in_five_minutes_and_names_scripts_that_exist() -> None:
    parts = plan()
    assert [p.name for p in parts] == ["setup", "clears", "decode", "poison", "serving"]
    assert sum(p.budget_s for p in parts) <= device_check.TOTAL_BUDGET_S < 5 * 60
    modules = {f"scripts.{Path(arg).stem}" for part in parts[1:] for arg in part.argv if arg.endswith(".py")}
    assert modules == set(device_setup.PART_MODULES), "set-up must import every part's module"
    for part in parts:
        scripts = [arg for arg in part.argv if arg.endswith(".py") or arg.startswith("tests/")]
        assert scripts and all((device_check.REPO / s).exists() for s in scripts), part


def run_fake(parts: list[Part], total_s: float = 60, out_dir: Path | None = None) -> tuple[int, list[dict]]:
    out = io.StringIO()
    code = run(parts, total_s, env={"PATH": "/usr/bin:/bin"}, out=out, out_dir=out_dir)
    return code, [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


def test_every_part_passing_passes_and_what_comes_back_is_written(tmp_path: Path) -> None:
    code, lines = run_fake(
        [fake("setup", "print('{\"ok\": true}')"), fake("a", "print('{\"x\": 1, \"ok\": true}'); print('plain text')")],
        out_dir=tmp_path,
    )
    assert code == 0
    assert lines[-1]["summary"] == {"setup": "ok", "a": "ok"} and lines[-1]["ok"] is True
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is True
    assert "plain text" in (tmp_path / "a.log").read_text() and "plain text" not in (tmp_path / "check.jsonl").read_text()
    assert [json.loads(line) for line in (tmp_path / "check.jsonl").read_text().splitlines()] == lines
    # The device tool brings back at most 8 files, no deeper than two folders, named plainly.
    files = list(tmp_path.rglob("*"))
    assert len(files) <= 8 and all(f.parent == tmp_path and f.name.replace(".", "").replace("_", "").isalnum() for f in files)


def test_a_failed_line_an_exit_code_or_a_timeout_each_fail_the_check() -> None:
    started = time.monotonic()
    code, lines = run_fake(
        [
            fake("setup", "pass"),
            fake("says_failed", "print('{\"section\": \"s\", \"ok\": false}')"),
            fake("exits_1", "import sys; sys.exit(1)"),
            fake("too_slow", "import time; print('started', flush=True); time.sleep(60)", budget_s=1.5),
            fake("fine", "pass"),
        ]
    )
    assert time.monotonic() - started < 20, "the slow part was not killed at its budget"
    assert code == 1
    summary = lines[-1]
    assert summary["summary"] == {"setup": "ok", "says_failed": "FAILED", "exits_1": "FAILED", "too_slow": "FAILED", "fine": "ok"}
    slow = next(line for line in lines if line.get("part") == "too_slow" and "failures" in line)
    assert "budget" in slow["failures"][0]


def test_a_failed_set_up_skips_the_rest_and_no_device_is_exit_2() -> None:
    code, lines = run_fake([fake("setup", "import sys; sys.exit(2)"), fake("a", "pass")])
    assert code == device_check.EXIT_NO_DEVICE
    assert lines[-1]["skipped"] == ["a"] and lines[-1]["ok"] is False


def test_the_whole_call_has_one_deadline() -> None:
    started = time.monotonic()
    code, _ = run_fake([fake("setup", "import time; time.sleep(30)", budget_s=30)], total_s=1.5)
    assert code == 1 and time.monotonic() - started < 15


def test_set_up_imports_everything_then_says_there_is_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert device_setup.main() == device_setup.EXIT_NO_DEVICE
    line = json.loads(capsys.readouterr().out)
    assert line["problems"] == [] and "no GPU on this machine" in line["error"] and line["torch"] == torch.__version__


def test_set_up_names_a_missing_pin_a_wrong_version_and_an_unimportable_module(monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"uvicorn": None, "pyzmq": "26.0.0"}
    real = device_setup.installed_version
    monkeypatch.setattr(device_setup, "installed_version", lambda name: versions[name] if name in versions else real(name))
    problems = device_setup.package_problems()
    assert any(p.startswith("uvicorn==") and "not installed" in p for p in problems)
    assert any(p.startswith("pyzmq==") and "pyzmq 26.0.0 comes first" in p for p in problems)
    assert device_setup.import_problems(("tp_runtime.no_such_module",))[0].startswith("tp_runtime.no_such_module cannot be imported")


def test_every_dependency_the_runtime_declares_travels_or_is_in_the_image(tmp_path: Path) -> None:
    assert device_env.unprovided_dependencies() == []
    pyproject = tmp_path / "pyproject.toml"
    text = (device_env.REPO / "pyproject.toml").read_text()
    pyproject.write_text(text.replace('"tqdm>=4.60",', '"tqdm>=4.60",\n    "msgspec>=0.18",'))
    assert device_env.unprovided_dependencies(pyproject) == ["msgspec"]  # a new dependency must join the carried set


def test_the_pins_and_wheel_names_are_read_strictly(tmp_path: Path) -> None:
    pins = device_env.pins()
    assert len({p.name for p in pins}) == len(pins) and all(p.version for p in pins)
    assert "torch" not in {p.name for p in pins} and not {"numpy", "torch"} & {p.name for p in pins}
    bad = tmp_path / "requirements.txt"
    bad.write_text("fastapi>=0.1\n")
    with pytest.raises(ValueError, match="not a pin"):
        device_env.pins(bad)
    assert device_env.wheel_pin("pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.whl") == device_env.Pin("pydantic-core", "2.46.4")
    assert device_env.is_pure("idna-3.20-py3-none-any.whl") and not device_env.is_pure("pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl")
    for name in ("idna-3.20-py3-none-any.whl", "idna-3.19-py3-none-any.whl", "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    wanted = [device_env.Pin("idna", "3.20"), device_env.Pin("pyzmq", "27.3.0"), device_env.Pin("h11", "0.16.0")]
    assert [p.name for p in device_env.strays(tmp_path, wanted)] == ["idna-3.19-py3-none-any.whl"]
    assert device_env.missing(tmp_path, wanted) == [device_env.Pin("h11", "0.16.0")]
    assert device_env.compiled_pins(tmp_path, wanted) == [device_env.Pin("pyzmq", "27.3.0")]


def test_the_tokenizer_that_travels_is_the_ggufs(tmp_path: Path) -> None:
    from executor.model import default_model_path
    from scripts.device_tokenizer import export
    from tp_runtime.tokenizer import Tokenizer

    gguf = Tokenizer.from_model_path(default_model_path())
    carried = Tokenizer.from_model_path(export(Path(default_model_path()), tmp_path))
    text = "<|im_start|>user\nWhat is 2+2? Ünïcödé 12345 \t tabs<|im_end|>"
    assert carried.encode(text) == gguf.encode(text) and carried.decode(gguf.encode(text)) == gguf.decode(gguf.encode(text))
    assert (carried.bos_token_id, carried.eos_token_ids, carried.chat_template) == (gguf.bos_token_id, gguf.eos_token_ids, gguf.chat_template)


def test_the_random_checkpoints_load_as_real_ones(tmp_path: Path) -> None:
    import torch

    from executor.model import load_model
    from scripts.device_models import LLAMA3_8B, TINY, parameters, write_checkpoint
    from scripts.device_tokenizer import export

    assert parameters(LLAMA3_8B) == 8_030_261_248  # Llama-3-8B's count
    tokenizer = export(Path(__import__("executor.model", fromlist=["x"]).default_model_path()), tmp_path / "tok")
    directory = write_checkpoint(tmp_path / "tiny", TINY, tokenizer, device=torch.device("cpu"))
    model = load_model(str(directory), rank=0, world_size=1, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert (model.config.num_layers, model.config.hidden_size, model.config.vocab_size) == (TINY.num_layers, TINY.hidden_size, TINY.vocab_size)
    assert len(list(directory.glob("*.safetensors"))) == 1 and (directory / "tokenizer.json").is_file()


def test_decode_on_the_cpu_runs_the_same_code_and_its_failures_are_real(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3 rows pad up to the graph of 4, 19 pages of context up to the 32-wide table: the padded static
    # buffers, run eagerly, against the plain forward.
    argv = ["--shape", "tiny", "--device", "cpu", "--batches", "1", "3", "--context", "300"]
    assert device_decode.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    decode = [r for r in rows if r["section"] == "decode"]
    assert [r["batch"] for r in decode] == [1, 3] and [r["graph"] for r in decode] == [[1, 32], [4, 32]]
    assert all(r["bytes_per_step"] > 0 and r["eager_tok_s"] > 0 and r["argmax_agreement"] == 1.0 for r in decode)
    kernels = [r for r in rows if r["section"] == "decode_kernels"]
    assert [r["batch"] for r in kernels] == [1, 3]
    assert all(0 < len(r["top"]) <= device_decode.TOP_KERNELS and r["total_us"] >= sum(k["us"] for k in r["top"]) for r in kernels)
    assert any("mm" in k["name"] for k in kernels[0]["top"])  # the matmuls are among a step's largest
    cost = next(r for r in rows if r["section"] == "clears_cost")
    assert cost["clear_4_pages_us"] > 0 and "4_pages_batch_3" in cost["fraction_of_step"]
    # Negative control: a graph that replays with the previous step's token ids (their rule's fill
    # gone, so the load leaves the static buffer as the last step wrote it) must break the agreement.
    from executor.cuda_graphs import StaticDecodeBatch
    from executor.inputs import Pad

    real_fills = StaticDecodeBatch.fills
    monkeypatch.setattr(StaticDecodeBatch, "fills", lambda b: {r: v for r, v in real_fills(b).items() if r is not Pad.ZERO})
    assert device_decode.main(argv) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "agrees" in " ".join(next(r for r in rows if r["section"] == "decode_summary")["failures"])
    assert device_decode.hbm_fraction(4_800_000_000, 1000.0, 4.8e9) == pytest.approx(1.0)
    assert device_decode.decode_failures(1, 1.0, 0.0, 0.9) == []
    assert device_decode.decode_failures(16, 1.0, 0.0, 0.1) == []  # the floor is batch 1's
    assert "HBM" in device_decode.decode_failures(1, 1.0, 0.0, 0.3)[0]
    assert "agrees" in device_decode.decode_failures(1, 0.9, 0.0, None)[0]
    assert device_decode.decode_failures(1, 1.0, float("nan"), None)
    assert device_decode.clear_failures(0.001) == [] and device_decode.clear_failures(None) == []
    assert "costs 5.0%" in device_decode.clear_failures(0.05)[0]


def test_the_clear_checks_run_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    from scripts import device_check_clear

    assert device_check_clear.main(["--device", "cpu"]) == 0
    sections = [json.loads(line)["section"] for line in capsys.readouterr().out.splitlines()]
    assert sections.count("clear_pages") == 4 and "offload" in sections


def answer(text: str | None, tokens: tuple[int, ...] = (), error: str | None = None) -> device_runtime.Answer:
    return device_runtime.Answer("p", 200 if text is not None else 500, text, error, tokens)


def test_the_runtime_checks_compare_what_they_claim() -> None:
    clean = [answer("a b", (1, 2)), answer("c", (3,))]
    assert device_runtime.answers_match(clean, [answer("a b", (1, 2)), answer("c", (3,))]) == []
    assert device_runtime.answers_match(clean, [answer("a b", (1, 2)), answer("c", (4,))])  # same text, other tokens
    assert device_runtime.answers_match(clean, [answer("a b", (1, 2)), answer(None, error="not finite")])
    assert device_runtime.poison_detected([answer(None, error="logits were not finite")]) == []
    assert device_runtime.poison_detected([answer("!!!!", (9, 9))])  # text from a poisoned cache
    assert device_runtime.poison_detected([answer(None, error="connection refused")])  # failed, but not detected
    assert device_runtime.agreement([answer("x", (1, 2, 3, 4))], [answer("y", (1, 2, 9, 4))]) == 0.5
    assert device_runtime.agreement(clean, clean) == 1.0


def test_the_poison_part_runs_its_two_rank_group_through_the_real_loop_on_the_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TP=2 over gloo through the engine and two executor processes: poisoned == clean token for
    token, and every answer of the run with clears skipped fails as non-finite."""
    from scripts.device_tokenizer import export
    from executor.model import default_model_path

    tokenizer = export(Path(default_model_path()), tmp_path / "tok")
    argv = ["--device", "cpu", "--groups", "loop-eager", "--work", str(tmp_path / "work"), "--tokenizer", str(tokenizer)]
    assert device_runtime.main(argv) == 0, capsys.readouterr().out[-3000:]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    group = next(line for line in lines if line.get("section") == "poison")
    assert group["tp"] == 2 and group["identical_with_clears"] and group["detected_without_clears"] and group["answers"] == 10


def test_the_serving_parts_gap_is_bench_steps_measurement_around_a_real_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's half of the serving part on the CPU: every forward is stamped through the wrapper
    the executor loads, and the gaps come out of bench_step's forward_gaps."""
    import torch

    from executor.model import default_model_path
    from scripts import device_serving
    from scripts.device_models import TINY, write_checkpoint
    from scripts.device_tokenizer import export

    monkeypatch.setattr(device_serving, "STREAM_TOKENS", 12)
    model = write_checkpoint(tmp_path / "tiny", TINY, export(Path(default_model_path()), tmp_path / "tok"), device=torch.device("cpu"))
    class Stamped(threading.Event):
        def set(self) -> None:
            self.at = time.perf_counter()  # the executor stamps its CPU forwards on the same clock
            super().set()

    # The server is up already; its stream waits on loop_done: one process's forwards at a time.
    turns = device_serving.Turns(server_up=threading.Event(), loop_done=Stamped())
    turns.server_up.set()
    trace = tmp_path / "trace.json"
    orders = device_serving.measure_gaps(model, "cpu", tmp_path, list(range(100, 110)), turns, trace, ("pipelined", "at-once"))
    assert device_serving.FAILURES == []
    import numpy as np

    from scripts.bench_step import forward_times_path

    # Both of the model thread's orders, each in a loop of its own, before the server's turn.
    assert set(orders) == set(device_serving.READBACK_ORDERS) == {"pipelined", "at-once"}
    assert len(orders["pipelined"].tokens) == 12 and orders["pipelined"].tokens == orders["at-once"].tokens
    for order, gaps in orders.items():
        ends = np.load(forward_times_path(tmp_path / order / "forward-times", 0))[:, 1]
        assert np.nanmax(ends) <= turns.loop_done.at
        assert gaps.forwards == 12 and gaps.step_ms > 0 and 0 < gaps.gap_us["median"] <= gaps.gap_us["p90"]
    assert any(e.get("name", "").startswith("aten::") for e in json.loads(trace.read_text())["traceEvents"])


@pytest.mark.parametrize("readback", ["bogus", "pipelined,pipelined", "at-once,bogus", "at_once"])
def test_the_serving_part_refuses_an_order_it_does_not_know(readback: str) -> None:
    from scripts import device_serving

    with pytest.raises(SystemExit) as refused:
        device_serving.main(["--device", "cpu", "--readback", readback])
    assert refused.value.code == 2


def test_the_serving_parts_gpu_stamps_bracket_each_graph_replay_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU half of the stamping, with CUDA's events and graphs stood in: a decode's step is its
    replay (the inputs' copies before it count in the gap), a forward without a graph is stamped
    whole, and every stamp reaches bench_step's times in order."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from scripts import device_serving

    log: list[tuple[str, object]] = []

    class Event:
        clock = 0.0

        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            Event.clock += 1.0
            self.at = Event.clock
            log.append(("record", self))

        def query(self) -> bool:
            return True

        def elapsed_time(self, other: "Event") -> float:
            return (other.at - self.at) * 1e3  # ms, as CUDA's

    class Graph:
        def replay(self) -> None:
            log.append(("replay", None))

    class Runner:
        def __init__(self, model, cache, **_):  # noqa: ANN001
            self.graphs = {(1, 16): SimpleNamespace(graph=Graph())}

        def graph_for(self, inputs):  # noqa: ANN001, ANN201
            return self.graphs[(1, 16)] if inputs == "decode" else None

        def forward(self, inputs, cache):  # noqa: ANN001, ANN201
            log.append(("load", inputs))
            if inputs == "decode":
                self.graphs[(1, 16)].graph.replay()
            else:
                log.append(("eager", None))
            return "logits"

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr("executor.cuda_graphs.DecodeGraphRunner", Runner)
    times = np.full((4, 2), np.nan)
    model = SimpleNamespace(fingerprint="f", config=None)
    timed = device_serving.TimedForward(model, times, geometry=None, graphs=True)
    cache = SimpleNamespace(device=torch.device("cuda", 0))
    for inputs in ("prefill", "decode", "decode"):
        assert timed.forward(inputs, cache) == "logits"
    kinds = [kind for kind, _ in log]
    assert kinds == ["record", "load", "eager", "record"] + ["load", "record", "replay", "record"] * 2
    assert timed.written == 3 and np.allclose(times[:3], [[0, 1], [2, 3], [4, 5]]) and np.isnan(times[3]).all()
