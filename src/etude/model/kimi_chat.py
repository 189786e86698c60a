"""The chat format of Kimi K2 (moonshotai/Kimi-K2-Instruct), built append-only, and its tool-call
parser.

Every turn is ``<|im_{user,assistant,system}|>{name}<|im_middle|>{body}<|im_end|>`` with nothing
between turns; tools are declared in a first turn of their own, the arguments of each call are
JSON, and a tool result is a system-class turn that names the call it answers::

    <|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{...}}]<|im_end|>
    <|im_system|>system<|im_middle|>{system}<|im_end|>
    <|im_user|>user<|im_middle|>{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{content}<|tool_calls_section_begin|>
      <|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{"path": "a.py"}<|tool_call_end|>
      <|tool_calls_section_end|><|im_end|>
    <|im_system|>{name or "tool"}<|im_middle|>## Return of functions.read_file:0\\n{result}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>

(the call lines are one line in the real text). The tool declaration is the OpenAI tools array
in compact JSON (``(",", ":")`` separators); a call id is ``functions.{name}:{index}``, the index
counting the calls of one assistant turn from 0. Without a system message the template writes
Kimi's default one (`DEFAULT_SYSTEM`); `KimiConversation` does the same. The format is
append-only as published: every turn is closed by its own ``<|im_end|>``.

`parse_kimi_tool_calls` reads the calls of a generated turn: each well-formed call is a
`FamilyCall` (the function name is the id's part between ``functions.`` and ``:``), each broken
one a `MalformedCall` (unclosed section or call, a call marker outside a section, a header that
is not ``functions.NAME:INDEX``, arguments that are not one JSON object). It reads decoded text,
as vLLM's ``kimi_k2`` parser does.

Not here: Kimi's thinking variants (``<think>`` blocks), images (``<|media_start|>``), the
tokenizer (``tiktoken.model``: ``etude.model.tiktoken_loader``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from etude.model.family_chat import (
    AppendOnlyChat,
    ChatTokenizer,
    FamilyCall,
    MalformedCall,
    ParsedCall,
    arguments_text,
    malformed_call,
    parse_arguments,
    scan_tool_calls,
)

IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
KIMI_MARKERS = (
    IM_USER,
    IM_ASSISTANT,
    IM_SYSTEM,
    IM_MIDDLE,
    IM_END,
    SECTION_BEGIN,
    SECTION_END,
    CALL_BEGIN,
    ARGUMENT_BEGIN,
    CALL_END,
)
"""The markers this format writes, each a single id of the tokenizer."""

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
"""What the template writes as the system turn when the conversation has none."""

CALL_FORMAT = (
    f"{SECTION_BEGIN}{CALL_BEGIN}functions.NAME:0{ARGUMENT_BEGIN}"
    f'{{"arg": "value"}}{CALL_END}{SECTION_END}'
)
_HEADER = re.compile(r"\s*(?:functions\.)?([A-Za-z_][\w\-]*):(\d+)\s*")


def call_id(name: str, index: int) -> str:
    """Kimi's id of the ``index``-th call (from 0) of one assistant turn."""
    return f"functions.{name}:{index}"


class KimiConversation:
    """Append-only ids and loss mask of one conversation in the Kimi K2 format."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._chat = AppendOnlyChat(tokenizer, KIMI_MARKERS)
        self._unanswered: list[str] = []  # call ids of the last assistant turn, in order
        if tools:
            declared = json.dumps(
                [dict(t) for t in tools], ensure_ascii=False, separators=(",", ":")
            )
            self._chat.append([IM_SYSTEM, "tool_declare", IM_MIDDLE, declared, IM_END], 0)
        content = DEFAULT_SYSTEM if system is None else system
        self._chat.append([IM_SYSTEM, "system", IM_MIDDLE, content, IM_END], 0)

    @property
    def end_id(self) -> int:
        """``<|im_end|>``: generation of an assistant turn stops at it."""
        return self._chat.marker_id(IM_END)

    def add_user(self, content: str) -> None:
        self._chat.append([IM_USER, "user", IM_MIDDLE, content, IM_END], 0)

    def add_assistant(self, content: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> None:
        """A finished assistant turn (loss mask 1 on its body and ``<|im_end|>``)."""
        self._chat.append([IM_ASSISTANT, "assistant", IM_MIDDLE], 0)
        parts = [content]
        ids: list[str] = []
        if tool_calls:
            parts.append(SECTION_BEGIN)
            for index, call in enumerate(tool_calls):
                function = call.get("function", call)
                this_id = call.get("id") or call_id(function["name"], index)
                ids.append(this_id)
                args = arguments_text(function["arguments"])
                parts += [CALL_BEGIN, this_id, ARGUMENT_BEGIN, args, CALL_END]
            parts.append(SECTION_END)
        self._chat.append([*parts, IM_END], 1)
        self._unanswered = ids

    def add_tool_result(
        self, content: str, *, tool_call_id: str | None = None, name: str | None = None
    ) -> None:
        """The result of one call; ``tool_call_id`` defaults to the next unanswered call of the
        last assistant turn. ``name`` (the turn's header) defaults to ``tool``, as the template
        writes a result message without a name."""
        if tool_call_id is None:
            if not self._unanswered:
                raise ValueError(
                    "a tool result needs tool_call_id: the last assistant turn has no "
                    "unanswered call"
                )
            tool_call_id = self._unanswered.pop(0)
        elif tool_call_id in self._unanswered:
            self._unanswered.remove(tool_call_id)
        body = f"## Return of {tool_call_id}\n{content}"
        self._chat.append([IM_SYSTEM, name or "tool", IM_MIDDLE, body, IM_END], 0)

    def add_message(self, message: Mapping[str, Any]) -> None:
        """An OpenAI-style message dict (``role``, ``content``, optional ``tool_calls``; a
        ``tool`` message may carry ``tool_call_id`` and ``name``)."""
        role = message.get("role")
        if role == "user":
            self.add_user(message["content"])
        elif role == "assistant":
            self.add_assistant(message.get("content") or "", message.get("tool_calls") or ())
        elif role == "tool":
            self.add_tool_result(
                message["content"],
                tool_call_id=message.get("tool_call_id"),
                name=message.get("name"),
            )
        else:
            raise ValueError(
                f"message role {role!r}: pass system and tools to KimiConversation(); messages "
                "are user, assistant or tool"
            )

    def add_generation_prompt(self) -> None:
        """``<|im_assistant|>assistant<|im_middle|>``: the model's turn comes next."""
        self._chat.append([IM_ASSISTANT, "assistant", IM_MIDDLE], 0)

    def add_generated(self, ids: Sequence[int]) -> None:
        """The model's own ids, verbatim (mask 1); the calls it made await their results."""
        self._chat.append_ids(ids, 1)
        calls = parse_kimi_tool_calls(self.tokenizer.decode(ids))
        self._unanswered = [c.call_id for c in calls if isinstance(c, FamilyCall) and c.call_id]

    def encode_turn_text(self, text: str) -> list[int]:
        """Ids of an assistant turn's text as the template writes it: the markers in it as their
        ids, the rest plain text (a scripted turn; the model's own ids go to `add_generated`)."""
        return self._chat.encode_parts(self._chat.split_markers(text))

    @property
    def ids(self) -> list[int]:
        return self._chat.ids

    @property
    def loss_mask(self) -> list[int]:
        return self._chat.loss_mask

    @property
    def text(self) -> str:
        return self._chat.text

    @property
    def pending_close(self) -> list[str]:
        """Always empty: every Kimi turn closes itself."""
        return []

    def pending_close_ids(self) -> list[int]:
        return []


def _malformed(problem: str, raw: str, name: str | None = None) -> MalformedCall:
    return malformed_call(problem, raw, CALL_FORMAT, name)


def _parse_call(body: str) -> ParsedCall:
    """One call's text between ``<|tool_call_begin|>`` and ``<|tool_call_end|>``."""
    header, sep, args = body.partition(ARGUMENT_BEGIN)
    if not sep:
        return _malformed(f"{ARGUMENT_BEGIN} is missing after the call id", body)
    match = _HEADER.fullmatch(header)
    if match is None:
        return _malformed(f"the call id {header.strip()!r} is not functions.NAME:INDEX", body)
    name = match.group(1)
    parsed = parse_arguments(args, name, CALL_FORMAT)
    if isinstance(parsed, MalformedCall):
        return MalformedCall(kind=parsed.kind, message=parsed.message, raw=body, name=name)
    return FamilyCall(name=name, arguments=parsed.arguments, call_id=header.strip())


def parse_kimi_tool_calls(text: str) -> list[ParsedCall]:
    """Every tool call of a generated assistant turn, in order (see the module docstring)."""
    return scan_tool_calls(
        text,
        section=(SECTION_BEGIN, SECTION_END),
        call=(CALL_BEGIN, CALL_END),
        parse_call=_parse_call,
        call_format=CALL_FORMAT,
    )


def kimi_content(text: str) -> str:
    """The text of a generated turn before its tool calls, without ``<|im_end|>``."""
    return text.split(SECTION_BEGIN, 1)[0].removesuffix(IM_END)
