"""Optional agent deleter: a model proposes which code to delete; the factory validates it.

The factory's own proposals come from coverage and static analysis. As an alternative source
(the way the feature-deletion recipe was first described: a model is asked to delete code so the
codebase keeps working while a testable feature is gone), ``propose_with_agent`` shows a model
behind an OpenAI-compatible ``/chat/completions`` endpoint one module at a time (its source and
public names) and asks for features as JSON::

    {"features": [{"delete": ["slugify", "_fold_accents"], "why": "..."}]}

A proposal may also name whole files (modules) of the feature: the model deletes code and files
so that the rest still works. Each proposal becomes a ``Feature`` only if it passes the same
static checks as the factory's own (``Miner.custom_feature``: definitions exist, nothing outside the set uses them, tests
exercise them), and then goes through the same deletion, sanitizing, leak scan and validation;
the records say ``kind = "agent_deletion"``.

Any OpenAI-compatible chat endpoint works (``etude serve``, vLLM, SGLang, a hosted API). With
``api = "tokens"`` the model is reached through the token-level inference backend instead
(``etude.tasks.agent_backend``: the prompt rendered into ids in the model's own chat format, an
``HTTPBackend`` on ``/v1/completions``); a caller may also pass any chat callable (``model``:
messages in, text out), e.g. ``agent_backend.backend_chat_model`` over an in-process
``EngineBackend``, which is how the tests drive a scripted agent. Off by default (``enabled = false``). The key is read from the environment variable named by
``api_key_env`` and sent as a bearer token; nothing else leaves the machine but the module's
source. Uses ``urllib`` only.

What this module does not do: let the model edit files (it names definitions; LibCST deletes),
retry on rate limits beyond one attempt per module, or trust the model's claims about tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

SYSTEM_PROMPT = (
    "You design programming exercises from real code. Given one Python module, choose features "
    "to delete so that the rest of the package still works and the feature's tests fail. A "
    "feature is a public function, class or method together with the private helpers only it "
    "uses. Answer with JSON only."
)


@dataclass(kw_only=True, slots=True)
class AgentDeleterConfig:
    """A model behind an OpenAI-compatible endpoint that proposes deletions (TOML ``[agent]``)."""

    enabled: bool = False
    """Ask the model for features in addition to the factory's own proposals."""
    api: Literal["chat", "tokens"] = "chat"
    """``chat``: ``/chat/completions`` with text; ``tokens``: the token-level backend
    (``/v1/completions`` with prompt ids, ``etude.engine.backends.HTTPBackend``)."""
    base_url: str = "http://localhost:8000/v1"
    """Endpoint root; ``/chat/completions`` (or, for ``tokens``, ``/completions``) is appended."""
    model: str = ""
    """Model name sent in the request (``tokens``: "" takes the first one the server lists)."""
    tokenizer: str = ""
    """``tokens`` only: the model directory whose tokenizer renders prompts and decodes replies."""
    chat_format: str = ""
    """``tokens`` only: ``etude``, ``hermes``, ``kimi_k2`` or ``deepseek_v3`` ("": detected
    from ``tokenizer``)."""
    dialect: str = "etude"
    """``tokens`` only: the server's dialect (``etude``, ``vllm``, ``sglang``)."""
    max_new_tokens: int = 1024
    """``tokens`` only: most tokens of one reply."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (empty or unset: no Authorization header)."""
    temperature: float = 0.0
    """Sampling temperature."""
    max_features_per_module: int = 3
    """Most proposals kept per module."""
    max_source_chars: int = 40000
    """Modules longer than this are not sent."""
    timeout_s: float = 120.0
    """Seconds per request."""

    def __post_init__(self) -> None:
        if self.api not in ("chat", "tokens"):
            raise ValueError(f"agent.api={self.api!r} must be 'chat' or 'tokens'")
        if self.enabled and self.api == "chat" and not self.model:
            raise ValueError("agent.model must name the model when agent.enabled is true")
        if self.enabled and self.api == "tokens" and not self.tokenizer:
            raise ValueError(
                "agent.tokenizer must name the model directory (its tokenizer renders the "
                "prompts) when agent.api is 'tokens'"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"agent.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"agent.base_url={self.base_url!r} must be an http(s) URL")
        if self.max_features_per_module < 1:
            raise ValueError("agent.max_features_per_module must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("agent.timeout_s must be > 0")


def chat(cfg: AgentDeleterConfig, messages: list[dict[str, str]]) -> str:
    """One chat completion; returns the assistant's text. Network errors raise ``RuntimeError``."""
    body = json.dumps(
        {"model": cfg.model, "messages": messages, "temperature": cfg.temperature}
    ).encode()
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        cfg.base_url.rstrip("/") + "/chat/completions", data=body, headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=cfg.timeout_s) as response:
            payload = json.loads(response.read().decode())
    except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as e:
        raise RuntimeError(f"agent deleter request to {cfg.base_url} failed: {e}") from None
    try:
        return payload["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise RuntimeError(
            f"agent deleter got an unexpected response: {str(payload)[:300]}"
        ) from None


def module_prompt(module: str, source: str, public: list[str], files: list[str] = ()) -> str:
    """The user message for one module (``files``: the package's module paths)."""
    names = ", ".join(public) or "(none)"
    listing = ", ".join(files) or "(this one only)"
    return (
        f"Module `{module}`:\n\n```python\n{source}\n```\n\nPublic definitions: {names}.\n"
        f"Files of the package: {listing}.\n\n"
        'Reply with {"features": [{"delete": [names...], "files": [paths...], "why": "..."}]}, '
        "where names are top-level names or Class.method of this module, including the private "
        "helpers only that feature uses, and files (optional) are whole modules of the package "
        "that belong to the feature and nothing else uses."
    )


def parse_proposals(text: str) -> list[tuple[list[str], list[str]]]:
    """``(names, files)`` of each feature in a model reply (the first JSON object in it); []
    if none parse. A malformed item is skipped."""
    match = re.search(r"\{.*\}", text, re.DOTALL)
    if not match:
        return []
    try:
        data = json.loads(match.group(0))
    except json.JSONDecodeError:
        return []
    out = []
    for item in data.get("features", []) if isinstance(data, dict) else []:
        if not isinstance(item, dict):
            continue
        names = item.get("delete", [])
        files = item.get("files", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            continue
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            continue
        if names or files:
            out.append((list(dict.fromkeys(names)), list(dict.fromkeys(files))))
    return out


def parse_features(text: str) -> list[list[str]]:
    """The ``delete`` lists of a model reply (``parse_proposals`` without the files)."""
    return [names for names, _ in parse_proposals(text) if names]


ChatModel = Callable[[list[dict[str, str]]], str]
"""A model as the deleter uses it: chat messages in, the assistant's text out."""


class PromptTooLong(ValueError):
    """A model's context cannot hold a module's prompt (the module is skipped, with the reason)."""


def propose_with_agent(
    miner: Any, cfg: AgentDeleterConfig, proposal_cfg: Any, *, model: ChatModel | None = None
) -> tuple[list[Any], dict[str, str]]:
    """Ask the model about every importable module; return (features, rejected name -> reason).

    ``model``: any chat callable (a scripted agent in tests, an in-process engine); default: the
    OpenAI-compatible endpoint of ``cfg`` (``chat``). A proposal that names files deletes those
    modules whole together with its definitions (``proposal.combine``).
    """
    from etude.tasks.proposal import Feature, combine

    if model is not None:
        ask = model
    elif cfg.api == "tokens":
        from etude.tasks.agent_backend import http_chat_model

        ask = http_chat_model(cfg)
    else:
        ask = lambda messages: chat(cfg, messages)  # noqa: E731
    path_to_module = {p: m for m, p in miner.layout.modules.items()}
    files = sorted(miner.layout.modules.values())
    features = []
    rejected: dict[str, str] = {}
    for module, mod in sorted(miner.index.items()):
        if module not in miner.baseline.importable or len(mod.source) > cfg.max_source_chars:
            continue
        public = [q for q in mod.units if not any(p.startswith("_") for p in q.split("."))]
        if not public:
            continue
        try:
            reply = ask(
                [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": module_prompt(module, mod.source, public, files)},
                ]
            )
        except PromptTooLong as e:
            rejected[f"{module}:"] = f"agent proposal: not asked: {e}"
            continue
        for names, paths in parse_proposals(reply)[: cfg.max_features_per_module]:
            key = f"{module}:{'+'.join(names + paths)}"
            parts: list[Any] = []
            reason = ""
            if names:
                found = miner.custom_feature(module, names, proposal_cfg)
                if isinstance(found, str):
                    reason = found
                else:
                    parts.append(found)
            for path in paths:
                target = path_to_module.get(path, path if path in miner.index else None)
                if target is None:
                    reason = reason or f"{path} is not a module of the package"
                    continue
                found = miner.module_feature(target, proposal_cfg)
                if isinstance(found, str):
                    reason = reason or f"{path}: {found}"
                else:
                    parts.append(found)
            if reason or not parts:
                rejected[key] = f"agent proposal: {reason or 'nothing to delete'}"
                continue
            feature: Feature = parts[0] if len(parts) == 1 else combine(parts)
            features.append(dataclasses.replace(feature, kind="agent"))
    return features, rejected
