"""Identifier styles (snake_case, camelCase, kebab-case) and URL slugs.

Word boundaries are found the same way for every style: runs of characters other than ASCII
letters and digits separate words, and inside a run a lower-to-upper change or the last capital of
an acronym starts a new word (``"HTTPServer"`` -> ``HTTP``, ``Server``). Digits stay attached to
the word they follow (``"version2Name"`` -> ``version2``, ``Name``).
"""

from __future__ import annotations

import re

# Acronym followed by a capitalised word, a (capitalised) lowercase word, a bare acronym, or
# leading digits; trailing digits stick to the word before them.
_WORD_RE = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+[0-9]*|[A-Z]+[0-9]*|[0-9]+")


def _split_words(text: str) -> list[str]:
    return _WORD_RE.findall(text)


def snake_case(text: str) -> str:
    """Convert ``text`` to snake_case.

    Words are lower-cased and joined with underscores; punctuation and whitespace only separate
    words and never appear in the result.

    >>> snake_case("HTTPServerError")
    'http_server_error'
    >>> snake_case("already-kebab case")
    'already_kebab_case'
    """
    return "_".join(word.lower() for word in _split_words(text))


def kebab_case(text: str) -> str:
    """Convert ``text`` to kebab-case (lower-case words joined with hyphens).

    >>> kebab_case("parseJSONResponse")
    'parse-json-response'
    """
    return "-".join(word.lower() for word in _split_words(text))


def camel_case(text: str, upper_first: bool = False) -> str:
    """Convert ``text`` to camelCase, or to PascalCase when ``upper_first`` is true.

    Every word after the first is capitalised (acronyms too: ``"http_server"`` gives
    ``"httpServer"`` and ``"HTTP server"`` gives ``"httpServer"``). An input with no letters or
    digits gives an empty string.

    >>> camel_case("user_id")
    'userId'
    >>> camel_case("user id", upper_first=True)
    'UserId'
    """
    words = [word.lower() for word in _split_words(text)]
    if not words:
        return ""
    head = words[0].capitalize() if upper_first else words[0]
    return head + "".join(word.capitalize() for word in words[1:])
