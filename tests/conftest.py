"""Every test session checks that no process a test started is left running (scripts/harness), and
runs against a disk cache of its own with compiled decode off and a fixed probe (tests/model/hermetic_cache.py)."""

pytest_plugins = ("scripts.harness.leak_check", "tests.model.hermetic_cache")
