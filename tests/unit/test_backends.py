"""Inference backends: the in-process backend, weight updates, the HTTP dialects' parsing."""

from __future__ import annotations

import pytest
import torch

from etude.engine import Engine, SamplingParams
from etude.engine.backends import (
    EngineBackend,
    GenerationRequest,
    HTTPBackend,
    HTTPBackendConfig,
    InferenceBackend,
    ServerResponseError,
    load_weights,
    parse_completion,
)
from etude.model import ModelConfig
from etude.model.transformer import build_model
from etude.parallel.checkpoint import export_safetensors


def tiny(seed: int):
    cfg = ModelConfig.preset(
        "tiny",
        vocab_size=96,
        dim=32,
        num_layers=2,
        num_dense_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        dense_ffn_dim=64,
        num_experts=0,
        max_seq_len=32,
    )
    return build_model(cfg, seed=seed)


def test_engine_backend_generates_and_updates_weights(tmp_path):
    model, other = tiny(0), tiny(1)
    backend = EngineBackend(Engine(model))
    assert isinstance(backend, InferenceBackend) and backend.max_seq_len == 32
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    requests = [GenerationRequest(prompt_ids=[3, 4, 5], params=greedy, session_id="a")]
    before = backend.generate(requests)[0]
    assert before.policy_version == 0
    backend.update_weights(other, version=3)
    after = backend.generate(requests)[0]
    assert after.policy_version == 3 and backend.policy_version == 3
    assert after.token_ids == Engine(other).generate([[3, 4, 5]], greedy)[0].token_ids
    # by path: an export directory written by export_safetensors
    export_safetensors(tiny(0), tmp_path / "export", {})
    backend.update_weights(tmp_path, version=4)
    assert backend.generate(requests)[0].token_ids == before.token_ids
    # the engine's own module: only the version moves
    backend.update_weights(model, version=5)
    assert backend.policy_version == 5
    assert backend.generate([]) == []


def test_load_weights_errors(tmp_path):
    model = tiny(0)
    with pytest.raises(ValueError, match="no weights at"):
        load_weights(model, tmp_path)
    with pytest.raises(ValueError, match="weights do not fit the served model"):
        load_weights(model, {"nope": torch.zeros(1)})


def _http(dialect: str) -> HTTPBackend:
    return HTTPBackend(HTTPBackendConfig(url="http://127.0.0.1:9/v1", dialect=dialect, model="m"))


def test_request_bodies_per_dialect():
    params = SamplingParams(
        max_new_tokens=5, temperature=0.7, top_k=4, stop_token_ids=(2,), stop_strings=("x",), seed=9
    )
    request = GenerationRequest(prompt_ids=[1, 2, 3], params=params, session_id="ep-1", priority=1)
    etude = _http("etude").request_body(request)
    assert etude["prompt"] == [1, 2, 3] and etude["logprobs"] == 0 and etude["return_token_ids"]
    assert etude["session_id"] == "ep-1" and etude["tier"] == "fast" and etude["seed"] == 9
    assert etude["stop_token_ids"] == [2] and etude["stop"] == ["x"] and etude["top_k"] == 4
    vllm = _http("vllm").request_body(request)
    assert vllm["ignore_eos"] and vllm["include_stop_str_in_output"] and "tier" not in vllm
    assert vllm["session_id"] == "ep-1" and vllm["return_tokens_as_token_ids"]
    sglang = _http("sglang").request_body(request)
    assert sglang["no_stop_trim"] and "session_id" not in sglang
    with pytest.raises(ValueError, match="must start with http"):
        HTTPBackendConfig(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="backend.dialect='openai' must be one of"):
        HTTPBackendConfig(url="http://x", dialect="openai")


def _choice(**fields):
    return {"choices": [{"text": "", "finish_reason": "stop", **fields}]}


def test_parse_completion_reads_ids_logprobs_and_stop():
    gen = parse_completion(
        _choice(token_ids=[4, 2], logprobs={"token_logprobs": [-0.5, -1.0]}, stop_reason=2), 7
    )
    assert gen.token_ids == [4, 2] and gen.logprobs == [-0.5, -1.0] and gen.stop == 2
    assert gen.policy_version == 7 and gen.finish_reason == "stop"
    # older vLLM: ids only as "token_id:N" strings in logprobs.tokens
    old = _choice(logprobs={"tokens": ["token_id:4", "token_id:2"], "token_logprobs": [-1, -2]})
    assert parse_completion(old, 0).token_ids == [4, 2]
    assert (
        parse_completion(
            {**_choice(token_ids=[1], logprobs={"token_logprobs": [0.0]}), "policy_version": 3}, 0
        ).policy_version
        == 3
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"choices": []}, "no choices"),
        (_choice(logprobs={"token_logprobs": [-1.0]}), "no generated token ids"),
        (_choice(token_ids=[1, 2]), "no logprob for every sampled token"),
        (_choice(token_ids=[1, 2], logprobs={"token_logprobs": [-1.0]}), "no logprob for every"),
        (
            {
                "choices": [
                    {
                        "token_ids": [1],
                        "logprobs": {"token_logprobs": [0.0]},
                        "finish_reason": "abort",
                    }
                ]
            },
            "finish_reason 'abort'",
        ),
    ],
)
def test_parse_completion_names_what_the_server_left_out(data, message):
    with pytest.raises(ServerResponseError, match=message):
        parse_completion(data, 0)


def test_unreachable_server_fails_after_retries():
    backend = HTTPBackend(
        HTTPBackendConfig(
            url="http://127.0.0.1:9", model="m", max_retries=1, backoff=0.01, timeout=2
        )
    )
    request = GenerationRequest(prompt_ids=[1], params=SamplingParams(max_new_tokens=1))
    with pytest.raises(ServerResponseError, match="failed after 2 tries"):
        backend.generate([request])
    with pytest.raises(ValueError, match="updates weights by path"):
        backend.update_weights(tiny(0), 1)
    backend.close()
