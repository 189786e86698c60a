"""A small INI dialect: sections, ``key = value`` pairs, comments and continuation lines.

The dialect: ``[section]`` headers; ``key = value`` or ``key: value`` (the first ``=`` or ``:``
splits); lines starting with ``#`` or ``;`` are comments; an indented line continues the previous
value (joined with a newline); keys before the first header belong to the section ``""``.
Values are strings; no interpolation, no type conversion.
"""

from __future__ import annotations

import re

_SECTION_RE = re.compile(r"\[([^\[\]]+)\]")


class IniError(ValueError):
    """A syntax error in INI text, with the 1-based line number where it was found."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


def parse_ini(text: str) -> dict[str, dict[str, str]]:
    """Parse INI ``text`` into ``{section: {key: value}}``, preserving order.

    Keys and values are stripped of surrounding whitespace; a section that appears twice is
    merged. Raises ``IniError`` (a ``ValueError``) naming the line for a line that is neither a
    header, a pair, a comment nor a continuation, for a key given twice in one section, and for a
    continuation line with no value to continue.

    >>> parse_ini("[server]\\nhost = example.org\\nport: 8080\\n")
    {'server': {'host': 'example.org', 'port': '8080'}}
    """
    sections: dict[str, dict[str, str]] = {}
    current = ""
    last_key: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if raw[0] in " \t":
            if last_key is None:
                raise IniError("continuation line with no value to continue", number)
            section = sections[current]
            section[last_key] = (
                f"{section[last_key]}\n{stripped}" if section[last_key] else stripped
            )
            continue
        header = _SECTION_RE.fullmatch(stripped)
        if header:
            current = header.group(1).strip()
            sections.setdefault(current, {})
            last_key = None
            continue
        split_at = min((i for i in (stripped.find("="), stripped.find(":")) if i >= 0), default=-1)
        if split_at <= 0:
            raise IniError(f"expected [section] or key = value, got {stripped!r}", number)
        key = stripped[:split_at].strip()
        value = stripped[split_at + 1 :].strip()
        section = sections.setdefault(current, {})
        if key in section:
            raise IniError(f"duplicate key {key!r} in section {current!r}", number)
        section[key] = value
        last_key = key
    return sections


def dump_ini(data: dict[str, dict[str, object]]) -> str:
    """Write ``{section: {key: value}}`` as INI text that ``parse_ini`` reads back.

    Values are converted with ``str``; a multi-line value is written as continuation lines. The
    ``""`` section, if present, is written first without a header.

    Raises ``ValueError`` for a key that is empty, contains ``=``, ``:`` or a newline, or starts
    with ``[``, ``#`` or ``;``; for a section name containing brackets or a newline; and for a
    value that would read back differently (see ``_check_value``).
    """
    blocks = []
    ordered = sorted(data.items(), key=lambda item: item[0] != "")
    for name, pairs in ordered:
        if any(ch in name for ch in "[]\n") or name != name.strip():
            raise ValueError(f"section name {name!r} cannot be written as INI")
        lines = [f"[{name}]"] if name else []
        for key, value in pairs.items():
            if not key or any(ch in key for ch in "=:\n") or key[0] in "[#;" or key != key.strip():
                raise ValueError(f"key {key!r} cannot be written as INI")
            text_lines = _check_value(key, str(value))
            lines.append(f"{key} = {text_lines[0]}")
            lines.extend(f"    {line}" for line in text_lines[1:])
        if lines:
            blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def _check_value(key: str, value: str) -> list[str]:
    # parse_ini strips every line, skips blank and comment lines, and lets a continuation
    # replace an empty first line: values that would hit any of these cannot round-trip.
    lines = value.split("\n")
    if any(line != line.strip() for line in lines):
        raise ValueError(f"value of {key!r} has leading or trailing whitespace on a line")
    if len(lines) > 1 and not all(lines):
        raise ValueError(f"multi-line value of {key!r} has an empty line")
    if any(line[:1] in ("#", ";") for line in lines[1:]):
        raise ValueError(f"continuation line of {key!r} would read as a comment")
    return lines
