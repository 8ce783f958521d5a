"""Prompts as token ids, built from a small embedded English corpus with a seeded generator.

Token-id prompts give exact lengths and exact shared prefixes (what prefix snapshots key on), and
the same ids go to the runtime under test and to every reference. The text is plain English so that
a chat model answers it the way users' prompts are answered, rather than babbling over noise.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

SENTENCES: tuple[str, ...] = (
    "The river rises in the northern hills and reaches the sea after three hundred kilometres.",
    "Most of the town's bakeries open before dawn so that bread is ready for the first trains.",
    "A lighthouse keeper once recorded the weather every hour for forty years without a break.",
    "The committee agreed to repair the old bridge before building a new road to the harbour.",
    "Copper conducts heat well, which is why it is often used for the bottoms of cooking pans.",
    "In spring the orchard fills with bees, and the farmers move their hives between the rows.",
    "The museum's oldest map shows the coastline as it was before the great storm changed it.",
    "Children in the village learn to swim in the lake because the nearest pool is far away.",
    "A good recipe for soup starts with onions cooked slowly until they turn soft and sweet.",
    "The library keeps a list of every book that has been borrowed more than a hundred times.",
    "Engineers measured the tower each year and found that it leaned a little less after repairs.",
    "The train from the capital arrives at noon, and the return journey leaves an hour later.",
    "Many birds fly south in autumn, following the same routes that their parents used.",
    "The market sells fish in the morning and flowers in the afternoon, on the same stalls.",
    "When the power failed, the hospital switched to its generators within ten seconds.",
    "The old school was turned into a theatre, and the gymnasium became its main stage.",
    "Farmers in the valley grow rice on terraces that were built by hand centuries ago.",
    "A telescope on the mountain top watches the same patch of sky every clear night.",
    "The city council published its budget online so that residents could comment on it.",
    "Salt was once so valuable that soldiers were sometimes paid with it instead of coins.",
    "The ferry carries cars, bicycles and sheep across the strait twice a day in summer.",
    "Glass is made by heating sand with soda and lime until the mixture melts and flows.",
    "Each winter the pond freezes and the neighbours hold a skating race on its surface.",
    "The first printing press in the region produced prayer books and almanacs for farmers.",
    "A careful cook tastes the sauce before adding more salt, since it is hard to take out.",
    "The volunteers planted two thousand trees along the motorway in a single weekend.",
    "Old letters found in the attic described a journey across the desert on camels.",
    "The factory reduced its water use by half after it began recycling its cooling water.",
    "Mountain guides check the snow every morning before they lead anyone up the glacier.",
    "The orchestra rehearsed the symphony for six weeks before the first public concert.",
    "Tea was first brought to the island by sailors who traded it for wool and leather.",
    "A small change to the timetable meant that the buses no longer waited at the station.",
    "The scientist kept her notebooks in a fireproof box under the laboratory bench.",
    "On market days the square is closed to cars and filled with tables and umbrellas.",
    "The bakery's sourdough starter has been kept alive for more than seventy years.",
    "Wind turbines on the ridge supply about a third of the electricity the town uses.",
    "The chess club meets on Tuesdays, and beginners play against the older members first.",
    "Every house on the street was painted a different colour after the festival.",
    "The canal was dug to carry coal from the mines to the steelworks by the coast.",
    "A map of the underground railway hangs in every carriage, next to the doors.",
)

QUESTIONS: tuple[str, ...] = (
    "Summarize the text above in one sentence.",
    "Which place in the text would you most like to visit, and why?",
    "List three facts from the text.",
    "What is the main topic of the text above?",
    "Write a short title for the text above.",
    "Explain the text above to a child.",
)

SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant who answers briefly and precisely, in plain English.",
    "You are a travel guide. Answer in a friendly tone, mention one practical tip, and keep every answer "
    "under five sentences. If the question is about a place, describe what a visitor would see first.",
    "You are a careful editor. Read the user's text, point out anything unclear, and then answer the "
    "question that follows it. Use short paragraphs, avoid jargon, and never invent facts that the text "
    "does not state. When the text is ambiguous, say so and give the most likely reading.",
)


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class PromptBuilder:
    """Builds token-id prompts of exact lengths; every sentence is encoded once."""

    def __init__(self, tokenizer: Encoder) -> None:
        self._tokenizer = tokenizer
        self._sentences = [tokenizer.encode(" " + s, add_special_tokens=False) for s in SENTENCES]
        self._questions = [tokenizer.encode("\n" + q, add_special_tokens=False) for q in QUESTIONS]

    def body(self, rng: random.Random, length: int) -> list[int]:
        """`length` tokens of shuffled corpus sentences, cut at the exact length."""
        if length < 1:
            raise ValueError(f"a prompt body needs at least one token, got {length}")
        ids: list[int] = []
        while len(ids) < length:
            ids.extend(rng.choice(self._sentences))
        return ids[:length]

    @property
    def longest_question(self) -> int:
        return max(len(q) for q in self._questions)

    def question(self, rng: random.Random) -> list[int]:
        return list(rng.choice(self._questions))

    def system_block(self, system: str) -> list[int]:
        return self._tokenizer.encode(f"<|im_start|>system\n{system}<|im_end|>\n", add_special_tokens=False)

    def chat(self, system: str | None, user_ids: Sequence[int]) -> list[int]:
        """ChatML around already-encoded user content; the system block is a shareable prefix."""
        encode = self._tokenizer.encode
        return [
            *(self.system_block(system) if system else []),
            *encode("<|im_start|>user\n", add_special_tokens=False),
            *user_ids,
            *encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False),
        ]
