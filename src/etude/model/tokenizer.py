"""Byte-level BPE tokenizer, trained locally with the HuggingFace `tokenizers` library.

Why: etude trains its models from scratch and can download nothing at run time, so the tokenizer
is trained here, in seconds, on text that is already on disk (the Python standard library and
etude's own sources, see `default_corpus`). The Rust library does the work; this module fixes the
recipe and the special-token policy so every part of the stack agrees on them.

The recipe:
- no normalizer: text is never changed, so ``decode(encode(s)) == s`` for every string that can be
  written as UTF-8 (all of Unicode except lone surrogates), whitespace and control bytes included;
- pre-tokenization splits text with the GPT-4 (cl100k) regex (letters, 1-3 digit numbers,
  punctuation runs, newlines, whitespace runs; the pattern is the one published in OpenAI's
  tiktoken), then maps every byte to a printable character (GPT-2's byte-level trick, Radford et
  al. 2019), and BPE merges never cross those pieces;
- the 256 byte symbols are always in the vocabulary, so there is no unknown token;
- training is deterministic: the same texts, vocabulary size and min frequency give the same file.

Special tokens (`SPECIAL_TOKENS`) take ids 0-6 in that order and are always single ids.
``<|endoftext|>`` ends a document and doubles as padding (`eos_id`, `pad_id`); chat turns end with
``<|im_end|>`` (`im_end_id`, see `etude.model.chat`).

Policy for text that contains a special token's string literally: by default it is ordinary text.
``encode("<|im_end|>")`` gives several ordinary ids, never the special id, so tool output, file
contents and other untrusted text can not forge a turn boundary or a tool call. The special ids
come only from ``encode(text, allow_special=True)`` (every marker in the text becomes its id) or
``allow_special={...}`` (only the named markers), or from code that writes the ids itself (the
chat renderer). No special string can come out of BPE merges either: the pre-tokenizer cuts each
one into several pieces (``<|``, ``im``, ``_end``, ``|>``) and merges stay inside a piece.

What this module does not do: pad or truncate batches, add BOS/EOS automatically (encoding adds
nothing), or render chat (`etude.model.chat`).
"""

from __future__ import annotations

import os
import re
import sysconfig
import tempfile
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
SPECIAL_TOKENS = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
)
"""The special tokens, in id order (0-6 in a tokenizer trained here)."""

TOKENIZER_FILE = "tokenizer.json"
NUM_BYTE_SYMBOLS = 256
MIN_VOCAB_SIZE = NUM_BYTE_SYMBOLS + len(SPECIAL_TOKENS)

# GPT-4 (cl100k_base) split pattern as published in tiktoken: case-insensitive English
# contractions, an optional non-letter before a letter run, numbers in groups of 1-3 digits,
# punctuation runs with trailing newlines, newline runs, and whitespace runs that leave the last
# space to the following word (so "    return" is "   " + " return").
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

DEFAULT_CORPUS_BYTES = 4_000_000
# Path components skipped by `default_corpus`: test suites (some hold deliberately broken or
# oddly encoded files) and third-party code that happens to live under the stdlib directory.
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


def _byte_level_backend() -> tokenizers.Tokenizer:
    """An untrained BPE tokenizer with the recipe of the module docstring."""
    backend = tokenizers.Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


class Tokenizer:
    """A byte-level BPE tokenizer with etude's special tokens (see the module docstring).

    Build one with `Tokenizer.train`, `train_default_tokenizer` or `Tokenizer.load`; the
    constructor wraps an existing ``tokenizers.Tokenizer`` (it is copied, the argument is left
    as it was) that must register every string of `SPECIAL_TOKENS` as a special token.
    """

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        special_ids = {}
        for token_id, added in sorted(backend.get_added_tokens_decoder().items()):
            if added.content in SPECIAL_TOKENS and added.special:
                special_ids[added.content] = token_id
        missing = [s for s in SPECIAL_TOKENS if s not in special_ids]
        if missing:
            raise ValueError(
                f"tokenizer lacks the special tokens {missing}; train it with Tokenizer.train "
                "or train_default_tokenizer, which register all of etude.model.tokenizer.SPECIAL_TOKENS"
            )
        self._special_ids = special_ids
        self._json = backend.to_str()
        # One private copy that never matches special strings: the marker handling below splits
        # text in Python, so no mode flag is toggled per call and concurrent calls are safe.
        self._plain = tokenizers.Tokenizer.from_str(self._json)
        self._plain.encode_special_tokens = True
        self._vocab_size = self._plain.get_vocab_size(with_added_tokens=True)
        self._split_patterns: dict[frozenset[str], re.Pattern[str]] = {}

    # ------------------------------------------------------------------ building

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
        """Train byte-level BPE on ``texts`` up to ``vocab_size`` ids (special tokens included).

        The result may hold fewer ids than asked when the texts offer no more pair that occurs
        ``min_frequency`` times. Deterministic: the same inputs give the same tokenizer.
        """
        if (
            isinstance(vocab_size, bool)
            or not isinstance(vocab_size, int)
            or vocab_size < MIN_VOCAB_SIZE
        ):
            raise ValueError(
                f"vocab_size={vocab_size!r} is too small: it must be an int of at least "
                f"{MIN_VOCAB_SIZE} ({NUM_BYTE_SYMBOLS} byte symbols + {len(SPECIAL_TOKENS)} special tokens)"
            )
        if (
            isinstance(min_frequency, bool)
            or not isinstance(min_frequency, int)
            or min_frequency < 1
        ):
            raise ValueError(f"min_frequency={min_frequency!r} must be an int >= 1")
        if isinstance(texts, str):
            raise ValueError(
                "texts must be an iterable of strings, not one string; wrap it in a list"
            )
        num_texts = 0

        def checked() -> Iterator[str]:
            nonlocal num_texts
            for text in texts:
                if not isinstance(text, str):
                    raise ValueError(f"texts[{num_texts}] is {type(text).__name__}, expected str")
                num_texts += 1
                yield text

        backend = _byte_level_backend()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(checked(), trainer=trainer)
        if num_texts == 0:
            raise ValueError("texts is empty: give the tokenizer some text to train on")
        tokenizer = cls(backend)
        assert all(tokenizer._special_ids[s] == i for i, s in enumerate(SPECIAL_TOKENS)), (
            tokenizer._special_ids
        )
        for special in SPECIAL_TOKENS:
            # the guarantee that BPE can never produce a special string as one token
            assert len(backend.pre_tokenizer.pre_tokenize_str(special)) > 1, special
        return tokenizer

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``directory/tokenizer.json`` atomically (temp file + rename); returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_FILE
        fd, tmp_name = tempfile.mkstemp(prefix=f".{TOKENIZER_FILE}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self._json)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Read ``directory/tokenizer.json`` as written by `save`."""
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(
                f"no tokenizer at {path}: save one there with Tokenizer.save({str(directory)!r})"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise ValueError(
                f"{path} is not a valid tokenizer file ({e}); write it with Tokenizer.save"
            ) from e
        try:
            return cls(backend)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str, allow_special: bool | Collection[str] = False) -> list[int]:
        """Token ids of ``text``; nothing is added (no BOS/EOS).

        ``allow_special`` says which special-token strings in ``text`` become their ids: none
        (False, the default, right for untrusted text), all (True), or the named ones. Text
        with a lone surrogate (which UTF-8 can not write) is a ``ValueError``.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        pattern = self._split_pattern(allow_special)
        # re.split with one capture group alternates plain text (even) and a marker (odd)
        parts = [text] if pattern is None else pattern.split(text)
        ids: list[int] = []
        try:
            for i, part in enumerate(parts):
                if i % 2:
                    ids.append(self._special_ids[part])
                elif part:
                    ids.extend(self._plain.encode(part, add_special_tokens=False).ids)
        except TypeError:  # the Rust side takes only text UTF-8 can write; it says "must be str"
            raise ValueError(_unencodable(text)) from None
        return ids

    def encode_batch(
        self, texts: Sequence[str], allow_special: bool | Collection[str] = False
    ) -> list[list[int]]:
        """`encode` of each text; plain text is encoded in parallel by the Rust library."""
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"texts[{i}] is {type(text).__name__}, expected str")
        if self._split_pattern(allow_special) is None:
            try:
                encodings = self._plain.encode_batch(texts, add_special_tokens=False)
            except TypeError:
                raise ValueError(_unencodable(*texts)) from None
            return [e.ids for e in encodings]
        return [self.encode(text, allow_special) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special ids decode to their strings. Ids that cut a multi-byte
        character in two decode to U+FFFD; whole sequences from `encode` round-trip exactly."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise ValueError(
                f"token id {bad} is out of range: ids must lie in [0, {self._vocab_size})"
            )
        return self._plain.decode(ids, skip_special_tokens=False)

    def _split_pattern(self, allow_special: bool | Collection[str]) -> re.Pattern[str] | None:
        """Regex that cuts out the allowed special strings (None when none is allowed)."""
        if allow_special is False:
            return None
        if allow_special is True:
            allowed = frozenset(SPECIAL_TOKENS)
        elif isinstance(allow_special, str) or not isinstance(allow_special, Collection):
            raise ValueError(
                f"allow_special must be True, False or a collection of special tokens, got {allow_special!r}"
            )
        else:
            allowed = frozenset(allow_special)
            unknown = sorted(allowed - set(SPECIAL_TOKENS))
            if unknown:
                raise ValueError(
                    f"allow_special names unknown special tokens {unknown}; valid: {list(SPECIAL_TOKENS)}"
                )
        if not allowed:
            return None
        pattern = self._split_patterns.get(allowed)
        if pattern is None:
            # longest first, so that no marker can match a prefix of another
            alternatives = "|".join(
                re.escape(s) for s in sorted(allowed, key=lambda s: (-len(s), s))
            )
            pattern = self._split_patterns[allowed] = re.compile(f"({alternatives})")
        return pattern

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (embedding tables need at least this many rows)."""
        return self._vocab_size

    @property
    def special_ids(self) -> dict[str, int]:
        """Id of each special token, keyed by its string (a copy)."""
        return dict(self._special_ids)

    @property
    def eos_id(self) -> int:
        """``<|endoftext|>``: the end of a document in pretraining data."""
        return self._special_ids[ENDOFTEXT]

    @property
    def pad_id(self) -> int:
        """``<|endoftext|>`` again: padding never reaches a loss (masks drop it)."""
        return self._special_ids[ENDOFTEXT]

    @property
    def im_start_id(self) -> int:
        """``<|im_start|>``: opens a chat message."""
        return self._special_ids[IM_START]

    @property
    def im_end_id(self) -> int:
        """``<|im_end|>``: closes a chat message; generation of an assistant turn stops at it."""
        return self._special_ids[IM_END]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry, or None. Ordinary entries are in byte-level form (a space is
        written ``"\\u0120"``); special tokens are their plain strings."""
        return self._plain.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary entry of ``token_id`` (byte-level form, see `token_to_id`)."""
        if (
            isinstance(token_id, bool)
            or not isinstance(token_id, int)
            or not 0 <= token_id < self._vocab_size
        ):
            raise ValueError(
                f"token id {token_id!r} is out of range: ids must lie in [0, {self._vocab_size})"
            )
        token = self._plain.id_to_token(token_id)
        assert token is not None, token_id
        return token

    def to_json(self) -> str:
        """The serialized tokenizer (the content `save` writes)."""
        return self._json

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self._vocab_size})"


def _unencodable(*texts: str) -> str:
    """Why text could not be encoded: a lone surrogate (U+D800-U+DFFF), which UTF-8 can not write."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                f"text holds the lone surrogate {text[e.start]!r} at index {e.start}, which UTF-8 "
                "can not write; escape it first (str.encode('utf-8', 'backslashreplace'))"
            )
    return "text could not be encoded"


def _python_files(root: Path) -> Iterator[Path]:
    """``*.py`` under ``root`` in sorted order, skipping `_SKIPPED_DIRS`."""
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_DIRS.isdisjoint(path.relative_to(root).parts[:-1]) and path.is_file():
            yield path


def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[str]:
    """Python source that is on every machine, one string per file, at most ``max_bytes`` of UTF-8.

    etude's own package comes first (small, and the closest to the code the agent edits), then
    the installed standard library (``sysconfig.get_paths()["stdlib"]``); files in sorted path
    order, test directories and ``site-packages`` skipped, files that are not valid UTF-8
    skipped. The last file is cut at a line end to fit the budget. The same installation and
    etude tree give the same corpus.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(
            f"max_bytes={max_bytes!r} must be a positive int (a few MB trains in seconds)"
        )
    package_root = Path(__file__).resolve().parents[1]
    stdlib_root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    texts: list[str] = []
    remaining = max_bytes
    for root in (package_root, stdlib_root):
        for path in _python_files(root):
            data = path.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if not text:
                continue
            if len(data) > remaining:
                # newline is one byte in UTF-8, so cutting after it never splits a character
                cut = data.rfind(b"\n", 0, remaining) + 1
                if cut > 0:
                    texts.append(data[:cut].decode("utf-8"))
                return texts
            texts.append(text)
            remaining -= len(data)
    return texts


def train_default_tokenizer(
    vocab_size: int, *, max_bytes: int = DEFAULT_CORPUS_BYTES, min_frequency: int = 2
) -> Tokenizer:
    """`Tokenizer.train` on `default_corpus` (about a second for the default 4 MB on 2 cores)."""
    return Tokenizer.train(default_corpus(max_bytes), vocab_size, min_frequency=min_frequency)
