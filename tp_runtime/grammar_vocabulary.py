"""What rank 0's grammar engine (executor/grammar.py) needs of the tokenizer, from the files the
frontend's tokenizer is built from: loaded on the engine's thread when the first grammar comes, so
that a launch without structured output never pays for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tp_runtime.config import RuntimeConfig
from tp_runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from executor.grammar import GrammarVocabulary


def grammar_vocabulary(config: RuntimeConfig) -> GrammarVocabulary:
    from executor.grammar import GrammarVocabulary

    tokenizer = Tokenizer.from_model_path(config.tokenizer or config.model)
    return GrammarVocabulary(tokenizer.backend_json(), tuple(tokenizer.eos_token_ids))
