"""The chat template (ChatML style) and an append-only token builder for conversations.

Why: RL needs the exact token ids the model saw and produced. Re-rendering a whole conversation
and tokenizing it again can merge tokens across a turn boundary or re-spell what the model
generated, and then the stored logprobs belong to other tokens. So a conversation is built by
appending: every call tokenizes only its own new piece, and ids already written never change.

The template, exactly (``<|...|>`` and the tag markers are single special ids, written by id):

    <|im_start|>{role}\\n{body}<|im_end|>\\n

- ``role`` is one of `ROLES`; ``{role}\\n`` is encoded as plain text.
- system and user: ``body`` is the content, plain text (special strings inside stay text).
- assistant: ``body`` is the content with the tool-call markers ``<tool_call>`` and
  ``</tool_call>`` written as their special ids, everything else plain text. The model calls a
  tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes/Qwen
  convention); parsing the calls is the environment's job (`etude.env`), not this module's.
- tool: the content is one tool result as raw text; ``body`` is
  ``<tool_response>\\n{content}\\n</tool_response>`` with the markers as ids and the content as
  plain text, so a tool's output can not close its message or forge a call. Several results of
  one assistant turn are several tool messages, in call order.

An assistant turn the model generates is built as `Conversation.add_generation_prompt`
(``<|im_start|>assistant\\n``) followed by `Conversation.add_generated` with the model's own ids,
kept verbatim; when they end with ``<|im_end|>`` the turn is closed and the ``\\n`` separator is
appended, as the template has it.

Loss mask: 1 on the tokens the model is trained to produce (the body of an assistant message and
its closing ``<|im_end|>``), 0 elsewhere (role headers, the ``\\n`` separators, system, user and
tool messages).

What this module does not do: parse or validate tool calls, execute tools, truncate long
conversations, or decide which turns an RL loss uses beyond the mask.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from etude.model.tokenizer import (
    IM_END,
    IM_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
    Tokenizer,
)

ROLES = ("system", "user", "assistant", "tool")
_ASSISTANT_SPECIALS = frozenset({TOOL_CALL_START, TOOL_CALL_END})
_TURN_SEPARATOR = "\n"


@dataclass(frozen=True, slots=True)
class Span:
    """Half-open range ``[start, end)`` of positions in a conversation's ids."""

    start: int
    end: int

    def __post_init__(self) -> None:
        assert 0 <= self.start <= self.end, self

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.end)


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a conversation and where its ids lie."""

    role: str
    """One of `ROLES`."""
    content: str
    """The content as given (for a generated turn: the decoded text before ``<|im_end|>``)."""
    span: Span
    """The whole rendered message, header to separator (to the last id so far while open)."""


def _check_role(role: object) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown chat role {role!r}; valid roles: {', '.join(ROLES)}")
    assert isinstance(role, str)
    return role


def render_message_text(role: str, content: str) -> str:
    """The text of one rendered message; the decode of `encode_message`'s ids equals it."""
    _check_role(role)
    if not isinstance(content, str):
        raise ValueError(f"message content must be a str, got {type(content).__name__}")
    if role == "tool":
        content = f"{TOOL_RESPONSE_START}\n{content}\n{TOOL_RESPONSE_END}"
    return f"{IM_START}{role}\n{content}{IM_END}{_TURN_SEPARATOR}"


def encode_header(tokenizer: Tokenizer, role: str) -> list[int]:
    """Ids of ``<|im_start|>{role}\\n``."""
    return [tokenizer.im_start_id, *tokenizer.encode(f"{_check_role(role)}\n")]


def encode_message(tokenizer: Tokenizer, role: str, content: str) -> tuple[list[int], list[int]]:
    """Ids and loss mask of one rendered message (the template of the module docstring)."""
    header = encode_header(tokenizer, role)
    if not isinstance(content, str):
        raise ValueError(f"message content must be a str, got {type(content).__name__}")
    separator = tokenizer.encode(_TURN_SEPARATOR)
    if role == "assistant":
        body = [*tokenizer.encode(content, allow_special=_ASSISTANT_SPECIALS), tokenizer.im_end_id]
        ids = header + body + separator
        mask = [0] * len(header) + [1] * len(body) + [0] * len(separator)
        return ids, mask
    specials = tokenizer.special_ids
    if role == "tool":
        body = [
            specials[TOOL_RESPONSE_START],
            *tokenizer.encode(f"\n{content}\n"),
            specials[TOOL_RESPONSE_END],
        ]
    else:
        body = tokenizer.encode(content)
    ids = header + body + [tokenizer.im_end_id] + separator
    return ids, [0] * len(ids)


class Conversation:
    """Append-only token ids and loss mask of one conversation (see the module docstring).

    Each ``add_*`` call tokenizes only its own piece, appends it, and returns the `Span` of what
    it was asked to add: the whole message (`add_message`), the header
    (`add_generation_prompt`), or exactly the model's ids (`add_generated`; the separator that
    closes the turn follows at ``span.end``). Earlier ids are never rewritten.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        self._mask: list[int] = []
        self._messages: list[Message] = []
        self._separator = tokenizer.encode(_TURN_SEPARATOR)
        self._generation_header = encode_header(tokenizer, "assistant")
        # ids the model produced in the open assistant turn (None: no turn is open)
        self._open_turn_ids: list[int] | None = None

    def _append(self, ids: Sequence[int], mask: Sequence[int]) -> Span:
        assert len(ids) == len(mask), (len(ids), len(mask))
        start = len(self._ids)
        self._ids.extend(ids)
        self._mask.extend(mask)
        return Span(start, len(self._ids))

    def _require_closed(self, action: str) -> None:
        if self._open_turn_ids is not None:
            raise ValueError(
                f"can not {action}: the assistant turn is still open; pass the model's ids ending "
                f"with {IM_END} to add_generated first"
            )

    def add_message(self, role: str, content: str) -> Span:
        """Render one message and append its ids; returns its span."""
        self._require_closed(f"add a {role!r} message")
        ids, mask = encode_message(self.tokenizer, role, content)
        span = self._append(ids, mask)
        self._messages.append(Message(role, content, span))
        return span

    def add_generation_prompt(self) -> Span:
        """Append ``<|im_start|>assistant\\n`` and open an assistant turn for `add_generated`."""
        self._require_closed("add a generation prompt")
        span = self._append(self._generation_header, [0] * len(self._generation_header))
        self._open_turn_ids = []
        self._messages.append(Message("assistant", "", span))
        return span

    def add_generated(self, ids: Sequence[int]) -> Span:
        """Append the model's ids verbatim (loss mask 1); returns the span of exactly those ids.

        Ids ending with ``<|im_end|>`` close the turn and append the ``\\n`` separator (mask 0);
        without it the turn stays open and more ids may follow (a generation cut by a length
        limit). ``<|im_end|>`` anywhere but last is an error: generation stops at it.
        """
        if self._open_turn_ids is None:
            raise ValueError(
                "no assistant turn is open: call add_generation_prompt before add_generated"
            )
        ids = [int(i) for i in ids]
        vocab_size = self.tokenizer.vocab_size
        for pos, token_id in enumerate(ids):
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"generated id {token_id} at position {pos} is out of range [0, {vocab_size})"
                )
        im_end = self.tokenizer.im_end_id
        if im_end in ids[:-1]:
            raise ValueError(
                f"generated ids hold {IM_END} at position {ids.index(im_end)} before their end; "
                "stop generation at the first one and pass only the ids up to it"
            )
        span = self._append(ids, [1] * len(ids))
        self._open_turn_ids.extend(ids)
        closed = bool(self._open_turn_ids) and self._open_turn_ids[-1] == im_end
        if closed:
            self._append(self._separator, [0] * len(self._separator))
        turn_ids = self._open_turn_ids[:-1] if closed else self._open_turn_ids
        header = self._messages[-1]
        assert header.role == "assistant", header
        turn_span = Span(header.span.start, len(self._ids))
        self._messages[-1] = Message("assistant", self.tokenizer.decode(turn_ids), turn_span)
        if closed:
            self._open_turn_ids = None
        return span

    @property
    def ids(self) -> list[int]:
        """All ids so far (a copy)."""
        return list(self._ids)

    @property
    def loss_mask(self) -> list[int]:
        """1 where the model is trained to produce the token, else 0 (a copy, aligned with `ids`)."""
        return list(self._mask)

    @property
    def messages(self) -> list[Message]:
        """The messages so far, in order (a copy)."""
        return list(self._messages)

    @property
    def turn_open(self) -> bool:
        """Whether an assistant turn awaits more generated ids."""
        return self._open_turn_ids is not None

    def __len__(self) -> int:
        return len(self._ids)


def render_messages(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = False,
) -> tuple[list[int], list[int]]:
    """Ids and loss mask of ``[{"role": ..., "content": ...}, ...]``, built by appending.

    For SFT data and prompts; ``add_generation_prompt`` ends with ``<|im_start|>assistant\\n``.
    """
    conversation = Conversation(tokenizer)
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"messages[{i}] must be a mapping with 'role' and 'content', got {message!r}"
            )
        keys = set(message)
        if keys != {"role", "content"}:
            raise ValueError(
                f"messages[{i}] has keys {sorted(keys)}; expected exactly 'role' and 'content' "
                "(write tool calls into the assistant content as <tool_call>...</tool_call>)"
            )
        conversation.add_message(message["role"], message["content"])
    if add_generation_prompt:
        conversation.add_generation_prompt()
    return conversation.ids, conversation.loss_mask


def tools_system_prompt(tools: Sequence[Mapping[str, object]], preamble: str = "") -> str:
    """System-message text that declares ``tools`` (OpenAI function schemas) and the call format.

    Each schema is one JSON line inside ``<tools></tools>``. ``preamble`` (for example the role
    of the agent) comes first when given.
    """
    if isinstance(tools, Mapping | str) or not isinstance(tools, Sequence):
        raise ValueError("tools must be a list of OpenAI function schemas")
    if not tools:
        raise ValueError(
            "tools is empty: declare at least one tool, or use no tools system prompt at all"
        )
    lines = []
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(function, Mapping)
        ):
            raise ValueError(
                f"tools[{i}] must be an OpenAI function schema "
                '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string, got {name!r}")
        if name in names:
            raise ValueError(
                f"tools[{i}]: the tool name {name!r} is declared twice; names must be unique"
            )
        names.add(name)
        try:
            lines.append(json.dumps(dict(tool), ensure_ascii=False))
        except TypeError as e:
            raise ValueError(f"tools[{i}] ({name}) is not JSON-serializable: {e}") from e
    parts = [preamble.strip()] if preamble.strip() else []
    parts.append(
        "You can call the tools declared below, one JSON schema per line:\n"
        "<tools>\n" + "\n".join(lines) + "\n</tools>\n\n"
        "To call a tool, write its name and a JSON object of arguments inside tool-call tags:\n"
        f'{TOOL_CALL_START}{{"name": "<tool name>", "arguments": {{...}}}}{TOOL_CALL_END}\n'
        "You may make several calls in one message, each in its own tags. Each result comes back "
        f"in a tool message, wrapped in {TOOL_RESPONSE_START}...{TOOL_RESPONSE_END}."
    )
    return "\n\n".join(parts)
