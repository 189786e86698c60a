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
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from etude.config import apply_overrides, from_dict, load_toml, to_dict
from etude.engine.backends import HTTPBackend, HTTPBackendConfig
from etude.env.coding import EnvConfig
from etude.env.pool import EnvPool
from etude.env.trajectory import is_infra_failure, read_jsonl
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus, train_default_tokenizer
from etude.model.transformer import build_model
from etude.parallel.checkpoint import export_safetensors
from etude.report.metrics import read_metrics
from etude.rl.rollout import RolloutConfig, collect_rollouts
from etude.rl.server_process import ServerProcess
from etude.rl.trainer import TrainRecipe, run_train
from etude.tasks.record import load_tasks

ROOT = Path(__file__).parents[2]
TASKS = ROOT / "examples" / "tasks" / "handwritten"
CFG = RolloutConfig(tasks_per_step=2, group_size=2, max_new_tokens=8, num_workers=2)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


TINY = {"max_seq_len": 4096}  # the "micro" preset with the episodes' context


def tiny_config(vocab_size: int) -> ModelConfig:
    return ModelConfig.preset("micro", vocab_size=vocab_size, **TINY)


@pytest.fixture(scope="module")
def server(tok: Tokenizer, tmp_path_factory) -> Iterator[ServerProcess]:
    cfg = tiny_config(tok.vocab_size)
    run = tmp_path_factory.mktemp("run")
    export_safetensors(build_model(cfg, seed=0), run / "export", to_dict(cfg))
    tok.save(run / "tokenizer")
    with ServerProcess(run, log_path=run / "serve.log") as process:
        yield process


@contextmanager
def silent_for_one_sample(upstream: str) -> Iterator[str]:
    """The URL of a proxy to ``upstream`` that never answers sample 1's completions."""
    SilentForOneSample.upstream = upstream
    SilentForOneSample.release.clear()
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), SilentForOneSample)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_port}"
    finally:
        SilentForOneSample.release.set()
        proxy.shutdown()


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


def backend_config(url: str, timeout: float) -> HTTPBackendConfig:
    # no retry: a silent server is found out after one timeout, which must still be long
    # enough for the answered requests on a loaded machine
    return HTTPBackendConfig(url=url, timeout=timeout, max_retries=0)


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
    reference = rollout(HTTPBackend(backend_config(server.url, 60.0)), tok, tmp_path / "a")
    assert all(t.reward is not None for t in reference)

    with silent_for_one_sample(server.url) as url:
        faulty = rollout(HTTPBackend(backend_config(url, 8.0)), tok, tmp_path / "b")
    lost = [t for t in faulty if t.info["sample"] == 1]
    kept = [t for t in faulty if t.info["sample"] == 0]
    assert len(lost) == len(kept) == CFG.tasks_per_step
    for trajectory in lost:
        check_masked(trajectory)
        assert not any(m for turn in trajectory.turns for m in turn.trainable)  # no turn taken
    # the other episodes are those of the run without the fault, rewards included
    assert summary(kept) == summary([t for t in reference if t.info["sample"] == 0])


def test_a_stopped_server_masks_the_step_s_episodes_and_the_step_completes(server, tok, tmp_path):
    backend = StoppedWhenAsked(backend_config(server.url, 2.0), server.proc.pid)
    try:
        trajectories = rollout(backend, tok, tmp_path)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert backend.calls == 1 and len(trajectories) == CFG.tasks_per_step * CFG.group_size
    for trajectory in trajectories:
        check_masked(trajectory)
        assert "failed after 1 tries" in trajectory.info["infra"]  # backend.max_retries=0


@pytest.mark.slow  # an RL run through etude serve, waiting out two request timeouts per step
def test_the_trainer_counts_the_lost_episodes_per_step_and_completes(tmp_path) -> None:
    """``etude train`` rolling out through the server behind the proxy: every step completes,
    its metrics count the two lost episodes (``infra/episodes``), and none is scored."""
    tok = train_default_tokenizer(512)
    served = tmp_path / "served"
    export_safetensors(
        build_model(tiny_config(512), seed=0), served / "export", to_dict(tiny_config(512))
    )
    tok.save(served / "tokenizer")
    run = tmp_path / "run"
    tok.save(run / "tokenizer")
    model = {"model.preset": "micro", "model.vocab_size": 512}
    model.update({f"model.{k}": v for k, v in TINY.items()})
    with ServerProcess(served, log_path=tmp_path / "serve.log") as server:
        with silent_for_one_sample(server.url) as url:
            overrides = [
                *(f"{k}={json.dumps(v)}" for k, v in model.items()),
                f"tasks.path='{TASKS / 'tasks.jsonl'}'",
                "tasks.limit=2",
                "tasks.curriculum=false",
                "tasks.repo=''",
                "env.max_turns=2",
                "env.max_tokens=4000",
                "rollout.tasks_per_step=2",
                "rollout.group_size=2",
                "rollout.max_new_tokens=8",
                "rollout.num_workers=2",
                f"rollout.server_url='{url}'",
                "rollout.sync.kind='http'",
                # a weight reload must fit in one request's time on a loaded machine
                "rollout.server_timeout_s=10.0",
                "rollout.server_retries=0",
                "rl.micro_batch_size=2",
                "train.init=''",
                "train.steps=2",
                "train.checkpoint_every=2",
                "train.progress=false",
                f"train.run_dir='{run}'",
            ]
            data = apply_overrides(load_toml(ROOT / "configs" / "rl-tiny.toml"), overrides)
            run_train(from_dict(TrainRecipe, data, "recipe"))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["infra/episodes"] for r in rows] == [2.0, 2.0]
    for path in sorted((run / "trajectories").glob("step_*.jsonl")):
        for trajectory in read_jsonl(path):
            if trajectory.info["sample"] == 1:
                check_masked(trajectory)
            else:
                assert trajectory.reward is not None and not is_infra_failure(trajectory)
