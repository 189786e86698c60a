"""``tiktoken.model`` tokenizers (Kimi K2's layout) on a small BPE file built here: round trips,
Kimi's split pattern, special tokens, the Kimi chat format on top, and bad files."""

from __future__ import annotations

import base64
import json
import re
from collections import Counter

import pytest

tiktoken = pytest.importorskip("tiktoken")

from etude.model.chat_family import detect_chat_format, load_chat_tokenizer  # noqa: E402
from etude.model.kimi_chat import KIMI_MARKERS, KimiConversation  # noqa: E402
from etude.model.tiktoken_loader import (  # noqa: E402
    NUM_RESERVED_SPECIAL_TOKENS,
    TiktokenTokenizer,
    load_tiktoken_tokenizer,
)

HAN_LATIN = "\u4e2d\u6587English"  # "Chinese" in Han, then Latin letters
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "## Return of functions.read_file:0\n",
    HAN_LATIN,
    "You fix bugs in the repository.",
] * 30


def train_ranks(texts: list[str], num_merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair, merged
    ``num_merges`` times, over pieces split coarser than Kimi's pattern (a Han run and the
    letters after it stay one piece, so merges across them exist)."""
    ranks = {bytes([i]): i for i in range(256)}
    words = Counter(
        tuple(bytes([b]) for b in piece.encode("utf-8"))
        for text in texts
        for piece in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text)
    )
    for _ in range(num_merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        ranks[best[0] + best[1]] = len(ranks)
        merged: Counter[tuple[bytes, ...]] = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi")
    ranks = train_ranks(TEXTS, 120)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    # the markers at scattered ids of the special range, as Kimi's are
    decoder = {
        str(base + 3 + 2 * i): {"content": m, "special": True} for i, m in enumerate(KIMI_MARKERS)
    }
    config = {"added_tokens_decoder": decoder, "tokenizer_class": "TikTokenTokenizer"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "config.json").write_text(json.dumps({"model_type": "kimi_k2"}))
    return directory, ranks


def test_round_trip_and_special_tokens(kimi_dir):
    directory, ranks = kimi_dir
    tok = load_tiktoken_tokenizer(directory, KIMI_MARKERS)
    assert tok.vocab_size == len(ranks) + NUM_RESERVED_SPECIAL_TOKENS
    for text in [*TEXTS[:4], "caf\u00e9 \U0001f600 \t\n\n  x", "<|im_end|> stays text"]:
        assert tok.decode(tok.encode(text)) == text
    end = tok.token_to_id("<|im_end|>")
    assert end == len(ranks) + 3 + 2 * KIMI_MARKERS.index("<|im_end|>")
    assert end not in tok.encode("<|im_end|>")  # plain text never forges a marker
    assert tok.encode_template("a<|im_end|>") == tok.encode("a") + [end]
    assert tok.decode([end]) == "<|im_end|>"
    assert tok.token_to_id(f"<|reserved_token_{len(ranks)}|>") == len(ranks)
    assert tok.token_to_id("def") == ranks.get(b"def")


def test_kimi_pattern_splits_han_from_latin(kimi_dir):
    directory, ranks = kimi_dir
    tok = load_tiktoken_tokenizer(directory)
    crossing = [t for t in ranks if b"\xe6\x96\x87E" in t]  # a merge across the Han/Latin edge
    assert crossing, "the trainer merged across the edge"
    ids = tok.encode(HAN_LATIN)
    assert ids == tok.encode("\u4e2d\u6587") + tok.encode("English")
    assert not {ranks[t] for t in crossing} & set(ids)


def test_kimi_conversation_on_tiktoken_ids_equal_the_template_tokenization(kimi_dir):
    directory, _ = kimi_dir
    assert detect_chat_format(directory) == "kimi_k2"
    tok = load_chat_tokenizer(directory, "kimi_k2")
    assert isinstance(tok, TiktokenTokenizer)
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    conv = KimiConversation(tok, system="You fix bugs in the repository.", tools=tools)
    conv.add_user("\u4e2d\u6587English: fix add")
    conv.add_assistant("", [{"function": {"name": "read_file", "arguments": {"path": "a.py"}}}])
    conv.add_tool_result("def add(a, b):\n    return a + b\n")
    conv.add_generation_prompt()
    assert conv.ids == tok.encode_template(conv.text)
    assert "## Return of functions.read_file:0\n" in conv.text


def test_bad_files_are_value_errors(tmp_path, kimi_dir):
    directory, _ = kimi_dir
    with pytest.raises(ValueError, match="no special token"):
        load_tiktoken_tokenizer(directory, ["<|im_start|>"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tiktoken.model").write_text("YQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:2 is not a tiktoken line"):
        load_tiktoken_tokenizer(bad)
    (bad / "tiktoken.model").write_text("YQ== 0\nYg== 5\n")
    with pytest.raises(ValueError, match="ranks are not"):
        load_tiktoken_tokenizer(bad)
