"""The chat format of the Qwen family (ChatML + Hermes tool calls), built append-only.

An imported Qwen2.5/Qwen3 checkpoint was trained on its own template, which differs from etude's
ChatML (``etude.model.chat``) in two places: tools are declared in the system message with the
family's own wording, and tool results come back as a *user* turn, consecutive results of one
assistant turn merged into it::

    <|im_start|>system\\n{system}\\n\\n# Tools\\n\\n...<tools>\\n{schema}\\n...</tools>...<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{result 1}\\n</tool_response>\\n<tool_response>\\n{result 2}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n

`HermesConversation` appends each message's ids and never rewrites earlier ones (re-tokenizing a
whole conversation can merge tokens across turns and re-spell what the model generated). The one
place the template is not append-only, the ``<|im_end|>`` that closes a run of tool results, is
held back until the next message or generation prompt (``pending_close``): the template closes
the run only when it sees what follows. Text between the markers is tokenized in one piece per
message, the markers are written as their ids, so the ids equal the tokenization of the
template's text (checked turn by turn in ``tests/unit/test_hf_chat.py`` against transformers'
``apply_chat_template``). Message content is plain text: a literal ``<tool_call>`` in a tool
result stays text and can not forge a call (the template's tokenization would make it a marker).

Not here: Qwen3's thinking blocks (the template adds an empty ``<think>`` block to the newest
assistant turn only, which is not append-only; rollouts run without thinking), the Kimi K2 and
DeepSeek-V3 formats (``etude.model.kimi_chat``, ``etude.model.deepseek_chat``), parsing tool
calls (``etude.env``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from etude.model.tokenizer import (
    IM_END,
    IM_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
    Tokenizer,
)

_MARKERS = (
    IM_START,
    IM_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
)

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
"""The family's own tool declaration text (inside the system message)."""


def _split_markers(text: str) -> list[str]:
    """The template's own fixed text in parts, its markers as separate parts (written as ids,
    as the template's tokenization makes them)."""
    pattern = "(" + "|".join(re.escape(m) for m in _MARKERS) + ")"
    return [part for part in re.split(pattern, text) if part]


def _tojson(value: Any) -> str:
    # Jinja's tojson as transformers configures it: ", " and ": " separators, non-ASCII kept
    return json.dumps(value, ensure_ascii=False)


class HermesConversation:
    """Append-only ids and loss mask of one conversation in the Qwen/Hermes format."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        self._mask: list[int] = []
        self._text: list[str] = []
        self._in_tool_run = False
        if tools:
            head = (system + "\n\n") if system else ""
            schemas = "".join("\n" + _tojson(dict(t)) for t in tools)
            # system text and schemas are content (plain text); the family's instructions are
            # template text, whose markers the template's tokenization turns into ids
            body = "system\n" + head + TOOLS_PREAMBLE + schemas
            self._append([IM_START, *_split_markers(body + TOOLS_INSTRUCTIONS), IM_END, "\n"], 0)
        elif system is not None:
            self._append([IM_START, "system\n" + system, IM_END, "\n"], 0)

    def _encode(self, parts: Sequence[str]) -> list[int]:
        ids: list[int] = []
        specials = self.tokenizer.special_ids
        for part in parts:
            if part in _MARKERS:
                ids.append(specials[part])
            elif part:
                ids.extend(self.tokenizer.encode(part))
        return ids

    def _append(self, parts: Sequence[str], mask: int) -> None:
        ids = self._encode(parts)
        self._ids.extend(ids)
        self._mask.extend([mask] * len(ids))
        self._text.extend(parts)

    def _close_tool_run(self) -> None:
        if self._in_tool_run:
            self._append(self.pending_close, 0)
            self._in_tool_run = False

    @property
    def pending_close(self) -> list[str]:
        """What the template writes after the last message if it is a tool result."""
        return [IM_END, "\n"] if self._in_tool_run else []

    def add_user(self, content: str) -> None:
        self._close_tool_run()
        self._append([IM_START, "user\n" + content, IM_END, "\n"], 0)

    def add_assistant(self, content: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> None:
        """A finished assistant turn (loss mask 1 on its body and ``<|im_end|>``)."""
        self._close_tool_run()
        self._append([IM_START, "assistant\n"], 0)
        parts: list[str] = []
        text = content
        for i, call in enumerate(tool_calls):
            function = call.get("function", call)
            args = function["arguments"]
            args_text = args if isinstance(args, str) else _tojson(args)
            if (i == 0 and content) or i > 0:
                text += "\n"
            call_text = f'\n{{"name": "{function["name"]}", "arguments": {args_text}}}\n'
            parts += [text, TOOL_CALL_START, call_text, TOOL_CALL_END]
            text = ""
        parts.append(text)
        self._append([*parts, IM_END], 1)
        self._append(["\n"], 0)

    def add_tool_result(self, content: str) -> None:
        """One tool result; consecutive results share one user turn."""
        if not self._in_tool_run:
            self._append([IM_START, "user"], 0)
            self._in_tool_run = True
        self._append(["\n", TOOL_RESPONSE_START, "\n" + content + "\n", TOOL_RESPONSE_END], 0)

    def add_message(self, message: Mapping[str, Any]) -> None:
        """An OpenAI-style message dict (``role``, ``content``, optional ``tool_calls``)."""
        role = message.get("role")
        if role == "user":
            self.add_user(message["content"])
        elif role == "assistant":
            self.add_assistant(message.get("content") or "", message.get("tool_calls") or ())
        elif role == "tool":
            self.add_tool_result(message["content"])
        else:
            raise ValueError(
                f"message role {role!r}: pass system and tools to HermesConversation(); messages "
                "are user, assistant or tool"
            )

    def add_generation_prompt(self) -> None:
        """``<|im_start|>assistant\\n``: the model's turn comes next."""
        self._close_tool_run()
        self._append([IM_START, "assistant\n"], 0)

    def add_generated(self, ids: Sequence[int]) -> None:
        """The model's own ids, verbatim (mask 1); ``\\n`` follows when they end the turn."""
        ids = [int(i) for i in ids]
        self._ids.extend(ids)
        self._mask.extend([1] * len(ids))
        self._text.append(self.tokenizer.decode(ids))
        if ids and ids[-1] == self.tokenizer.im_end_id:
            self._append(["\n"], 0)

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    @property
    def loss_mask(self) -> list[int]:
        return list(self._mask)

    @property
    def text(self) -> str:
        """The rendered text so far (markers written out), without ``pending_close``."""
        return "".join(self._text)

    def pending_close_ids(self) -> list[int]:
        return self._encode(self.pending_close)
