"""Rollouts through a real ``etude serve`` that stops answering: the episodes whose requests got
no answer are infrastructure failures (reward None, masked, never 0) and the step completes.

Two faults: a proxy in front of the server that never answers one sample's requests (the other
episodes must be exactly those of a run without the fault), and the server process itself
stopped with SIGSTOP once the step's episodes are reset (alive, accepting connections, never
answering). Without the masking, both raised out of ``collect_rollouts`` and failed the step."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from etude.config import to_dict
from etude.engine.backends import HTTPBackend, HTTPBackendConfig
from etude.env.coding import EnvConfig
from etude.env.pool import EnvPool
from etude.env.trajectory import is_infra_failure
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.parallel.checkpoint import export_safetensors
from etude.rl.rollout import RolloutConfig, collect_rollouts
from etude.rl.server_process import ServerProcess
from etude.tasks.record import load_tasks

TASKS = Path(__file__).parents[2] / "examples" / "tasks" / "handwritten"
CFG = RolloutConfig(tasks_per_step=2, group_size=2, max_new_tokens=8, num_workers=2)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


@pytest.fixture(scope="module")
def server(tok: Tokenizer, tmp_path_factory) -> Iterator[ServerProcess]:
    cfg = ModelConfig.preset(
        "tiny",
        vocab_size=tok.vocab_size,
        dim=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        expert_ffn_dim=32,
        dense_ffn_dim=64,
        max_seq_len=4096,
    )
    run = tmp_path_factory.mktemp("run")
    export_safetensors(build_model(cfg, seed=0), run / "export", to_dict(cfg))
    tok.save(run / "tokenizer")
    with ServerProcess(run, log_path=run / "serve.log") as process:
        yield process


class SilentForOneSample(BaseHTTPRequestHandler):
    """Forwards to the server, except completions of sample 1's episodes: never answered."""

    upstream = ""
    release = threading.Event()

    def _forward(self, body: bytes | None) -> None:
        request = urllib.request.Request(
            self.upstream + self.path, data=body, method=self.command, headers=self.headers
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            data = response.read()
            self.send_response(response.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def do_GET(self) -> None:
        self._forward(None)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if str(json.loads(body).get("session_id", "")).endswith("-sample1"):
            self.release.wait()  # hold the connection, answer nothing
            return
        self._forward(body)

    def log_message(self, *args: object) -> None:
        pass


def rollout(backend: HTTPBackend, tok: Tokenizer, tmp_path: Path) -> list:
    tmp_path.mkdir(exist_ok=True)
    env_cfg = EnvConfig(max_turns=2, max_tokens=4000, work_dir=str(tmp_path))
    tasks = load_tasks(TASKS / "tasks.jsonl")[:2]
    try:
        with EnvPool(env_cfg, tokenizer=tok, base_dir=TASKS, max_workers=2) as pool:
            trajectories, _ = collect_rollouts(backend, pool, tasks, CFG, seed=4, step=0)
    finally:
        backend.close()
    return trajectories


def backend_config(url: str) -> HTTPBackendConfig:
    # a short timeout and no retry: a silent server is found out in two seconds
    return HTTPBackendConfig(url=url, timeout=2.0, max_retries=0)


class StoppedWhenAsked(HTTPBackend):
    """The real backend; the server process is stopped (SIGSTOP) just before the step's first
    generation: the episodes are reset and the server has answered ``/v1/models``."""

    def __init__(self, cfg: HTTPBackendConfig, server_pid: int) -> None:
        super().__init__(cfg)
        self.server_pid = server_pid
        self.calls = 0

    def generate(self, requests):
        if self.calls == 0:
            os.kill(self.server_pid, signal.SIGSTOP)  # alive, accepts, never answers
        self.calls += 1
        return super().generate(requests)


def summary(trajectories) -> list[tuple]:
    return [(t.task_id, t.token_ids, t.reward, t.tests) for t in trajectories]


def check_masked(trajectory) -> None:
    """An infrastructure failure: no reward (not 0), the reason recorded."""
    assert is_infra_failure(trajectory) and trajectory.reward is None
    assert trajectory.info["grade"]["status"] == "infra"
    assert "inference server did not answer" in trajectory.info["infra"]


def test_requests_the_server_never_answers_mask_their_episodes_only(server, tok, tmp_path):
    reference = rollout(HTTPBackend(backend_config(server.url)), tok, tmp_path / "a")
    assert all(t.reward is not None for t in reference)

    SilentForOneSample.upstream = server.url
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), SilentForOneSample)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{proxy.server_port}"
        faulty = rollout(HTTPBackend(backend_config(url)), tok, tmp_path / "b")
    finally:
        SilentForOneSample.release.set()
        proxy.shutdown()
    lost = [t for t in faulty if t.info["sample"] == 1]
    kept = [t for t in faulty if t.info["sample"] == 0]
    assert len(lost) == len(kept) == CFG.tasks_per_step
    for trajectory in lost:
        check_masked(trajectory)
        assert not any(m for turn in trajectory.turns for m in turn.trainable)  # no turn taken
    # the other episodes are those of the run without the fault, rewards included
    assert summary(kept) == summary([t for t in reference if t.info["sample"] == 0])


def test_a_stopped_server_masks_the_step_s_episodes_and_the_step_completes(server, tok, tmp_path):
    backend = StoppedWhenAsked(backend_config(server.url), server.proc.pid)
    try:
        trajectories = rollout(backend, tok, tmp_path)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert backend.calls == 1 and len(trajectories) == CFG.tasks_per_step * CFG.group_size
    for trajectory in trajectories:
        check_masked(trajectory)
        assert "failed after 1 tries" in trajectory.info["infra"]  # backend.max_retries=0
