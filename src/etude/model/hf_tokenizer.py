"""Tokenizers of imported checkpoints: ``tokenizer.json`` through the ``tokenizers`` library.

etude's rollouts speak ChatML with Hermes/Qwen tool calls (``etude.model.chat``), so an imported
tokenizer must have the seven markers of ``etude.model.tokenizer.SPECIAL_TOKENS``
(``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>``) as single ids. Qwen tokenizers have them all but
register the four tool markers as added tokens that are not flagged special; `load_hf_tokenizer`
flags them (their ids do not change), so untrusted text can not forge them (etude's policy,
see ``etude.model.tokenizer``). A tokenizer without one of the markers is a ``ValueError``.

Not here: tiktoken files (Kimi K2 ships ``tiktoken.model``: ``etude.model.tiktoken_loader``),
the Kimi and DeepSeek chat formats and their tokenizers without etude's markers
(``etude.model.chat_family.load_chat_tokenizer``).
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import AddedToken

from etude.model.tokenizer import SPECIAL_TOKENS, TOKENIZER_FILE, Tokenizer


def load_hf_tokenizer(directory: str | Path) -> Tokenizer:
    """An etude `Tokenizer` from a Hugging Face directory's ``tokenizer.json``."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        hint = (
            " (it ships tiktoken.model: load it with etude.model.chat_family.load_chat_tokenizer)"
            if (Path(directory) / "tiktoken.model").is_file()
            else ""
        )
        raise ValueError(f"no {TOKENIZER_FILE} in {directory}{hint}")
    backend = tokenizers.Tokenizer.from_file(str(path))
    added = {t.content: (i, t) for i, t in backend.get_added_tokens_decoder().items()}
    missing = [s for s in SPECIAL_TOKENS if s not in added and backend.token_to_id(s) is None]
    if missing:
        raise ValueError(
            f"{path} has no {missing} token(s); etude's rollouts use ChatML with Hermes tool "
            "calls, which need all of etude.model.tokenizer.SPECIAL_TOKENS as single ids"
        )
    unflagged = [s for s in SPECIAL_TOKENS if s not in added or not added[s][1].special]
    if unflagged:
        before = {s: backend.token_to_id(s) for s in unflagged}
        backend.add_special_tokens(
            [AddedToken(s, special=True, normalized=False) for s in unflagged]
        )
        after = {s: backend.token_to_id(s) for s in unflagged}
        assert before == after, (before, after)
    return Tokenizer(backend)
