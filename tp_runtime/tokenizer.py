"""The tokenizer, built from the model's own files, and incremental detokenization.

Two sources: a GGUF file (llama.cpp's `tokenizer.ggml.*` metadata: a byte-level BPE vocabulary with
its merges, as SmolLM2 and Llama 3 ship, or a sentencepiece BPE vocabulary with scores, as Llama 2
and Mistral ship) or a Hugging Face directory (`tokenizer.json` with `tokenizer_config.json`). Both
end up as a `tokenizers.Tokenizer` built the way transformers builds it from the same files, so the
ids match and encoding and decoding run in Rust. Nothing is downloaded.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from executor.gguf_file import GGUFFile, GGUFFormatError
from protocol.errors import TPRuntimeError

_REPLACEMENT = "\ufffd"
# sentencepiece's byte-fallback tokens spell one byte each: <0x0A>.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# How many prompt tokens the detokenizer decodes as context in front of the first generated token:
# decoders that drop a leading space at the start of a text (Metaspace) need a token before it.
_DETOKENIZE_CONTEXT = 5

# llama.cpp token types (gguf.TokenType).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer splits by llama.cpp's `tokenizer.ggml.pre`; any other value (gpt2, smollm, ...) uses
# the GPT-2 byte-level split, which is what transformers builds for those files too.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS_BY_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}


class TokenizerError(TPRuntimeError, ValueError):
    """The model files do not describe a tokenizer that this runtime can build."""


class _TextBytes(dict[int, bytes]):
    """Token id -> the token's bytes in decode()'s text. An id that decode() gives no text (a
    special token, one past the vocabulary) reads b"" rather than raising, so that a sequence of
    ids is read by mapping __getitem__, a C call a token, with no Python check of each id."""

    def __missing__(self, token_id: int) -> bytes:
        return b""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


@dataclass(frozen=True)
class _GGUFTokenizerData:
    tokens: list[str]
    token_types: list[int]
    scores: list[float]
    merges: list[str]
    model: str
    pre: str
    bos_token_id: int | None
    eos_token_id: int | None
    unknown_token_id: int | None
    add_bos: bool
    chat_template: str | None


def _read_gguf_tokenizer(path: Path) -> _GGUFTokenizerData:
    try:
        values = GGUFFile(path).metadata
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    except GGUFFormatError as exc:
        raise TokenizerError(f"{path}: {exc}") from exc
    model = values.get("tokenizer.ggml.model")
    tokens = values.get("tokenizer.ggml.tokens")
    if not isinstance(model, str) or not isinstance(tokens, list):
        raise TokenizerError(f"{path} holds no tokenizer (no tokenizer.ggml.model/.tokens metadata)")
    return _GGUFTokenizerData(
        tokens=tokens,
        token_types=list(values.get("tokenizer.ggml.token_type", [])),
        scores=list(values.get("tokenizer.ggml.scores", [])),
        merges=list(values.get("tokenizer.ggml.merges", [])),
        model=model,
        pre=str(values.get("tokenizer.ggml.pre", "default")),
        bos_token_id=values.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=values.get("tokenizer.ggml.eos_token_id"),
        unknown_token_id=values.get("tokenizer.ggml.unknown_token_id"),
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        add_bos=bool(values.get("tokenizer.ggml.add_bos_token", model == "llama")),
        chat_template=values.get("tokenizer.chat_template"),
    )


def _byte_level_bpe(data: _GGUFTokenizerData) -> _HFTokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Byte-level vocabularies spell every token in the GPT-2 byte alphabet; a token written in plain
    # UTF-8 (some converters do that for added tokens) is respelled so BPE can reach it.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(data.tokens)
    }
    merges = []
    for line in data.merges:
        left, sep, right = line.partition(" ")
        if not sep:
            raise TokenizerError(f"malformed BPE merge {line!r} in the GGUF metadata")
        merges.append((left, right))
    tokenizer = _HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = _SPLITS_BY_PRE.get(data.pre)
    if split is not None:
        byte_level = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()

    # A control token spelled outside the byte alphabet is a converter's mislabel: adding it would
    # grow the vocabulary past the model's.
    return _add_special_tokens(tokenizer, data, is_control_spelling=lambda token: set(token) <= alphabet)


def _sentencepiece_bpe(data: _GGUFTokenizerData) -> _HFTokenizer:
    """Llama 2-style sentencepiece BPE: `▁` for spaces, byte-fallback tokens, merges that the file
    does not store but that its token scores imply (the higher the merged token's score, the earlier
    the merge), as transformers rebuilds them."""
    if len(data.scores) != len(data.tokens):
        raise TokenizerError("the GGUF sentencepiece vocabulary has no score per token (tokenizer.ggml.scores)")
    vocab = {token: index for index, token in enumerate(data.tokens)}
    merges: list[tuple[str, str, float]] = []
    for merged, score in zip(data.tokens, data.scores):
        pieces = [
            (merged[:cut], merged[cut:], score)
            for cut in range(1, len(merged))
            if merged[:cut] in vocab and merged[cut:] in vocab
        ]
        merges.extend(sorted(pieces, key=lambda piece: (vocab[piece[0]], vocab[piece[1]])))
    merges.sort(key=lambda piece: (piece[2], len(piece[0]), len(piece[1])), reverse=True)
    unknown = None if data.unknown_token_id is None else data.tokens[data.unknown_token_id]
    tokenizer = _HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for left, right, _ in merges],
            unk_token=unknown,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return _add_special_tokens(tokenizer, data, is_control_spelling=lambda token: True)


def _add_special_tokens(tokenizer: _HFTokenizer, data: _GGUFTokenizerData, is_control_spelling) -> _HFTokenizer:
    types = data.token_types or [0] * len(data.tokens)
    # Control tokens (<|im_start|>, </s>, ...) must stay whole in text and vanish on decode;
    # user-defined ones stay whole but are ordinary text.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(data.tokens, types)
            if kind == _TOKEN_CONTROL and is_control_spelling(token)
        ]
    )
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(data.tokens, types)
            if kind == _TOKEN_USER_DEFINED and token in vocab
        ]
    )
    if data.add_bos and data.bos_token_id is not None:
        bos = data.tokens[data.bos_token_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, data.bos_token_id)]
        )
    return tokenizer


# tokenizer.ggml.model -> builder: "gpt2" is byte-level BPE (SmolLM2, Llama 3), "llama" is
# sentencepiece BPE (Llama 2, Mistral).
_GGUF_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _token_name(entry: object) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


class Tokenizer:
    """Text <-> token ids for one model, plus what the frontend needs around them."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ):
        self._backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template

    @classmethod
    def from_model_path(cls, path: str | Path) -> Tokenizer:
        """A `.gguf` file, or a directory holding `tokenizer.json`."""
        path = Path(path)
        if path.is_dir():
            return cls._from_hf_dir(path)
        if path.is_file():
            return cls._from_gguf(path)
        raise TokenizerError(f"no model at {path}: expected a .gguf file or a directory")

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        data = _read_gguf_tokenizer(path)
        builder = _GGUF_BUILDERS.get(data.model)
        if builder is None:
            raise TokenizerError(
                f"{path} describes a {data.model!r} tokenizer; GGUF tokenizers of type "
                f"{', '.join(sorted(_GGUF_BUILDERS))} are built. Use a Hugging Face directory with "
                "tokenizer.json instead."
            )
        backend = builder(data)
        eos = () if data.eos_token_id is None else (data.eos_token_id,)
        return cls(
            backend,
            bos_token_id=data.bos_token_id,
            eos_token_ids=eos,
            chat_template=data.chat_template,
        )

    @classmethod
    def _from_hf_dir(cls, path: Path) -> Tokenizer:
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{path} has no tokenizer.json")
        backend = _HFTokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        chat_template = config.get("chat_template")
        template_file = path / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text()
        if isinstance(chat_template, list):
            # A list of named templates: the plain chat one is called "default".
            named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
            chat_template = named.get("default")

        def token_id(entry: object) -> int | None:
            name = _token_name(entry)
            return None if name is None else backend.token_to_id(name)

        eos_ids: list[int] = []
        first_eos = token_id(config.get("eos_token"))
        if first_eos is not None:
            eos_ids.append(first_eos)
        # Llama 3 ends a chat turn with <|eot_id|> but names <|end_of_text|> as its eos token: the
        # generation config lists both.
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        for extra in generation_eos if isinstance(generation_eos, list) else [generation_eos]:
            if isinstance(extra, int) and extra not in eos_ids:
                eos_ids.append(extra)
        return cls(
            backend,
            bos_token_id=token_id(config.get("bos_token")),
            eos_token_ids=tuple(eos_ids),
            chat_template=chat_template if isinstance(chat_template, str) else None,
        )

    def to_json(self) -> str:
        """The tokenizer as a Hugging Face tokenizer.json, which _from_hf_dir reads back."""
        return self._backend.to_str()

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if not self.eos_token_ids else self._backend.id_to_token(self.eos_token_ids[0])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens adds what the model's files ask for (a BOS, if any); a prompt
        rendered by a chat template already carries its special tokens, so pass False."""
        # encode_batch_fast gives the same ids but releases the GIL while the Rust tokenizer works,
        # and encode does not (docs/http_api.md measures the three): a long prompt tokenized on a
        # worker thread then stalls neither the server's event loop nor the engine thread. Unlike
        # encode_batch it does not track offsets, which nothing here reads, and saves their cost.
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: a text longer than n times this cannot fit
        in n tokens. A token's spelling in the vocabulary is never shorter than its text (byte-level
        vocabularies spell one character per byte; sentencepiece ones spell characters, or a byte
        fallback as six); only a tokenizer that fuses unknown characters or strips some in its
        normalizer breaks the bound, and neither is built here."""
        return max(len(token) for token in self._backend.get_vocab(with_added_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, which may be part of one UTF-8 character (OpenAI's
        logprobs `bytes`). A model's vocabulary may be padded past the tokenizer's: such an id
        stands for no bytes, as decode() gives it no text."""
        table = self._byte_table
        return table[token_id] if 0 <= token_id < len(table) else b""

    def build_byte_table(self) -> None:
        """Builds what token_bytes and text_bytes read now (~85 ms for a vocabulary of 49,152 on a
        CPU of these machines): a server does as it starts, not in the first request that asks for
        logprobs or that a byte-level tokenizer's detokenizer reads."""
        self.text_bytes_by_id  # noqa: B018 - the cached property (and the table) is built by its first read

    @functools.cached_property
    def _byte_table(self) -> tuple[bytes, ...]:
        backend = self._backend
        byte_level = b'"ByteLevel"' in (backend.decoder.__getstate__() if backend.decoder else b"")
        alphabet = {char: byte for byte, char in _bytes_to_unicode().items()}
        table = []
        # Every id decode() spells: an added token's may lie past the count of tokens (ids with gaps).
        bound = max(self.vocab_size, 1 + max(backend.get_added_tokens_decoder(), default=-1))
        for token_id in range(bound):
            spelling = backend.id_to_token(token_id) or ""
            byte = _BYTE_TOKEN.fullmatch(spelling)
            if byte_level and spelling and all(char in alphabet for char in spelling):
                table.append(bytes(alphabet[char] for char in spelling))
            elif byte is not None:
                table.append(bytes([int(byte.group(1), 16)]))
            elif byte_level:  # an added token, spelled as plain text
                table.append(spelling.encode())
            else:
                table.append(spelling.replace("\u2581", " ").encode())
        return tuple(table)

    @functools.cached_property
    def byte_level(self) -> bool:
        """Whether the decoder is tokenizers' ByteLevel alone: decode() is then the UTF-8 of the
        tokens' bytes joined, invalid bytes replaced one sequence at a time, so that a window's
        text does not depend on how the tokens before it were grouped. A byte-fallback decoder
        (sentencepiece's) replaces every byte of an invalid run, valid ones included: there the
        grouping shows."""
        decoder = self._backend.decoder
        return decoder is not None and json.loads(decoder.__getstate__()).get("type") == "ByteLevel"

    def open_character(self, token_ids: Sequence[int]) -> bytes:
        """The bytes at the end of the tokens' text that begin a UTF-8 character and do not finish
        it (b"" when the text ends on a whole character or on bytes that are no character's):
        what decode() spells as U+FFFD only because a later token would have completed it.
        Special tokens, which decode() leaves out, are left out here too."""
        reader = _Utf8Reader()
        reader.read(self.text_bytes(token_ids))
        return reader.held

    @functools.cached_property
    def text_bytes_by_id(self) -> _TextBytes:
        """Each token's bytes in decode()'s text: b"" for a special token (which decode() leaves out)
        and for an id past the vocabulary. text_bytes reads a sequence through it; a byte-level
        tokenizer's detokenizer reads each step's tokens through it (~4 MB for a vocabulary of
        49,152)."""
        special = self._special_ids
        return _TextBytes((t, data) for t, data in enumerate(self._byte_table) if t not in special)

    def text_bytes(self, token_ids: Sequence[int]) -> bytes:
        """The bytes of the tokens' text: each token's bytes, special tokens (which decode() leaves
        out) left out."""
        return b"".join(map(self.text_bytes_by_id.__getitem__, token_ids))

    def decode_byte_level(self, token_ids: Sequence[int]) -> str:
        """decode(), for a byte-level tokenizer (byte_level says when it is one) in C: its bytes
        joined and read as UTF-8, where decode() takes each id through the vocabulary's spelling
        and the decoder (0.36 against 0.77 us for a detokenizer's window of four, warm)."""
        return self.text_bytes(token_ids).decode("utf-8", "replace")

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, token in self._backend.get_added_tokens_decoder().items() if token.special)

    def decode(self, token_ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def spellings(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it ("Ġhello"): vLLM's token_strs."""
        return [self._backend.id_to_token(t) or "" for t in token_ids]

    def backend_json(self) -> str:
        """The tokenizer as Hugging Face's tokenizer.json text (what a GGUF's metadata was built into):
        the grammar engine builds its own view of the vocabulary from it (executor/grammar.py)."""
        return self._backend.to_str()


def load_tokenizer(model: str, tokenizer: str = "", chat_template: str = "") -> Tokenizer:
    """The frontend's tokenizer: --tokenizer's files (default: the model's), with --chat-template's
    template (a file or the text; default: the tokenizer's own)."""
    loaded = Tokenizer.from_model_path(tokenizer or model)
    if chat_template:
        from tp_runtime.chat import load_chat_template

        loaded.chat_template = load_chat_template(chat_template)
    return loaded


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


class _Utf8Reader:
    """UTF-8 read as it comes, as a byte-level tokenizer's decode() reads it joined: each invalid
    sequence replaced by U+FFFD where it stands, whatever follows, and only the bytes of an
    unfinished character held. CPython's incremental decoder also holds a surrogate's first two
    bytes (ED A0-BF), for its surrogatepass handler; in UTF-8 they begin no character and decode()
    spells them as two U+FFFD at once, so they are read out here."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._decode = self._decoder.decode

    def read(self, data: bytes) -> str:
        text = self._decode(data)
        # The decoder holds a surrogate's first two bytes only when the second (A0-BF) has just
        # come; held bytes are the last ones fed. On English text the check costs ~70 ns a token.
        if data and 0xA0 <= data[-1] <= 0xBF:
            held = self._decoder.getstate()[0]
            if len(held) == 2 and held[0] == 0xED:
                text += self._decode(b"", True)
        return text

    @property
    def held(self) -> bytes:
        """The bytes of an unfinished character read so far (b"" between characters)."""
        return self._decoder.getstate()[0]

    def reset(self) -> None:
        """Drops an unfinished character's bytes."""
        self._decoder.reset()


class IncrementalDetokenizer:
    """Turns generated tokens, one step at a time, into text deltas that are always whole characters.

    A byte-level token may end inside a multi-byte UTF-8 character; the character's bytes are held
    back until a later token completes it. A byte-level tokenizer's text is the UTF-8 reading of
    its tokens' bytes joined (Tokenizer.byte_level), each invalid sequence replaced where it stands
    whatever follows, so an incremental UTF-8 reader fed each step's bytes (_Utf8Reader) gives
    exactly that text, and sends invalid bytes' U+FFFD at once: a lookup a token and one decode a
    step. The windowed reading (_WindowedDetokenizer) serves a prompt whose last tokens end inside
    a character, and tokenizers that are not byte-level (sentencepiece's byte fallback replaces
    every byte of an invalid run, so its text depends on how the bytes are grouped).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | tuple[int, ...] = ()):
        context = prompt_token_ids[-_DETOKENIZE_CONTEXT:]
        self._windowed: _WindowedDetokenizer | None = None
        # A prompt given as token ids may end inside a character. The windowed reading leaves that
        # character out of the output (its U+FFFD was the context's text); a decoder fed the
        # context would spell it, or U+FFFD, in the output. Rare, so the windowed reading stays.
        if not tokenizer.byte_level or tokenizer.open_character(context):
            self._windowed = _WindowedDetokenizer(tokenizer, prompt_token_ids)
            return
        # A reader fed a context that ends on a whole character (or on invalid bytes, replaced as
        # read) holds nothing after it, just as a fresh one: the context's bytes need no reading.
        self._reader = _Utf8Reader()
        self._read = self._reader.read
        self._token_bytes = tokenizer.text_bytes_by_id.__getitem__

    def add(self, token_id: int) -> str:
        """Appends one token and returns the text it completes ("" while a character is open)."""
        if self._windowed is not None:
            return self._windowed.add(token_id)
        return self._read(self._token_bytes(token_id))

    def extend(self, token_ids: Sequence[int]) -> str:
        """Appends several tokens (a step's) and returns the text they complete: add() of each,
        joined."""
        if self._windowed is not None:
            return self._windowed.extend(token_ids)
        return self._read(b"".join(map(self._token_bytes, token_ids)))

    def flush(self) -> str:
        """What is still held back at the end, without a trailing incomplete character (generation
        stopped inside it; its bytes can never form text)."""
        if self._windowed is not None:
            return self._windowed.flush()
        # The reader holds only the bytes of an unfinished character: all else came out as read.
        self._reader.reset()
        return ""


class _WindowedDetokenizer:
    """IncrementalDetokenizer's reading by windows, for any tokenizer: the tokens' text is decoded
    again at each step, and text ending in U+FFFD (an incomplete character, or invalid bytes) is held
    back until a later token completes the character. Each step decodes only a short window (from
    `prefix_offset`), so the cost per token stays constant.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | tuple[int, ...] = ()):
        context = list(prompt_token_ids[-_DETOKENIZE_CONTEXT:])
        self._tokenizer = tokenizer
        self._decode = tokenizer.decode_byte_level if tokenizer.byte_level else tokenizer.decode
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add(self, token_id: int) -> str:
        """Appends one token and returns the text it completes ("" while a character is open)."""
        self._ids.append(token_id)
        return self._read() or ""

    def extend(self, token_ids: Sequence[int]) -> str:
        """Appends several tokens (a step's) and returns the text they complete: add() of each,
        joined. A byte-level tokenizer's step takes the two decodes of one window instead of two
        per token; where its last token leaves a character open, and for other tokenizers, it
        goes token by token, so that no text is held back or spelled otherwise than add() would."""
        if len(token_ids) > 1 and self._tokenizer.byte_level:
            self._ids.extend(token_ids)
            text = self._read()
            if text is not None:
                return text
            del self._ids[-len(token_ids) :]
        return "".join([self.add(token_id) for token_id in token_ids])

    def _read(self) -> str | None:
        """The text the tokens after the read offset complete, the offsets moved past them; None,
        offsets kept, while they leave a character open."""
        decode = self._decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset])
        text = decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """What is still held back at the end: the text of the pending tokens, without the
        replacement characters of a trailing incomplete character (generation stopped inside it;
        its bytes can never form text). A U+FFFD the tokens spell whole (its own three bytes), or
        one that invalid bytes make, is text, and stays."""
        window = self._ids[self._prefix_offset :]
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(window)[len(prefix) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        if not text.endswith(_REPLACEMENT):
            return text
        open_bytes = len(self._tokenizer.open_character(window))
        # A byte-level decoder replaces an unfinished character with one U+FFFD, byte fallback
        # (sentencepiece's) each of its bytes with one.
        spelled = min(open_bytes, 1) if self._tokenizer.byte_level else open_bytes
        return text[: len(text) - spelled] if text.endswith(_REPLACEMENT * spelled) else text
