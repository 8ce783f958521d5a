"""Token sampling on rank 0: logits processing, greedy, temperature, top-k, top-p, per-request seeds,
and the most likely alternatives of each sampled token.

Logits processing comes first, on the rows that ask for it, in vLLM's order: logit bias, banned
tokens (-inf: a request's stop tokens before its min_tokens), the grammar's mask (-inf on every token
a row's output grammar does not allow next), then the repetition penalty (a token
seen in the prompt or the output has its positive logit divided by it, its negative one multiplied),
the frequency penalty (minus penalty x its count in the output) and the presence penalty (minus
penalty once it appears in the output). Rank 0 sees whole rows at any tensor-parallel size, so the
result does not depend on it.

Each random row is sampled by inverse CDF: one uniform number per row, a prefix sum and a binary
search, instead of a noise vector over the whole vocabulary (which costs tens of milliseconds a
step on a CPU). A seeded row's uniform is a hash of (seed, position of the token whose logits it
holds): its token then depends only on its own logits row, never on which rows share the batch or
on the tensor-parallel size (rank 0 always sees the whole row).
Unseeded rows take one draw a forward from the default generator, made where the step is staged
(draw_unseeded).

Top-k and top-p rows are sampled, on a CPU, among their candidates: the tokens within a factor of
the row's most likely one, found by one comparison pass and sorted alone (a partial topk or a full
sort of the vocabulary costs 10-100x more on a CPU). A row whose nucleus is not inside them (a flat
distribution) widens the factor once, then takes its k most likely tokens (one partition of the
row) if top-k cuts it, or every token, so the result is exact either way. On a GPU
the rows are sorted whole instead: sizing the candidates reads device values back (each nonzero,
any and max stalls the host until the forward is done), where a sort is one more kernel in the
queue. Both draw the same tokens from the same probabilities on the same CPU
(tests/executor/test_sampler.py); a GPU's float32 sums may round otherwise at a draw's edge, as any
two devices may. scripts/device_decode.py times the device's (sample_ms).

On a CPU, torch runs log_softmax, the exponentials and a plain row's draw, and numpy the rest: the
candidates' comparison and indices, their sort and draw, the tokens' logprobs. A torch call costs
2-3 us before any work and gives up the GIL, which the executor's link thread then holds until it
blocks; numpy's costs ~1 us and keeps the GIL on small arrays (a few hundred candidates), and its
comparison and flat nonzero over a [16, 49152] batch take a quarter of torch's (docs/control_plane.md,
change 47). Where the install compiled executor/_sampling.c, two of those steps are compiled calls
(each of the thirty-odd calls they replace cost 3-7 us right after a sleeping forward): the finite
check with the division by the temperature, for batches with no logits processing, and the first
round of the candidates' draw, which decides every peaked row (numpy's rounds draw the rows it
leaves). Without it, torch checks and divides and numpy draws, to the same tokens as those calls.

Where the install compiled it, every row that no logits processing touches (the usual decode row)
is drawn in one compiled call instead (_sample_compiled): per row a pass for the finite check and
the largest logit, one that sums the exponentials and gathers the candidates, and for a row that
wants alternatives one that keeps its most likely tokens, with no table of logprobs written. Its
exponential is its own, so it is held to the passes above to float32 rounding: the same flags, the
same tokens except where a uniform or a top-p cut falls within that rounding of a token's edge,
logprobs within a few ulps of torch's log_softmax
(each 256-column block summed in float32 lanes, the lanes' totals in float64: nearer the exact
value than torch's float32 sum). Greedy tokens are the first largest column either way.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType

import numpy as np
import torch

from executor.host_copy import to_device
from protocol.errors import TPRuntimeError

# The compiled calls of executor/_sampling.c, and the interface this file expects of them: a build
# made from an older source (a checkout pulled without `pip install -e .` again) is not used.
_SAMPLING_INTERFACE = 7


def _usable(built: ModuleType | None) -> ModuleType | None:
    if built is not None and getattr(built, "INTERFACE", None) != _SAMPLING_INTERFACE:
        logging.getLogger(__name__).warning(
            "%s was built from another executor/_sampling.c: sampling without it until `pip install -e .` rebuilds it",
            built.__file__,
        )
        return None
    return built


try:
    from executor import _sampling as _built
except ImportError:  # no C compiler built it: torch and numpy draw, to the same tokens within float32 rounding
    _built = None
_sampling = _usable(_built)

_MASK64 = (1 << 64) - 1
# A top-k / top-p row's candidates are its tokens with at least this share of its most likely
# token's probability: 2**-12 holds the nucleus of peaked rows (a few hundred candidates at most),
# 2**-24 that of flat ones; the last round (0) takes a top-k row's k most likely tokens and every
# token of the others. Every token at or above a floor comes before every token below it in the
# row's sorted order, so the candidates are a prefix of it.
CANDIDATE_RATIOS = (2.0**-12, 2.0**-24, 0.0)
# The candidates are first found on the logprobs this far below the floor, well over exp's error,
# and then held to the floor in probabilities (_candidates).
_LOG_MARGIN = 2.0**-10
# How far a float32 prefix sum of probabilities may stray from their float64 sum (a few ulps of 1).
_MASS_ROUNDING = 1e-6
# The first-round candidates a row may have for the compiled draw (a peaked row has at most a few
# hundred); a row with more is drawn by numpy's rounds.
_COMPILED_ROOM = 1024
# The one compiled pass's room for a cut row's first-round candidates: a row with more, or whose
# nucleus is wider than them, is drawn there among all its tokens (change 86: a flat row of 49,152
# in ~0.5 ms where the passes' whole-row sorts took 3-6). pick_row sorts only the candidates a row
# has, so a wide room costs a peaked row nothing; with the default model unsure (bench_step
# --forward model, sixteen rows at temperature 0.7), 1,024 sent a row or more further in half the
# steps and 8,192 in a tenth (docs/control_plane.md, change 83).
_PASS_ROOM = 8192
# The compiled pass's threads at most: every CPU (executor/_sampling.c takes no more than the
# process may run on). Between two forwards the forward's threads sit idle, and in a group the other
# ranks wait for rank 0's sample in the feedback: at TP=2 on two cores, with one torch thread a
# rank, a second thread took the sixteen-row gap around the real forward from ~2.1 to ~1.5 ms
# (docs/control_plane.md, change 85).
_PASS_THREADS = os.cpu_count() or 1
# How the compiled pass draws a row (HostRows.draws): its argmax, over its whole row, among its
# top-k / top-p candidates, or not at all (a row that logits processing touches: the passes draw it).
DRAW_GREEDY, DRAW_PLAIN, DRAW_CUT, DRAW_ELSEWHERE = 0, 1, 2, 3
# Empty arrays shared rather than made afresh for each batch (each numpy call costs microseconds
# between two forwards): a batch with no random row's uniforms, a batch that wants no
# alternatives' buffers (zero-sized: nothing is ever written to them).
_NONE_DRAWN = np.zeros(0, dtype=np.float32)
_NO_ALTERNATIVES = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
# A plain row's draw on a CPU goes through sums of blocks this wide (_draw_plain), where its
# vocabulary is a multiple of them and at least _PLAIN_MIN_VOCAB wide (below, one pass is cheap).
_PLAIN_BLOCK = 256
_PLAIN_MIN_VOCAB = 16 * _PLAIN_BLOCK


class SamplingError(TPRuntimeError, ValueError):
    """The sampling parameters do not match the logits they are meant for."""


@dataclass(frozen=True)
class LogitsProcessing:
    """What is done to some rows' logits before temperature. Every tensor is on the logits' device;
    `*_rows` index the logits rows, except prompt_rows/output_rows, which index penalty_rows."""

    bias_rows: torch.Tensor  # long[b]: (row, token) pairs, unique, and the bias added there
    bias_ids: torch.Tensor  # long[b]
    bias_values: torch.Tensor  # float32[b]
    banned_rows: torch.Tensor  # long[k]: (row, token) pairs set to -inf
    banned_ids: torch.Tensor  # long[k]
    penalty_rows: torch.Tensor  # long[r]: the rows with a penalty, ascending
    presence: torch.Tensor  # float32[r]
    frequency: torch.Tensor  # float32[r]
    repetition: torch.Tensor  # float32[r]
    prompt_rows: torch.Tensor  # long[P]: each prompt token of those rows, by its row among penalty_rows
    prompt_ids: torch.Tensor  # long[P]
    output_rows: torch.Tensor  # long[O]: each output token so far, likewise
    output_ids: torch.Tensor  # long[O]
    # Rows whose output follows a grammar (ascending), and the tokens it forbids next (set to -inf).
    grammar_rows: torch.Tensor | None = None  # long[g]
    forbidden: torch.Tensor | None = None  # bool[g, vocab]
    # min_p: after temperature, a random row draws only among tokens at least min_p times as likely
    # as its most likely one (vLLM's; greedy rows keep their argmax).
    min_p_rows: torch.Tensor | None = None  # long[q]
    min_p: torch.Tensor | None = None  # float32[q], in (0, 1]


@dataclass(frozen=True)
class HostRows:
    """What the PREPARE says of each row, on the host, and what the draws derive from it: the
    sampler branches on these and draws the seeded uniforms from them without reading a device
    value (on a GPU each such read stalls the host between two forwards). Only a CPU's path reads
    values (it has nothing to wait for). The derived arrays are made with the rows, where a
    PREPARE is staged (a rank's link thread, while the forward before runs), so that the sample
    between two forwards derives nothing: on a CPU that was ~15 numpy calls of 1-3 us each, cold,
    right after the forward (docs/control_plane.md, fourteenth sitting)."""

    temperature: np.ndarray  # float32[m]; 0 means greedy
    top_p: np.ndarray  # floating[m] given, float32[m] kept; 1 means off
    top_k: np.ndarray  # integer[m] given, int64[m] kept; 0 means off
    seeds: np.ndarray  # int64[m]; -1 means unseeded
    positions: np.ndarray  # int64[m]: the position of the token whose logits the row holds
    num_logprobs: np.ndarray  # integer[m]: the logprob alternatives the row wants returned, 0 for none
    scale: np.ndarray = field(init=False)  # float32[m]: what a row's logits are divided by (1 when greedy)
    dividing: bool = field(init=False)  # whether any row's scale is not 1 (x / 1 is x: no pass)
    random: np.ndarray = field(init=False)  # int64: the rows drawn at a temperature, ascending
    # Of the random rows (indices into `random`): those drawn over their whole row, those that top-k
    # or top-p cuts, and those that carry a seed, with the uniform each seed gives at its position.
    plain: np.ndarray = field(init=False)
    cut: np.ndarray = field(init=False)
    seeded: np.ndarray = field(init=False)
    seeded_uniforms: np.ndarray = field(init=False)  # float32
    # The plain and cut rows as logits rows, and the cut rows' top-k (0: off) and top-p.
    plain_rows: np.ndarray = field(init=False)
    cut_rows: np.ndarray = field(init=False)
    cut_top_k: np.ndarray = field(init=False)  # int64
    cut_top_p: np.ndarray = field(init=False)  # float32
    most_logprobs: int = field(init=False)  # the most alternatives any row wants
    # How the compiled pass (_sample_compiled) draws each row: DRAW_GREEDY, DRAW_PLAIN or DRAW_CUT
    # (the sample leaves a row that logits processing touches elsewhere, DRAW_ELSEWHERE).
    draws: np.ndarray = field(init=False)  # uint8[m]

    def __post_init__(self) -> None:
        # Checked where the rows are built (a rank's link thread), not in every sample() between
        # two forwards. An int array for the temperature would pass a shape check and make a row
        # of temperature 0.5 greedy.
        rows = self.temperature.shape if isinstance(self.temperature, np.ndarray) else None
        for name, kind in (
            ("temperature", "f"), ("top_p", "f"), ("top_k", "iu"), ("seeds", "iu"), ("positions", "iu"), ("num_logprobs", "iu"),
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.dtype.kind not in kind or value.ndim != 1 or value.shape != rows:
                what = "floating-point" if kind == "f" else "integer"
                raise SamplingError(f"host rows: {name} must be a one-dimensional numpy {what} array, as long as temperature")
        derive = partial(object.__setattr__, self)
        # The compiled calls read top-k as int64 and top-p as float32 (HostRows.of's; no copy then).
        derive("top_k", self.top_k.astype(np.int64, copy=False))
        derive("top_p", self.top_p.astype(np.float32, copy=False))
        if rows[0] and not 0 <= self.num_logprobs.min() <= self.num_logprobs.max() <= 255:
            raise SamplingError("host rows: num_logprobs must be in 0 to 255")
        derive("num_logprobs", self.num_logprobs.astype(np.uint8, copy=False))  # as the compiled pass reads it
        greedy = self.greedy
        random = np.flatnonzero(~greedy)
        cut_of_random = self.filtered[random]
        plain, cut = np.flatnonzero(~cut_of_random), np.flatnonzero(cut_of_random)
        scale = np.where(greedy, np.float32(1), self.temperature).astype(np.float32)
        seeded = np.flatnonzero(self.seeds[random] >= 0)
        derive("scale", scale)
        derive("dividing", bool((scale != 1).any()))
        derive("random", random)
        derive("plain", plain)
        derive("cut", cut)
        derive("seeded", seeded)
        derive("seeded_uniforms", _seeded_uniforms(self.seeds[random[seeded]], self.positions[random[seeded]]))
        derive("plain_rows", random[plain])
        derive("cut_rows", random[cut])
        derive("cut_top_k", self.top_k[random[cut]])
        derive("cut_top_p", self.top_p[random[cut]])
        derive("most_logprobs", int(self.num_logprobs.max()) if rows[0] else 0)
        draws = np.full(rows, DRAW_GREEDY, dtype=np.uint8)
        draws[random[plain]] = DRAW_PLAIN
        draws[random[cut]] = DRAW_CUT
        derive("draws", draws)

    @classmethod
    def of(
        cls, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, seeds: np.ndarray, positions: np.ndarray,
        num_logprobs: np.ndarray | None = None,
    ) -> HostRows:  # fmt: skip
        wanted = np.zeros(temperature.shape[0], dtype=np.uint8) if num_logprobs is None else num_logprobs
        return cls(
            temperature.astype(np.float32), top_p.astype(np.float32), top_k.astype(np.int64), seeds.astype(np.int64),
            positions.astype(np.int64), wanted,
        )  # fmt: skip

    @property
    def greedy(self) -> np.ndarray:
        """bool[m]: temperature 0."""
        return self.temperature <= 0

    @property
    def filtered(self) -> np.ndarray:
        """bool[m]: top-k or top-p cuts the vocabulary."""
        return (self.top_k > 0) | (self.top_p < 1)

    def one_position_on(self) -> HostRows:
        """The same rows one position on: the next forward of a step of several, made for each of
        them where the step is staged (StepInputs.later). Only the seeded uniforms depend on the
        position, so only they are derived again."""
        later = copy.copy(self)
        positions = self.positions + 1
        seeded = self.random[self.seeded]
        object.__setattr__(later, "positions", positions)
        object.__setattr__(later, "seeded_uniforms", _seeded_uniforms(self.seeds[seeded], positions[seeded]))
        return later

    def by_row(self, uniforms: np.ndarray) -> np.ndarray:
        """uniforms (one per random row, in `random`'s order) at each row's place, 0 for greedy rows."""
        if self.random.shape[0] == self.temperature.shape[0]:  # every row random: in row order already
            return uniforms
        out = np.zeros(self.temperature.shape[0], dtype=np.float32)
        out[self.random] = uniforms
        return out

    def uniforms(self, unseeded: np.ndarray | None = None) -> np.ndarray:
        """float32[random rows]: one uniform in [0, 1) per random row, in `random`'s order: an
        unseeded row's from `unseeded` (draw_unseeded's, made ahead) or, without it, drawn here; a
        seeded row's the one its seed gives at its position."""
        uniforms = draw_unseeded(1, self.random.shape[0])[0] if unseeded is None else unseeded
        if self.seeded.shape[0]:
            uniforms = uniforms.copy()  # `unseeded` stays as the step was staged
            uniforms[self.seeded] = self.seeded_uniforms
        return uniforms


def draw_unseeded(forwards: int, rows: int) -> np.ndarray:
    """float32[forwards, rows]: the uniforms of `rows` random rows in each of `forwards` forwards,
    from torch's default generator (which --seed seeds), forward after forward: the same numbers,
    in the same order, as one draw of `rows` per forward (torch draws a CPU tensor's elements in
    order)."""
    return torch.rand(forwards, rows).numpy()


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row parameters, one entry per logits row: what a device's arithmetic reads on the logits'
    device, and the same rows on the host, which the branches, the seeded draws and a CPU's
    arithmetic read. A step's is made where its PREPARE is staged (executor.inputs), a later
    forward's of its frame too, checked here then, so that the sample between two forwards checks
    only the logits' rows (but for a batch that logits processing is added to there, which derives
    `drawn` again: a step with processing takes the passes, whose cost dwarfs it)."""

    temperature: torch.Tensor  # float32[m]; 0 means greedy
    top_p: torch.Tensor  # float32[m]; 1 means off
    top_k: torch.Tensor  # int[m]; 0 means off
    host: HostRows  # the same rows, with their seeds, positions, alternatives wanted and draws
    processing: LogitsProcessing | None = None  # None: no row asks for any
    # float32[f, random rows]: the unseeded uniforms of this forward (the first) and of the later
    # forwards of its step, drawn where the step is staged (draw_unseeded), off the time between two
    # forwards, where torch's draw of a few numbers took ~28 us on a CPU (docs/control_plane.md,
    # change 87); None: sample() draws them.
    unseeded: np.ndarray | None = None
    # This forward's uniform of each random row, derived with the batch (where the step is staged,
    # a later forward's too): cold after a forward, deriving them took ~19 us of the gap (bench_step
    # --num-scheduler-steps 16, marked). None where the batch has random rows and no draws made
    # ahead: uniforms() draws them then.
    drawn: np.ndarray | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows = self.host.temperature.shape[0]
        for name in ("temperature", "top_p", "top_k"):
            got = getattr(self, name).shape
            if got != (rows,):
                raise SamplingError(f"{name} has shape {tuple(got)}, expected ({rows},): the host rows describe {rows} rows")
        u = self.unseeded
        if u is not None and (u.dtype != np.float32 or u.ndim != 2 or u.shape[0] < 1 or u.shape[1] != self.host.random.shape[0]):
            raise SamplingError(
                f"unseeded uniforms of shape {u.shape} ({u.dtype}) for {self.host.random.shape[0]} random rows: "
                "float32[forwards, random rows] expected"
            )
        if not self.host.random.shape[0]:
            object.__setattr__(self, "drawn", _NONE_DRAWN)
        elif u is not None:
            object.__setattr__(self, "drawn", self.host.uniforms(u[0]))

    def one_position_on(self) -> SamplingBatch:
        """The batch of the next forward of a step of several (HostRows.one_position_on), with
        that forward's uniforms first; no processing (the next forward's is made from the states
        then)."""
        unseeded = None if self.unseeded is None or self.unseeded.shape[0] == 1 else self.unseeded[1:]
        return SamplingBatch(self.temperature, self.top_p, self.top_k, self.host.one_position_on(), unseeded=unseeded)

    def uniforms(self) -> np.ndarray:
        """This forward's uniform of each random row (HostRows.uniforms): `drawn`, or drawn now."""
        return self.host.uniforms() if self.drawn is None else self.drawn

    def rows(self, index: np.ndarray) -> SamplingBatch:
        """The rows at `index` alone, with no logits processing (the caller's rows have none): the
        rows the compiled pass leaves (a flat row whose buffers could not be had), whose host rows
        are derived again here, between two forwards, as the passes' cost dwarfs it."""
        h = self.host
        host = HostRows(h.temperature[index], h.top_p[index], h.top_k[index], h.seeds[index], h.positions[index], h.num_logprobs[index])
        rows = to_device(index, self.temperature.device)
        return SamplingBatch(self.temperature[rows], self.top_p[rows], self.top_k[rows], host)

    @classmethod
    def of(
        cls, temperature: object, top_p: object, top_k: object, seeds: object, positions: object, *, device: torch.device | str = "cpu",
        processing: LogitsProcessing | None = None, num_logprobs: np.ndarray | None = None,
    ) -> SamplingBatch:  # fmt: skip
        """From host values (sequences, arrays, CPU tensors): the tensors on `device`, the host rows."""
        t, p, k = np.asarray(temperature, np.float32), np.asarray(top_p, np.float32), np.asarray(top_k, np.int64)
        tensors = (to_device(a, device) for a in (t, p, k))
        return cls(*tensors, HostRows.of(t, p, k, np.asarray(seeds), np.asarray(positions), num_logprobs), processing)


@dataclass(frozen=True)
class SampleOutput:
    token_ids: torch.Tensor  # int64[m]; 0 where finite is False
    # float32[m]; log_softmax of the processed, temperature-scaled row; nan where not finite
    logprobs: torch.Tensor
    finite: torch.Tensor  # bool[m]; False: the logits row held a NaN or an inf (or nothing samplable)
    # [m, k] for the largest k asked for, most likely first, from the same log_softmax (ids 0 and
    # logprobs nan where not finite); None when no row asked.
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class HostOutputs:
    """Where the compiled pass writes one forward's sample on a CPU: its arrays, and `out`, the
    SampleOutput of torch views of the same memory. A step's are made where it is staged (one per
    forward of a frame, StagedStep.outputs): between two forwards, making them took ~15-20 us cold
    (three arrays and three tensors over them; bench_step --num-scheduler-steps 16, marked)."""

    tokens: np.ndarray  # int64[m]
    logprobs: np.ndarray  # float32[m]
    finite: np.ndarray  # uint8[m]
    top_ids: np.ndarray  # int64[m, width] (ids 0 until drawn); _NO_ALTERNATIVES' when width is 0
    top_logprobs: np.ndarray  # float32[m, width] (NaN until drawn)
    out: SampleOutput

    def wrote(self, out: SampleOutput) -> bool:
        """Whether `out` is this one's: the compiled pass wrote the sample into these arrays (sample()
        returns another output where the logits could not take the pass)."""
        return self.out is out

    @classmethod
    def frame(cls, forwards: int, rows: int, width: int) -> tuple[HostOutputs, ...]:
        """One per forward, each over its row of one array of each kind."""
        shape = (forwards, rows)
        tokens, logprobs, finite = np.empty(shape, np.int64), np.empty(shape, np.float32), np.empty(shape, np.uint8)
        if width:
            top_ids, top_logprobs = np.zeros((forwards, rows, width), np.int64), np.full((forwards, rows, width), np.nan, np.float32)
        made = []
        for f in range(forwards):
            ids, lps = (top_ids[f], top_logprobs[f]) if width else _NO_ALTERNATIVES
            out = SampleOutput(
                token_ids=torch.from_numpy(tokens[f]), logprobs=torch.from_numpy(logprobs[f]), finite=torch.from_numpy(finite[f].view(np.bool_)),
                top_ids=torch.from_numpy(ids) if width else None, top_logprobs=torch.from_numpy(lps) if width else None,
            )  # fmt: skip
            made.append(cls(tokens[f], logprobs[f], finite[f], ids, lps, out))
        return tuple(made)


def row_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from a request seed and a position (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample(logits: torch.Tensor, params: SamplingBatch, into: HostOutputs | None = None) -> SampleOutput:
    """`into`: on a CPU, where the compiled pass writes (its `out` is returned then, unless the
    logits cannot take the pass); made for these rows and the alternatives the greediest wants."""
    if logits.dim() != 2:
        raise SamplingError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    if params.temperature.shape[0] != rows:  # the batch agrees with itself (SamplingBatch checks it)
        raise SamplingError(f"temperature has shape {tuple(params.temperature.shape)}, expected ({rows},) for {rows} rows")
    # A batch without alternatives has top_ids of shape (0,) (_NO_ALTERNATIVES'): its last dimension 0 too.
    if into is not None and (into.tokens.shape[0] != rows or into.top_ids.shape[-1] != params.host.most_logprobs):
        raise SamplingError(f"outputs made for {into.tokens.shape[0]} rows of {into.top_ids.shape[-1]} alternatives, not this batch's")
    # Nothing here is differentiated: a tensor that requires grad is read as its data (the passes
    # read logits.numpy(), which refuses one). The dtype is read first: a call of float() on
    # float32 logits costs ~6 us more cold, for nothing. is_cpu, not device.type: the torch.device
    # made for the latter cost ~25 us more right after an idle (docs/control_plane.md, change 110).
    if logits.requires_grad:
        logits = logits.detach()
    if logits.dtype is not torch.float32:
        logits = logits.float()
    if logits.is_cpu:
        return _sample_on_host(logits, params, into)
    if into is not None:
        raise SamplingError("outputs made on the host for a sample on a device")
    return _sample_on_device(logits, params)


def _sample_on_device(logits: torch.Tensor, params: SamplingBatch) -> SampleOutput:
    """Every row in torch ops queued on the device, with nothing read back (the module says why)."""
    host = params.host
    finite = torch.isfinite(logits).all(dim=-1)
    if params.processing is not None:
        logits = process_logits(logits, params.processing)
        # A penalty may still overflow a huge logit to +inf, and banning every token leaves nothing
        # to sample: such a row is not sampled either.
        finite &= torch.isfinite(logits.amax(dim=-1))
    # A non-finite row is flagged, not sampled; zeroing it keeps NaN out of every reduction below.
    # The zeroing pass costs less than the sync that asking whether it is needed would.
    safe = torch.where(finite.unsqueeze(1), logits, torch.zeros((), device=logits.device))
    random = host.random
    if not random.shape[0]:
        scaled = safe  # greedy rows report the unscaled log-softmax
    else:
        temperature = torch.where(params.temperature <= 0, torch.ones_like(params.temperature), params.temperature)
        scaled = safe / temperature.float().unsqueeze(1)
    # Whole-vocabulary passes are most of a step's sampling cost: one fused log_softmax gives every
    # row's logprob and the random rows' probabilities.
    log_probs = torch.log_softmax(scaled, dim=-1)
    finite &= ~torch.isnan(log_probs[:, 0])  # _overflowed says why; a pass over a column, no read
    if random.shape[0] < logits.shape[0]:
        tokens = argmax_rows(safe)
    else:
        tokens = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    if random.shape[0]:
        random_rows = to_device(random, logits.device)
        drawn = _draw(
            _rows(_min_p_filtered(log_probs, params.processing), random_rows).exp(),
            params.top_k[random_rows],
            params.top_p[random_rows],
            to_device(params.uniforms(), logits.device),
            host,
        )
        tokens = tokens.index_put((random_rows,), drawn)
    tokens = torch.where(finite, tokens, torch.zeros_like(tokens))
    logprobs = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    logprobs = torch.where(finite, logprobs, torch.full_like(logprobs, float("nan")))
    top_ids, top_logprobs = _alternatives(log_probs, host, finite)
    return SampleOutput(token_ids=tokens, logprobs=logprobs, finite=finite, top_ids=top_ids, top_logprobs=top_logprobs)


def _sample_on_host(logits: torch.Tensor, params: SamplingBatch, into: HostOutputs | None = None) -> SampleOutput:
    """The same rows on a CPU: each row that no logits processing touches in one compiled pass
    (_sample_compiled), the others in torch, numpy and the compiled calls (the module says which
    does what). Which way a row goes depends on that row alone, so that its token, logprob and
    alternatives never depend on the rows beside it. The random rows' uniforms are drawn once."""
    host = params.host
    uniforms = params.uniforms()
    if _sampling is None or not logits.is_contiguous():
        return _sample_in_passes(logits, params, uniforms)
    draws = host.draws
    if params.processing is not None:
        draws = draws.copy()
        draws[_processed_rows(params.processing, draws.shape[0])] = DRAW_ELSEWHERE
        if (draws == DRAW_ELSEWHERE).all():
            return _sample_in_passes(logits, params, uniforms)
    compiled, left = _sample_compiled(logits, host, uniforms, draws, into=into)
    if left is None:
        return compiled
    if params.processing is None:  # the passes take those rows alone
        part = params.rows(left)
        passes = _sample_in_passes(logits[torch.from_numpy(left)], part, host.by_row(uniforms)[left][part.host.random])
        at: slice | np.ndarray = slice(None)
    else:  # its row indices are the processing's: the passes take the batch
        passes, at = _sample_in_passes(logits, params, uniforms), left
    for name in ("token_ids", "logprobs", "finite"):
        getattr(compiled, name).numpy()[left] = getattr(passes, name).numpy()[at]
    if passes.top_ids is not None:  # the compiled call's are as wide as the batch's greediest row wants: no narrower
        width = passes.top_ids.shape[1]
        compiled.top_ids.numpy()[left, :width] = passes.top_ids.numpy()[at]
        compiled.top_logprobs.numpy()[left, :width] = passes.top_logprobs.numpy()[at]
    return compiled


def _processed_rows(p: LogitsProcessing, rows: int) -> np.ndarray:
    """bool[rows]: the rows that some logits processing touches."""
    touched = np.zeros(rows, dtype=np.bool_)
    for index in (p.bias_rows, p.banned_rows, p.penalty_rows, p.grammar_rows, p.min_p_rows):
        if index is not None and index.numel():
            touched[index.cpu().numpy()] = True
    return touched


def _sample_compiled(
    logits: torch.Tensor, host: HostRows, uniforms: np.ndarray, draws: np.ndarray, threads: int = _PASS_THREADS,
    into: HostOutputs | None = None,
) -> tuple[SampleOutput, np.ndarray | None]:
    """The rows `draws` does not leave elsewhere, in one compiled call: per row a pass for the
    finite check and the largest logit, one that sums the exponentials and gathers the candidates,
    and where the row wants alternatives one that keeps its most likely tokens (change 89), where
    the passes below write the scaled rows and a table of logprobs and read them
    back (~7 times the logits' bytes; at sixteen rows of 49,152 after a real forward, 2.4 ms of a
    3.1 ms gap, docs/control_plane.md). Its exponential is executor/_sampling.c's own: logprobs agree
    with torch's log_softmax to float32 rounding, tokens except where a uniform or a top-p cut falls
    within that rounding of a token's edge. A large batch's rows are drawn on up to `threads` threads
    (sixteen rows of 49,152 after a real forward on two: 1.4 ms between two forwards instead of 2.0,
    docs/control_plane.md, change 85); a cut row whose first candidates (up to _PASS_ROOM) do not
    decide it, a flat one, is drawn among all its tokens (change 86). The alternatives are as wide
    as the greediest row wants for every row that wants some, as the passes' topk makes them (ids 0
    and logprobs NaN for the others, and for the rows left). Returns the output and the rows it left
    (those `draws` leaves elsewhere; a flat row too where its buffers could not be had), None when it
    drew every row."""
    rows, vocab = logits.shape
    width = host.most_logprobs
    if into is None:
        into = HostOutputs.frame(1, rows, width)[0]
    tokens, logprobs, finite, top_ids, top_logprobs = into.tokens, into.logprobs, into.finite, into.top_ids, into.top_logprobs
    # By address (the C file says why), so what a buffer's checks would refuse is refused here: the
    # C code reads rows x vocab float32 from it, and this frame holds the tensor through the call.
    as_read = logits.is_cpu and logits.dtype is torch.float32 and logits.layout is torch.strided
    if not (as_read and logits.is_contiguous() and not logits.is_neg()):
        raise TypeError(
            "the compiled pass reads contiguous float32 logits in the host's memory, as they are (no negative view): "
            f"not {logits.dtype} on {logits.device}, {logits.layout}, contiguous {logits.is_contiguous()}, negative {logits.is_neg()}"
        )
    left = _sampling.sample_rows(
        (logits.data_ptr(), rows), vocab, host.scale, draws, host.top_k, host.top_p, host.by_row(uniforms),
        _FIRST_LOG_RATIO, _LOG_MARGIN_32, CANDIDATE_RATIOS[0], min(vocab, _PASS_ROOM), tokens, logprobs, finite,
        host.num_logprobs, width, top_ids, top_logprobs, threads,
    )  # fmt: skip
    return into.out, (np.flatnonzero(tokens < 0) if left else None)


def _sample_in_passes(logits: torch.Tensor, params: SamplingBatch, uniforms: np.ndarray) -> SampleOutput:
    """The rows in torch, numpy and the compiled calls (the module says which does what), with a
    branch wherever it saves a pass, since reading a value here waits for nothing. What the rows'
    parameters decide (which rows draw how, each row's scale, the seeded uniforms) comes made with
    the host rows."""
    host = params.host
    rows, vocab = logits.shape
    # A batch at temperature 1 (OpenAI's default) and greedy rows skip a pass: x / 1 is x. So greedy
    # rows of `scaled` are their logits (non-finite rows zeroed), whichever way it is made.
    if params.processing is None and _sampling is not None and logits.is_contiguous():
        finite, scaled = _finite_scaled_compiled(logits, host.scale, host.dividing)
    else:
        finite = _finite_rows(logits)
        if params.processing is not None:
            logits = process_logits(logits, params.processing)
            finite &= np.isfinite(logits.amax(dim=-1).numpy())
        safe = _zero_rows(logits, finite)
        scaled = safe / torch.from_numpy(host.scale).unsqueeze(1) if host.dividing else safe
    log_probs = torch.log_softmax(scaled, dim=-1)
    table = log_probs.numpy()
    overflowed = _overflowed(table) & finite
    if overflowed.any():
        # Nothing to sample in them: a uniform row keeps the draws below well defined, and the
        # rows are flagged (their tokens 0, their logprobs NaN) like any other non-finite row.
        finite &= ~overflowed
        log_probs[torch.from_numpy(overflowed)] = -math.log(vocab)
    random = host.random
    tokens = argmax_rows(scaled).numpy() if random.shape[0] < rows else np.zeros(rows, dtype=np.int64)
    if random.shape[0]:
        drawn = _min_p_filtered(log_probs, params.processing)
        if host.plain.shape[0]:
            weights = _rows(drawn, host.plain_rows).exp()
            tokens[host.plain_rows] = _draw_plain(weights, torch.from_numpy(uniforms[host.plain])).numpy()
        if host.cut.shape[0]:
            k = np.where(host.cut_top_k > 0, host.cut_top_k, vocab)
            tokens[host.cut_rows] = _draw_candidates(_rows(drawn.numpy(), host.cut_rows), k, host.cut_top_p, uniforms[host.cut])
    logprobs = table[np.arange(rows), tokens]
    if not finite.all():
        tokens[~finite] = 0
        logprobs[~finite] = np.nan
    finite_rows = torch.from_numpy(finite)
    top_ids, top_logprobs = _alternatives(log_probs, host, finite_rows)
    return SampleOutput(
        token_ids=torch.from_numpy(tokens), logprobs=torch.from_numpy(logprobs), finite=finite_rows,
        top_ids=top_ids, top_logprobs=top_logprobs,
    )  # fmt: skip


def process_logits(logits: torch.Tensor, p: LogitsProcessing) -> torch.Tensor:
    """logits after logit bias, banned tokens and the penalties (a new tensor; logits is unchanged)."""
    out = logits.clone()
    if p.bias_rows.numel():
        out.index_put_((p.bias_rows, p.bias_ids), p.bias_values, accumulate=True)
    if p.banned_rows.numel():
        out.index_put_((p.banned_rows, p.banned_ids), out.new_full((), float("-inf")))  # no copy from the host
    if p.grammar_rows is not None:
        if p.grammar_rows.shape[0] == out.shape[0]:  # every row (ascending, unique): in place
            out.masked_fill_(p.forbidden, float("-inf"))
        else:
            masked = out.index_select(0, p.grammar_rows).masked_fill_(p.forbidden, float("-inf"))
            out.index_copy_(0, p.grammar_rows, masked)
    if p.penalty_rows.numel():
        rows = out.index_select(0, p.penalty_rows)
        counts = torch.zeros_like(rows)
        if p.output_rows.numel():
            ones = torch.ones_like(p.output_ids, dtype=rows.dtype)
            counts.index_put_((p.output_rows, p.output_ids), ones, accumulate=True)
        in_output = counts > 0
        seen = in_output.clone()
        if p.prompt_rows.numel():
            seen[p.prompt_rows, p.prompt_ids] = True
        repetition = torch.where(seen, p.repetition.unsqueeze(1), torch.ones((), device=rows.device))
        rows = torch.where(rows > 0, rows / repetition, rows * repetition)
        rows -= p.frequency.unsqueeze(1) * counts
        rows -= p.presence.unsqueeze(1) * in_output
        out[p.penalty_rows] = rows
    return out


def _min_p_filtered(log_probs: torch.Tensor, p: LogitsProcessing | None) -> torch.Tensor:
    """log_probs with each min_p row's tokens under min_p x its most likely one's probability set
    to -inf (a new tensor when any row has min_p; the reported logprobs keep the whole row)."""
    if p is None or p.min_p_rows is None:
        return log_probs
    rows = log_probs.index_select(0, p.min_p_rows)
    floor = rows.amax(dim=-1, keepdim=True) + torch.log(p.min_p).unsqueeze(1)
    return log_probs.index_copy(0, p.min_p_rows, rows.masked_fill(rows < floor, float("-inf")))


def _alternatives(log_probs: torch.Tensor, host: HostRows, finite: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The most likely tokens of each row that wants alternatives, and their logprobs, as many as
    the greediest row wants (a row that wants fewer reads a prefix; one that wants none, zeros)."""
    k = host.most_logprobs
    if k == 0:
        return None, None
    rows = to_device(host.num_logprobs.nonzero()[0], log_probs.device)
    values, ids = _rows(log_probs, rows).topk(k, dim=-1)
    keep = finite[rows].unsqueeze(1)
    top_ids = torch.zeros(log_probs.shape[0], k, dtype=torch.long, device=log_probs.device)
    top_logprobs = torch.full((log_probs.shape[0], k), float("nan"), dtype=log_probs.dtype, device=log_probs.device)
    top_ids[rows] = torch.where(keep, ids, torch.zeros_like(ids))
    top_logprobs[rows] = torch.where(keep, values, torch.full_like(values, float("nan")))
    return top_ids, top_logprobs


def _rows(t: torch.Tensor | np.ndarray, index: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """t's rows at `index` (ascending, unique: from nonzero; a tensor's or an array's alike), without
    a copy when that is all of them: a copy of [rows, vocab] costs as much as a pass over it."""
    if index.shape[0] == t.shape[0]:
        return t
    return t[torch.from_numpy(index)] if isinstance(t, torch.Tensor) and isinstance(index, np.ndarray) else t[index]


def argmax_rows(t: torch.Tensor) -> torch.Tensor:
    """Each row's first largest column, as torch.argmax gives it. On the CPU through numpy, whose
    argmax is vectorized where torch's CPU argmax is a scalar loop: scripts/bench_step.py's pieces
    measure both (sample_*_greedy_us and argmax_*_us)."""
    if t.device.type != "cpu":
        return t.argmax(dim=-1)
    return torch.from_numpy(t.detach().numpy().argmax(axis=-1))


def _finite_scaled_compiled(logits: torch.Tensor, scale: np.ndarray, dividing: bool) -> tuple[np.ndarray, torch.Tensor]:
    """_finite_rows and the division by the temperature (non-finite rows zeroed) in one compiled
    pass: torch's sum, isfinite and division were ~50 us for 16 rows of 256 right after a sleeping
    forward, the compiled pass ~10. At 49,152 columns the two are alike (one pass on one thread
    against two on two). Without a division, non-finite rows are zeroed by torch, as before."""
    rows, vocab = logits.shape
    finite = np.empty(rows, np.uint8)
    out = np.empty((rows, vocab), np.float32) if dividing else None
    bad = _sampling.finite_scaled(logits.detach().numpy(), vocab, scale, out, finite)  # the count of non-finite rows
    finite = finite.view(np.bool_)
    if out is not None:
        return finite, torch.from_numpy(out)
    return finite, (_zero_rows(logits, finite) if bad else logits)


def _zero_rows(logits: torch.Tensor, finite: np.ndarray) -> torch.Tensor:
    """logits with its non-finite rows zeroed (a new tensor only when there are any)."""
    return logits if finite.all() else logits.masked_fill(torch.from_numpy(~finite).unsqueeze(1), 0.0)


def _overflowed(log_probs: np.ndarray) -> np.ndarray:
    """Rows whose log_softmax is NaN: finite logits that the temperature still scaled past float32
    (protocol.sampling_limits: logits over ~3.4e33 at the lowest temperature). A +inf or NaN
    anywhere in a row makes all of its log_softmax NaN, so its first column says it."""
    return np.isnan(log_probs[:, 0])


def _finite_rows(logits: torch.Tensor) -> np.ndarray:
    """torch.isfinite(logits).all(dim=-1) of CPU logits, without its cost on the common all-finite batch.

    A row whose sum is finite holds no NaN and no inf (either would make the sum NaN or inf); only
    rows whose sum is not finite (a NaN, an inf, or a finite overflow) are checked element-wise.
    """
    finite = np.isfinite(logits.sum(dim=-1).numpy())
    if not finite.all():
        suspect = np.flatnonzero(~finite)
        finite[suspect] = torch.isfinite(logits[torch.from_numpy(suspect)]).all(dim=-1).numpy()
    return finite


def _seeded_uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Each seeded row's uniform in [0, 1): the top 24 bits of its row_seed, which a float32 holds
    exactly (a generator of its own per row cost ~8 us a row)."""
    values = [(row_seed(seed, position) >> 40) * 2.0**-24 for seed, position in zip(seeds.tolist(), positions.tolist())]
    return np.array(values, dtype=np.float32)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column index per row, drawn with probability proportional to the row's weights."""
    cdf = weights.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    # right=True skips zero-weight columns: their cdf equals their predecessor's, never above target.
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return picked.clamp_(max=weights.shape[1] - 1)


def _draw_plain(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """_inverse_cdf over whole rows (random rows that neither top-k nor top-p cuts). On a CPU
    through block sums: the block that holds the row's target, then the column within it. A prefix
    sum over the whole vocabulary is one sequential pass there (torch's CPU cumsum accumulates in
    float64, 550 us for 16 x 49152 on a 2-core Xeon), its block sums a vectorized one (~140 us). On
    a GPU the scan is one fast kernel, and the blocks' dozen small ones would cost more."""
    rows, vocab = probs.shape
    if probs.device.type != "cpu" or vocab % _PLAIN_BLOCK or vocab < _PLAIN_MIN_VOCAB:
        return _inverse_cdf(probs, uniforms)
    sums = probs.reshape(rows, vocab // _PLAIN_BLOCK, _PLAIN_BLOCK).sum(dim=-1)
    before = sums.cumsum(dim=-1)
    targets = uniforms * before[:, -1]
    block = torch.searchsorted(before, targets.unsqueeze(1), right=True).clamp_(max=sums.shape[1] - 1)
    before = before.gather(1, block) - sums.gather(1, block)  # the mass of the blocks before it
    columns = block * _PLAIN_BLOCK + torch.arange(_PLAIN_BLOCK)
    inner = probs.gather(1, columns).cumsum(dim=-1)
    # The block's own prefix sums may end a rounding short of the target its sum put in it: then the
    # block's last column of any weight, never one of none.
    within = torch.minimum((targets.unsqueeze(1) - before).clamp_(min=0.0), inner[:, -1:].nextafter(torch.zeros(())))
    # Clamped as _inverse_cdf is: a row whose whole weight is a denormal can round u * total up to it.
    picked = torch.searchsorted(inner, within, right=True).clamp_(max=_PLAIN_BLOCK - 1)
    return (block * _PLAIN_BLOCK + picked).squeeze(1)


def _draw(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor, host: HostRows
) -> torch.Tensor:
    """A device's random rows: plain ones over the whole row, top-k / top-p ones sorted whole
    (host.plain and host.cut: which of the random rows are which)."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    if host.plain.shape[0]:
        plain = to_device(host.plain, probs.device)
        out[plain] = _draw_plain(_rows(probs, plain), uniforms[plain])
    if host.cut.shape[0]:
        rows = to_device(host.cut, probs.device)
        row_k = top_k[rows].long()
        k = torch.where(row_k > 0, row_k, torch.full_like(row_k, probs.shape[1]))
        out[rows] = _draw_sorted(_rows(probs, rows), k, top_p[rows], uniforms[rows])
    return out


def _draw_sorted(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The filtered draw over every row sorted whole, with no read of a device value (the module
    says why a GPU takes it). The candidates are a prefix of this order, ties in id order in both,
    so its tokens are the candidates' draw's."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(sorted_probs.shape[1], device=sorted_probs.device).unsqueeze(0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # The most likely token always survives: its mass_before is 0, never above top_p.
    dropped = (top_p < 1).unsqueeze(1) & (mass_before > top_p.unsqueeze(1))
    keep = (rank < k.unsqueeze(1)) & ~dropped
    picked = _inverse_cdf(sorted_probs * keep, uniforms)
    return order.gather(1, picked.unsqueeze(1)).squeeze(1)


def _draw_candidates(log_probs: np.ndarray, k: np.ndarray, top_p: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """The filtered draw on a CPU, where a sort of the vocabulary costs 10-100x a pass: among each
    row's candidates, widened until they hold its nucleus. Peaked rows, the usual case, are all
    drawn in the first round. `k` is each row's top-k, the vocabulary where it has none; the
    arithmetic is _draw_sorted's, in the same float32 steps (a cumulative sum accumulated in
    float64, as torch's CPU cumsum is), so that it picks the same tokens from the same
    probabilities."""
    if _sampling is not None and log_probs.flags.c_contiguous:
        out = _first_round_compiled(log_probs, k, top_p, uniforms)
        pending = np.flatnonzero(out < 0)  # numpy's rounds take these from the first: a row's path is its own
        if not pending.shape[0]:
            return out
    else:
        out = np.empty(log_probs.shape[0], dtype=np.int64)
        pending = np.arange(log_probs.shape[0])  # the rows not drawn yet
    for ratio in CANDIDATE_RATIOS:
        rows = _rows(log_probs, pending)
        row_k, row_p, row_u = k[pending], top_p[pending], uniforms[pending]
        row_of, ids, values = _candidates(rows, ratio, row_k)
        count = np.bincount(row_of, minlength=pending.shape[0])
        mass = np.bincount(row_of, weights=values, minlength=pending.shape[0])
        # The nucleus ends inside the candidates when top-k cuts there, or when they hold more than
        # top_p of the mass by more than a float32 cumulative sum's rounding (every later token then
        # has its mass_before over top_p in _draw_sorted too). Decided per row from the row alone, so
        # a seeded row's path never depends on its neighbours. top_p 1 is off.
        covered = (row_k <= count) | ((row_p < 1) & (mass > row_p.astype(np.float64) + _MASS_ROUNDING)) | (ratio == 0.0)
        if covered.all():
            out[pending] = _pick_sorted(*_sorted_by_row(row_of, ids, values, count), row_k, row_p, row_u)
            return out
        if covered.any():
            local = np.cumsum(covered) - 1  # a covered row's index among the covered rows
            keep = covered[row_of]
            sorted_probs, sorted_ids = _sorted_by_row(local[row_of[keep]], ids[keep], values[keep], count[covered])
            out[pending[covered]] = _pick_sorted(sorted_probs, sorted_ids, row_k[covered], row_p[covered], row_u[covered])
        pending = pending[~covered]
    raise AssertionError("the last round (the k most likely tokens, or every one) draws every row left")


def _first_round_compiled(log_probs: np.ndarray, k: np.ndarray, top_p: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """The first round of _draw_candidates in two compiled calls and one torch.exp (torch's, so
    that the probabilities are those a device's draw exponentiates): each row's token, or -1 where
    the round does not decide it (more candidates than _COMPILED_ROOM, or a nucleus wider than them).
    A cold numpy round was ~30 calls of 3-7 us each right after a sleeping forward."""
    rows, vocab = log_probs.shape
    room = min(vocab, _COMPILED_ROOM)
    ids, values, counts = np.empty(rows * room, np.int32), np.empty(rows * (room + 1), np.float32), np.empty(rows, np.int64)
    total = _sampling.gather(log_probs, vocab, _FIRST_LOG_RATIO, _LOG_MARGIN_32, room, ids, values, counts)
    probs = torch.from_numpy(values[: total + rows]).exp().numpy()
    out = np.empty(rows, np.int64)
    # k int64, top_p and uniforms float32, as numpy's rounds compare them (the call refuses others)
    _sampling.pick(ids, probs, counts, CANDIDATE_RATIOS[0], k, top_p, uniforms, out)
    return out


def _log_ratio(ratio: float) -> np.float32:
    """A round's floor below a row's largest logprob: the same float32 in numpy's round and the
    compiled one."""
    return np.float32(np.log(ratio))


# The compiled round's float32 constants, made once rather than at every step.
_FIRST_LOG_RATIO = float(_log_ratio(CANDIDATE_RATIOS[0]))
_LOG_MARGIN_32 = float(np.float32(_LOG_MARGIN))


def _candidates(log_probs: np.ndarray, ratio: float, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's tokens whose probability is at least `ratio` times its most likely one's, as
    (row, id, probability), row-major with ids ascending; with ratio 0 (the last round), a row's k
    most likely tokens and any that tie the k-th where k cuts it (k < vocabulary), else every token.
    They are found on the logprobs, a little below the floor, and then held to it in probabilities:
    exactly the tokens a comparison of every probability would keep, without exponentiating the rest
    of the vocabulary. A confident row (nothing else within 2**-24 of its token) under top-k 40 or
    50, as llama.cpp's and transformers' defaults are, sorted its whole vocabulary before: ~8 ms a
    row of 49,152, against ~40 us for the partition."""
    vocab = log_probs.shape[1]
    top = log_probs.max(axis=1)
    if ratio:
        floor = top + _log_ratio(ratio)
    else:
        floor = np.full(top.shape, -np.inf, dtype=np.float32)
        for row in np.flatnonzero(k < vocab).tolist():
            floor[row] = np.partition(log_probs[row], vocab - k[row])[vocab - k[row]]
    index = np.flatnonzero(log_probs >= (floor - np.float32(_LOG_MARGIN))[:, None])
    row_of, ids = np.divmod(index, vocab)
    picked = log_probs.reshape(-1)[index] if log_probs.flags.c_contiguous else log_probs[row_of, ids]
    # torch's exp, not numpy's (they differ in the last bit): the very probabilities a device's
    # draw exponentiates, and with them, in one call, what the floor in probabilities is made from:
    # the rows' most likely ones times the ratio, or the k-th's.
    exp = torch.from_numpy(np.concatenate((picked, top if ratio else floor))).exp().numpy()
    values, bound = exp[: index.shape[0]], exp[index.shape[0] :]
    keep = values >= (bound * np.float32(ratio) if ratio else bound)[row_of]
    return row_of[keep], ids[keep], values[keep]


def _sorted_by_row(
    row_of: np.ndarray, ids: np.ndarray, values: np.ndarray, count: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Candidates (row, id, probability), row-major with ids ascending, `count` of them per row ->
    [rows, widest] probabilities and ids, each row in descending probability with ties in id order,
    padded with zero probability. A stable sort of each padded row keeps the ids' order in ties (a
    lexsort of the flat candidates took 2.4x as long over flat rows' whole vocabulary)."""
    rank = np.arange(row_of.shape[0]) - (np.cumsum(count) - count)[row_of]
    negated = np.ones((count.shape[0], int(count.max())), dtype=np.float32)  # padding sorts last
    negated[row_of, rank] = -values
    order = np.argsort(negated, axis=1, kind="stable")
    padded_ids = np.zeros(negated.shape, dtype=np.int64)
    padded_ids[row_of, rank] = ids
    each_row = np.arange(count.shape[0])[:, None]
    return (-negated[each_row, order]).clip(min=0.0), padded_ids[each_row, order]


def _pick_sorted(
    sorted_probs: np.ndarray, sorted_ids: np.ndarray, k: np.ndarray, top_p: np.ndarray, uniforms: np.ndarray
) -> np.ndarray:
    """_draw_sorted's draw among the top-k / top-p survivors of rows sorted by descending
    probability, on the host."""
    mass_before = _cumsum(sorted_probs) - sorted_probs
    dropped = (top_p < 1)[:, None] & (mass_before > top_p[:, None])
    keep = (np.arange(sorted_probs.shape[1])[None, :] < k[:, None]) & ~dropped
    cdf = _cumsum(sorted_probs * keep)
    # torch.searchsorted(cdf, target, right=True): the columns at or under the row's target.
    picked = np.minimum((cdf <= (uniforms * cdf[:, -1])[:, None]).sum(axis=1), sorted_probs.shape[1] - 1)
    return sorted_ids[np.arange(sorted_ids.shape[0]), picked]


def _cumsum(a: np.ndarray) -> np.ndarray:
    """A row-wise cumulative sum as torch's CPU cumsum makes it: accumulated in float64, each
    prefix rounded to float32."""
    return np.cumsum(a, axis=1, dtype=np.float64).astype(np.float32)
