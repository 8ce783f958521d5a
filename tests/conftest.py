"""Every test session checks that no process a test started is left running (scripts/harness)."""

pytest_plugins = ("scripts.harness.leak_check",)
