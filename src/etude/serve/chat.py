"""OpenAI chat messages in, etude's chat template out; a reply's tool calls back to OpenAI form.

Rendering (``render_chat``): ``tools`` (OpenAI function schemas) become the system prompt of
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
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START, Tokenizer
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


def render_chat(tokenizer: Tokenizer, messages: Any, tools: Any) -> list[int]:
    """Prompt ids of an OpenAI chat request (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
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


def parse_reply(
    decode: Callable[[list[int]], str], im_end_id: int, token_ids: list[int]
) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a generated assistant turn."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] == im_end_id else token_ids
    text = decode(ids)
    calls = parse_tool_calls(text)
    cut = text.find(TOOL_CALL_START)
    content = text if cut == -1 else text[:cut]
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
