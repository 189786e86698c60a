"""``etude serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

Starlette app (run by uvicorn) with:

- ``POST /v1/completions``: ``prompt`` as token ids (or text when the model has etude's
  tokenizer); the response carries ``choices[0].token_ids`` and, with ``logprobs`` set,
  ``choices[0].logprobs.token_logprobs`` (the behaviour logprob of each sampled token); the
  token-in/token-out fields vLLM and SGLang use (``stop_token_ids``, ``top_k``, ``seed``,
  ``return_token_ids``, ``session_id``) are read, ``stream: true`` streams SSE chunks;
- ``POST /v1/chat/completions``: ``messages`` (+ OpenAI ``tools``) rendered with etude's chat
  template, the reply's ``<tool_call>`` segments parsed by etude's protocol into OpenAI
  ``tool_calls`` (a malformed call stays in ``content`` as text);
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format);
- ``POST /v1/weights/reload`` ``{"path": ..., "version": N}``: read and check the weights off
  the engine thread, swap them in between two decode steps, bump the policy version.

Every request names a tier (``tier``: ``fast``, the default, or ``standard``): fast requests
are admitted first, may preempt standard ones and, with ``latency_batch_size``, run in small
decode batches. Every response carries ``usage`` with the tier's cost (``etude.serve.metering``)
and ``policy_version``; the ledger row is committed before the response (or the last stream
chunk) is sent. Requests need ``Authorization: Bearer KEY`` with a key from the keys file.

Bad input (malformed JSON, unknown model, a prompt over the context length, too many tokens,
bad sampling values) gets a 4xx JSON error ``{"error": {"message", "type", "code"}}`` and the
server keeps serving. A client that disconnects has its request aborted (its row freed at once)
and billed for the tokens generated so far (status ``disconnected``).

Not here: ``n > 1``, ``echo``, ``best_of``, prompt logprobs, the Responses API, TLS.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from etude.engine import Engine, SamplingParams
from etude.engine.backends import load_weights
from etude.serve.loading import Served
from etude.serve.loop import EngineLoop, Ticket
from etude.serve.metering import Tier, UsageLedger, usage_record


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """Settings of one server."""

    api_keys: dict[str, str] | None
    """secret -> key name; None serves without keys (ledger key ``anonymous``)."""
    ledger_path: str
    tiers: dict[str, Tier]
    default_tier: str = "fast"
    max_batch_size: int = 32
    latency_batch_size: int = 0
    """Decode batch cap while a fast request is present (0 = no cap)."""
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.default_tier not in self.tiers:
            raise ValueError(
                f"--default-tier {self.default_tier!r} is not a tier; use one of {sorted(self.tiers)}"
            )


class BadRequest(Exception):
    """A client mistake: becomes a 4xx JSON error."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def error_response(message: str, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


class Metrics:
    """Prometheus series of one server (own registry, so several apps can live in a process)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "etude_requests",
            "Requests by endpoint, tier and status",
            ["endpoint", "tier", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "etude_tokens", "Tokens by tier and kind", ["tier", "kind"], registry=r
        )
        self.cost = Counter("etude_cost_usd", "Billed dollars by tier", ["tier"], registry=r)
        self.latency = Histogram(
            "etude_request_seconds",
            "Request latency by tier",
            ["tier"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        Gauge("etude_running_requests", "Requests in the running batch", registry=r).set_function(
            lambda: loop.num_running
        )
        Gauge("etude_waiting_requests", "Requests waiting for a row", registry=r).set_function(
            lambda: loop.num_waiting
        )
        Gauge("etude_policy_version", "Version of the served weights", registry=r).set_function(
            lambda: loop.engine.policy_version
        )
        Gauge("etude_preemptions", "Standard requests preempted so far", registry=r).set_function(
            lambda: loop.engine.num_preemptions
        )
        Gauge(
            "etude_shared_prefix_tokens", "Prompt tokens copied, not prefilled", registry=r
        ).set_function(lambda: loop.engine.num_shared_prefix_tokens)


# ---------------------------------------------------------------- request parsing


def _int(
    body: dict[str, Any], key: str, default: int | None, *, low: int | None = None
) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        bound = f" >= {low}" if low is not None else ""
        raise BadRequest(f"{key} must be an integer{bound}, got {value!r}")
    return value


def _float(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"{key} must be a number, got {value!r}")
    return float(value)


class ServeApp:
    """Request handling (one instance per server); `build_app` wires it into Starlette."""

    def __init__(self, served: Served, cfg: ServeConfig) -> None:
        self.served = served
        self.cfg = cfg
        max_seq_len = cfg.max_seq_len or served.model.cfg.max_seq_len
        self.engine = Engine(
            served.model,
            max_seq_len=max_seq_len,
            decode_fn=self.decode if served.decode is not None else None,
            max_batch_size=cfg.max_batch_size,
            latency_batch_size=cfg.latency_batch_size,
        )
        self.loop = EngineLoop(self.engine)
        self.ledger = UsageLedger(cfg.ledger_path)
        self.metrics = Metrics(self.loop)
        self.started = time.time()

    # ------------------------------------------------------------------ helpers

    def decode(self, ids: list[int]) -> str:
        """Text of ids; ids the tokenizer does not know (a model vocabulary padded past the
        tokenizer's) decode to nothing."""
        if self.served.decode is None:
            return ""
        tok = self.served.tokenizer
        if tok is not None:
            ids = [i for i in ids if i < tok.vocab_size]
        return self.served.decode(ids)

    def authorize(self, request: Request) -> str:
        if self.cfg.api_keys is None:
            return "anonymous"
        header = request.headers.get("authorization", "")
        scheme, _, secret = header.partition(" ")
        name = self.cfg.api_keys.get(secret.strip()) if scheme.lower() == "bearer" else None
        if name is None:
            raise BadRequest(
                "invalid or missing API key: send Authorization: Bearer <key> with a key from "
                "the server's --api-keys file",
                401,
                "authentication_error",
            )
        return name

    async def read_body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise BadRequest(f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model not in (None, "", self.served.name):
            raise BadRequest(
                f"model {model!r} is not served here; this server serves {self.served.name!r}",
                404,
                "model_not_found",
            )
        return body

    def tier_of(self, body: dict[str, Any]) -> Tier:
        """``tier`` (fast / standard), else OpenAI's ``service_tier`` (priority -> fast,
        default / flex -> standard, auto -> the server's default)."""
        name = body.get("tier")
        if not name and body.get("service_tier"):
            mapped = {"priority": "fast", "default": "standard", "flex": "standard", "auto": ""}
            if body["service_tier"] not in mapped:
                raise BadRequest(
                    f"service_tier {body['service_tier']!r} is unknown; use one of "
                    f"{sorted(mapped)} or tier = fast / standard"
                )
            name = mapped[body["service_tier"]]
        name = name or self.cfg.default_tier
        if name not in self.cfg.tiers:
            raise BadRequest(f"tier {name!r} is unknown; use one of {sorted(self.cfg.tiers)}")
        return self.cfg.tiers[name]

    def sampling_params(
        self, body: dict[str, Any], prompt_len: int, extra_stop_ids: tuple[int, ...] = ()
    ) -> SamplingParams:
        if _int(body, "n", 1, low=1) != 1:
            raise BadRequest("n must be 1: send one request per sample")
        if body.get("echo"):
            raise BadRequest("echo is not supported")
        limit = self.engine.max_seq_len
        if prompt_len >= limit:
            raise BadRequest(
                f"the prompt has {prompt_len} tokens; the context length is {limit}: shorten it"
            )
        max_tokens = _int(body, "max_tokens", None, low=1)
        if max_tokens is None:
            max_tokens = _int(body, "max_completion_tokens", 16, low=1)
        if prompt_len + max_tokens > limit:
            raise BadRequest(
                f"too many tokens: prompt {prompt_len} + max_tokens {max_tokens} exceeds the "
                f"context length {limit}; lower max_tokens to at most {limit - prompt_len}"
            )
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        stop_ids = body.get("stop_token_ids") or []
        top_k = _int(body, "top_k", 0)
        if stop and self.served.decode is None:
            raise BadRequest(
                "stop strings need a tokenizer; this model has none: use stop_token_ids"
            )
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=_float(body, "temperature", 1.0),
                top_p=_float(body, "top_p", 1.0),
                top_k=0 if top_k is None or top_k < 0 else top_k,  # vLLM/SGLang: -1 = off
                stop_token_ids=tuple(stop_ids) + extra_stop_ids,
                stop_strings=tuple(stop),
                seed=_int(body, "seed", None),
            )
        except (ValueError, TypeError) as error:
            raise BadRequest(str(error)) from None

    def check_prompt_ids(self, prompt: Any) -> list[int]:
        vocab = self.served.model.cfg.vocab_size
        if isinstance(prompt, str):
            if self.served.tokenizer is None:
                raise BadRequest("this model has no etude tokenizer: send prompt as token ids")
            return self.served.tokenizer.encode(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest("prompt must be a non-empty list of token ids (or a string)")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise BadRequest(
                "prompt must be one list of integer token ids (one prompt per request)"
            )
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} is outside [0, {vocab}) (the vocabulary)")
        return prompt

    # ------------------------------------------------------------------ generation

    async def run(
        self,
        request: Request,
        prompt_ids: list[int],
        params: SamplingParams,
        tier: Tier,
    ) -> tuple[asyncio.Queue, Ticket]:
        if not self.loop.alive:
            raise BadRequest(
                "the engine thread has stopped; restart the server", 503, "server_error"
            )
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        ticket = self.loop.submit(
            prompt_ids,
            params,
            tier.priority,
            lambda item: loop.call_soon_threadsafe(events.put_nowait, item),
        )
        return events, ticket

    def bill(
        self,
        *,
        request_id: str,
        key: str,
        endpoint: str,
        tier: Tier,
        status: str,
        prompt: int,
        completion: int,
    ) -> dict[str, Any]:
        self.ledger.record(
            request_id=request_id,
            api_key=key,
            endpoint=endpoint,
            model=self.served.name,
            tier=tier,
            status=status,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
        usage = usage_record(tier, prompt, completion)
        self.metrics.requests.labels(endpoint, tier.name, status).inc()
        self.metrics.tokens.labels(tier.name, "input").inc(prompt)
        self.metrics.tokens.labels(tier.name, "output").inc(completion)
        self.metrics.cost.labels(tier.name).inc(float(usage["cost"]["total_usd"]))
        return usage

    async def bill_async(self, **fields: Any) -> dict[str, Any]:
        """`bill` on a worker thread: the commit (an fsync) does not stall the event loop, and
        the caller still answers only after it."""
        return await asyncio.to_thread(lambda: self.bill(**fields))

    async def collect(
        self, request: Request, events: asyncio.Queue, ticket: Ticket
    ) -> tuple[list[int], list[float], Any]:
        """Wait for the whole generation; abort it when the client goes away."""
        ids: list[int] = []
        logprobs: list[float] = []
        checked = time.monotonic()
        while True:
            item = None
            try:
                item = await asyncio.wait_for(events.get(), timeout=0.25)
            except TimeoutError:
                pass
            # tokens may arrive faster than the timeout: check the client on a clock
            if item is None or time.monotonic() - checked > 0.25:
                checked = time.monotonic()
                if await request.is_disconnected():
                    self.loop.abort(ticket)
                    return ids, logprobs, None
            if item is None:
                continue
            if isinstance(item, BaseException):
                raise item
            ids += item.new_token_ids
            logprobs += item.new_logprobs
            if item.generation is not None:
                return ids, logprobs, item.generation


def build_app(served: Served, cfg: ServeConfig) -> Starlette:
    """The Starlette app; the engine thread starts and stops with the app's lifespan."""
    from etude.serve.routes import routes

    state = ServeApp(served, cfg)

    async def lifespan(app: Starlette):
        state.loop.start()
        try:
            yield
        finally:
            state.loop.stop()
            state.ledger.close()

    app = Starlette(
        routes=[Route(path, fn, methods=m) for path, fn, m in routes(state)], lifespan=lifespan
    )
    app.state.serve = state
    return app


async def reload_weights(state: ServeApp, path: str, version: int) -> int:
    """Read and check the weights at ``path`` on a worker thread, then swap them in."""

    def read() -> dict[str, Any]:
        candidate = copy.deepcopy(state.served.model)
        load_weights(candidate, path)
        return candidate.state_dict()

    weights = await asyncio.to_thread(read)
    done = state.loop.swap_weights(weights, version)
    return await asyncio.wrap_future(done)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def metrics_response(state: ServeApp) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type="text/plain; version=0.0.4")
