"""Fitting text into a column: greedy wrapping, full justification and truncation.

All three functions treat any run of whitespace as one word break; widths count characters.
"""

from __future__ import annotations


def wrap(text: str, width: int = 70) -> list[str]:
    """Wrap ``text`` into lines of at most ``width`` characters.

    Words are packed greedily, separated by single spaces. A word longer than ``width`` is split
    into pieces of ``width`` characters (the last piece may share its line with the next words).
    Empty or whitespace-only text gives an empty list.

    Raises ``ValueError`` if ``width`` is below 1.

    >>> wrap("the quick brown fox", 10)
    ['the quick', 'brown fox']
    """
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    lines: list[str] = []
    current = ""
    for word in text.split():
        while len(word) > width:
            if current:
                lines.append(current)
                current = ""
            lines.append(word[:width])
            word = word[width:]
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def _pack_lines(words: list[str], width: int) -> list[list[str]]:
    lines: list[list[str]] = []
    current: list[str] = []
    length = 0
    for word in words:
        needed = len(word) if not current else length + 1 + len(word)
        if current and needed > width:
            lines.append(current)
            current, length = [word], len(word)
        else:
            current.append(word)
            length = needed
    if current:
        lines.append(current)
    return lines


def _spread(words: list[str], width: int) -> str:
    if len(words) == 1:
        return words[0]
    gaps = len(words) - 1
    spaces = width - sum(len(word) for word in words)
    base, extra = divmod(spaces, gaps)
    # Leftmost gaps take the remainder, as typesetters and most editors do.
    parts = []
    for i, word in enumerate(words[:-1]):
        parts.append(word + " " * (base + (1 if i < extra else 0)))
    parts.append(words[-1])
    return "".join(parts)


def justify(text: str, width: int) -> list[str]:
    """Fully justify ``text`` to ``width`` characters per line.

    Words are packed greedily; on every line but the last, spaces are added between words until
    the line is exactly ``width`` long, the leftmost gaps getting one more space when the spaces
    do not divide evenly. The last line, and any line holding a single word, is left-aligned and
    not padded. A word longer than ``width`` stays whole on its own line.

    Raises ``ValueError`` if ``width`` is below 1.

    >>> justify("This is an example of text justification.", 16)
    ['This    is    an', 'example  of text', 'justification.']
    """
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    lines = _pack_lines(text.split(), width)
    if not lines:
        return []
    out = [_spread(line, width) for line in lines[:-1]]
    out.append(" ".join(lines[-1]))
    return out


def truncate(text: str, width: int, placeholder: str = "...") -> str:
    """Shorten ``text`` to at most ``width`` characters, ending with ``placeholder`` if cut.

    Whitespace is collapsed first. If the text then fits it is returned whole; otherwise as many
    whole words as fit together with the placeholder are kept. If not even the first word fits,
    the text is cut mid-word.

    Raises ``ValueError`` if ``placeholder`` is longer than ``width``.

    >>> truncate("Hello brave new world", 15)
    'Hello brave...'
    """
    if len(placeholder) > width:
        raise ValueError(f"placeholder {placeholder!r} does not fit in width {width}")
    collapsed = " ".join(text.split())
    if len(collapsed) <= width:
        return collapsed
    room = width - len(placeholder)
    kept = ""
    for word in collapsed.split(" "):
        candidate = f"{kept} {word}" if kept else word
        if len(candidate) > room:
            break
        kept = candidate
    if not kept:
        kept = collapsed[:room]
    return kept + placeholder
