"""The ranges of a sequence's sampling parameters that the wire carries and the sampler is exact at.

The HTTP edge refuses anything outside them with a 400 naming the field, and executors refuse a
PREPARE whose sequences break them, naming those sequences (REJECT.seq_ids), so that one request's
parameters can never fail a batch they share with others. Measured on executor/sampler.py:
- temperature: 0 is greedy. The sampler divides logits by it; a temperature of 1e-40 is a float32
  denormal and the division overflows to inf (NaN probabilities). From 1e-5 up the scaled logits stay
  finite for any logits under ~3.4e33 (vLLM also treats temperatures under 1e-5 as a special case),
  and any finite float32 above it is exact (a flat row is a uniform draw). A row whose logits are so
  large that they overflow anyway is flagged not finite rather than sampled.
- top_p: the sampler always keeps the most likely token, so any positive float32 is exact; 1e-46
  rounds to 0 in float32, so the floor is stated where float32 represents it without denormals.
- top_k: int32 on the wire; 0 is off, any value at or above the vocabulary size is off as well.
- seed: int64 on the wire; -1 is "unseeded", so a request's seed is in [0, 2**63).
- presence and frequency penalties: OpenAI's [-2, 2]. A frequency penalty subtracts
  penalty x count, and a count is at most max_model_len, so the row stays finite.
- repetition penalty: vLLM's (> 0, 1 is off): a seen token's positive logit is divided by it, a
  negative one multiplied. As for temperature, a denormal divisor overflows, so the floor is 1e-5;
  any finite float32 above it is taken. A row that a penalty still drives to +inf (logits near
  float32's largest) is flagged not finite rather than sampled.
- logit bias: OpenAI's [-100, 100] per token, at most 300 tokens per request.
- alternatives per sampled token (top logprobs): up to 20, OpenAI's limit on chat and vLLM's
  default max_logprobs.
"""

from __future__ import annotations

TEMPERATURE_MIN = 1e-5  # besides 0 (greedy)
FLOAT32_MAX = 3.4028234663852886e38
TOP_P_MIN = 1e-6
TOP_K_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
PENALTY_MIN = -2.0  # presence and frequency
PENALTY_MAX = 2.0
REPETITION_PENALTY_MIN = 1e-5
LOGIT_BIAS_MIN = -100.0
LOGIT_BIAS_MAX = 100.0
LOGIT_BIAS_MAX_ENTRIES = 300
TOP_LOGPROBS_MAX = 20
