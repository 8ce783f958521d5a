"""Errors of the executor that processes without torch catch: the CLI refuses a bad model path in a
sentence before anything imports torch (2 s of a usage error's 3)."""

from __future__ import annotations

from protocol.errors import TPRuntimeError


class ModelLoadError(TPRuntimeError):
    """A model file is missing, corrupt, or does not describe a model this runtime can run."""
