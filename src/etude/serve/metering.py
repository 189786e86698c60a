"""Tiers, per-token prices, API keys and the usage ledger of ``etude serve``.

Two tiers of the same model: ``fast`` (the default; scheduled for latency) and ``standard``
(scheduled for throughput). Prices are dollars per million input / output tokens, defaults
$3.00 / $15.00 for fast and $0.50 / $2.50 for standard. Costs are exact decimals
(``decimal.Decimal``), never floats: ``cost = (input * price_in + output * price_out) / 1e6``.

API keys come from a file: one key per line, ``NAME:SECRET`` (or a bare ``SECRET``, named
``key-`` + the first 8 hex digits of its SHA-256); ``#`` starts a comment. The ledger records
key names, never secrets.

The ledger is one SQLite file (WAL journal, ``synchronous=FULL``): one row per request, written
in its own transaction BEFORE the response (or the stream's last chunk) is sent, so a server
killed with SIGKILL loses no row that a client saw. ``etude serve usage`` sums it per key and
tier.

Not here: rate limits, quotas, key rotation without a restart, prices per model.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

MILLION = Decimal(1_000_000)


@dataclass(frozen=True, slots=True)
class Tier:
    """One service tier: its prices and scheduling priority."""

    name: str
    input_per_million: Decimal
    output_per_million: Decimal
    priority: int
    """Engine priority: higher is admitted first and may preempt lower."""

    def cost(self, input_tokens: int, output_tokens: int) -> tuple[Decimal, Decimal]:
        """(input cost, output cost) in dollars, exact."""
        return (
            Decimal(input_tokens) * self.input_per_million / MILLION,
            Decimal(output_tokens) * self.output_per_million / MILLION,
        )


def parse_prices(text: str, setting: str) -> tuple[Decimal, Decimal]:
    """``"3.00,15.00"`` -> (input, output) dollars per million tokens."""
    parts = text.split(",")
    try:
        values = tuple(Decimal(p.strip()) for p in parts)
    except ArithmeticError:
        values = ()
    if len(values) != 2 or any(not v.is_finite() or v < 0 for v in values):
        raise ValueError(
            f"{setting}={text!r} must be two non-negative dollar amounts per million tokens, "
            "input,output (e.g. 3.00,15.00)"
        )
    return values[0], values[1]


def default_tiers(fast: str = "3.00,15.00", standard: str = "0.50,2.50") -> dict[str, Tier]:
    fast_in, fast_out = parse_prices(fast, "--fast-prices")
    std_in, std_out = parse_prices(standard, "--standard-prices")
    return {
        "fast": Tier(
            name="fast", input_per_million=fast_in, output_per_million=fast_out, priority=1
        ),
        "standard": Tier(
            name="standard", input_per_million=std_in, output_per_million=std_out, priority=0
        ),
    }


def usage_record(tier: Tier, input_tokens: int, output_tokens: int) -> dict[str, object]:
    """The ``usage`` object of a response: OpenAI's token counts plus tier and cost."""
    cost_in, cost_out = tier.cost(input_tokens, output_tokens)
    return {
        "prompt_tokens": input_tokens,
        "completion_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
        "tier": tier.name,
        "cost": {
            "input_usd": str(cost_in),
            "output_usd": str(cost_out),
            "total_usd": str(cost_in + cost_out),
            "input_per_million_usd": str(tier.input_per_million),
            "output_per_million_usd": str(tier.output_per_million),
        },
    }


def key_name(secret: str) -> str:
    return "key-" + hashlib.sha256(secret.encode()).hexdigest()[:8]


def load_api_keys(path: str | os.PathLike[str]) -> dict[str, str]:
    """secret -> name from a keys file (see the module docstring)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--api-keys {file}: no such file; write one key per line, NAME:SECRET")
    keys: dict[str, str] = {}
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, secret = line.partition(":")
        if not sep:
            name, secret = key_name(line), line
        name, secret = name.strip(), secret.strip()
        if not name or len(secret) < 8 or any(c.isspace() for c in secret):
            raise ValueError(
                f"{file}:{number}: a key needs a name and a secret of at least 8 characters "
                "without spaces (NAME:SECRET)"
            )
        if secret in keys:
            raise ValueError(f"{file}:{number}: this secret is listed twice")
        keys[secret] = name
    if not keys:
        raise ValueError(f"{file} lists no API key; write one key per line, NAME:SECRET")
    return keys


_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY,
    request_id TEXT NOT NULL UNIQUE,
    created REAL NOT NULL,
    api_key TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    model TEXT NOT NULL,
    tier TEXT NOT NULL,
    status TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost_usd TEXT NOT NULL
)
"""


class UsageLedger:
    """Append-only SQLite usage ledger (see the module docstring); safe across threads."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)

    def record(
        self,
        *,
        request_id: str,
        api_key: str,
        endpoint: str,
        model: str,
        tier: Tier,
        status: str,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """Write one row in its own committed transaction."""
        cost_in, cost_out = tier.cost(prompt_tokens, completion_tokens)
        row = (
            request_id,
            time.time(),
            api_key,
            endpoint,
            model,
            tier.name,
            status,
            prompt_tokens,
            completion_tokens,
            str(cost_in + cost_out),
        )
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT INTO usage (request_id, created, api_key, endpoint, model, tier, "
                    "status, prompt_tokens, completion_tokens, cost_usd) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    row,
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()


def read_usage(path: str | os.PathLike[str]) -> list[dict[str, object]]:
    """Per (key, tier): requests, input/output tokens and exact total cost."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{file}: no usage ledger there; pass the --ledger file etude serve wrote")
    db = sqlite3.connect(f"file:{file}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT api_key, tier, prompt_tokens, completion_tokens, cost_usd FROM usage"
        ).fetchall()
    finally:
        db.close()
    totals: dict[tuple[str, str], dict[str, object]] = {}
    for key, tier, prompt, completion, cost in rows:
        entry = totals.setdefault(
            (key, tier),
            {
                "api_key": key,
                "tier": tier,
                "requests": 0,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "cost_usd": Decimal(0),
            },
        )
        entry["requests"] += 1
        entry["prompt_tokens"] += prompt
        entry["completion_tokens"] += completion
        entry["cost_usd"] += Decimal(cost)
    return [totals[k] for k in sorted(totals)]


def format_usage(entries: list[dict[str, object]]) -> str:
    """A fixed-width table of `read_usage` with a total line."""
    header = (
        f"{'api key':<20} {'tier':<9} {'requests':>9} {'input':>12} {'output':>12} {'cost $':>14}"
    )
    lines = [header, "-" * len(header)]
    total = [0, 0, 0, Decimal(0)]
    for e in entries:
        lines.append(
            f"{e['api_key']:<20} {e['tier']:<9} {e['requests']:>9,} {e['prompt_tokens']:>12,} "
            f"{e['completion_tokens']:>12,} {e['cost_usd']:>14.6f}"
        )
        for i, k in enumerate(("requests", "prompt_tokens", "completion_tokens", "cost_usd")):
            total[i] += e[k]
    lines.append("-" * len(header))
    lines.append(
        f"{'total':<20} {'':<9} {total[0]:>9,} {total[1]:>12,} {total[2]:>12,} {total[3]:>14.6f}"
    )
    return "\n".join(lines)
