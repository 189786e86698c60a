"""What the chat formats of imported model families share: marker tokenizers, append-only ids,
parsed tool calls.

A model family (Kimi K2, DeepSeek-V3, ...) writes its turns and tool calls with its own marker
tokens. Three pieces are common to every family's conversation:

- `MarkerTokenizer`: a ``tokenizers`` backend whose ``encode`` treats text as plain text (a
  marker's string inside a tool result stays ordinary ids, so untrusted text can not forge a
  turn or a call) and whose markers are single ids written by the renderer. Any object with
  ``encode(text)``, ``decode(ids)`` and ``token_to_id(token)`` of that meaning serves (etude's
  own ``Tokenizer``, the tiktoken loader of ``etude.model.tiktoken_loader``).
- `AppendOnlyChat`: ids, loss mask and text built by appending each message, never re-rendering
  the conversation (re-tokenizing can merge tokens across turns and re-spell what the model
  generated). Text between markers is tokenized in one piece per message and markers are their
  ids, so the ids equal the tokenization of the template's text (each family's test checks this
  turn by turn against transformers' ``apply_chat_template``).
- `FamilyCall` / `MalformedCall`: what a family's parser finds in generated text. A malformed
  call is data (kind, message for the model, raw text), never an exception.

Not here: Hermes/Qwen (``etude.model.hf_chat``) and etude's ChatML (``etude.model.chat``), which
predate this module; choosing a family from a checkpoint (``etude.model.chat_family``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import tokenizers

MALFORMED_KINDS = ("malformed_json", "malformed_call")
"""``malformed_json``: the arguments are not one JSON object; ``malformed_call``: the markers
around a call are wrong (unclosed, stray, no function name)."""


class ChatTokenizer(Protocol):
    """What a conversation needs of a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Plain-text ids: a marker's string in ``text`` is never its marker id."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, marker ids written as their strings."""
        ...

    def token_to_id(self, token: str) -> int | None: ...


class MarkerTokenizer:
    """A ``tokenizers`` backend with a family's markers as special single ids."""

    def __init__(self, backend: tokenizers.Tokenizer, markers: Sequence[str]) -> None:
        missing = [m for m in markers if backend.token_to_id(m) is None]
        if missing:
            raise ValueError(
                f"the tokenizer has no id for the marker(s) {missing}; this chat format needs "
                "every one of them as a single token (added_tokens of tokenizer.json)"
            )
        self._plain = tokenizers.Tokenizer.from_str(backend.to_str())
        # markers in text encode as ordinary pieces; the renderer writes marker ids itself
        self._plain.encode_special_tokens = True
        self.special_ids = {m: backend.token_to_id(m) for m in markers}

    @classmethod
    def from_file(cls, path: str | Path, markers: Sequence[str]) -> MarkerTokenizer:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no tokenizer file at {path}")
        return cls(tokenizers.Tokenizer.from_file(str(path)), markers)

    @property
    def vocab_size(self) -> int:
        """Ids of the tokenizer, added tokens (the markers) included."""
        return self._plain.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._plain.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._plain.token_to_id(token)


@dataclass(kw_only=True, slots=True, frozen=True)
class FamilyCall:
    """One well-formed tool call found in generated text."""

    name: str
    arguments: dict[str, Any]
    call_id: str | None = None
    """The family's own call id where it writes one (Kimi K2: ``functions.NAME:IDX``)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class MalformedCall:
    """A tool call that could not be read: an observation for the model, never a crash."""

    kind: str
    """One of `MALFORMED_KINDS`."""
    message: str
    """What the model is told."""
    raw: str
    """The text of the call as written."""
    name: str | None = None
    """The function name, when it could be read."""

    def __post_init__(self) -> None:
        assert self.kind in MALFORMED_KINDS, self.kind


ParsedCall = FamilyCall | MalformedCall


def parse_arguments(raw: str, name: str | None, call_format: str) -> ParsedCall:
    """The JSON object ``raw`` as a call of ``name``, or why it is malformed."""
    if name is None or not name.strip():
        message = f"Malformed tool call: no function name. Write {call_format}."
        return MalformedCall(kind="malformed_call", message=message, raw=raw)
    name = name.strip()
    try:
        value = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        message = f"Malformed tool call: the arguments of {name} are not valid JSON ({e})."
        return MalformedCall(kind="malformed_json", message=message, raw=raw, name=name)
    if not isinstance(value, dict):
        kind = type(value).__name__
        message = f"Malformed tool call: the arguments of {name} must be a JSON object, got {kind}."
        return MalformedCall(kind="malformed_json", message=message, raw=raw, name=name)
    return FamilyCall(name=name, arguments=value)


def malformed_call(
    problem: str, raw: str, call_format: str, name: str | None = None
) -> MalformedCall:
    """A call whose markers or header could not be read, with the format the model should write."""
    message = f"Malformed tool call: {problem}. Write {call_format}."
    return MalformedCall(kind="malformed_call", message=message, raw=raw, name=name)


def scan_tool_calls(
    text: str,
    *,
    section: tuple[str, str],
    call: tuple[str, str],
    parse_call: Callable[[str], ParsedCall],
    call_format: str,
) -> list[ParsedCall]:
    """Every tool call of a generated turn whose calls sit in ``section`` markers, each between
    ``call`` markers (Kimi K2's and DeepSeek-V3's layouts), in order. A marker out of place, or a
    section or call left open, is a `MalformedCall`; the scan goes on after it."""
    section_begin, section_end = section
    call_begin, call_end = call

    def bad(problem: str, raw: str) -> MalformedCall:
        return malformed_call(problem, raw, call_format)

    def calls_in(block: str) -> list[ParsedCall]:
        out: list[ParsedCall] = []
        pos = 0
        while True:
            begin = block.find(call_begin, pos)
            stray = block.find(call_end, pos)
            if stray != -1 and (begin == -1 or stray < begin):
                out.append(bad(f"{call_end} without {call_begin}", block[pos:stray]))
                pos = stray + len(call_end)
                continue
            if begin == -1:
                return out
            start = begin + len(call_begin)
            end = block.find(call_end, start)
            reopen = block.find(call_begin, start)
            if end == -1 or (reopen != -1 and reopen < end):
                stop = reopen if reopen != -1 else len(block)
                out.append(bad(f"{call_begin} is not closed by {call_end}", block[start:stop]))
                pos = stop
                continue
            out.append(parse_call(block[start:end]))
            pos = end + len(call_end)

    out: list[ParsedCall] = []
    pos = 0
    while True:
        begin = text.find(section_begin, pos)
        outside = text[pos:] if begin == -1 else text[pos:begin]
        for marker in (call_begin, call_end, section_end):
            if marker in outside:
                out.append(bad(f"{marker} outside {section_begin}...{section_end}", outside))
                break
        if begin == -1:
            return out
        start = begin + len(section_begin)
        end = text.find(section_end, start)
        if end == -1:
            out += calls_in(text[start:])
            out.append(bad(f"{section_begin} is not closed by {section_end}", text[start:]))
            return out
        out += calls_in(text[start:end])
        pos = end + len(section_end)


def arguments_text(arguments: Any) -> str:
    """A call's arguments as the templates write them: a string verbatim, else JSON (Jinja's
    ``tojson`` as transformers configures it: ``", "`` and ``": "``, non-ASCII kept)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class AppendOnlyChat:
    """Ids, loss mask and text of one conversation, grown by appending parts.

    A part is a marker (written as its id) or plain text (tokenized in one piece).
    """

    def __init__(self, tokenizer: ChatTokenizer, markers: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.markers = tuple(markers)
        self._ids: list[int] = []
        self._mask: list[int] = []
        self._text: list[str] = []
        self._marker_ids: dict[str, int] = {}
        for m in self.markers:
            token_id = tokenizer.token_to_id(m)
            if token_id is None:
                raise ValueError(
                    f"the tokenizer has no id for {m!r}; this chat format needs all of "
                    f"{list(self.markers)} as single tokens"
                )
            self._marker_ids[m] = token_id
        self._split = re.compile("(" + "|".join(re.escape(m) for m in self.markers) + ")")

    def marker_id(self, marker: str) -> int:
        return self._marker_ids[marker]

    def split_markers(self, text: str) -> list[str]:
        """Template text in parts, its markers as parts of their own (written as ids)."""
        return [part for part in self._split.split(text) if part]

    def encode_parts(self, parts: Sequence[str]) -> list[int]:
        ids: list[int] = []
        for part in parts:
            if part in self._marker_ids:
                ids.append(self._marker_ids[part])
            elif part:
                ids.extend(self.tokenizer.encode(part))
        return ids

    def append(self, parts: Sequence[str], mask: int) -> None:
        ids = self.encode_parts(parts)
        self._ids.extend(ids)
        self._mask.extend([mask] * len(ids))
        self._text.extend(parts)

    def append_ids(self, ids: Sequence[int], mask: int) -> None:
        """Ids verbatim (the model's own generation)."""
        ids = [int(i) for i in ids]
        self._ids.extend(ids)
        self._mask.extend([mask] * len(ids))
        self._text.append(self.tokenizer.decode(ids))

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    @property
    def loss_mask(self) -> list[int]:
        return list(self._mask)

    @property
    def text(self) -> str:
        return "".join(self._text)
