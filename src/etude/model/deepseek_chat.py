"""The chat format of DeepSeek-V3 (deepseek-ai/DeepSeek-V3-0324), built append-only, and its
tool-call parser.

DeepSeek-V3 writes its markers with fullwidth bars and U+2581 (shown here as ``<|User|>`` etc.;
the code holds the real strings, `DEEPSEEK_MARKERS`). The system prompt follows the BOS marker
as plain text; a user turn is followed at once by the assistant marker; an assistant turn ends
with the EOS marker; the calls of one turn sit in one calls block, each as ``function``, a
separator, the name and a fenced JSON block; tool results sit in one outputs block::

    <|begin_of_sentence|>{system}{tools declaration}
    <|User|>{content}<|Assistant|>{content}<|tool_calls_begin|>
      <|tool_call_begin|>function<|tool_sep|>read_file\\n```json\\n{"path": "a.py"}\\n```<|tool_call_end|>\\n
      <|tool_call_begin|>function<|tool_sep|>run_tests\\n```json\\n{}\\n```<|tool_call_end|>
      <|tool_calls_end|><|end_of_sentence|>
    <|tool_outputs_begin|><|tool_output_begin|>{result 1}<|tool_output_end|>\\n
      <|tool_output_begin|>{result 2}<|tool_output_end|><|tool_outputs_end|>{content}<|end_of_sentence|>

(one line in the real text). This follows the V3-0324 revision of the template; the December
2024 one differs in tool turns only (a single call's block is never closed and the first-call
flag is never reset, so multi-turn tool use renders broken text). Two places are not
append-only and are held back (``pending_close``): the ``<|tool_outputs_end|>`` that closes a
run of results is written when an assistant turn or the generation prompt follows (a following
user turn drops it, as the template does), and the generation prompt after a tool run is that
close alone (the model's turn follows it without an assistant marker).

The model's own template declares no tools; `DeepSeekV3Conversation` declares them after the
system prompt with the text of vLLM's DeepSeek-V3 tool template (`TOOLS_PREAMBLE`, one JSON
schema per line, `TOOLS_INSTRUCTIONS`).

`parse_deepseek_tool_calls` reads the calls of a generated turn: each well-formed call is a
`FamilyCall`, each broken one a `MalformedCall` (unclosed block or call, a call marker outside a
block, no separator, a type other than ``function``, no fenced block, arguments that are not one
JSON object). It reads decoded text, as vLLM's ``deepseek_v3`` parser does.

Not here: DeepSeek-V3.1 and later (another call syntax, thinking), R1's ``<think>`` blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from etude.model.family_chat import (
    AppendOnlyChat,
    ChatTokenizer,
    MalformedCall,
    ParsedCall,
    arguments_text,
    malformed_call,
    parse_arguments,
    scan_tool_calls,
)


def _marker(name: str) -> str:
    # "<" FULLWIDTH VERTICAL LINE, words joined by LOWER ONE EIGHTH BLOCK, FULLWIDTH VERTICAL LINE ">"
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


BOS = _marker("begin of sentence")
EOS = _marker("end of sentence")
USER = _marker("User")
ASSISTANT = _marker("Assistant")
CALLS_BEGIN = _marker("tool calls begin")
CALLS_END = _marker("tool calls end")
CALL_BEGIN = _marker("tool call begin")
CALL_END = _marker("tool call end")
SEP = _marker("tool sep")
OUTPUTS_BEGIN = _marker("tool outputs begin")
OUTPUTS_END = _marker("tool outputs end")
OUTPUT_BEGIN = _marker("tool output begin")
OUTPUT_END = _marker("tool output end")
DEEPSEEK_MARKERS = (
    BOS,
    EOS,
    USER,
    ASSISTANT,
    CALLS_BEGIN,
    CALLS_END,
    CALL_BEGIN,
    CALL_END,
    SEP,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    OUTPUT_BEGIN,
    OUTPUT_END,
)
"""The markers this format writes, each a single id of the tokenizer."""

TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    f"\n</tools>\n\nFor function call returns, you should first print {CALLS_BEGIN}"
    "For each function call, you should return object like:\n"
    f"{CALL_BEGIN}function{SEP}<function_name>\n```json\n<function_arguments_in_json_format>\n```"
    f"{CALL_END}At the end of function call returns, you should print {CALLS_END}{EOS}"
)
"""The tool declaration around the schemas (after the system prompt)."""

CALL_FORMAT = f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}NAME\\n```json\\n{{"arg": "value"}}\\n```{CALL_END}{CALLS_END}'
_CALL = re.compile(r"\s*(?P<kind>[^\n]*?)\s*" + re.escape(SEP) + r"(?P<rest>.*)", re.DOTALL)
_FENCED = re.compile(
    r"\s*(?P<name>[^\n]*?)\s*\n```(?:json)?[ \t]*\n(?P<args>.*?)\n?```\s*", re.DOTALL
)


def _call_text(function: Mapping[str, Any]) -> str:
    return f"{function['name']}\n```json\n{arguments_text(function['arguments'])}\n```"


class DeepSeekV3Conversation:
    """Append-only ids and loss mask of one conversation in the DeepSeek-V3 format."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._chat = AppendOnlyChat(tokenizer, DEEPSEEK_MARKERS)
        self._in_tool_run = False
        self._output_first = True  # the template's is_output_first
        self._last_user = False  # the template's is_last_user
        head = system or ""
        if tools:
            schemas = "".join("\n" + json.dumps(dict(t), ensure_ascii=False) for t in tools)
            # the system text and schemas are content, the instructions' markers become ids
            self._chat.append(
                [
                    BOS,
                    *self._chat.split_markers(head + TOOLS_PREAMBLE + schemas + TOOLS_INSTRUCTIONS),
                ],
                0,
            )
        else:
            self._chat.append([BOS, head], 0)

    @property
    def end_id(self) -> int:
        """The EOS marker: generation of an assistant turn stops at it."""
        return self._chat.marker_id(EOS)

    def _close_tool_run(self) -> None:
        if self._in_tool_run:
            self._chat.append([OUTPUTS_END], 0)
            self._in_tool_run = False

    @property
    def pending_close(self) -> list[str]:
        """What the template writes after the last message if it is a tool result."""
        return [OUTPUTS_END] if self._in_tool_run else []

    def pending_close_ids(self) -> list[int]:
        return self._chat.encode_parts(self.pending_close)

    def add_user(self, content: str) -> None:
        self._in_tool_run = False  # the template drops the close before a user turn
        self._chat.append([USER, content, ASSISTANT], 0)
        self._last_user = True

    def add_assistant(self, content: str, tool_calls: Sequence[Mapping[str, Any]] = ()) -> None:
        """A finished assistant turn (loss mask 1 on its body and the EOS marker)."""
        self._close_tool_run()
        parts = [content]
        if tool_calls:
            parts.append(CALLS_BEGIN)
            for index, call in enumerate(tool_calls):
                function = call.get("function", call)
                kind = call.get("type", "function")
                if index:
                    parts.append("\n")
                parts += [CALL_BEGIN, kind, SEP, _call_text(function), CALL_END]
            parts.append(CALLS_END)
            self._output_first = True
        self._chat.append([*parts, EOS], 1)
        self._last_user = False

    def add_tool_result(self, content: str) -> None:
        """One tool result; consecutive results share one outputs block."""
        if self._output_first:
            self._chat.append([OUTPUTS_BEGIN, OUTPUT_BEGIN, content, OUTPUT_END], 0)
            self._output_first = False
        else:
            self._chat.append(["\n", OUTPUT_BEGIN, content, OUTPUT_END], 0)
        self._in_tool_run = True
        self._last_user = False

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
                f"message role {role!r}: pass system and tools to DeepSeekV3Conversation(); "
                "messages are user, assistant or tool"
            )

    def add_generation_prompt(self) -> None:
        """The model's turn comes next: after a user turn nothing (its assistant marker is
        written), after tool results their close, otherwise the assistant marker."""
        if self._in_tool_run:
            self._close_tool_run()
        elif not self._last_user:
            self._chat.append([ASSISTANT], 0)

    def add_generated(self, ids: Sequence[int]) -> None:
        """The model's own ids, verbatim (mask 1)."""
        self._chat.append_ids(ids, 1)
        if CALLS_BEGIN in self.tokenizer.decode(ids):
            self._output_first = True
        self._last_user = False

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
        """The rendered text so far (markers written out), without ``pending_close``."""
        return self._chat.text


def _malformed(problem: str, raw: str, name: str | None = None) -> MalformedCall:
    return malformed_call(problem, raw, CALL_FORMAT, name)


def _parse_call(body: str) -> ParsedCall:
    """One call's text between the call markers: ``function<sep>NAME\\n```json\\n{...}\\n```"""
    match = _CALL.fullmatch(body)
    if match is None:
        return _malformed(f"{SEP} is missing after the call type", body)
    if match["kind"] != "function":
        return _malformed(f"the call type is {match['kind']!r}, not 'function'", body)
    fenced = _FENCED.fullmatch(match["rest"])
    if fenced is None:
        name = match["rest"].strip().split("\n", 1)[0] or None
        return _malformed("the arguments are not in a fenced ```json block", body, name)
    parsed = parse_arguments(fenced["args"], fenced["name"], CALL_FORMAT)
    if isinstance(parsed, MalformedCall):
        return MalformedCall(kind=parsed.kind, message=parsed.message, raw=body, name=parsed.name)
    return parsed


def parse_deepseek_tool_calls(text: str) -> list[ParsedCall]:
    """Every tool call of a generated assistant turn, in order (see the module docstring)."""
    return scan_tool_calls(
        text,
        section=(CALLS_BEGIN, CALLS_END),
        call=(CALL_BEGIN, CALL_END),
        parse_call=_parse_call,
        call_format=CALL_FORMAT,
    )


def deepseek_content(text: str) -> str:
    """The text of a generated turn before its tool calls, without the EOS marker."""
    return text.split(CALLS_BEGIN, 1)[0].removesuffix(EOS)
