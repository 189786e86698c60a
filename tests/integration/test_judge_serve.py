"""The judge through ``etude serve``: the inference backend protocol over real HTTP.

A tiny random model is served on 127.0.0.1 by ``etude serve`` in a subprocess; the monitor's
judge (``transport = "backend"``) renders the rubric and the episode with the served model's
tokenizer, sends token ids through ``HTTPBackend`` and parses what comes back. A random model
writes no verdict, so the answer must be "unavailable" (a severity-0 flag), never "clean"; a
server that is gone is unavailable too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from etude.config import to_dict
from etude.env.trajectory import read_jsonl
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.monitor.judge import JudgeConfig, judge_many, verdict_flags
from etude.parallel.checkpoint import export_safetensors

CORPUS = Path(__file__).parents[1] / "assets" / "monitor_provenance"
KEY = "secret-monitor-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge-serve")
    tok = Tokenizer.train(default_corpus(50_000), 400)
    cfg = ModelConfig.preset("micro", vocab_size=tok.vocab_size, max_seq_len=16384)  # fmt: skip
    export_safetensors(build_model(cfg, seed=0), root / "run" / "export", to_dict(cfg))
    tok.save(root / "run" / "tokenizer")
    (root / "keys.txt").write_text(f"monitor:{KEY}\n")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "etude", "serve", str(root / "run"), "--name", "judge",
         "--port", str(port), "--ledger", str(root / "ledger.sqlite"),
         "--api-keys", str(root / "keys.txt")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read().decode())
    else:
        proc.kill()
        raise RuntimeError("etude serve did not come up")
    yield url, root / "run" / "tokenizer"
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.stdout.close()


def test_judge_reaches_etude_serve_and_never_reads_noise_as_clean(served, monkeypatch):
    url, tokenizer = served
    monkeypatch.setenv("JUDGE_KEY", KEY)
    (traj,) = [t for t in read_jsonl(CORPUS / "hacks.jsonl") if t.info["case"] == "git_log_base64"]
    cfg = JudgeConfig(
        enabled=True, url=url + "/v1", model="judge", transport="backend", api_key_env="JUDGE_KEY",
        tokenizer=str(tokenizer), max_tokens=24, max_chars=3000, timeout_s=60,
    )  # fmt: skip
    (verdict,) = judge_many([traj], cfg)
    # the request went through and a generation came back: a random model writes no verdict
    assert verdict.status == "unavailable"
    assert "no JSON verdict" in verdict.error, verdict.error
    assert [f.severity for f in verdict_flags(verdict, cfg)] == [0]
    gone = JudgeConfig(
        enabled=True, url=f"http://127.0.0.1:{free_port()}", model="judge", transport="backend",
        tokenizer=str(tokenizer), timeout_s=5,
    )  # fmt: skip
    (down,) = judge_many([traj], gone)
    assert down.status == "unavailable"
