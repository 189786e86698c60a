"""The agent deleter's model through the token-level inference backend.

``etude.tasks.agent_deleter`` asks a model for features as chat messages and reads its text
reply. ``backend_chat_model`` turns any ``etude.engine.backends.InferenceBackend`` (the
in-process ``EngineBackend``, or ``HTTPBackend`` on an OpenAI-compatible ``/v1/completions``
server in its token-in/token-out dialect: ``etude serve``, vLLM, SGLang) into such a chat
callable: the messages are rendered into prompt ids in the model's own chat format
(``etude``'s ChatML, ``hermes``, ``kimi_k2``, ``deepseek_v3``: the same builders episodes use),
generation stops at the format's end of turn, and the generated ids are decoded without it.
``http_chat_model`` builds one from the deleter's settings (``agent.api = "tokens"``): the
tokenizer of ``agent.tokenizer``, its format (``agent.chat_format`` or detected), an
``HTTPBackend`` on ``agent.base_url``.

A prompt that leaves no room to generate within the backend's ``max_seq_len`` raises
`PromptTooLong`; the deleter records that module as not asked and goes on.

What this does not do: sample several replies, stream, or keep a conversation across modules
(each module is a fresh two-message prompt); a reply cut by ``max_new_tokens`` is decoded as far
as it went (its JSON then usually does not parse and the module yields nothing).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from etude.tasks.agent_deleter import AgentDeleterConfig, ChatModel, PromptTooLong

__all__ = ["PromptTooLong", "backend_chat_model", "http_chat_model", "render_prompt"]


def render_prompt(
    messages: Sequence[Mapping[str, str]], tokenizer: Any, chat_format: str
) -> list[int]:
    """Prompt ids of ``messages`` (system first, optional) in ``chat_format``, ending with the
    assistant generation prompt."""
    from etude.model.chat import render_messages
    from etude.model.chat_family import check_chat_format, new_conversation

    check_chat_format(chat_format, "agent.chat_format")
    if chat_format == "etude":
        return render_messages(tokenizer, messages, add_generation_prompt=True)[0]
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    conversation = new_conversation(chat_format, tokenizer, system=system)
    for message in messages[1 if system is not None else 0 :]:
        conversation.add_message({"role": message["role"], "content": message["content"]})
    conversation.add_generation_prompt()
    return list(conversation.ids)


def backend_chat_model(
    backend: Any,
    tokenizer: Any,
    *,
    chat_format: str = "etude",
    max_new_tokens: int = 1024,
    temperature: float = 0.0,
    seed: int | None = 0,
) -> ChatModel:
    """A chat callable (messages in, the reply's text out) over ``backend``'s token ids."""
    from etude.engine.backends import GenerationRequest
    from etude.engine.sampling import SamplingParams
    from etude.env.episode_chat import end_of_turn_id

    end_id = end_of_turn_id(chat_format, tokenizer)

    def ask(messages: list[dict[str, str]]) -> str:
        prompt = render_prompt(messages, tokenizer, chat_format)
        budget = max_new_tokens
        limit = backend.max_seq_len
        if limit is not None:
            budget = min(budget, limit - len(prompt))
            if budget < 1:
                raise PromptTooLong(
                    f"the prompt has {len(prompt)} tokens and the model's context {limit}; "
                    "lower agent.max_source_chars to send shorter modules"
                )
        params = SamplingParams(
            max_new_tokens=budget,
            temperature=temperature,
            stop_token_ids=(end_id,),
            seed=seed,
        )
        (generation,) = backend.generate([GenerationRequest(prompt_ids=prompt, params=params)])
        ids = list(generation.token_ids)
        if ids and ids[-1] == end_id:
            ids.pop()
        return tokenizer.decode(ids)

    return ask


def http_chat_model(cfg: AgentDeleterConfig) -> ChatModel:
    """The deleter's model for ``agent.api = "tokens"``: an ``HTTPBackend`` on ``base_url``
    with the tokenizer and chat format of ``agent.tokenizer``."""
    from etude.engine.backends import HTTPBackend, HTTPBackendConfig
    from etude.model.chat_family import detect_chat_format, load_chat_tokenizer

    chat_format = detect_chat_format(cfg.tokenizer, chat_format=cfg.chat_format or None)
    tokenizer = load_chat_tokenizer(cfg.tokenizer, chat_format)
    key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
    backend = HTTPBackend(
        HTTPBackendConfig(
            url=cfg.base_url,
            model=cfg.model,
            api_key=key,
            dialect=cfg.dialect,  # type: ignore[arg-type]
            timeout=cfg.timeout_s,
        )
    )
    return backend_chat_model(
        backend,
        tokenizer,
        chat_format=chat_format,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
    )
