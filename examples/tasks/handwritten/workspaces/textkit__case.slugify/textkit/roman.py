"""Roman numerals: integers 1..3999 to and from their canonical (subtractive) spelling."""

from __future__ import annotations

import re

_NUMERALS = (
    (1000, "M"),
    (900, "CM"),
    (500, "D"),
    (400, "CD"),
    (100, "C"),
    (90, "XC"),
    (50, "L"),
    (40, "XL"),
    (10, "X"),
    (9, "IX"),
    (5, "V"),
    (4, "IV"),
    (1, "I"),
)

_CANONICAL = re.compile(r"M{0,3}(CM|CD|D?C{0,3})(XC|XL|L?X{0,3})(IX|IV|V?I{0,3})")

MAX_ROMAN = 3999


def to_roman(number: int) -> str:
    """Spell ``number`` as a Roman numeral in canonical subtractive form.

    >>> to_roman(1994)
    'MCMXCIV'

    Raises ``TypeError`` for anything but an ``int`` (``bool`` included) and ``ValueError``
    outside ``1..3999``.
    """
    if not isinstance(number, int) or isinstance(number, bool):
        raise TypeError(f"expected an int, got {type(number).__name__}")
    if not 1 <= number <= MAX_ROMAN:
        raise ValueError(f"Roman numerals cover 1..{MAX_ROMAN}, got {number}")
    parts = []
    for value, symbol in _NUMERALS:
        count, number = divmod(number, value)
        parts.append(symbol * count)
    return "".join(parts)


def from_roman(numeral: str) -> int:
    """Read a Roman numeral; lower case is accepted, surrounding whitespace ignored.

    Only the canonical spelling is valid: ``"IIII"``, ``"IC"`` or ``"VX"`` raise ``ValueError``,
    as does an empty string.

    >>> from_roman("mcmxciv")
    1994
    """
    text = numeral.strip().upper()
    if not text or not _CANONICAL.fullmatch(text):
        raise ValueError(f"not a canonical Roman numeral: {numeral!r}")
    total = 0
    pos = 0
    for value, symbol in _NUMERALS:
        while text.startswith(symbol, pos):
            total += value
            pos += len(symbol)
    assert pos == len(text), text
    return total
