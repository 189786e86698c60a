"""vLLM as a rollout server for an etude model (``make test-vllm``; not part of ``make test``).

An etude MoE model with the demo's shapes is exported as a Hugging Face directory
(``etude model export --format hf``: ``Glm4MoeForCausalLM``) with its tokenizer, served by
vLLM's CPU build from its own environment (``ETUDE_VLLM_PYTHON``, made by ``make test-vllm``),
and the hand-written tasks are rolled out through ``HTTPBackend(dialect="vllm")``. etude's own
forward then scores the same tokens: the largest |logprob difference| goes to
benchmarks/results/vllm_parity.json. Then a second checkpoint is loaded into the running server
through vLLM's development-mode ``/collective_rpc`` (``reload_weights``, then
``/reset_prefix_cache``) and the served logprobs are compared with both checkpoints: recorded,
not asserted (see docs/async-rl.md for what was found).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from etude.config import to_dict
from etude.engine import SamplingParams
from etude.engine.backends import GenerationRequest, HTTPBackend, HTTPBackendConfig
from etude.env.coding import EnvConfig
from etude.env.pool import EnvPool
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.parallel.checkpoint import export_safetensors
from etude.rl.rollout import RolloutConfig, collect_rollouts
from etude.rl.server_process import free_port
from etude.tasks.record import load_tasks

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
TASKS = ROOT / "examples" / "tasks" / "handwritten"
RESULTS = ROOT / "benchmarks" / "results" / "vllm_parity.json"
VLLM_PYTHON = os.environ.get("ETUDE_VLLM_PYTHON", "")


def model_config(vocab: int) -> ModelConfig:
    return ModelConfig.preset(
        "tiny",
        vocab_size=vocab,
        dim=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        dense_ffn_dim=192,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        expert_ffn_dim=64,
        max_seq_len=4096,
    )


def export(model, tok: Tokenizer, root: Path, name: str) -> Path:
    """``etude model export RUN --format hf`` of ``model``, with an HF tokenizer config."""
    run = root / f"run-{name}"
    export_safetensors(model, run / "export", to_dict(model.cfg))
    tok.save(run / "tokenizer")
    hf = root / f"hf-{name}"
    code = subprocess.call(
        [sys.executable, "-m", "etude", "model", "export", str(run), "--format", "hf",
         "--out", str(hf)]
    )  # fmt: skip
    assert code == 0
    if not (hf / "tokenizer_config.json").is_file():
        # etude's tokenizer.json is a `tokenizers` file: transformers wraps it as a fast tokenizer
        (hf / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096})
        )
    return hf


class VLLMServer:
    def __init__(self, hf_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc for the weight reload
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                 "--served-model-name", "policy", "--dtype", "float32", "--max-model-len", "4096",
                 "--host", "127.0.0.1", "--port", str(self.port), "--max-num-seqs", "8",
                 "--enforce-eager", "--compilation-config", '{"mode": 0}',
                 "--logprobs-mode", "processed_logprobs", "--seed", "0",
                 # a seeded request whose prefill is chunked crashes vLLM's CPU worker ("CPU
                 # Generator does not use offset"): prefill whole prompts
                 "--no-enable-chunked-prefill", "--max-num-batched-tokens", "32768"],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("vLLM did not start: " + log.read_text(errors="replace")[-3000:])
            time.sleep(1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def etude_logprobs(model, ids: list[int], trainable: list[int]) -> list[float]:
    """log p(ids[t] | ids[<t]) at each trainable t, from one full forward in fp32."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
    return [float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if trainable[t]]


@pytest.mark.timeout(2400)  # vLLM's start alone took 460 s on a loaded 2-core machine
@pytest.mark.skipif(
    not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(),
    reason="needs vLLM's CPU build in its own environment: run `make test-vllm`",
)
def test_vllm_rollouts_match_etude_logprobs(tmp_path) -> None:
    torch.manual_seed(0)
    tok = Tokenizer.train(default_corpus(200_000), 512)
    cfg = model_config(tok.vocab_size)
    model = build_model(cfg, seed=0).eval()
    other = build_model(cfg, seed=1).eval()
    hf = export(model, tok, tmp_path, "a")
    hf_other = export(other, tok, tmp_path, "b")
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["Glm4MoeForCausalLM"]
    started = time.monotonic()
    server = VLLMServer(hf, tmp_path / "vllm.log")
    startup_s = time.monotonic() - started
    try:
        backend = HTTPBackend(HTTPBackendConfig(url=server.url, dialect="vllm", timeout=600))
        tasks = load_tasks(TASKS / "tasks.jsonl")
        env_cfg = EnvConfig(max_turns=2, max_tokens=4000, work_dir=str(tmp_path))
        rollout_cfg = RolloutConfig(tasks_per_step=3, group_size=2, max_new_tokens=24)
        with EnvPool(env_cfg, tokenizer=tok, base_dir=TASKS, max_workers=2) as pool:
            trajectories, stats = collect_rollouts(
                backend, pool, tasks, rollout_cfg, seed=0, step=0
            )
        diffs, tokens = [], 0
        for traj in trajectories:
            ids = traj.token_ids
            trainable = [m for t in traj.turns for m in t.trainable]
            behavior = [x for t in traj.turns for x in t.logprobs]
            served = [behavior[t] for t in range(1, len(ids)) if trainable[t]]
            local = etude_logprobs(model, ids, trainable)
            diffs += [abs(a - b) for a, b in zip(served, local)]
            tokens += len(served)
        assert tokens > 0 and all(t.reward is not None for t in trajectories)
        max_diff = max(diffs)

        # weights into the running server: vLLM's in-place reload from a checkpoint directory
        prompt = trajectories[0].token_ids[:64]
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
        t0 = time.monotonic()
        response = httpx.post(
            f"{server.url}/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(hf_other)}},
            timeout=600,
        )
        reload_ok = response.status_code == 200
        # KV blocks cached from the old weights would otherwise serve the same prefix again
        reset = httpx.post(f"{server.url}/reset_prefix_cache", timeout=120)
        reload_s = time.monotonic() - t0
        reload_ok = reload_ok and reset.status_code == 200
        reload_diff = reload_diff_old = float("nan")
        if reload_ok:
            out = backend.generate([GenerationRequest(prompt_ids=prompt, params=params)])[0]
            trainable = [0] * len(prompt) + [1] * len(out.token_ids)
            local = etude_logprobs(other, prompt + out.token_ids, trainable)
            reload_diff = max(abs(a - b) for a, b in zip(out.logprobs, local))
            # against the weights it served before: did the reload take effect at all?
            before = etude_logprobs(model, prompt + out.token_ids, trainable)
            reload_diff_old = max(abs(a - b) for a, b in zip(out.logprobs, before))
        backend.close()
    finally:
        server.close()
        print("---- vLLM server log (tail) ----\n" + server.log.read_text(errors="replace")[-4000:])
    results = {
        "vllm_max_abs_logprob_diff": max_diff,
        "vllm_tokens_compared": tokens,
        "vllm_episodes": len(trajectories),
        "vllm_startup_seconds": round(startup_s, 1),
        "vllm_rollout_seconds": round(stats.seconds, 2),
        "vllm_reload_ok": float(reload_ok),
        "vllm_reload_seconds": round(reload_s, 2),
        "vllm_reload_max_abs_logprob_diff": reload_diff,
        "vllm_reload_max_abs_logprob_diff_vs_old_weights": reload_diff_old,
    }
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(results, indent=2))
    assert max_diff < 1e-3, results
    # the reload is reported, not required: on vLLM 0.32's CPU build the dev-mode
    # reload_weights answers 200 but the served logprobs do not become the new checkpoint's
    # (docs/async-rl.md); the rollout parity above is what this test guarantees
    assert reload_ok, response.text[:500]
