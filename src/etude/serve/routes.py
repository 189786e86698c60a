"""The HTTP endpoints of ``etude serve`` (request handling lives in ``etude.serve.app``).

Each handler turns a `BadRequest` into a JSON error and never lets one request's failure reach
another: the engine thread keeps running whatever a handler does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from etude.serve.app import (
    BadRequest,
    ServeApp,
    error_response,
    metrics_response,
    new_request_id,
    reload_weights,
)

Handler = Callable[[Request], Awaitable[Response]]


def _guarded(handler: Handler) -> Handler:
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except BadRequest as error:
            return error_response(str(error), error.status, error.kind)
        except ValueError as error:  # the engine's own input checks
            return error_response(str(error), 400)

    return run


def _logprobs_block(state: ServeApp, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    return {
        "tokens": [state.decode([i]) for i in ids],
        "token_logprobs": logprobs,
        "top_logprobs": None,
        "text_offset": None,
    }


def routes(state: ServeApp) -> list[tuple[str, Handler, list[str]]]:
    model_name = state.served.name

    async def completions(request: Request) -> Response:
        key = state.authorize(request)
        body = await state.read_body(request)
        prompt_ids = state.check_prompt_ids(body.get("prompt"))
        params = state.sampling_params(body, len(prompt_ids))
        tier = state.tier_of(body)
        want_logprobs = body.get("logprobs") is not None
        request_id = new_request_id("cmpl")
        started = time.perf_counter()
        events, ticket = await state.run(request, prompt_ids, params, tier)
        base = {"id": request_id, "object": "text_completion", "created": int(time.time())}
        base["model"] = model_name

        if body.get("stream"):
            return StreamingResponse(
                _stream(state, events, ticket, key, tier, prompt_ids, base, want_logprobs, started),
                media_type="text/event-stream",
            )
        ids, logprobs, gen = await state.collect(request, events, ticket)
        if gen is None:  # the client went away: bill what was generated, answer nobody
            await state.bill_async(
                request_id=request_id, key=key, endpoint="completions", tier=tier,
                status="disconnected", prompt=len(prompt_ids), completion=len(ids),
            )  # fmt: skip
            return Response(status_code=499)
        usage = await state.bill_async(
            request_id=request_id, key=key, endpoint="completions", tier=tier, status="ok",
            prompt=len(prompt_ids), completion=len(gen.token_ids),
        )  # fmt: skip
        state.metrics.latency.labels(tier.name).observe(time.perf_counter() - started)
        choice = {
            "index": 0,
            "text": state.decode(gen.token_ids),
            "token_ids": gen.token_ids,
            "prompt_token_ids": prompt_ids if body.get("return_token_ids") else None,
            "logprobs": _logprobs_block(state, gen.token_ids, gen.logprobs)
            if want_logprobs
            else None,
            "finish_reason": gen.finish_reason,
            "stop_reason": gen.stop,
        }
        return JSONResponse(
            {**base, "choices": [choice], "usage": usage, "policy_version": gen.policy_version}
        )

    async def chat_completions(request: Request) -> Response:
        from etude.serve.chat import parse_reply, render_chat

        key = state.authorize(request)
        body = await state.read_body(request)
        if state.served.chat_format is None:
            raise BadRequest(
                "this model has no chat format etude speaks (no tokenizer with a known chat "
                "template): use /v1/completions with token ids"
            )
        if body.get("stream"):
            raise BadRequest("stream is not supported on /v1/chat/completions; use /v1/completions")
        served = state.served
        fmt = served.chat_format
        prompt_ids = render_chat(served.tokenizer, body.get("messages"), body.get("tools"), fmt)
        params = state.sampling_params(body, len(prompt_ids), extra_stop_ids=served.stop_token_ids)
        tier = state.tier_of(body)
        request_id = new_request_id("chatcmpl")
        started = time.perf_counter()
        events, ticket = await state.run(request, prompt_ids, params, tier)
        ids, logprobs, gen = await state.collect(request, events, ticket)
        if gen is None:
            await state.bill_async(
                request_id=request_id, key=key, endpoint="chat", tier=tier,
                status="disconnected", prompt=len(prompt_ids), completion=len(ids),
            )  # fmt: skip
            return Response(status_code=499)
        usage = await state.bill_async(
            request_id=request_id, key=key, endpoint="chat", tier=tier, status="ok",
            prompt=len(prompt_ids), completion=len(gen.token_ids),
        )  # fmt: skip
        state.metrics.latency.labels(tier.name).observe(time.perf_counter() - started)
        end_id = served.stop_token_ids[0]
        content, tool_calls = parse_reply(state.decode, end_id, gen.token_ids, fmt)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        reason = "tool_calls" if tool_calls else gen.finish_reason
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": reason,
            "token_ids": gen.token_ids,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {"token": state.decode([i]), "logprob": lp, "top_logprobs": []}
                    for i, lp in zip(gen.token_ids, gen.logprobs)
                ]
            }
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice],
                "usage": usage,
                "policy_version": gen.policy_version,
            }
        )

    async def models(request: Request) -> Response:
        state.authorize(request)
        card = {
            "id": model_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "etude",
            "max_model_len": state.engine.max_seq_len,
            "policy_version": state.engine.policy_version,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": model_name,
                "policy_version": state.engine.policy_version,
                "running": state.loop.num_running,
                "waiting": state.loop.num_waiting,
                "failed_steps": state.loop.num_failed_steps,
                "engine_alive": state.loop.alive,
            }
        )

    async def metrics(request: Request) -> Response:
        return metrics_response(state)

    async def reload(request: Request) -> Response:
        state.authorize(request)
        body = await state.read_body(request)
        path, version = body.get("path"), body.get("version")
        if not isinstance(path, str) or not path:
            raise BadRequest("path must name the weights to load (a path the server can read)")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise BadRequest(f"version must be an integer >= 0, got {version!r}")
        started = time.perf_counter()
        loaded = await reload_weights(state, path, version)
        return JSONResponse(
            {"policy_version": loaded, "seconds": round(time.perf_counter() - started, 4)}
        )

    return [
        ("/v1/completions", _guarded(completions), ["POST"]),
        ("/v1/chat/completions", _guarded(chat_completions), ["POST"]),
        ("/v1/models", _guarded(models), ["GET"]),
        ("/health", health, ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/v1/weights/reload", _guarded(reload), ["POST"]),
    ]


async def _stream(
    state: ServeApp,
    events: asyncio.Queue,
    ticket,
    key: str,
    tier,
    prompt_ids: list[int],
    base: dict[str, Any],
    want_logprobs: bool,
    started: float,
) -> AsyncIterator[str]:
    """SSE chunks, one per engine step; the ledger row is written before the last chunk."""
    ids: list[int] = []
    billed = False
    try:
        while True:
            item = await events.get()
            if isinstance(item, BaseException):
                error = {"error": {"message": str(item), "type": "server_error", "code": 500}}
                yield f"data: {json.dumps(error)}\n\n"
                return
            ids += item.new_token_ids
            gen = item.generation
            choice = {
                "index": 0,
                "text": state.decode(item.new_token_ids),
                "token_ids": item.new_token_ids,
                "logprobs": (
                    _logprobs_block(state, item.new_token_ids, item.new_logprobs)
                    if want_logprobs
                    else None
                ),
                "finish_reason": gen.finish_reason if gen is not None else None,
            }
            chunk: dict[str, Any] = {**base, "choices": [choice]}
            if gen is not None:
                chunk["usage"] = await state.bill_async(
                    request_id=base["id"], key=key, endpoint="completions", tier=tier,
                    status="ok", prompt=len(prompt_ids), completion=len(gen.token_ids),
                )  # fmt: skip
                billed = True
                chunk["policy_version"] = gen.policy_version
                choice["stop_reason"] = gen.stop
                state.metrics.latency.labels(tier.name).observe(time.perf_counter() - started)
            yield f"data: {json.dumps(chunk)}\n\n"
            if gen is not None:
                yield "data: [DONE]\n\n"
                return
    finally:
        if not billed:  # the client went away (or the stream failed): free the row, bill
            state.loop.abort(ticket)
            state.bill(
                request_id=base["id"], key=key, endpoint="completions", tier=tier,
                status="disconnected", prompt=len(prompt_ids), completion=len(ids),
            )  # fmt: skip
