"""What every tool's report shares: percentiles, the JSON files, the report directory."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from scripts.harness.processes import REPO_ROOT


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def default_out_dir(kind: str) -> Path:
    return REPO_ROOT / "reports" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
