"""OpenAI chat messages in, the model's chat template out; a reply's tool calls back to OpenAI
form.

The model's chat format (``Served.chat_format``, ``etude.model.chat_family``) decides both
directions. ``etude`` is described below; a family format (``hermes``, ``kimi_k2``,
``deepseek_v3``) renders the messages with the family's builder (``new_conversation``: the first
system message and ``tools`` go to the template's own system turn and tool declaration,
assistant ``tool_calls`` are written in the family's call syntax with their arguments string
verbatim, a ``tool`` message answers a call, Kimi K2's by its ``tool_call_id``) and reads the
reply with the family's parser; Kimi K2's call ids (``functions.NAME:IDX``) are the OpenAI ids,
so a client that sends them back renders what the model was trained on.

Rendering in the ``etude`` format (``render_chat``): ``tools`` (OpenAI function schemas) become the system prompt of
``etude.model.chat.tools_system_prompt`` (a leading system message is its preamble); user and
system messages are rendered as they are; an assistant message's ``tool_calls`` are written back
as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after its content; a ``tool``
message is one tool result. The prompt ends with an open assistant header.

Parsing (``parse_reply``): the generated text up to ``<|im_end|>`` goes through
``etude.env.protocol.parse_tool_calls``; each well-formed call becomes an OpenAI ``tool_calls``
entry (arguments as a JSON string); the content is the text before the first ``<tool_call>``,
plus the raw text of any malformed call, so a client sees it instead of losing it.

Not here: images, audio, ``tool_choice`` or forced calls, parallel-call limits.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from etude.env.protocol import parse_tool_calls
from etude.model.chat import Conversation, tools_system_prompt
from etude.model.chat_family import TOOL_CALL_PARSERS, new_conversation
from etude.model.family_chat import MalformedCall
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START
from etude.serve.app import BadRequest


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(f"{where}: only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts")


def render_chat(tokenizer: Any, messages: Any, tools: Any, chat_format: str = "etude") -> list[int]:
    """Prompt ids of an OpenAI chat request (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    if chat_format != "etude":
        return _render_family(tokenizer, messages, tools, chat_format)
    conversation = Conversation(tokenizer)
    start = 0
    if tools:
        preamble = ""
        first = messages[0]
        if isinstance(first, dict) and first.get("role") == "system":
            preamble, start = _text(first.get("content"), "messages[0]"), 1
        try:
            conversation.add_message("system", tools_system_prompt(tools, preamble))
        except ValueError as error:
            raise BadRequest(f"tools: {error}") from None
    for i, message in enumerate(messages[start:], start=start):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object with role and content")
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise BadRequest(f"{where}.role={role!r} must be system, user, assistant or tool")
        text = _text(message.get("content"), where)
        if role == "assistant":
            for call in message.get("tool_calls") or []:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise BadRequest(f"{where}.tool_calls: each call needs function.name")
                arguments = function.get("arguments") or "{}"
                try:
                    args = json.loads(arguments) if isinstance(arguments, str) else arguments
                except ValueError:
                    raise BadRequest(f"{where}.tool_calls: arguments is not JSON") from None
                payload = json.dumps({"name": function["name"], "arguments": args})
                text += f"{TOOL_CALL_START}{payload}{TOOL_CALL_END}"
        try:
            conversation.add_message(role, text)
        except ValueError as error:
            raise BadRequest(f"{where}: {error}") from None
    conversation.add_generation_prompt()
    return conversation.ids


def _call_dict(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where}.tool_calls: each call needs function.name")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = "{}"
    if not isinstance(arguments, str | dict):
        raise BadRequest(f"{where}.tool_calls: arguments must be a JSON string or an object")
    out: dict[str, Any] = {"function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _render_family(tokenizer: Any, messages: list[Any], tools: Any, chat_format: str) -> list[int]:
    """Prompt ids in a family's format (see the module docstring)."""
    start, system = 0, None
    first = messages[0]
    if isinstance(first, dict) and first.get("role") == "system":
        system, start = _text(first.get("content"), "messages[0]"), 1
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list of OpenAI function schemas")
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"tools[{i}] must be an OpenAI function schema with function.name")
    conversation = new_conversation(chat_format, tokenizer, system=system, tools=tools or None)
    for i, message in enumerate(messages[start:], start=start):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object with role and content")
        role = message.get("role")
        if role not in ("user", "assistant", "tool"):
            raise BadRequest(
                f"{where}.role={role!r}: in the {chat_format} format a system message comes "
                "first only; the others are user, assistant or tool"
            )
        turn: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
        if role == "assistant":
            turn["tool_calls"] = [_call_dict(c, where) for c in message.get("tool_calls") or []]
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    turn[key] = message[key]
        try:
            conversation.add_message(turn)
        except ValueError as error:
            raise BadRequest(f"{where}: {error}") from None
    conversation.add_generation_prompt()
    return conversation.ids


def parse_reply(
    decode: Callable[[list[int]], str],
    im_end_id: int,
    token_ids: list[int],
    chat_format: str = "etude",
) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a generated assistant turn (``im_end_id``: the format's
    end of turn)."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] == im_end_id else token_ids
    text = decode(ids)
    if chat_format in TOOL_CALL_PARSERS:
        return _family_reply(text, chat_format)
    calls = parse_tool_calls(text)
    cut = text.find(TOOL_CALL_START)
    content = text if cut == -1 else text[:cut]
    if chat_format == "hermes" and cut != -1:  # the template writes "\n" before the first call
        content = content.removesuffix("\n")
    tool_calls = []
    for parsed in calls:
        if parsed.call is None:
            content += f"{TOOL_CALL_START}{parsed.raw}{TOOL_CALL_END}"
            continue
        tool_calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": parsed.call.name,
                    "arguments": json.dumps(parsed.call.arguments),
                },
            }
        )
    return content, tool_calls


def _family_reply(text: str, chat_format: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a reply in a family format with its own call syntax."""
    from etude.model.deepseek_chat import deepseek_content
    from etude.model.kimi_chat import kimi_content

    content = kimi_content(text) if chat_format == "kimi_k2" else deepseek_content(text)
    tool_calls = []
    for parsed in TOOL_CALL_PARSERS[chat_format](text):
        if isinstance(parsed, MalformedCall):
            content += parsed.raw  # the client sees a broken call instead of losing it
            continue
        tool_calls.append(
            {
                "id": parsed.call_id or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": parsed.name, "arguments": json.dumps(parsed.arguments)},
            }
        )
    return content, tool_calls
