"""Per-rank executor: KV cache planes, clear_pages, the model shard, sampling and the step loop."""
