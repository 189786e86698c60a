"""The tool-call protocol: find the calls in an assistant turn, run them, append the results.

The convention (Hermes/Qwen, docs/architecture.md "Tool-call protocol"): the assistant writes
``<tool_call>{"name": "read_file", "arguments": {"path": "x.py"}}</tool_call>``, as many as it
likes in one turn, with free text around them. Decisions this module makes:

- **Several calls per turn run in order**, each answered by its own ``tool`` message (the chat
  template's tools prompt promises that). A ``submit`` ends the turn: later calls are answered
  ``Not executed: ...`` and not run; so are calls after the episode's time ran out.
- **A turn without any tool call is a mistake, not a final answer**: it gets the typed error
  ``no_tool_call`` and a ``user`` message reminding the protocol (`NO_TOOL_CALL_MESSAGE`). Only
  ``submit`` ends an episode on the agent's initiative.
- Each ``<tool_call>`` body is read as one JSON value (``json.JSONDecoder.raw_decode``), so a
  ``</tool_call>`` inside a JSON string (a file that mentions the tag) does not end the call.
  The body must be an object with a string ``name`` and, optionally, an object ``arguments``
  (absent means ``{}``); anything else is ``malformed_json``.

The texts the model sees for each error (``trajectory.ToolError.kind`` in brackets):

- [unknown_tool] exactly ``Tool not found: NAME. Available tools: a, b, c``;
- [malformed_json] ``Malformed tool call: <the problem>. Write <tool_call>{"name": ...,
  "arguments": {...}}</tool_call>.``: the problem is invalid JSON (with the decoder's message and
  position), a body that is not an object, a missing or non-string ``name``, ``arguments`` that is
  not an object, unexpected keys, an unclosed ``<tool_call>`` or a stray ``</tool_call>``;
- [bad_arguments], [path_escape], [tool_failed]: from the tools (``etude.env.tools``);
- [no_tool_call] `NO_TOOL_CALL_MESSAGE`.

Nothing here raises on model output: every problem becomes an observation and a typed error.
What this module does not do: decide when an episode ends (``etude.env.coding``) or execute a
tool itself (``etude.env.tools``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from etude.env.tools import Toolbox, json_type_name
from etude.env.trajectory import ToolCall, ToolError, Turn
from etude.model.chat import Span, tools_system_prompt
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START

CALL_FORMAT = f'{TOOL_CALL_START}{{"name": "<tool name>", "arguments": {{...}}}}{TOOL_CALL_END}'
NO_TOOL_CALL_MESSAGE = (
    f"Your message contains no tool call. Act only through the tools: write {CALL_FORMAT}. "
    "When the task is done, call submit."
)
NOT_EXECUTED_SUBMITTED = "Not executed: the episode ended with submit before this call."
NOT_EXECUTED_TIMEOUT = "Not executed: the episode's time limit was reached."
TOOL_DECLARATIONS = ("json", "compact")


def _type_name(schema: dict[str, Any]) -> str:
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        kind = "|".join(str(k) for k in kind if k != "null")
    return {"string": "str", "integer": "int", "boolean": "bool", "array": "list"}.get(
        str(kind), str(kind)
    )


def compact_tool_lines(tools: Sequence[dict[str, Any]]) -> list[str]:
    """One signature line per OpenAI function schema: ``name(arg: type, opt?: type): what``.

    The same tools and argument names as the JSON declarations, in about a sixth of the tokens
    (the JSON form costs ~1,500 of a tiny model's few thousand context tokens); argument
    descriptions and bounds are left out, the tools' own error messages restate them.
    """
    lines = []
    for tool in tools:
        function = tool["function"]
        params = function.get("parameters", {})
        required = set(params.get("required", []))
        args = [
            f"{name}{'' if name in required else '?'}: {_type_name(spec)}"
            for name, spec in params.get("properties", {}).items()
        ]
        lines.append(f"{function['name']}({', '.join(args)}): {function.get('description', '')}")
    return lines


def system_prompt(
    tools: Sequence[dict[str, Any]], *, preamble: str = "", declarations: str = "json"
) -> str:
    """The episode's system message: ``preamble`` + the tool declarations + the call format.

    ``declarations``: ``json`` (one OpenAI schema per line, ``chat.tools_system_prompt``) or
    ``compact`` (``compact_tool_lines``).
    """
    if declarations not in TOOL_DECLARATIONS:
        raise ValueError(f"env.tool_declarations={declarations!r}: use json or compact")
    if declarations == "json":
        return tools_system_prompt(tools, preamble=preamble)
    parts = [preamble.strip()] if preamble.strip() else []
    parts.append(
        "Tools:\n"
        + "\n".join(compact_tool_lines(tools))
        + f"\nCall one as {CALL_FORMAT}; results come back in tool messages."
    )
    return "\n\n".join(parts)


_NAME_RE = re.compile(r'"name"\s*:\s*"([^"\\]{1,100})"')
_DECODER = json.JSONDecoder()


def unknown_tool_message(name: str, available: Sequence[str]) -> str:
    """The observation for a call to a tool that does not exist."""
    return f"Tool not found: {name}. Available tools: {', '.join(available)}"


def _malformed(problem: str) -> str:
    return f"Malformed tool call: {problem}. Write {CALL_FORMAT}."


@dataclass(kw_only=True, slots=True)
class ParsedCall:
    """One ``<tool_call>`` segment: a call, or the error that kept it from being one."""

    call: ToolCall | None
    error: ToolError | None
    raw: str
    """The text between the tags (to the end of the text when the tag is not closed)."""


def _guess_name(raw: str) -> str | None:
    found = _NAME_RE.search(raw)
    return found.group(1) if found else None


def _call_from_json(value: Any, raw: str) -> ParsedCall:
    def bad(problem: str, tool: str | None = None) -> ParsedCall:
        message = _malformed(problem)
        error = ToolError(kind="malformed_json", message=message, tool=tool)
        return ParsedCall(call=None, error=error, raw=raw)

    if not isinstance(value, dict):
        kind = json_type_name(value)
        return bad(f'the JSON must be an object with "name" and "arguments", got {kind}')
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return bad(f'"name" must be a non-empty string naming the tool, got {json.dumps(name)}')
    extra = sorted(k for k in value if k not in ("name", "arguments"))
    if extra:
        keys = ", ".join(json.dumps(k) for k in extra)
        return bad(f'unexpected keys {keys}; a call has only "name" and "arguments"', name)
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        kind = json_type_name(arguments)
        return bad(f'"arguments" of {name} must be a JSON object, got {kind}', name)
    return ParsedCall(call=ToolCall(name=name, arguments=arguments), error=None, raw=raw)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _json_problem(raw: str) -> str:
    """Why ``raw`` (the text between the tags) is not one JSON value."""
    if not raw.strip():
        return "the tags hold no JSON"
    try:
        json.loads(raw)
    except json.JSONDecodeError as e:
        # the position within the body reads better than one within the whole turn
        return f"the text inside the tags is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        return f"the text inside the tags is not valid JSON ({e})"
    except RecursionError:
        return "the JSON inside the tags is nested too deeply"
    return "the text inside the tags is not one JSON object"


def _decode(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``pos`` (after blanks) and the index after it, or None."""
    try:
        return _DECODER.raw_decode(text, _skip_space(text, pos))
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>`` segment of ``text`` in order (a stray closing tag counts as one)."""
    out: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_START, pos)
        stray = text.find(TOOL_CALL_END, pos)
        if stray != -1 and (start == -1 or stray < start):
            message = _malformed(f"{TOOL_CALL_END} without an opening {TOOL_CALL_START}")
            error = ToolError(kind="malformed_json", message=message)
            out.append(ParsedCall(call=None, error=error, raw=text[pos:stray]))
            pos = stray + len(TOOL_CALL_END)
            continue
        if start == -1:
            return out
        body = start + len(TOOL_CALL_START)
        decoded = _decode(text, body)
        if decoded is not None:
            value, end = decoded
            end = _skip_space(text, end)
            if text.startswith(TOOL_CALL_END, end):
                out.append(_call_from_json(value, text[body:end]))
                pos = end + len(TOOL_CALL_END)
                continue
        close = text.find(TOOL_CALL_END, body)
        reopen = text.find(TOOL_CALL_START, body)
        if close == -1 or (reopen != -1 and reopen < close):
            end = reopen if reopen != -1 else len(text)
            raw = text[body:end]
            problem = f"{TOOL_CALL_START} is not closed by {TOOL_CALL_END}"
            pos = end
        else:
            raw = text[body:close]
            problem = _json_problem(raw)
            pos = close + len(TOOL_CALL_END)
        message = _malformed(problem)
        error = ToolError(kind="malformed_json", message=message, tool=_guess_name(raw))
        out.append(ParsedCall(call=None, error=error, raw=raw))


@dataclass(kw_only=True, slots=True)
class CallResult:
    """The answer to one ``<tool_call>`` segment: one ``tool`` message."""

    call: ToolCall | None
    """The parsed call; None when the segment was malformed."""
    observation: str
    error: ToolError | None = None
    executed: bool = True
    """False when the call was not run (malformed, unknown tool, after submit or timeout)."""
    provenance: dict[str, Any] | None = None
    """What the call's sandboxed command touched, when recorded (``ToolOutcome.provenance``)."""


@dataclass(kw_only=True, slots=True)
class TurnResult:
    """What one assistant turn did: its calls, their answers and its typed errors."""

    calls: list[ToolCall] = field(default_factory=list)
    """Every call that parsed (unknown tools included), in order: the turn's ``tool_calls``."""
    errors: list[ToolError] = field(default_factory=list)
    """The turn's typed errors, in order."""
    results: list[CallResult] = field(default_factory=list)
    """One per ``<tool_call>`` segment, in order."""
    reminder: str | None = None
    """`NO_TOOL_CALL_MESSAGE` when the turn made no call (sent as a ``user`` message)."""
    submitted: bool = False
    timed_out: bool = False
    """The deadline passed before a call could run."""


def run_turn(
    text: str,
    toolbox: Toolbox,
    *,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    parse: Callable[[str], list[ParsedCall]] = parse_tool_calls,
    reminder: str = NO_TOOL_CALL_MESSAGE,
) -> TurnResult:
    """Parse the calls of an assistant turn and run them in order (see the module docstring).

    ``deadline`` is a ``clock()`` time after which no call starts; each call's timeout is capped
    by the time left. ``parse`` and ``reminder`` are the chat format's call parser and no-call
    reminder (``etude.env.episode_chat``; etude's own by default).
    """
    turn = TurnResult()
    parsed = parse(text)
    if not parsed:
        turn.reminder = reminder
        turn.errors.append(ToolError(kind="no_tool_call", message=reminder))
        return turn
    for segment in parsed:
        call = segment.call
        if call is not None:
            turn.calls.append(call)
        if turn.submitted or turn.timed_out:
            reason = NOT_EXECUTED_SUBMITTED if turn.submitted else NOT_EXECUTED_TIMEOUT
            turn.results.append(CallResult(call=call, observation=reason, executed=False))
            continue
        if segment.error is not None:
            error = segment.error
        elif call.name not in toolbox.names:
            message = unknown_tool_message(call.name, toolbox.names)
            error = ToolError(kind="unknown_tool", message=message, tool=call.name)
        else:
            time_left = None if deadline is None else deadline - clock()
            if time_left is not None and time_left <= 0:
                turn.timed_out = True
                turn.results.append(
                    CallResult(call=call, observation=NOT_EXECUTED_TIMEOUT, executed=False)
                )
                continue
            outcome = toolbox.call(call.name, call.arguments, time_left=time_left)
            if outcome.error is not None:
                turn.errors.append(outcome.error)
            turn.submitted = outcome.submitted
            turn.results.append(
                CallResult(
                    call=call,
                    observation=outcome.observation,
                    error=outcome.error,
                    provenance=outcome.provenance,
                )
            )
            continue
        turn.errors.append(error)
        turn.results.append(
            CallResult(call=call, observation=error.message, error=error, executed=False)
        )
    return turn


def turn_record(conversation: Any, span: Span, role: str, text: str) -> Turn:
    """A trajectory `Turn` for the ids of ``span``, copied from the conversation (anything with
    ``ids`` and ``loss_mask``)."""
    ids = conversation.ids[span.slice]
    mask = conversation.loss_mask[span.slice]
    return Turn(role=role, text=text, token_ids=ids, trainable=mask, logprobs=[0.0] * len(ids))


def _encodable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes. A JSON string in a call can
    hold one (``"\\ud800"``), observations quote the model's strings, and the tokenizer takes only
    text that UTF-8 can write."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def append_results(chat: Any, turn: TurnResult) -> list[Turn]:
    """Append the answers of ``turn`` (tool results, or the reminder) to ``chat`` (an
    ``etude.env.episode_chat.EpisodeChat``) and return their Turns."""
    out = []
    for index, result in enumerate(turn.results):
        observation = _encodable(result.observation)
        if result.call is not None:
            name = result.call.name
        else:
            name = result.error.tool if result.error is not None else None
        span = chat.add_tool_result(observation, index, name)
        record = turn_record(chat, span, "tool", observation)
        record.tool_name = result.call.name if result.call is not None else None
        record.provenance = result.provenance
        out.append(record)
    if turn.reminder is not None:
        span = chat.add_user(turn.reminder)
        out.append(turn_record(chat, span, "user", turn.reminder))
    return out
