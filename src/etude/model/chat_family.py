"""Which chat format a checkpoint speaks: the registry of formats and the choice for a directory.

A model answers well only in the format it was trained on, so an imported checkpoint's
conversations are rendered in its family's own format. The formats (`CHAT_FORMATS`):

| name          | conversation                                  | tool calls parsed by                  |
|---------------|-----------------------------------------------|---------------------------------------|
| ``etude``     | ``etude.model.chat.Conversation`` (ChatML)    | ``etude.env.protocol``                |
| ``hermes``    | ``etude.model.hf_chat.HermesConversation``    | ``etude.env.protocol`` (same syntax)  |
| ``kimi_k2``   | ``etude.model.kimi_chat.KimiConversation``    | ``parse_kimi_tool_calls``             |
| ``deepseek_v3`` | ``etude.model.deepseek_chat.DeepSeekV3Conversation`` | ``parse_deepseek_tool_calls`` |

`detect_chat_format` decides from the directory's tokenizer files and ``config.json``, in this
order: a format named by the caller (``chat_format``, ``etude model import --chat-format``); one
recorded by ``etude model import`` in ``hf_source.json``; the family's markers in the tokenizer
(Kimi K2's ten ``<|im_*|>``/tool-call tokens, DeepSeek-V3's thirteen fullwidth ones); etude's
seven ChatML markers at ids 0-6 (a tokenizer trained by etude); the ChatML markers with a Qwen
``model_type`` or a chat template that writes ``<tool_call>`` (Hermes). Anything else is a
``ValueError`` that names the override. The markers decide before ``model_type`` because Kimi
K2 checkpoints are also published with ``model_type = "deepseek_v3"``.

Not here: the formats themselves (their modules), tokenizers (``etude.model.hf_tokenizer``,
``etude.model.tiktoken_loader``), GLM-4's own chat format (a GLM-4 checkpoint with its own
tokenizer is an unknown family here; etude's models exported as ``glm4_moe`` carry etude's
tokenizer and speak ``etude``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from etude.model.deepseek_chat import DEEPSEEK_MARKERS, parse_deepseek_tool_calls
from etude.model.family_chat import ParsedCall
from etude.model.kimi_chat import KIMI_MARKERS, parse_kimi_tool_calls
from etude.model.tokenizer import SPECIAL_TOKENS, TOOL_CALL_START

CHAT_FORMATS = ("etude", "hermes", "kimi_k2", "deepseek_v3")
"""Every chat format etude renders."""

QWEN_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
"""``config.json`` model types whose checkpoints speak the Hermes format."""

TOOL_CALL_PARSERS: dict[str, Callable[[str], list[ParsedCall]]] = {
    "kimi_k2": parse_kimi_tool_calls,
    "deepseek_v3": parse_deepseek_tool_calls,
}
"""The parsers of the formats whose call syntax is not Hermes' (``etude.env.protocol``)."""

SOURCE_FILE = "hf_source.json"
"""Written by ``etude model import``; holds the ``chat_format`` chosen at import."""


def check_chat_format(chat_format: str, setting: str = "chat_format") -> str:
    if chat_format not in CHAT_FORMATS:
        raise ValueError(
            f"{setting}={chat_format!r} is not a chat format; use one of {CHAT_FORMATS}"
        )
    return chat_format


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    return value if isinstance(value, dict) else {}


def tokenizer_dir(directory: str | Path) -> Path:
    """Where a directory's tokenizer files are: ``DIR/tokenizer`` in an etude model directory
    (``etude model import``), ``DIR`` itself in a Hugging Face one."""
    directory = Path(directory)
    nested = directory / "tokenizer"
    return nested if (directory / SOURCE_FILE).is_file() and nested.is_dir() else directory


def added_tokens(directory: str | Path) -> dict[str, int]:
    """The added tokens (markers) of a tokenizer directory: content -> id, from
    ``tokenizer.json`` and ``tokenizer_config.json``'s ``added_tokens_decoder``."""
    directory = Path(directory)
    tokens: dict[str, int] = {}
    for entry in _read_json(directory / "tokenizer.json").get("added_tokens", []):
        if isinstance(entry, dict) and "content" in entry and "id" in entry:
            tokens[entry["content"]] = int(entry["id"])
    decoder = _read_json(directory / "tokenizer_config.json").get("added_tokens_decoder", {})
    for token_id, entry in decoder.items() if isinstance(decoder, dict) else ():
        if isinstance(entry, dict) and "content" in entry:
            tokens.setdefault(entry["content"], int(token_id))
    return tokens


def _chat_template(directory: Path) -> str:
    path = directory / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = _read_json(directory / "tokenizer_config.json").get("chat_template", "")
    return template if isinstance(template, str) else json.dumps(template)


def detect_chat_format(directory: str | Path, *, chat_format: str | None = None) -> str:
    """The chat format of a Hugging Face or etude model directory (see the module docstring)."""
    if chat_format is not None:
        return check_chat_format(chat_format)
    directory = Path(directory)
    recorded = _read_json(directory / SOURCE_FILE).get("chat_format")
    if recorded is not None:
        return check_chat_format(recorded, f"{directory / SOURCE_FILE}: chat_format")
    tok_dir = tokenizer_dir(directory)
    tokens = added_tokens(tok_dir)
    if all(m in tokens for m in KIMI_MARKERS):
        return "kimi_k2"
    if all(m in tokens for m in DEEPSEEK_MARKERS):
        return "deepseek_v3"
    config = _read_json(directory / "config.json") or _read_json(directory / "export/config.json")
    model_type = config.get("model_type")
    if all(m in tokens for m in SPECIAL_TOKENS):
        if all(tokens[s] == i for i, s in enumerate(SPECIAL_TOKENS)):
            return "etude"
        if model_type in QWEN_MODEL_TYPES or TOOL_CALL_START in _chat_template(tok_dir):
            return "hermes"
    raise ValueError(
        f"{directory}: can not tell its chat format (model_type={model_type!r}; the tokenizer "
        f"has neither Kimi K2's nor DeepSeek-V3's markers nor a Hermes/ChatML layout); pass "
        f"chat_format= (or `etude model import --chat-format`) with one of {CHAT_FORMATS}"
    )


def policy_chat_format(init: str) -> str:
    """The chat format of a recipe's starting policy (``train.init``): a Hugging Face directory's
    (``hf:PATH``, `detect_chat_format`), the one ``etude model import`` recorded in a model
    directory, else ``etude`` (a fresh model, or a run of etude's own)."""
    if init.startswith("hf:"):
        return detect_chat_format(init[3:])
    if init and (Path(init) / SOURCE_FILE).is_file():
        return detect_chat_format(init)
    return "etude"


RL_CHAT_FORMATS = ("etude", "hermes")
"""Formats the RL trainer runs end to end: its hint messages, SFT data and export are ChatML."""


def check_rl_chat_format(init: str) -> str:
    """`policy_chat_format` of ``train.init``, or a ``ValueError`` if the RL trainer can not train
    a policy of that format."""
    chat_format = policy_chat_format(init)
    if chat_format not in RL_CHAT_FORMATS:
        raise ValueError(
            f"train.init={init!r} speaks the {chat_format} chat format; the RL trainer's hint "
            f"messages and export are ChatML ({', '.join(RL_CHAT_FORMATS)} formats only). Roll "
            "this model out with etude.env.pool.EnvPool(chat_format=...) and "
            "etude.rl.rollout.collect_rollouts, or serve it with `etude serve`"
        )
    return chat_format


def new_conversation(
    chat_format: str,
    tokenizer: Any,
    *,
    system: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> Any:
    """An empty conversation of ``chat_format`` with its system turn and tool declaration.

    ``hermes``, ``kimi_k2`` and ``deepseek_v3`` share one interface (``add_message``,
    ``add_generation_prompt``, ``add_generated``, ``ids``, ``loss_mask``); ``etude`` is
    ``etude.model.chat.Conversation`` (``add_message(role, content)``).
    """
    check_chat_format(chat_format)
    if chat_format == "etude":
        from etude.model.chat import Conversation, tools_system_prompt

        conversation = Conversation(tokenizer)
        if tools:
            conversation.add_message("system", tools_system_prompt(tools, system or ""))
        elif system is not None:
            conversation.add_message("system", system)
        return conversation
    if chat_format == "hermes":
        from etude.model.hf_chat import HermesConversation

        return HermesConversation(tokenizer, system=system, tools=tools)
    if chat_format == "kimi_k2":
        from etude.model.kimi_chat import KimiConversation

        return KimiConversation(tokenizer, system=system, tools=tools)
    from etude.model.deepseek_chat import DeepSeekV3Conversation

    return DeepSeekV3Conversation(tokenizer, system=system, tools=tools)


def load_chat_tokenizer(directory: str | Path, chat_format: str) -> Any:
    """The tokenizer a ``chat_format`` conversation of ``directory`` needs: etude's ``Tokenizer``
    for ``etude``/``hermes`` (``tokenizer.json``), a `MarkerTokenizer` with the family's markers
    for ``kimi_k2``/``deepseek_v3`` (``tokenizer.json``, or ``tiktoken.model`` for Kimi K2)."""
    check_chat_format(chat_format)
    tok_dir = tokenizer_dir(directory)
    if chat_format in ("etude", "hermes"):
        from etude.model.hf_tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(tok_dir)
    markers = KIMI_MARKERS if chat_format == "kimi_k2" else DEEPSEEK_MARKERS
    if (tok_dir / "tokenizer.json").is_file():
        from etude.model.family_chat import MarkerTokenizer

        return MarkerTokenizer.from_file(tok_dir / "tokenizer.json", markers)
    if (tok_dir / "tiktoken.model").is_file():
        from etude.model.tiktoken_loader import load_tiktoken_tokenizer

        return load_tiktoken_tokenizer(tok_dir, markers)
    raise ValueError(f"{tok_dir}: no tokenizer.json or tiktoken.model for the {chat_format} format")
