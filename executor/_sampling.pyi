# The compiled calls of executor/_sampling.c (the C file documents each); executor/sampler.py
# is their one caller, and passes numpy arrays of the kinds named here (sample_rows' logits also as
# a tensor's (address, rows)).
import numpy as np

INTERFACE: int
DRAW_GREEDY: int
DRAW_PLAIN: int
DRAW_CUT: int
DRAW_ELSEWHERE: int

def finite_scaled(logits: np.ndarray, vocab: int, temperature: np.ndarray, out: np.ndarray | None, finite: np.ndarray, /) -> int: ...
def gather(log_probs: np.ndarray, vocab: int, log_ratio: float, margin: float, room: int, ids: np.ndarray, values: np.ndarray, counts: np.ndarray, /) -> int: ...
def pick(ids: np.ndarray, probs: np.ndarray, counts: np.ndarray, ratio: float, k: np.ndarray, top_p: np.ndarray, uniforms: np.ndarray, out: np.ndarray, /) -> int: ...
def sample_rows(
    logits: np.ndarray | tuple[int, int], vocab: int, scale: np.ndarray, kinds: np.ndarray, k: np.ndarray, top_p: np.ndarray, uniforms: np.ndarray,
    log_ratio: float, margin: float, ratio: float, room: int, tokens: np.ndarray, logprobs: np.ndarray, finite: np.ndarray,
    wants: np.ndarray, alternatives: int, top_ids: np.ndarray, top_logprobs: np.ndarray, threads: int, /,
) -> int: ...
def pool_stats() -> tuple[int, int]: ...
