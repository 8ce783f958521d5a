"""What every GPU part of the device check prints: one JSON line per section, and its failures."""

from __future__ import annotations

import json


class Checks:
    """The failed checks of one part (each part's process has its own)."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, condition: bool, what: str) -> bool:
        if not condition:
            self.failures.append(what)
        return condition


def report(section: str, **values: object) -> None:
    print(json.dumps({"section": section, **values}), flush=True)
