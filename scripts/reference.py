"""References the soak run and the benchmark measure the runtime against.

- `OfflineReference`: the runtime's own model at TP=1 in this process, no scheduler, no pressure,
  no poison: the logits the TP=1 reference run saw at any position of its output. The soak reads
  the two best of them where a greedy output under test first differs from the reference.
- `HFReference`: Hugging Face transformers generating from the same weights (the GGUF file, which
  transformers dequantizes) in the same dtype, batched with left padding as a user would write it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


class OfflineReference:
    """One whole-prompt forward of the runtime's model at TP=1 over a fresh, zeroed cache."""

    def __init__(self, model_path: str, dtype: str, page_size: int = 16) -> None:
        from executor.model import load_model

        self.model = load_model(
            model_path, rank=0, world_size=1, dtype=_torch_dtype(dtype), device=torch.device("cpu")
        )
        self.kv_dtype = dtype
        self.page_size = page_size

    def next_token_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [vocab]: the logits of the token that would follow token_ids."""
        from executor.cache import KVCache
        from executor.inputs import StepInputs
        from protocol.frames import Prepare, plain_sampling

        count = len(token_ids)
        if count == 0:
            raise ValueError("the reference needs at least one token of context")
        pages = -(-count // self.page_size)
        config = self.model.config
        cache = KVCache(
            num_kv_pages=pages,
            page_size=self.page_size,
            num_layers=config.num_layers,
            num_kv_heads=self.model.shard.local_kv_heads,
            head_dim=config.head_dim,
            kv_dtype=self.kv_dtype,
            device=torch.device("cpu"),
        )
        page_ids = np.arange(pages, dtype=np.int32)
        cache.clear_pages(page_ids)

        def ints(values: Sequence[int] | np.ndarray, dtype: str = "<i4") -> np.ndarray:
            return np.asarray(values, dtype=dtype)

        prepare = Prepare(
            seq_ids=ints([0], "<i8"),
            query_lens=ints([count]),
            context_lens=ints([count]),
            token_ids=ints(token_ids),
            positions=ints(np.arange(count)),
            page_table_lens=ints([pages]),
            page_table_base=ints([0]),
            page_table=page_ids,
            sample=ints([1], "u1"),
            temperature=ints([0.0], "<f4"),
            top_p=ints([1.0], "<f4"),
            top_k=ints([0]),
            seeds=ints([-1], "<i8"),
            cleared_pages=ints([]),
            restore_pages=ints([]),
            restore_slots=ints([]),
            offload_pages=ints([]),
            offload_slots=ints([]),
            poison_pages=ints([]),
            feedback=ints([0], "u1"),
            **plain_sampling(1),
        )
        inputs = StepInputs.from_prepare(prepare, pad_page=cache.pad_page, page_size=self.page_size, device="cpu")
        logits = self.model.forward(inputs, cache)
        return logits[0].float().numpy()


@dataclass(frozen=True)
class BatchRun:
    """One `generate` call: the new tokens of each row and when each step's token appeared."""

    token_ids: list[list[int]]
    t_start: float
    step_times: list[float]  # perf_counter after each generated position (shared by the batch)

    @property
    def ttft_s(self) -> float:
        return self.step_times[0] - self.t_start

    @property
    def tpot_s(self) -> float | None:
        if len(self.step_times) < 2:
            return None
        return (self.step_times[-1] - self.step_times[0]) / (len(self.step_times) - 1)

    @property
    def itl_s(self) -> list[float]:
        """Each row's gaps between two tokens (every row's are the batch's steps)."""
        times = self.step_times
        return [b - a for a, b in zip(times, times[1:])]


class HFReference:
    """transformers' AutoModelForCausalLM on the same GGUF, in the runtime's dtype.

    The GGUF is dequantized at load (GgufConfig(dequantize=True)): the runtime computes with dense
    weights in `dtype`, and so does this reference. transformers' default keeps GGUF blocks packed
    and computes in float32 through its own kernels, which is neither the same dtype nor the same
    arithmetic.
    """

    def __init__(self, model_path: str, dtype: str) -> None:
        from transformers import AutoModelForCausalLM, GgufConfig

        path = Path(model_path)
        if path.is_file():
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent),
                gguf_file=path.name,
                dtype=_torch_dtype(dtype),
                quantization_config=GgufConfig(dequantize=True),
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_torch_dtype(dtype))
        self.model = model.eval()
        eos = self.model.generation_config.eos_token_id
        self.pad_token_id = int(eos[0] if isinstance(eos, list) else eos)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, ignore_eos: bool) -> BatchRun:
        """Greedy batched generation; prompts of unequal length are left-padded."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        step_times: list[float] = []

        class StepClock(StoppingCriteria):
            # generate calls its stopping criteria once per new position: a per-token clock.
            def __call__(self, ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.BoolTensor:
                step_times.append(time.perf_counter())
                return torch.zeros(ids.shape[0], dtype=torch.bool)

        t_start = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if ignore_eos else 0,
                pad_token_id=self.pad_token_id,
                stopping_criteria=StoppingCriteriaList([StepClock()]),
            )
        new = output[:, width:].tolist()
        return BatchRun(token_ids=new, t_start=t_start, step_times=step_times)
