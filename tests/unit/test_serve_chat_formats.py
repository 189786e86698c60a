"""`etude serve`'s chat endpoint in an imported model's own format: the tiny checkpoints of
``test_env_chat_formats`` (Kimi K2, DeepSeek-V3, Qwen/Hermes) are served; an OpenAI chat request
renders to the family template's tokenization, a reply in the family's call syntax comes back
as OpenAI ``tool_calls``, and a request through the HTTP app stops at the family's end id."""

from __future__ import annotations

import dataclasses
import json

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from test_env_chat_formats import (  # noqa: E402, F401
    END,
    assistant_text,
    end_id,
    imported,
)

from etude.model.transformer import build_model  # noqa: E402
from etude.serve.app import ServeConfig, build_app  # noqa: E402
from etude.serve.chat import parse_reply, render_chat  # noqa: E402
from etude.serve.loading import load_served  # noqa: E402
from etude.serve.metering import default_tiers  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {"name": "run_tests", "description": "Run the tests.", "parameters": {}},
    },
]


def kimi_call(name: str, index: int, arguments: str) -> dict:
    return {
        "id": f"functions.{name}:{index}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


MESSAGES = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "tests fail; fix add."},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            kimi_call("read_file", 0, '{"path": "pkg/core.py"}'),
            kimi_call("run_tests", 1, "{}"),
        ],
    },
    {"role": "tool", "tool_call_id": "functions.read_file:0", "content": "def add(a, b): ..."},
    {"role": "tool", "tool_call_id": "functions.run_tests:1", "content": "1 failed"},
]


@pytest.fixture(scope="module")
def served(imported):  # noqa: F811
    name, out, _, hf_tok = imported
    return name, load_served(out), hf_tok


def test_the_import_serves_in_its_format(served):
    name, srv, hf_tok = served
    assert srv.chat_format == name
    assert srv.stop_token_ids == (end_id(name, srv.tokenizer),)
    prompt = render_chat(srv.tokenizer, MESSAGES, TOOLS, srv.chat_format)
    want = hf_tok.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert prompt == hf_tok(want, add_special_tokens=False)["input_ids"]


def test_reply_calls_come_back_in_openai_form(served):
    name, srv, hf_tok = served
    reply = {
        "role": "assistant",
        "content": "Running.",
        "tool_calls": [kimi_call("run_tests", 0, '{"path": "tests"}')],
    }
    text = assistant_text(name, hf_tok, MESSAGES, reply)
    ids = hf_tok(text + END[name].removesuffix("\n"), add_special_tokens=False)["input_ids"]
    content, calls = parse_reply(srv.decode, srv.stop_token_ids[0], ids, srv.chat_format)
    assert content == "Running."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("run_tests", {"path": "tests"})
    ]
    if name == "kimi_k2":  # the family's own id, which the client sends back with the result
        assert calls[0]["id"] == "functions.run_tests:0"


def test_chat_endpoint_stops_at_the_family_end_of_turn(served, tmp_path):
    name, srv, _ = served
    end = srv.stop_token_ids[0]
    # the tiny configs hold 128 positions; the prompt with its tool declaration needs more
    model = build_model(dataclasses.replace(srv.model.cfg, max_seq_len=4096), seed=0)
    model.load_state_dict(srv.model.state_dict())
    srv = dataclasses.replace(srv, model=model.eval())
    with torch.no_grad():  # the model ends its turn at once (as in test_env_chat_formats)
        srv.model.tok_embeddings.weight[:, 0] = 1000.0
        srv.model.output.weight.zero_()
        srv.model.output.weight[end, 0] = 10.0
    cfg = ServeConfig(
        api_keys=None,
        ledger_path=str(tmp_path / "usage.sqlite"),
        tiers=default_tiers(),
        max_seq_len=4096,
    )
    with TestClient(build_app(srv, cfg)) as client:
        body = {"model": srv.name, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == [end] and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": ""}
    prompt = render_chat(srv.tokenizer, MESSAGES, TOOLS, srv.chat_format)
    assert response.json()["usage"]["prompt_tokens"] == len(prompt)
