"""etude serve end to end: a real uvicorn server on 127.0.0.1 in a subprocess.

HTTP rollouts equal in-process ones; keys are enforced; bad input gets clear errors while the
server keeps serving; a weight reload changes the served logits and the version; a client that
disconnects leaves nothing running; kill -9 loses no ledger row a response reported.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from etude.config import to_dict
from etude.engine import Engine, SamplingParams
from etude.engine.backends import EngineBackend, GenerationRequest, HTTPBackend, HTTPBackendConfig
from etude.env.coding import EnvConfig
from etude.env.pool import EnvPool
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.parallel.checkpoint import export_safetensors
from etude.rl.rollout import RolloutConfig, collect_rollouts
from etude.tasks.record import load_tasks

TASKS = Path(__file__).parents[2] / "examples" / "tasks" / "handwritten"
KEY = "secret-alice-123"


def model_config(vocab: int) -> ModelConfig:
    return ModelConfig.preset("micro", vocab_size=vocab, max_seq_len=4096)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    tok = Tokenizer.train(default_corpus(200_000), 512)
    cfg = model_config(tok.vocab_size)
    export_safetensors(build_model(cfg, seed=0), root / "run" / "export", to_dict(cfg))
    tok.save(root / "run" / "tokenizer")
    # a second checkpoint for the reload test
    export_safetensors(build_model(cfg, seed=1), root / "other" / "export", to_dict(cfg))
    (root / "keys.txt").write_text(f"# test keys\nalice:{KEY}\nbob:secret-bob-4567\n")
    return root


def load_local(run_dir: Path, which: str = "run"):
    from etude.serve.loading import load_served

    return load_served(run_dir / which, name="run")


class Server:
    def __init__(self, root: Path, name: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.ledger = root / f"{name}.sqlite"
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "etude", "serve", str(root / "run"), "--name", "run",
             "--port", str(self.port), "--api-keys", str(root / "keys.txt"),
             "--ledger", str(self.ledger), "--max-batch-size", "8"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stdout.read().decode())
        else:
            raise RuntimeError("etude serve did not come up")
        self.client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
        )

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return self.client.post(path, json=body, **kw)

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def server(run_dir):
    srv = Server(run_dir, "main")
    yield srv
    srv.stop()


def test_refused_keys(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong-key-0000"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and "invalid or missing API key" in r.json()["error"]["message"]
    assert server.post("/v1/completions", body).status_code == 200


def test_bad_input_gets_clear_errors_and_the_server_keeps_serving(server):
    r = server.client.post(
        "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    cases = [
        ({"model": "gpt-9", "prompt": [1]}, 404, "is not served here"),
        ({"prompt": [1] * 4096}, 400, "the context length is 4096"),
        ({"prompt": [1, 2], "max_tokens": 5000}, 400, "too many tokens"),
        ({"prompt": [1, 99999]}, 400, "outside [0,"),
        ({"prompt": [1], "temperature": -1}, 400, "sampling.temperature must be >= 0"),
        ({"prompt": [1], "tier": "turbo"}, 400, "tier 'turbo' is unknown"),
        ({"prompt": [1], "service_tier": "gold"}, 400, "service_tier 'gold' is unknown"),
        ({"prompt": [1], "n": 2}, 400, "n must be 1"),
        ({"prompt": []}, 400, "non-empty list of token ids"),
    ]
    for body, status, message in cases:
        r = server.post("/v1/completions", body)
        assert r.status_code == status and message in r.json()["error"]["message"], (body, r.text)
    ok = server.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3
    assert ok.json()["usage"]["tier"] == "fast"  # the default tier
    flex = server.post("/v1/completions", {"prompt": [5], "max_tokens": 1, "service_tier": "flex"})
    assert flex.json()["usage"]["tier"] == "standard"


def test_completion_tokens_logprobs_usage_and_ledger(server, run_dir):
    served = load_local(run_dir)
    engine = Engine(served.model, decode_fn=served.decode)
    prompt = served.tokenizer.encode("def add(a, b):\n    return")
    want = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0))[0]
    r = server.post(
        "/v1/completions",
        {
            "model": "run",
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": 0,
            "tier": "standard",
        },
    )
    data = r.json()
    choice = data["choices"][0]
    assert choice["token_ids"] == want.token_ids
    torch.testing.assert_close(
        torch.tensor(choice["logprobs"]["token_logprobs"]),
        torch.tensor(want.logprobs),
        atol=1e-5,
        rtol=0,
    )
    usage = data["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 12)
    assert usage["tier"] == "standard"
    from decimal import Decimal

    assert (
        Decimal(usage["cost"]["total_usd"])
        == (len(prompt) * Decimal("0.50") + 12 * Decimal("2.50")) / 10**6
    )
    db = sqlite3.connect(server.ledger)
    row = db.execute(
        "SELECT api_key, tier, prompt_tokens, completion_tokens, cost_usd FROM usage WHERE request_id=?",
        (data["id"],),
    ).fetchone()
    assert row == ("alice", "standard", len(prompt), 12, usage["cost"]["total_usd"])
    models = server.client.get("/v1/models").json()["data"]
    assert models[0]["id"] == "run" and models[0]["max_model_len"] == 4096
    metrics = server.client.get("/metrics").text
    assert "etude_requests_total" in metrics and "etude_running_requests" in metrics


def test_http_rollouts_equal_in_process_rollouts(server, run_dir, tmp_path):
    served = load_local(run_dir)
    tok = served.tokenizer
    tasks = load_tasks(TASKS / "tasks.jsonl")[:1]
    env_cfg = EnvConfig(max_turns=2, max_tokens=4000, work_dir=str(tmp_path))
    cfg = RolloutConfig(tasks_per_step=1, group_size=2, max_new_tokens=12, num_workers=2)
    local = EngineBackend(Engine(served.model, max_seq_len=4000, decode_fn=tok.decode))
    remote = HTTPBackend(HTTPBackendConfig(url=server.url + "/v1", api_key=KEY, tier="standard"))
    with EnvPool(env_cfg, tokenizer=tok, base_dir=TASKS, max_workers=2) as pool:
        a, _ = collect_rollouts(local, pool, tasks, cfg, seed=3, step=1)
        b, _ = collect_rollouts(remote, pool, tasks, cfg, seed=3, step=1)
        envs = [pool.make_env(t) for t in load_tasks(TASKS / "tasks.jsonl")[:2]]
        pool.reset_many(envs)
        prompts = [list(e.prompt_ids) for e in envs]
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        lx = [v for t in x.turns for v in t.logprobs]
        ly = [v for t in y.turns for v in t.logprobs]
        torch.testing.assert_close(torch.tensor(lx), torch.tensor(ly), atol=1e-5, rtol=0)
    # greedy: the same ids and logprobs from both backends
    greedy = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(tok.im_end_id,))
    requests = [
        GenerationRequest(prompt_ids=p, params=greedy, session_id=f"s{i}")
        for i, p in enumerate(prompts)
    ]
    for x, y in zip(local.generate(requests), remote.generate(requests)):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0
        )
    remote.close()


def test_chat_completion_renders_messages_and_returns_a_message(server):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "run_tests",
                "description": "run",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You fix code."},
        {"role": "user", "content": "Fix it."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "run_tests", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1 failed"},
    ]
    r = server.post("/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 8})
    data = r.json()
    assert r.status_code == 200 and data["choices"][0]["message"]["role"] == "assistant"
    assert data["usage"]["tier"] == "fast" and data["usage"]["completion_tokens"] >= 1
    bad = server.post("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert bad.status_code == 400 and "role='wizard'" in bad.json()["error"]["message"]


def test_disconnecting_client_leaves_no_stuck_request(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True, "temperature": 1.0}
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            first = next(r.iter_lines())
            assert first.startswith("data: ")
            request_id = json.loads(first[6:])["id"]
    deadline = time.time() + 30
    while time.time() < deadline:
        health = server.client.get("/health").json()
        if health["running"] == 0 and health["waiting"] == 0:
            break
        time.sleep(0.1)
    assert health["running"] == 0 and health["waiting"] == 0
    ok = server.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert ok.status_code == 200
    deadline = time.time() + 10
    row = None
    while row is None and time.time() < deadline:
        row = (
            sqlite3.connect(server.ledger)
            .execute("SELECT status FROM usage WHERE request_id=?", (request_id,))
            .fetchone()
        )
        time.sleep(0.1)
    assert row == ("disconnected",)


def _wait_idle(server) -> dict:
    deadline = time.time() + 30
    while time.time() < deadline:
        health = server.client.get("/health").json()
        if health["running"] == 0 and health["waiting"] == 0:
            return health
        time.sleep(0.1)
    return health


def test_non_streaming_client_that_hangs_up_is_aborted(server):
    body = json.dumps({"prompt": [8, 9], "max_tokens": 3000, "tier": "standard"}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = sqlite3.connect(server.ledger).execute("SELECT COUNT(*) FROM usage").fetchone()[0]
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(head + body)
        deadline = time.time() + 10
        while server.client.get("/health").json()["running"] == 0 and time.time() < deadline:
            time.sleep(0.05)
    health = _wait_idle(server)
    assert health["running"] == 0 and health["waiting"] == 0 and health["engine_alive"]
    deadline = time.time() + 10
    rows = []
    while not rows and time.time() < deadline:
        rows = (
            sqlite3.connect(server.ledger)
            .execute(
                "SELECT status, completion_tokens FROM usage ORDER BY id LIMIT -1 OFFSET ?",
                (before,),
            )
            .fetchall()
        )
        time.sleep(0.1)
    assert rows and rows[0][0] == "disconnected" and rows[0][1] < 3000


def test_weight_reload_serves_the_new_checkpoint_and_kill_9_keeps_every_reported_row(run_dir):
    srv = Server(run_dir, "reload")
    try:
        other = load_local(run_dir, "other")
        prompt = [11, 12, 13, 14]
        want = Engine(other.model).generate(
            [prompt], SamplingParams(max_new_tokens=8, temperature=0)
        )[0]
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0}
        before = srv.post("/v1/completions", body).json()
        assert before["policy_version"] == 0
        bad = srv.post("/v1/weights/reload", {"path": str(run_dir / "nowhere"), "version": 2})
        assert bad.status_code == 400 and "no weights at" in bad.json()["error"]["message"]
        r = srv.post("/v1/weights/reload", {"path": str(run_dir / "other"), "version": 2})
        assert r.status_code == 200 and r.json()["policy_version"] == 2
        after = srv.post("/v1/completions", body).json()
        assert after["policy_version"] == 2
        assert (
            after["choices"][0]["token_ids"] == want.token_ids != before["choices"][0]["token_ids"]
        )
        torch.testing.assert_close(
            torch.tensor(after["choices"][0]["logprobs"]["token_logprobs"]),
            torch.tensor(want.logprobs),
            atol=1e-5,
            rtol=0,
        )
        assert srv.client.get("/v1/models").json()["data"][0]["policy_version"] == 2
        # every response a client saw has its ledger row, even after SIGKILL
        seen = {before["id"]: before["usage"], after["id"]: after["usage"]}
        for i in range(6):
            data = srv.post(
                "/v1/completions",
                {"prompt": [3, i + 1], "max_tokens": 4, "tier": ["fast", "standard"][i % 2]},
            ).json()
            seen[data["id"]] = data["usage"]
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(timeout=30)
        db = sqlite3.connect(srv.ledger)
        rows = dict(
            (rid, (p, c))
            for rid, p, c in db.execute(
                "SELECT request_id, prompt_tokens, completion_tokens FROM usage"
            )
        )
        for rid, usage in seen.items():
            assert rows[rid] == (usage["prompt_tokens"], usage["completion_tokens"])
        out = subprocess.run(
            [sys.executable, "-m", "etude", "serve", "usage", "--ledger", str(srv.ledger)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert "alice" in out.stdout and "total" in out.stdout
    finally:
        srv.stop()
