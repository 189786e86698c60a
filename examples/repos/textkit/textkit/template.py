"""``{{ placeholder }}`` templates with dotted lookups and filters.

Syntax: ``{{ name }}`` inserts a value; ``{{ user.name }}`` looks up a key, an attribute or a
list index at each dot; ``{{ name | upper | strip }}`` applies filters left to right. A literal
``{{`` is written as ``\\{{``. Nothing else (no loops, no conditionals, no expressions).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_PLACEHOLDER_RE = re.compile(r"(\\?)\{\{\s*([^{}|]+?)\s*((?:\|\s*\w+\s*)*)\}\}")

_FILTERS = {
    "upper": lambda v: str(v).upper(),
    "lower": lambda v: str(v).lower(),
    "title": lambda v: str(v).title(),
    "strip": lambda v: str(v).strip(),
    "length": lambda v: len(v),
}

_MISSING = object()


def _resolve(context: Mapping[str, Any], dotted: str) -> Any:
    value: Any = context
    for part in dotted.split("."):
        if isinstance(value, Mapping):
            value = value.get(part, _MISSING)
        elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit():
            index = int(part)
            value = value[index] if -len(value) <= index < len(value) else _MISSING
        else:
            value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def render(template: str, context: Mapping[str, Any], strict: bool = True) -> str:
    """Fill the ``{{ ... }}`` placeholders of ``template`` from ``context``.

    Each placeholder is a dotted name, optionally followed by ``| filter`` steps (``upper``,
    ``lower``, ``title``, ``strip``, ``length``); the result is converted with ``str``. ``\\{{``
    renders as a literal ``{{``.

    A name that cannot be resolved raises ``KeyError`` naming it when ``strict`` is true, and
    renders as an empty string otherwise. An unknown filter always raises ``ValueError``.

    >>> render("Hello, {{ user.name | title }}!", {"user": {"name": "ada"}})
    'Hello, Ada!'
    """

    def substitute(match: re.Match[str]) -> str:
        escaped, name, filters = match.groups()
        if escaped:
            return match.group(0)[1:]
        value = _resolve(context, name)
        if value is _MISSING:
            if strict:
                raise KeyError(name)
            return ""
        for filter_name in (f.strip() for f in filters.split("|")[1:]):
            if filter_name not in _FILTERS:
                known = ", ".join(sorted(_FILTERS))
                raise ValueError(f"unknown filter {filter_name!r}; known filters: {known}")
            value = _FILTERS[filter_name](value)
        return str(value)

    return _PLACEHOLDER_RE.sub(substitute, template)


def find_placeholders(template: str) -> list[str]:
    """The distinct placeholder names in ``template``, in order of first appearance.

    Filters are not part of the name and escaped placeholders are skipped.

    >>> find_placeholders("{{ a }} {{ b.c | upper }} {{ a }} \\\\{{ d }}")
    ['a', 'b.c']
    """
    names: list[str] = []
    for escaped, name, _ in _PLACEHOLDER_RE.findall(template):
        if not escaped and name not in names:
            names.append(name)
    return names
