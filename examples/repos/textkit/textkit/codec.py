"""Small codecs: integers in any base up to 62, and run-length encoding of sequences."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""The default digit alphabet: 0-9, then a-z, then A-Z (base 62 uses all of them)."""


def to_base(number: int, base: int, alphabet: str = DIGITS) -> str:
    """Write the integer ``number`` in ``base`` using the first ``base`` digits of ``alphabet``.

    Negative numbers get a leading ``-``; zero is the alphabet's first digit.

    >>> to_base(255, 16)
    'ff'
    >>> to_base(-10, 2)
    '-1010'
    >>> to_base(61, 62)
    'Z'

    Raises ``ValueError`` if ``base`` is below 2 or larger than the alphabet, or if the alphabet
    repeats a character or contains ``-``.
    """
    _check_alphabet(base, alphabet)
    if number == 0:
        return alphabet[0]
    sign = "-" if number < 0 else ""
    number = abs(number)
    digits = []
    while number:
        number, remainder = divmod(number, base)
        digits.append(alphabet[remainder])
    return sign + "".join(reversed(digits))


def from_base(text: str, base: int, alphabet: str = DIGITS) -> int:
    """Read an integer written in ``base`` with the first ``base`` digits of ``alphabet``.

    A leading ``-`` or ``+`` is allowed; surrounding whitespace is ignored. Digits are
    case-sensitive (with the default alphabet ``"a"`` is 10 and ``"A"`` is 36).

    >>> from_base("ff", 16)
    255
    >>> from_base("-1010", 2)
    -10

    Raises ``ValueError`` for an empty string, a character that is not a digit of this base, or
    a bad ``base``/``alphabet`` (see ``to_base``).
    """
    _check_alphabet(base, alphabet)
    body = text.strip()
    sign = 1
    if body[:1] in ("-", "+"):
        sign = -1 if body[0] == "-" else 1
        body = body[1:]
    if not body:
        raise ValueError(f"no digits in {text!r}")
    values = {ch: i for i, ch in enumerate(alphabet[:base])}
    number = 0
    for ch in body:
        if ch not in values:
            raise ValueError(f"{ch!r} is not a base-{base} digit (in {text!r})")
        number = number * base + values[ch]
    return sign * number


def _check_alphabet(base: int, alphabet: str) -> None:
    if not 2 <= base <= len(alphabet):
        raise ValueError(f"base must be in 2..{len(alphabet)} for this alphabet, got {base}")
    if len(set(alphabet)) != len(alphabet) or "-" in alphabet or "+" in alphabet:
        raise ValueError("alphabet must have distinct characters and no sign characters")


def rle_encode(items: Iterable[Any]) -> list[tuple[Any, int]]:
    """Run-length encode ``items`` into ``(item, count)`` pairs.

    Consecutive equal items (compared with ``==``) collapse into one pair; any iterable works,
    strings included.

    >>> rle_encode("aaabcc")
    [('a', 3), ('b', 1), ('c', 2)]
    >>> rle_encode([])
    []
    """
    runs: list[tuple[Any, int]] = []
    for item in items:
        if runs and runs[-1][0] == item:
            runs[-1] = (item, runs[-1][1] + 1)
        else:
            runs.append((item, 1))
    return runs


def rle_decode(runs: Iterable[Sequence[Any]]) -> list[Any]:
    """Expand ``(item, count)`` pairs back into the list of items.

    ``"".join(rle_decode(rle_encode(s))) == s`` for every string ``s``.

    >>> rle_decode([("a", 3), ("b", 1)])
    ['a', 'a', 'a', 'b']

    Raises ``ValueError`` if a run is not a pair or its count is not a positive ``int``.
    """
    items: list[Any] = []
    for run in runs:
        if len(run) != 2:
            raise ValueError(f"a run must be an (item, count) pair, got {run!r}")
        item, count = run
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"run count must be a positive int, got {count!r}")
        items.extend([item] * count)
    return items
