"""The inference backend protocol that rollouts (and anything else that samples) talk to.

``generate(requests) -> [Generation]`` takes prompt token ids with sampling params and returns
per request the generated token ids, the behaviour logprob of each sampled token, the finish
reason and the policy version that produced it; ``update_weights(source, version)`` moves the
backend to new weights. Token ids go in and come out: nothing is re-tokenized, so a multi-turn
episode's ids stay append-only.

Backends:

- `EngineBackend` (the default): the in-process continuous-batching `Engine`. ``source`` is a
  module (its weights are copied; the engine's own module means "already updated"), a state
  dict, or a path (see `load_weights`).
- `HTTPBackend`: an OpenAI-compatible ``/v1/completions`` server in its token-in/token-out
  dialect, as ``etude serve``, vLLM and SGLang speak it: ``prompt`` is a list of token ids,
  ``return_token_ids`` asks for the generated ids, ``logprobs: 0`` for the logprob of each
  sampled token, ``stop_token_ids`` and ``seed`` as in `SamplingParams`, and a session id per
  episode (header ``X-Session-ID``; body ``session_id`` for etude and vLLM) so a router can keep
  an episode on the replica that holds its prefix. Requests run concurrently (a thread pool of
  ``max_concurrency``); connection errors, timeouts, 429 and 5xx are retried with exponential
  backoff; a request still unanswered after ``max_retries`` retries is a `ServerUnavailable`
  (an infrastructure failure: ``generate`` raises it with the generations of the requests that
  did succeed, so a rollout masks only the episodes whose requests failed). A response without
  token ids or logprobs is a `ServerResponseError` that names the missing field and the server
  option that provides it. A request the server refuses (4xx) is a ``ValueError`` with the
  server's message.

What the HTTP backend does not check: that the server's logprobs are those of the distribution it
sampled (vLLM needs ``--logprobs-mode processed_logprobs`` for that; see docs/serve.md), nor that
the server's tokenizer matches the trainer's (ids are taken as they are).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from etude.engine.engine import Engine
from etude.engine.sampling import Generation, SamplingParams


@dataclass(kw_only=True, slots=True)
class GenerationRequest:
    """One prompt to continue."""

    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    """Requests of one episode share it (prefix-cache affinity on servers that route by it)."""
    priority: int = 0
    """Scheduling priority (higher first); the HTTP backend sends it as the request's tier."""


@runtime_checkable
class InferenceBackend(Protocol):
    """What rollouts need from an inference engine, in process or behind HTTP."""

    policy_version: int

    @property
    def max_seq_len(self) -> int | None:
        """Most prompt + generated tokens per request (None: the server did not say)."""
        ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]: ...

    def update_weights(self, source: Any, version: int) -> None: ...


class ServerResponseError(RuntimeError):
    """The server answered, but not with what the trainer needs (or not at all, after retries)."""


class ServerUnavailable(ServerResponseError):
    """The server did not answer within the retries (timeouts, lost connections, 429, 5xx): an
    infrastructure failure, not the request's fault. From ``HTTPBackend.generate``, ``outputs``
    holds per request its `Generation`, or None where the request failed."""

    def __init__(self, message: str, outputs: Sequence[Generation | None] = ()) -> None:
        super().__init__(message)
        self.outputs = list(outputs)


def load_weights(model: nn.Module, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
    """Load ``source`` into ``model`` (strict).

    ``source``: a state dict; a ``.safetensors`` file; an export directory (``model.safetensors``);
    a run directory (``export/model.safetensors``); a DCP checkpoint directory (``step_N``
    with ``extra.json``); or a Hugging Face checkpoint directory (``config.json`` with
    ``architectures``), converted by ``etude.parallel.checkpoint.load_hf_checkpoint``.
    """
    if isinstance(source, Mapping):
        try:
            model.load_state_dict(dict(source), strict=True)
        except RuntimeError as error:
            raise ValueError(f"weights do not fit the served model: {error}") from None
        return
    from etude.parallel.checkpoint import load_checkpoint, load_safetensors

    path = Path(source)
    candidates = [path, path / "model.safetensors", path / "export" / "model.safetensors"]
    try:
        if (path / "extra.json").is_file():
            load_checkpoint(path, model)
            return
        if _is_hf_dir(path):
            from etude.parallel.checkpoint import load_hf_checkpoint

            load_hf_checkpoint(model, path)
            return
        for candidate in candidates:
            if candidate.is_file() and candidate.suffix == ".safetensors":
                load_safetensors(model, candidate)
                return
    except RuntimeError as error:
        raise ValueError(f"weights at {path} do not fit the served model: {error}") from None
    raise ValueError(
        f"no weights at {path}: pass a .safetensors file, an export or run directory (with "
        "model.safetensors or export/model.safetensors), a checkpoint step directory or a "
        "Hugging Face checkpoint directory"
    )


def _is_hf_dir(path: Path) -> bool:
    import json

    config = path / "config.json"
    try:
        return config.is_file() and "architectures" in json.loads(config.read_text())
    except ValueError:
        return False


class EngineBackend:
    """The in-process engine as an `InferenceBackend`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.engine.policy_version = version

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        if not requests:
            return []
        with self._lock:  # the engine is stepped by one thread at a time
            return self.engine.generate(
                [list(r.prompt_ids) for r in requests], [r.params for r in requests]
            )

    def update_weights(self, source: Any, version: int) -> None:
        """Copy ``source`` into the engine's model (unless it is that model) and set ``version``."""
        with self._lock:
            if isinstance(source, nn.Module):
                if source is not self.engine.model:
                    with torch.no_grad():
                        load_weights(self.engine.model, source.state_dict())
            else:
                load_weights(self.engine.model, source)
            self.engine.policy_version = int(version)


Dialect = Literal["etude", "vllm", "sglang"]


@dataclass(kw_only=True, slots=True)
class HTTPBackendConfig:
    """Where and how to reach an OpenAI-compatible completions server."""

    url: str
    """Server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted)."""
    model: str = ""
    """Model name to request; "" = the first one ``/v1/models`` lists."""
    api_key: str = ""
    """Bearer token; "" = the ``ETUDE_API_KEY`` environment variable, if set."""
    dialect: Dialect = "etude"
    """``etude`` (etude serve), ``vllm`` or ``sglang``: which extra fields to send."""
    tier: str = ""
    """etude serve's tier for every request ("" = the server's default; ``fast``/``standard``)."""
    timeout: float = 600.0
    """Seconds per HTTP request before it counts as failed (and is retried)."""
    max_retries: int = 3
    """Retries after the first try for connection errors, timeouts, 429 and 5xx."""
    max_concurrency: int = 64
    """Requests in flight at once."""
    backoff: float = 0.5
    """First retry delay in seconds; doubles each retry (with jitter)."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend.url={self.url!r} must start with http:// or https://")
        if self.dialect not in ("etude", "vllm", "sglang"):
            raise ValueError(f"backend.dialect={self.dialect!r} must be one of etude, vllm, sglang")
        if not self.timeout > 0:
            raise ValueError(f"backend.timeout={self.timeout!r} must be > 0 seconds")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"backend.max_retries={self.max_retries!r} must be an integer >= 0")
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ValueError(
                f"backend.max_concurrency={self.max_concurrency!r} must be an integer >= 1"
            )


class HTTPBackend:
    """An `InferenceBackend` over an OpenAI-compatible completions server (see the module doc)."""

    def __init__(self, cfg: HTTPBackendConfig) -> None:
        import httpx

        self.cfg = cfg
        root = cfg.url.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        api_key = cfg.api_key or os.environ.get("ETUDE_API_KEY", "")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.root,
            headers=headers,
            timeout=httpx.Timeout(cfg.timeout),
            limits=httpx.Limits(max_connections=cfg.max_concurrency),
        )
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="etude-http")
        self.policy_version = 0
        self._model = cfg.model
        self._max_seq_len: int | None = None
        self._models_read = False

    # ------------------------------------------------------------------ protocol

    @property
    def max_seq_len(self) -> int | None:
        self._read_models()
        return self._max_seq_len

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        if not requests:
            return []
        self._read_models()
        futures = [self._pool.submit(self._complete, r) for r in requests]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None and not isinstance(error, ServerUnavailable):
                raise error
        lost = [error for error in errors if error is not None]
        if lost:
            raise ServerUnavailable(
                f"{len(lost)} of {len(requests)} requests failed: {lost[0]}",
                [None if error is not None else f.result() for f, error in zip(futures, errors)],
            )
        return [f.result() for f in futures]

    def update_weights(self, source: Any, version: int) -> None:
        """Ask the server to load the weights at path ``source`` (a path the server can read)."""
        if not isinstance(source, str | os.PathLike):
            raise ValueError(
                "the HTTP backend updates weights by path: save them (export_safetensors) and "
                f"pass the path the server can read, not a {type(source).__name__}"
            )
        path = str(Path(source).resolve())
        if self.cfg.dialect == "etude":
            self._post("/v1/weights/reload", {"path": path, "version": int(version)})
        elif self.cfg.dialect == "sglang":
            self._post("/update_weights_from_disk", {"model_path": path})
        else:
            raise ValueError(
                "backend.dialect='vllm': this backend does not push weights to vLLM; restart "
                "the server on the new checkpoint or use etude serve / SGLang for weight reloads"
            )
        self.policy_version = int(version)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    # ------------------------------------------------------------------ requests

    def _read_models(self) -> None:
        if self._models_read:
            return
        data = self._request("GET", "/v1/models", None)
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list) or not models:
            raise ServerResponseError(f"{self.root}/v1/models listed no model: {data!r}")
        if not self._model:
            self._model = str(models[0].get("id", ""))
        card = next((m for m in models if m.get("id") == self._model), None)
        if card is None:
            names = ", ".join(str(m.get("id")) for m in models)
            raise ValueError(
                f"backend.model={self._model!r} is not served at {self.root} (it serves {names})"
            )
        limit = card.get("max_model_len")
        self._max_seq_len = int(limit) if isinstance(limit, int) else None
        self._models_read = True

    def request_body(self, request: GenerationRequest) -> dict[str, Any]:
        """The ``/v1/completions`` JSON body for one request in this backend's dialect."""
        p = request.params
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": list(request.prompt_ids),
            "max_tokens": p.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": list(p.stop_token_ids),
        }
        if p.top_k:
            body["top_k"] = p.top_k
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop_strings:
            body["stop"] = list(p.stop_strings)
        dialect = self.cfg.dialect
        if dialect in ("etude", "vllm") and request.session_id:
            body["session_id"] = request.session_id
        if dialect == "etude":
            if self.cfg.tier:
                body["tier"] = self.cfg.tier
            elif request.priority > 0:
                body["tier"] = "fast"
        else:
            # only the caller's stop ids end a sequence, and a stop string stays in the output
            # (as in the in-process engine)
            body["ignore_eos"] = True
            body["skip_special_tokens"] = False
        if dialect == "vllm":
            body["include_stop_str_in_output"] = True
            body["return_tokens_as_token_ids"] = True  # ids in logprobs.tokens on older vLLM
        if dialect == "sglang":
            body["no_stop_trim"] = True
        return body

    def _complete(self, request: GenerationRequest) -> Generation:
        headers = {"X-Session-ID": request.session_id} if request.session_id else None
        data = self._request("POST", "/v1/completions", self.request_body(request), headers)
        return parse_completion(data, self.policy_version)

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self._request("POST", path, body)

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        import httpx

        url = f"{self.root}{path}"
        last = ""
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                delay = self.cfg.backoff * 2 ** (attempt - 1)
                time.sleep(delay * (0.5 + random.random()))
            try:
                response = self._client.request(method, path, json=body, headers=headers)
            except httpx.TransportError as error:  # connection refused/reset, timeouts
                last = f"{type(error).__name__}: {error}"
                continue
            if response.status_code == 429 or response.status_code >= 500:
                last = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code >= 400:
                raise ValueError(
                    f"{url} refused the request (HTTP {response.status_code}): "
                    f"{_error_message(response)}"
                )
            try:
                return response.json()
            except ValueError:
                raise ServerResponseError(
                    f"{url} answered with non-JSON: {response.text[:300]!r}"
                ) from None
        raise ServerUnavailable(
            f"{url} failed after {self.cfg.max_retries + 1} tries (backend.max_retries="
            f"{self.cfg.max_retries}, backend.timeout={self.cfg.timeout}s); last error: {last}"
        )


def _error_message(response: Any) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:300]
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def parse_completion(data: Any, policy_version: int) -> Generation:
    """A `Generation` from one ``/v1/completions`` response (token ids and sampled logprobs)."""
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("choices"), list)
        or not data["choices"]
    ):
        raise ServerResponseError(f"completion response has no choices: {str(data)[:300]}")
    choice = data["choices"][0]
    token_ids = choice.get("token_ids")
    logprobs = choice.get("logprobs") or {}
    if token_ids is None:
        tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
        if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            token_ids = [int(t.split(":", 1)[1]) for t in tokens]
    if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
        raise ServerResponseError(
            "the server returned no generated token ids (choices[0].token_ids): the trainer "
            "needs them; etude serve always sends them, vLLM needs a version with "
            "return_token_ids (or return_tokens_as_token_ids), SGLang needs return_token_ids"
        )
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if (
        not isinstance(values, list)
        or len(values) != len(token_ids)
        or any(not isinstance(v, int | float) for v in values)
    ):
        raise ServerResponseError(
            "the server returned no logprob for every sampled token "
            "(choices[0].logprobs.token_logprobs, one per token id): the trainer needs them "
            f"as behaviour logprobs; got {str(values)[:200]} for {len(token_ids)} tokens"
        )
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise ServerResponseError(
            f"finish_reason {reason!r} (want 'stop' or 'length'): the server cut the request"
        )
    stop = choice.get("stop_reason", choice.get("matched_stop", choice.get("stop")))
    version = data.get("policy_version", policy_version)
    return Generation(
        token_ids=list(token_ids),
        logprobs=[float(v) for v in values],
        finish_reason=reason,
        stop=stop if isinstance(stop, int | str) else None,
        policy_version=int(version) if isinstance(version, int) else policy_version,
    )
