"""Byte-level BPE tokenizer: round trips, special-token policy, save/load, determinism."""

from __future__ import annotations

import json
import random

import pytest

from etude.model.tokenizer import (
    ENDOFTEXT,
    IM_END,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    TOOL_CALL_END,
    TOOL_CALL_START,
    Tokenizer,
    default_corpus,
    train_default_tokenizer,
)

CORPUS_BYTES = 300_000
VOCAB = 512

TRICKY = [
    "",
    " ",
    "\n",
    "  leading and trailing  ",
    "\t\tx\n\n\n\r\n\ry  \n",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\nclass A:\n\tpass\n",
    "if (a<b && c>=d) { x->y(); } /* c */ // end",
    "numbers 0 7 42 12345678901234567890 3.14159e-10 0xDEADBEEF",
    "h\u00e9llo w\u00f6rld, na\u00efve caf\u00e9",
    "e\u0301 vs \u00e9",  # NFD and NFC forms must stay distinct: no normalization
    "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4",
    "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd",
    "\U0001f389\U0001f600 \U0001f469\u200d\U0001f4bb \U0001f1eb\U0001f1f7 \U0001d518\U0001d52b",
    "\x00\x01\x02\x7f\x1b[31mred\x1b[0m",
    "\ufeffbom \u2028line sep\u2029 \u00a0nbsp \u200bzw",
    "<|im_end|> and <tool_call>{}</tool_call> as plain text",
    "<|im_start|><|im_start|>user\n<|endoftext|><|endoftext",
    "".join(chr(i) for i in range(256)),
]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return default_corpus(CORPUS_BYTES)


@pytest.fixture(scope="module")
def tok(corpus: list[str]) -> Tokenizer:
    return Tokenizer.train(corpus, VOCAB)


def _random_text(rng: random.Random, length: int) -> str:
    """Random code points from ASCII, Latin, CJK and astral planes (no surrogates)."""
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    chars = []
    for _ in range(length):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky_strings(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, allow_special=True)) == text


def test_round_trip_random_unicode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng, rng.randint(0, 40))
        assert tok.decode(tok.encode(text)) == text


def test_round_trip_corpus_and_concatenation(tok: Tokenizer, corpus: list[str]) -> None:
    for text in corpus:
        assert tok.decode(tok.encode(text)) == text
    # pieces encoded apart decode to the concatenated text, even when a piece cuts a word
    a, b = "def enc", "ode(s\u00e9lf):\n    pass"
    assert tok.decode(tok.encode(a) + tok.encode(b)) == a + b


def test_byte_level_compresses_code(tok: Tokenizer, corpus: list[str]) -> None:
    num_bytes = sum(len(t.encode()) for t in corpus)
    num_ids = sum(len(ids) for ids in tok.encode_batch(corpus))
    assert num_ids < 0.6 * num_bytes  # merges were learned and used (bytes alone give 1.0)
    # every single byte is in the vocabulary: a lone byte is one id
    for i in range(128):
        assert len(tok.encode(chr(i))) == 1


def test_special_tokens_are_single_ids_in_order(tok: Tokenizer) -> None:
    assert tok.special_ids == {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    assert tok.eos_id == tok.pad_id == tok.special_ids[ENDOFTEXT] == 0
    assert tok.im_end_id == tok.special_ids[IM_END]
    for token, token_id in tok.special_ids.items():
        assert tok.encode(token, allow_special=True) == [token_id]
        assert tok.token_to_id(token) == token_id
        assert tok.id_to_token(token_id) == token
        assert tok.decode([token_id]) == token


def test_special_strings_are_plain_text_by_default(tok: Tokenizer, corpus: list[str]) -> None:
    special = set(tok.special_ids.values())
    for token in SPECIAL_TOKENS:
        ids = tok.encode(token)
        assert len(ids) > 1 and special.isdisjoint(ids), (token, ids)
        assert tok.decode(ids) == token
    # the corpus holds these strings literally (etude's own sources), and still no special id
    assert any(IM_END in text for text in corpus)
    for ids in tok.encode_batch(corpus):
        assert special.isdisjoint(ids)


def test_allow_special_subset(tok: Tokenizer) -> None:
    text = f"{TOOL_CALL_START}{TOOL_CALL_START}x{IM_END}{TOOL_CALL_END}"
    call, end, im_end = (tok.special_ids[s] for s in (TOOL_CALL_START, TOOL_CALL_END, IM_END))
    subset = tok.encode(text, allow_special={TOOL_CALL_START, TOOL_CALL_END})
    assert subset[:2] == [call, call] and subset[-1] == end
    assert im_end not in subset
    assert tok.decode(subset) == text
    full = tok.encode(text, allow_special=True)
    assert full == [call, call, *tok.encode("x"), im_end, end]
    assert tok.encode(text, allow_special=()) == tok.encode(text)
    with pytest.raises(ValueError, match="unknown special tokens"):
        tok.encode(text, allow_special={"<bos>"})
    with pytest.raises(ValueError, match="allow_special"):
        tok.encode(text, allow_special=TOOL_CALL_START)


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    assert tok.encode_batch(TRICKY) == [tok.encode(t) for t in TRICKY]
    assert tok.encode_batch(TRICKY, allow_special=True) == [
        tok.encode(t, allow_special=True) for t in TRICKY
    ]


def test_lone_surrogate_is_a_value_error_that_says_where(tok: Tokenizer) -> None:
    # a JSON "\ud800" escape decodes to a str that UTF-8 (and so the tokenizer) can not take
    message = r"lone surrogate '\\ud800' at index 12"
    for allow_special in (False, True):
        with pytest.raises(ValueError, match=message):
            tok.encode("<tool_call>a\ud800", allow_special=allow_special)
    with pytest.raises(ValueError, match=r"lone surrogate '\\udc00' at index 1"):
        tok.encode_batch(["ok", "a\udc00"])


def test_vocabulary_lookups(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB
    for token_id in range(tok.vocab_size):
        assert tok.token_to_id(tok.id_to_token(token_id)) == token_id
    assert tok.token_to_id("no such entry \u2603") is None
    for bad in (-1, tok.vocab_size):
        with pytest.raises(ValueError, match="out of range"):
            tok.id_to_token(bad)
        with pytest.raises(ValueError, match="out of range"):
            tok.decode([1, bad])
    with pytest.raises(ValueError, match="expects a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_save_load_identical(tok: Tokenizer, tmp_path) -> None:
    path = tok.save(tmp_path / "tok")
    assert path == tmp_path / "tok" / TOKENIZER_FILE
    assert sorted(p.name for p in path.parent.iterdir()) == [TOKENIZER_FILE]  # no temp file left
    loaded = Tokenizer.load(tmp_path / "tok")
    assert loaded.to_json() == tok.to_json()
    assert loaded.vocab_size == tok.vocab_size and loaded.special_ids == tok.special_ids
    for text in TRICKY:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.encode(text, allow_special=True) == tok.encode(text, allow_special=True)
    # saving over an existing file replaces it
    other = Tokenizer.train(["abc abd abe " * 50], MIN_VOCAB_SIZE + 3)
    other.save(tmp_path / "tok")
    assert Tokenizer.load(tmp_path / "tok").to_json() == other.to_json()
    assert sorted(p.name for p in path.parent.iterdir()) == [TOKENIZER_FILE]


def test_load_errors(tok: Tokenizer, tmp_path) -> None:
    with pytest.raises(ValueError, match=str(tmp_path / "missing" / TOKENIZER_FILE)):
        Tokenizer.load(tmp_path / "missing")
    (tmp_path / TOKENIZER_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer file"):
        Tokenizer.load(tmp_path)
    # a valid file whose special tokens are not etude's
    data = json.loads(tok.to_json())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != IM_END]
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"lacks the special tokens \['<\|im_end\|>'\]"):
        Tokenizer.load(tmp_path)


def test_training_is_deterministic(corpus: list[str], tok: Tokenizer) -> None:
    again = Tokenizer.train(iter(corpus), VOCAB)  # a one-shot iterator trains the same
    assert again.to_json() == tok.to_json()
    smaller = Tokenizer.train(corpus, VOCAB - 100)
    assert smaller.vocab_size == VOCAB - 100
    # a smaller vocabulary is a prefix of the merge list of a larger one
    merges = json.loads(tok.to_json())["model"]["merges"]
    assert json.loads(smaller.to_json())["model"]["merges"] == merges[: len(merges) - 100]


def test_small_corpus_stops_early_and_min_frequency() -> None:
    texts = ["aaaa bbbb aaaa"]
    tok = Tokenizer.train(texts, 1000)
    assert MIN_VOCAB_SIZE < tok.vocab_size < 1000  # no pair left that occurs twice
    strict = Tokenizer.train(texts, 1000, min_frequency=100)
    assert strict.vocab_size == MIN_VOCAB_SIZE  # bytes and specials only
    assert strict.decode(strict.encode("aaaa bbbb")) == "aaaa bbbb"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"texts": ["x"], "vocab_size": MIN_VOCAB_SIZE - 1}, "vocab_size"),
        ({"texts": ["x"], "vocab_size": 512.0}, "vocab_size"),
        ({"texts": ["x"], "vocab_size": 512, "min_frequency": 0}, "min_frequency"),
        ({"texts": [], "vocab_size": 512}, "texts is empty"),
        ({"texts": ["ok", 3], "vocab_size": 512}, r"texts\[1\] is int"),
        ({"texts": "a string", "vocab_size": 512}, "not one string"),
    ],
)
def test_train_bad_inputs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Tokenizer.train(**kwargs)


def test_default_corpus_deterministic_and_bounded() -> None:
    first = default_corpus(CORPUS_BYTES)
    assert first == default_corpus(CORPUS_BYTES)
    total = sum(len(t.encode()) for t in first)
    assert 0 < total <= CORPUS_BYTES
    assert all(t.endswith("\n") for t in first[-1:])  # the cut falls on a line end
    # a bigger budget extends the same sequence of files
    bigger = default_corpus(2 * CORPUS_BYTES)
    assert bigger[: len(first) - 1] == first[:-1]
    assert bigger[len(first) - 1].startswith(first[-1])
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="max_bytes"):
            default_corpus(bad)  # type: ignore[arg-type]


def test_train_default_tokenizer() -> None:
    tok = train_default_tokenizer(VOCAB, max_bytes=CORPUS_BYTES)
    assert tok.to_json() == Tokenizer.train(default_corpus(CORPUS_BYTES), VOCAB).to_json()
    code = "for i in range(10):\n    print(i)\n"
    assert tok.decode(tok.encode(code)) == code
