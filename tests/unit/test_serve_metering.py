"""Metering: exact cost arithmetic, price parsing, key files, the ledger and its summary."""

from __future__ import annotations

from decimal import Decimal

import pytest

from etude.serve.chat import parse_reply
from etude.serve.metering import (
    UsageLedger,
    default_tiers,
    format_usage,
    key_name,
    load_api_keys,
    parse_prices,
    read_usage,
    usage_record,
)


def test_cost_arithmetic_is_exact_at_the_default_prices():
    tiers = default_tiers()
    fast, standard = tiers["fast"], tiers["standard"]
    assert fast.priority > standard.priority
    assert sum(fast.cost(1_000_000, 1_000_000)) == Decimal("18.00")
    assert sum(standard.cost(1_000_000, 1_000_000)) == Decimal("3.00")
    # 1234 * 0.50e-6 + 567 * 2.50e-6 = 0.000617 + 0.0014175
    assert standard.cost(1234, 567) == (Decimal("0.000617"), Decimal("0.0014175"))
    assert sum(fast.cost(1, 1)) == Decimal("0.000018")
    usage = usage_record(fast, 10, 3)
    assert usage["total_tokens"] == 13 and usage["cost"]["total_usd"] == "0.000075"
    assert sum(fast.cost(0, 0)) == 0


def test_price_parsing():
    assert parse_prices("3.00, 15.00", "--fast-prices") == (Decimal("3.00"), Decimal("15.00"))
    for bad in ("3", "a,b", "-1,2", "1,2,3", "nan,1"):
        with pytest.raises(ValueError, match="--fast-prices"):
            parse_prices(bad, "--fast-prices")


def test_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nalice:aaaaaaaa-1\n\nbbbbbbbbbbbb  # bare key\n")
    keys = load_api_keys(path)
    assert keys == {"aaaaaaaa-1": "alice", "bbbbbbbbbbbb": key_name("bbbbbbbbbbbb")}
    path.write_text("alice:short\n")
    with pytest.raises(ValueError, match="at least 8 characters"):
        load_api_keys(path)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="lists no API key"):
        load_api_keys(path)
    with pytest.raises(ValueError, match="no such file"):
        load_api_keys(tmp_path / "missing")


def test_ledger_rows_and_summary(tmp_path):
    tiers = default_tiers()
    ledger = UsageLedger(tmp_path / "u.sqlite")
    for i, (key, tier, p, c) in enumerate(
        [("alice", "fast", 10, 5), ("alice", "fast", 1, 1), ("bob", "standard", 100, 0)]
    ):
        ledger.record(
            request_id=f"r{i}", api_key=key, endpoint="completions", model="m",
            tier=tiers[tier], status="ok", prompt_tokens=p, completion_tokens=c,
        )  # fmt: skip
    with pytest.raises(Exception, match="UNIQUE"):
        ledger.record(
            request_id="r0", api_key="alice", endpoint="completions", model="m",
            tier=tiers["fast"], status="ok", prompt_tokens=1, completion_tokens=1,
        )  # fmt: skip
    ledger.close()
    rows = read_usage(tmp_path / "u.sqlite")
    assert [(r["api_key"], r["requests"], r["prompt_tokens"]) for r in rows] == [
        ("alice", 2, 11),
        ("bob", 1, 100),
    ]
    assert rows[0]["cost_usd"] == sum(tiers["fast"].cost(11, 6))
    table = format_usage(rows)
    assert "alice" in table and "total" in table
    with pytest.raises(ValueError, match="no usage ledger"):
        read_usage(tmp_path / "none.sqlite")


def test_reply_tool_calls_in_openai_form():
    from etude.model.tokenizer import Tokenizer, default_corpus

    tok = Tokenizer.train(default_corpus(50_000), 300)
    text = 'Let me test.<tool_call>{"name": "run_tests", "arguments": {"k": 1}}</tool_call><tool_call>{"name": 3}</tool_call>'
    ids = tok.encode(text, allow_special=True) + [tok.im_end_id]
    content, calls = parse_reply(tok.decode, tok.im_end_id, ids)
    assert [c["function"]["name"] for c in calls] == ["run_tests"]
    assert calls[0]["type"] == "function" and calls[0]["function"]["arguments"] == '{"k": 1}'
    assert content.startswith("Let me test.") and '{"name": 3}' in content
