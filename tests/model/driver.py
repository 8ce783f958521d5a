"""A minimal stand-in for the scheduler: builds PREPARE frames for a model and a KV cache.

Pages are handed out from a shuffled pool so page tables are not trivially ordered; each page is
listed in `cleared_pages` the first time a step uses it (the scheduler's rule 3), unless the
driver is told to skip clears.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from executor.cache import KVCache
from executor.inputs import StepInputs
from executor.kv_scales import KVScales, ScaleCalibration
from executor.model import LlamaModel
from executor.model.runner import ModelRunner
from protocol.frames import Prepare


@dataclass
class Sequence:
    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


class Driver:
    def __init__(
        self,
        model: LlamaModel,
        *,
        num_kv_pages: int = 64,
        page_size: int = 4,
        kv_dtype: str = "fp32",
        poison: bool = False,
        clear: bool = True,
        seed: int = 0,
        kv_scales: KVScales | ScaleCalibration | None = None,
    ) -> None:
        self.model = model
        # Steps run as the executor runs them: the runner picks eager, compiled or a graph.
        self.runner = ModelRunner(model)
        self.page_size = page_size
        self.clear = clear
        self.cache = KVCache(
            num_kv_pages=num_kv_pages,
            page_size=page_size,
            num_layers=model.config.num_layers,
            num_kv_heads=model.shard.local_kv_heads,
            head_dim=model.config.head_dim,
            kv_dtype=kv_dtype,
            device=model.device,
            poison=poison,
            scales=kv_scales,
        )
        self.free = list(np.random.default_rng(seed).permutation(num_kv_pages))
        self.seqs: dict[int, Sequence] = {}

    def step(self, chunks: list[tuple[int, list[int], bool]]) -> torch.Tensor | None:
        """Run one step: (seq_id, new tokens, sample?) per sequence. Returns the sampled logits."""
        seq_ids, query_lens, context_lens, tokens = [], [], [], []
        table_lens, table, sample, cleared = [], [], [], []
        for seq_id, new, sampled in chunks:
            seq = self.seqs.setdefault(seq_id, Sequence())
            seq.tokens.extend(new)
            while len(seq.pages) * self.page_size < len(seq.tokens):
                page = int(self.free.pop())
                seq.pages.append(page)
                cleared.append(page)
            seq_ids.append(seq_id)
            query_lens.append(len(new))
            context_lens.append(len(seq.tokens))
            tokens.extend(new)
            table_lens.append(len(seq.pages))
            table.extend(seq.pages)
            sample.append(1 if sampled else 0)
        prepare = Prepare.greedy(
            query_lens,
            context_lens,
            tokens,
            table_lens,
            table,
            seq_ids=seq_ids,
            sample=sample,
            cleared_pages=sorted(cleared) if self.clear else [],
        )
        self.cache.clear_pages(prepare.cleared_pages)
        if self.cache.calibration_pending:  # as executor.steps does: the first step calibrates
            self.cache.begin_calibration()
        inputs = StepInputs.from_prepare(
            prepare, pad_page=self.cache.pad_page, page_size=self.page_size, device=self.model.device
        )
        return self.runner.forward(inputs, self.cache)

    def greedy(self, prompts: dict[int, list[int]], steps: int) -> tuple[list[torch.Tensor], dict[int, list[int]]]:
        """Prefill every prompt in one step, then `steps` batched greedy decode steps.

        Returns the logits of every step (rank 0; None elsewhere) and the generated tokens. On
        ranks other than 0 the next tokens come from `next_tokens`, which every rank must agree
        on: callers running TP pass them through `broadcast`.
        """
        all_logits = []
        logits = self.step([(seq_id, prompt, True) for seq_id, prompt in prompts.items()])
        generated: dict[int, list[int]] = {seq_id: [] for seq_id in prompts}
        for _ in range(steps):
            all_logits.append(logits)
            next_tokens = broadcast_argmax(logits, len(prompts), self.model)
            for seq_id, token in zip(prompts, next_tokens):
                generated[seq_id].append(token)
            logits = self.step([(seq_id, [generated[seq_id][-1]], True) for seq_id in prompts])
        all_logits.append(logits)
        return all_logits, generated


def broadcast_argmax(logits: torch.Tensor | None, rows: int, model: LlamaModel) -> list[int]:
    """Greedy tokens picked on rank 0 and shared with every rank (as the scheduler would)."""
    chosen = torch.zeros(rows, dtype=torch.long)
    if logits is not None:
        chosen = logits.argmax(dim=-1).cpu()
    if model.shard.world_size > 1:
        torch.distributed.broadcast(chosen, src=0)
    return chosen.tolist()
