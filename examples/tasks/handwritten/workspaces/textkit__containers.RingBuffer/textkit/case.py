"""Identifier styles (snake_case, camelCase, kebab-case) and URL slugs.

Word boundaries are found the same way for every style: runs of characters other than ASCII
letters and digits separate words, and inside a run a lower-to-upper change or the last capital of
an acronym starts a new word (``"HTTPServer"`` -> ``HTTP``, ``Server``). Digits stay attached to
the word they follow (``"version2Name"`` -> ``version2``, ``Name``).
"""

from __future__ import annotations

import re
import unicodedata

# Acronym followed by a capitalised word, a (capitalised) lowercase word, a bare acronym, or
# leading digits; trailing digits stick to the word before them.
_WORD_RE = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+[0-9]*|[A-Z]+[0-9]*|[0-9]+")

# Letters that Unicode decomposition does not reduce to ASCII.
_TRANSLITERATION = {
    "\u00df": "ss",
    "\u00e6": "ae",
    "\u00c6": "AE",
    "\u00f8": "o",
    "\u00d8": "O",
    "\u0153": "oe",
    "\u0152": "OE",
    "\u0111": "d",
    "\u0110": "D",
    "\u0142": "l",
    "\u0141": "L",
    "\u00fe": "th",
    "\u00de": "TH",
}


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


def _fold_accents(text: str) -> str:
    text = "".join(_TRANSLITERATION.get(ch, ch) for ch in text)
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch))


def slugify(text: str, separator: str = "-", max_length: int | None = None) -> str:
    """Make a lower-case ASCII slug of ``text`` for use in URLs and file names.

    Accented letters are folded to their ASCII base (``"Creme Brulee"`` from the accented
    spelling, ``"ss"`` for the German sharp s); every run of other characters becomes one
    ``separator``, with none at either end. With ``max_length`` the slug is cut at the last
    separator that keeps it within the limit; a single word longer than the limit is cut hard.

    Raises ``ValueError`` if ``separator`` is empty or ``max_length`` is below 1.

    >>> slugify("Hello, World!")
    'hello-world'
    >>> slugify("The quick brown fox", max_length=12)
    'the-quick'
    """
    if not separator:
        raise ValueError("separator must be a non-empty string")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    ascii_text = _fold_accents(text).encode("ascii", "ignore").decode("ascii").lower()
    words = re.findall(r"[a-z0-9]+", ascii_text)
    slug = separator.join(words)
    if max_length is None or len(slug) <= max_length:
        return slug
    cut = slug[: max_length + len(separator)]
    boundary = cut.rfind(separator)
    if boundary > 0:
        return slug[:boundary]
    return slug[:max_length]
