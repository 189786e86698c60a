"""The agent deleter through the token-level inference backend: a scripted model behind the
backend protocol and behind an OpenAI-compatible ``/v1/completions`` server (token ids in and
out), and the real in-process engine. Prompts are the chat template's ids, replies stop at the
format's end of turn, and proposals go through the same checks as the chat endpoint's."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from test_tasks_agent_deleter import REPLIES, _miner
from test_tasks_mine import write_mini_repo

from etude.engine import Engine
from etude.engine.backends import EngineBackend, InferenceBackend
from etude.engine.sampling import Generation
from etude.model import ModelConfig
from etude.model.chat import render_messages
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.tasks.agent_backend import backend_chat_model, render_prompt
from etude.tasks.agent_deleter import SYSTEM_PROMPT, AgentDeleterConfig, propose_with_agent
from etude.tasks.proposal import ProposalConfig

PROPOSALS = ProposalConfig(min_lines=2, max_test_fraction=1.0)
EXPECTED = [
    ("minipkg.shapes.area", "minipkg.shapes._square", "minipkg.shapes._UNIT"),
    ("minipkg.words.shout",),
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


def scripted_reply(tok: Tokenizer, prompt_ids: list[int]) -> list[int]:
    """The scripted model: reads which module the prompt asks about, answers from ``REPLIES``
    with the ids of its text and the end of turn."""
    module = tok.decode(prompt_ids).split("Module `")[1].split("`")[0]
    text = "Here you go:\n" + json.dumps(REPLIES.get(module, {"features": []}))
    return tok.encode(text) + [tok.im_end_id]


class ScriptedBackend:
    """An `InferenceBackend` whose model is `scripted_reply` (records its requests)."""

    def __init__(self, tok: Tokenizer, max_seq_len: int | None = None) -> None:
        self.tok = tok
        self.policy_version = 0
        self._max_seq_len = max_seq_len
        self.requests: list = []

    @property
    def max_seq_len(self) -> int | None:
        return self._max_seq_len

    def generate(self, requests):
        self.requests.extend(requests)
        out = []
        for r in requests:
            ids = scripted_reply(self.tok, r.prompt_ids)
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
        return out

    def update_weights(self, source, version):
        raise AssertionError("the deleter never updates weights")


def test_a_scripted_model_behind_the_backend_protocol(tmp_path, tok):
    backend = ScriptedBackend(tok)
    assert isinstance(backend, InferenceBackend)
    miner = _miner(write_mini_repo(tmp_path))
    cfg = AgentDeleterConfig(enabled=True, model="m")
    model = backend_chat_model(backend, tok)
    features, rejected = propose_with_agent(miner, cfg, PROPOSALS, model=model)
    assert [f.symbols for f in features] == EXPECTED
    assert all(f.kind == "agent" for f in features)
    assert "scale is needed at import time" in rejected["minipkg.shapes:scale"]
    # the prompt is the chat template's ids, ending with the generation prompt; greedy, stopping
    # at the end of turn
    first = backend.requests[0]
    text = tok.decode(first.prompt_ids)
    assert "def area(radius):" in text and SYSTEM_PROMPT in text
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]},
    ]
    assert first.prompt_ids == render_messages(tok, messages, add_generation_prompt=True)[0]
    assert first.params.stop_token_ids == (tok.im_end_id,) and first.params.temperature == 0


def test_hermes_prompts_render_in_the_family_template(tok):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Module `m`"}]
    ids = render_prompt(messages, tok, "hermes")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nS") and text.endswith("<|im_start|>assistant\n")
    assert "Module `m`" in text


def test_a_prompt_longer_than_the_context_skips_the_module(tmp_path, tok):
    miner = _miner(write_mini_repo(tmp_path))
    backend = ScriptedBackend(tok, max_seq_len=64)
    cfg = AgentDeleterConfig(enabled=True, model="m")
    features, rejected = propose_with_agent(
        miner, cfg, PROPOSALS, model=backend_chat_model(backend, tok)
    )
    assert features == [] and backend.requests == []
    reason = rejected["minipkg.shapes:"]
    assert reason.startswith("agent proposal: not asked: the prompt has") and "64" in reason
    assert "agent.max_source_chars" in reason


def test_the_in_process_engine_answers_through_the_same_path(tmp_path, tok):
    """A real (untrained) model in the in-process engine: its reply is whatever it samples, so
    nothing parses, but the prompt goes through the engine and the reply comes back as text."""
    cfg = ModelConfig.preset(
        "tiny",
        vocab_size=tok.vocab_size,
        dim=32,
        num_layers=1,
        num_dense_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        dense_ffn_dim=64,
        num_experts=0,
        max_seq_len=4096,
    )
    generations: list[Generation] = []

    class Recording(EngineBackend):
        def generate(self, requests):
            out = super().generate(requests)
            generations.extend(out)
            return out

    backend = Recording(Engine(build_model(cfg, seed=0)))
    replies: list[str] = []
    inner = backend_chat_model(backend, tok, max_new_tokens=4)

    def model(messages):
        replies.append(inner(messages))
        return replies[-1]

    miner = _miner(write_mini_repo(tmp_path))
    features, _ = propose_with_agent(
        miner, AgentDeleterConfig(enabled=True, model="m"), PROPOSALS, model=model
    )
    assert features == [] and len(replies) == len(generations) == 2
    for reply, generation in zip(replies, generations, strict=True):
        ids = generation.token_ids
        assert 1 <= len(ids) <= 4
        if generation.finish_reason == "stop":
            assert ids[-1] == tok.im_end_id
            ids = ids[:-1]
        assert reply == tok.decode(ids)


class _Completions(BaseHTTPRequestHandler):
    """An OpenAI-compatible server in the token dialect whose model is `scripted_reply`."""

    tok: Tokenizer
    requests: list = []

    def _send(self, data):
        payload = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):  # noqa: N802 - the http.server API
        self._send({"data": [{"id": "scripted", "max_model_len": 8192}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, dict(self.headers), body))
        ids = scripted_reply(self.tok, body["prompt"])
        self._send(
            {
                "choices": [
                    {
                        "token_ids": ids,
                        "logprobs": {"token_logprobs": [0.0] * len(ids)},
                        "finish_reason": "stop",
                    }
                ]
            }
        )

    def log_message(self, *args):
        pass


@pytest.fixture
def completions(tok):
    _Completions.tok = tok
    _Completions.requests = []
    server = HTTPServer(("127.0.0.1", 0), _Completions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_agent_api_tokens_goes_through_the_http_backend(tmp_path, tok, completions, monkeypatch):
    """``agent.api = "tokens"``: the factory's settings alone reach a ``/v1/completions``
    server with prompt ids; the tokenizer comes from ``agent.tokenizer``, its format detected."""
    monkeypatch.setenv("ETUDE_TEST_KEY", "sk-test")
    tok.save(tmp_path / "model")
    miner = _miner(write_mini_repo(tmp_path / "repo"))
    cfg = AgentDeleterConfig(
        enabled=True,
        api="tokens",
        base_url=completions,
        tokenizer=str(tmp_path / "model"),
        api_key_env="ETUDE_TEST_KEY",
    )
    features, _ = propose_with_agent(miner, cfg, PROPOSALS)
    assert [f.symbols for f in features] == EXPECTED
    path, headers, body = _Completions.requests[0]
    assert path == "/v1/completions" and headers["Authorization"] == "Bearer sk-test"
    assert body["model"] == "scripted" and isinstance(body["prompt"][0], int)
    assert tok.im_end_id in body["stop_token_ids"]


def test_tokens_settings_are_checked():
    with pytest.raises(ValueError, match="agent.tokenizer"):
        AgentDeleterConfig(enabled=True, api="tokens")
    with pytest.raises(ValueError, match="agent.api"):
        AgentDeleterConfig(api="text")  # type: ignore[arg-type]
    assert AgentDeleterConfig(enabled=True, api="tokens", tokenizer="m").model == ""
