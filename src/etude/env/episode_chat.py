"""An episode's conversation in the policy's own chat format: one interface over etude's ChatML
and the formats of imported model families.

A model acts well only in the format it was trained on, so an episode with an imported Kimi K2,
DeepSeek-V3 or Qwen checkpoint is rendered in that family's template and its tool calls are read
in that family's syntax (``etude.model.chat_family`` names the formats and picks one for a model
directory). `EpisodeChat` gives ``etude.env.coding`` one interface over the four builders:

| format          | builder (append-only)                    | turn ends with | calls parsed by             |
|-----------------|------------------------------------------|----------------|-----------------------------|
| ``etude``       | ``etude.model.chat.Conversation``        | ``<|im_end|>`` | ``protocol.parse_tool_calls`` |
| ``hermes``      | ``etude.model.hf_chat.HermesConversation`` | ``<|im_end|>`` | ``protocol.parse_tool_calls`` |
| ``kimi_k2``     | ``etude.model.kimi_chat.KimiConversation`` | ``<|im_end|>`` | ``parse_kimi_tool_calls``   |
| ``deepseek_v3`` | ``etude.model.deepseek_chat.DeepSeekV3Conversation`` | EOS marker | ``parse_deepseek_tool_calls`` |

What each method adds is the family template's own rendering of that message, appended; ids
already written never change (the builders' contract). Every ``add_*`` returns the `Span` of the
ids it appended: a template's held-back piece (``pending_close``: Hermes' ``<|im_end|>`` after a
run of tool results, DeepSeek-V3's outputs close) lands in the span of the message or generation
prompt that makes the template write it, so an episode's turns still tile its ids.

Per format, the episode's system prompt: ``etude`` writes the instructions and the tool schemas
(or compact signatures) in its own words (``protocol.system_prompt``); a family writes the
instructions as the system message and declares the tools as its template does (``hermes``: in
the system turn; ``kimi_k2``: a ``tool_declare`` turn; ``deepseek_v3``: after the system prompt),
always as JSON schemas (``env.tool_declarations = "compact"`` is etude's format only). A tool
result is answered as the family answers one: ``hermes`` a ``<tool_response>`` in a user turn,
``kimi_k2`` a ``## Return of functions.NAME:IDX`` turn naming the call (a malformed call's id is
``functions.NAME:IDX`` with its position in the turn, ``invalid`` when no name could be read),
``deepseek_v3`` an outputs block. A family's malformed call (either kind of
``etude.model.family_chat.MalformedCall``) is the env's ``malformed_json`` error, its message
naming the family's call syntax.

Not here: running tools or ending episodes (``etude.env.coding``, ``etude.env.protocol``),
thinking blocks (no format here writes them), the trainer's own prompts (hints, SFT data), which
are etude's format only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from etude.env.protocol import NO_TOOL_CALL_MESSAGE, ParsedCall, parse_tool_calls, system_prompt
from etude.env.trajectory import ToolCall, ToolError
from etude.model.chat import Conversation, Span, encode_header
from etude.model.chat_family import TOOL_CALL_PARSERS, check_chat_format, new_conversation
from etude.model.family_chat import FamilyCall
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START

_HERMES_MARKERS = (TOOL_CALL_START, TOOL_CALL_END)


FAMILY_NO_TOOL_CALL_MESSAGE = (
    "Your message contains no tool call. Act only through the tools declared above, calling "
    "them in your tool-call format. When the task is done, call submit."
)
"""The reminder in a family's format: it names no marker (a user turn's text is plain text, so
a marker string in it would not be the marker the model writes)."""


def no_tool_call_message(chat_format: str) -> str:
    """The reminder after a turn without a tool call (a user turn)."""
    check_chat_format(chat_format)
    return NO_TOOL_CALL_MESSAGE if chat_format == "etude" else FAMILY_NO_TOOL_CALL_MESSAGE


def parse_family_calls(chat_format: str, text: str) -> list[ParsedCall]:
    """The calls of a generated turn's text in ``chat_format``, as the env's `ParsedCall`."""
    return _parse_with_ids(chat_format, text)[0]


def _parse_with_ids(chat_format: str, text: str) -> tuple[list[ParsedCall], list[str | None]]:
    """`parse_family_calls` and each segment's own call id (Kimi K2 writes one per call)."""
    check_chat_format(chat_format)
    if chat_format not in TOOL_CALL_PARSERS:
        parsed = parse_tool_calls(text)
        return parsed, [None] * len(parsed)
    out, ids = [], []
    for found in TOOL_CALL_PARSERS[chat_format](text):
        if isinstance(found, FamilyCall):
            call = ToolCall(name=found.name, arguments=found.arguments)
            # the family parsers keep no text of a well-formed call: its id stands for it
            out.append(ParsedCall(call=call, error=None, raw=found.call_id or found.name))
            ids.append(found.call_id)
        else:
            error = ToolError(kind="malformed_json", message=found.message, tool=found.name)
            out.append(ParsedCall(call=None, error=error, raw=found.raw))
            ids.append(None)
    return out, ids


def end_of_turn_id(chat_format: str, tokenizer: Any) -> int:
    """The id that ends an assistant turn in ``chat_format`` (where generation stops)."""
    check_chat_format(chat_format)
    if chat_format in ("etude", "hermes"):
        return tokenizer.im_end_id
    if chat_format == "kimi_k2":
        from etude.model.kimi_chat import IM_END as end
    else:
        from etude.model.deepseek_chat import EOS as end
    token_id = tokenizer.token_to_id(end)
    if token_id is None:
        raise ValueError(f"the tokenizer has no id for {end!r}, the end of a {chat_format} turn")
    return token_id


class EpisodeChat:
    """One episode's append-only ids and loss mask in ``chat_format`` (see the module docstring).

    ``tokenizer`` is the one the format needs (``etude.model.chat_family.load_chat_tokenizer``):
    etude's `Tokenizer` for ``etude`` and ``hermes``, a marker tokenizer for the families.
    """

    def __init__(
        self,
        chat_format: str,
        tokenizer: Any,
        *,
        instructions: str,
        tools: Sequence[Mapping[str, Any]],
        declarations: str = "json",
    ) -> None:
        self.chat_format = check_chat_format(chat_format)
        self.tokenizer = tokenizer
        if chat_format != "etude" and declarations != "json":
            raise ValueError(
                f"env.tool_declarations={declarations!r} is etude's own format; this model speaks "
                f"{chat_format}, whose template declares tools as JSON schemas: set "
                "env.tool_declarations = 'json'"
            )
        if chat_format == "etude":
            self.conversation: Any = Conversation(tokenizer)
            text = system_prompt(tools, preamble=instructions, declarations=declarations)
            self._system_span = self.conversation.add_message("system", text)
            self.system_text = text
            self.end_id = tokenizer.im_end_id
            self.max_prompt_len = len(encode_header(tokenizer, "assistant"))
        else:
            self.conversation = new_conversation(
                chat_format, tokenizer, system=instructions, tools=tools
            )
            self._system_span = Span(0, len(self.conversation.ids))
            self.system_text = tokenizer.decode(self.conversation.ids)
            self.end_id = end_of_turn_id(chat_format, tokenizer)
            # the most ids a generation prompt appends (a held-back close, then the header)
            self.max_prompt_len = {
                "hermes": 2 + len(tokenizer.encode("\n")) + len(tokenizer.encode("assistant\n")),
                "kimi_k2": 2 + len(tokenizer.encode("assistant")),
                "deepseek_v3": 1,
            }[chat_format]
        self.reminder = no_tool_call_message(chat_format)
        self._open = False
        self._generated: list[int] = []
        self._call_ids: list[str | None] = []

    # ------------------------------------------------------------ reading

    @property
    def ids(self) -> list[int]:
        return self.conversation.ids

    @property
    def loss_mask(self) -> list[int]:
        return self.conversation.loss_mask

    def __len__(self) -> int:
        return len(self.conversation.ids)

    @property
    def system_span(self) -> Span:
        """Where the system prompt (and a family's tool declaration) lies."""
        return self._system_span

    @property
    def turn_open(self) -> bool:
        """Whether the last assistant turn awaits more generated ids (cut before its end id)."""
        return self._open

    def generated_text(self) -> str:
        """The last assistant turn's text: its generated ids decoded, the end id left out."""
        if self.chat_format == "etude":
            return self.conversation.messages[-1].content
        ids = self._generated
        if ids and ids[-1] == self.end_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------ appending

    def _grow(self, add: Any, *args: Any) -> Span:
        start = len(self)
        add(*args)
        return Span(start, len(self))

    def add_user(self, content: str) -> Span:
        if self.chat_format == "etude":
            return self.conversation.add_message("user", content)
        return self._grow(self.conversation.add_user, content)

    def add_generation_prompt(self) -> Span:
        """Open the model's turn; the ids since the last message end the prompt."""
        self._generated = []
        self._open = True
        if self.chat_format == "etude":
            return self.conversation.add_generation_prompt()
        return self._grow(self.conversation.add_generation_prompt)

    def add_generated(self, ids: Sequence[int]) -> Span:
        """The model's ids verbatim (loss mask 1); returns the span of exactly those ids.

        Ids ending with the format's end id close the turn; ids without it (a generation cut by a
        length limit) leave it open. The end id before the last position is an error: generation
        stops at it.
        """
        ids = [int(i) for i in ids]
        if self.chat_format == "etude":
            span = self.conversation.add_generated(ids)
        else:
            if self.end_id in ids[:-1]:
                raise ValueError(
                    f"generated ids hold the end id {self.end_id} at position "
                    f"{ids.index(self.end_id)} before their end; stop generation at the first one"
                )
            start = len(self)
            self.conversation.add_generated(ids)
            span = Span(start, start + len(ids))
        self._generated += ids
        self._open = not (self._generated and self._generated[-1] == self.end_id)
        return span

    def encode_assistant(self, text: str) -> list[int]:
        """Ids of an assistant turn's ``text`` as the template writes it (the format's call markers
        as their ids, the rest plain text), the end id appended: what a scripted agent says."""
        if self.chat_format in ("etude", "hermes"):
            return [*self.tokenizer.encode(text, allow_special=_HERMES_MARKERS), self.end_id]
        return [*self.conversation.encode_turn_text(text), self.end_id]

    def parse_calls(self, text: str) -> list[ParsedCall]:
        """The calls of the last assistant turn (``text``: `generated_text`), remembered so that
        each result names the call it answers."""
        calls, self._call_ids = _parse_with_ids(self.chat_format, text)
        return calls

    def add_tool_result(self, content: str, index: int, name: str | None = None) -> Span:
        """The result of the ``index``-th call segment of the last assistant turn (``name``: the
        tool it called, when one could be read)."""
        if self.chat_format == "etude":
            return self.conversation.add_message("tool", content)
        if self.chat_format != "kimi_k2":
            return self._grow(self.conversation.add_tool_result, content)
        from etude.model.kimi_chat import call_id

        this_id = self._call_ids[index] if index < len(self._call_ids) else None
        if this_id is None:  # malformed: its position in the turn
            this_id = call_id(name or "invalid", index)
        return self._grow(lambda: self.conversation.add_tool_result(content, tool_call_id=this_id))
