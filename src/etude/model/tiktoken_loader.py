"""Tokenizers shipped as ``tiktoken.model`` (Kimi K2), through OpenAI's ``tiktoken`` library.

A ``tiktoken.model`` file is the BPE vocabulary alone: one ``base64(token bytes) rank`` line per
token, the rank being the id and the merge priority. What the file does not hold comes from the
model's ``tokenizer_config.json`` and its tokenizer code, as Kimi K2 publishes them:

- the special tokens: `NUM_RESERVED_SPECIAL_TOKENS` ids right after the vocabulary, named by
  ``added_tokens_decoder`` where it names them and ``<|reserved_token_{id}|>`` elsewhere;
- the pre-tokenizer split pattern, `KIMI_K2_PATTERN` (``tokenization_kimi.py``): Han runs on
  their own, then the o200k-style letter, number, punctuation and whitespace pieces with Han
  taken out of the letter classes (``&&`` class intersection, which tiktoken's regex engine
  supports).

`TiktokenTokenizer` has the interface the family chat formats use (``etude.model.family_chat``:
``encode`` of plain text, where a special token's string stays ordinary ids, ``decode`` with
special ids written out, ``token_to_id``). The file is read here, line by line, rather than by
``tiktoken.load`` (which caches every file it reads under a temporary directory).

Not here: training such a vocabulary, converting it to ``tokenizer.json``, etude's seven ChatML
markers (a Kimi vocabulary does not have them; speak the ``kimi_k2`` format).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

TIKTOKEN_FILE = "tiktoken.model"
NUM_RESERVED_SPECIAL_TOKENS = 256
"""Special-token ids after the vocabulary in Kimi K2's tokenizer."""

KIMI_K2_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
"""Kimi K2's split pattern (see the module docstring)."""


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """The ``token bytes -> rank`` table of a ``tiktoken.model`` file."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = line.split()
            try:
                if len(fields) != 2:
                    raise ValueError("expected 'base64 rank'")
                ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
            except (ValueError, binascii.Error) as e:
                raise ValueError(
                    f"{path}:{number} is not a tiktoken line ({e}); a tiktoken.model file "
                    "has one 'base64(token) rank' pair per line"
                ) from e
    if not ranks:
        raise ValueError(f"{path} holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


class TiktokenTokenizer:
    """A ``tiktoken.Encoding`` with the chat formats' tokenizer interface."""

    def __init__(self, encoding, special_tokens: dict[str, int]) -> None:
        self._encoding = encoding
        self.special_ids = dict(special_tokens)
        self._by_id = {i: s for s, i in special_tokens.items()}

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        """Plain-text ids: special tokens' strings in ``text`` stay ordinary ids."""
        return self._encoding.encode_ordinary(text)

    def encode_template(self, text: str) -> list[int]:
        """Ids of rendered template text: every special token's string becomes its id."""
        return self._encoding.encode(text, allowed_special="all")

    def decode(self, ids: Iterable[int]) -> str:
        return self._encoding.decode([int(i) for i in ids], errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in self.special_ids:
            return self.special_ids[token]
        try:
            return self._encoding.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None


def load_tiktoken_tokenizer(
    directory: str | Path,
    markers: Sequence[str] = (),
    *,
    pattern: str = KIMI_K2_PATTERN,
    num_reserved: int = NUM_RESERVED_SPECIAL_TOKENS,
) -> TiktokenTokenizer:
    """The tokenizer of a directory with ``tiktoken.model`` (+ ``tokenizer_config.json``);
    each of ``markers`` must be one of its special tokens."""
    try:
        import tiktoken
    except ImportError as e:
        raise ValueError(
            f"{directory} ships {TIKTOKEN_FILE}, which needs the tiktoken package: "
            "pip install 'etude[hf]'"
        ) from e
    directory = Path(directory)
    ranks = read_tiktoken_ranks(directory / TIKTOKEN_FILE)
    config_path = directory / "tokenizer_config.json"
    named: dict[int, str] = {}
    if config_path.is_file():
        decoder = json.loads(config_path.read_text(encoding="utf-8")).get(
            "added_tokens_decoder", {}
        )
        named = {int(i): entry["content"] for i, entry in decoder.items()}
    base = len(ranks)
    outside = sorted(i for i in named if not base <= i < base + num_reserved)
    if outside:
        raise ValueError(
            f"{config_path}: added token ids {outside[:5]} lie outside the special range "
            f"[{base}, {base + num_reserved}) after the {base} tokens of {TIKTOKEN_FILE}"
        )
    special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + num_reserved)}
    missing = [m for m in markers if m not in special]
    if missing:
        raise ValueError(
            f"{directory}: the tokenizer has no special token {missing}; this chat format needs "
            "them (added_tokens_decoder of tokenizer_config.json)"
        )
    encoding = tiktoken.Encoding(
        name=directory.name or "tiktoken",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens=special,
    )
    return TiktokenTokenizer(encoding, special)
