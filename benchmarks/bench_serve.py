"""Serving figures: continuous batching vs per-group batching, and a loopback load test of
``etude serve`` with mixed tiers.

Run: ``.venv/bin/python benchmarks/bench_serve.py`` (about 3-5 minutes on 2 loaded cores;
writes benchmarks/results/bench_serve.json).

Part 1, engine throughput on a rollout workload: the first-turn prompts of 8 groups x 4 samples
of the demo's kind of episode (the bundled handwritten tasks, cycled; each prompt is the tool
declarations + the task, about 2,200 tokens with the demo tokenizer), one sampled assistant turn
each (temperature 1, up to 96 tokens, stop at ``<|im_end|>``), on the demo's model shape with
random weights. Modes, interleaved and repeated (median of the repeats):

- ``per_group``: what rollouts did before continuous batching: one engine call per group, the
  batch is the group's 4 samples, every prompt prefilled from scratch;
- ``per_group_shared``: the same calls with prefix sharing on (the 4 samples share a prompt);
- ``continuous_no_sharing``: one call for all 32 episodes, prefix sharing off (batching alone);
- ``continuous``: one call for all 32, prefix sharing on (what ``collect_rollouts`` does now).

``continuous_over_per_group`` = continuous / per_group generated tokens per second.

Part 2, loopback load test: ``etude serve`` in a subprocess on 127.0.0.1 (max batch 8, the
default scheduling: fast admitted first and preempting standard) and 200 requests from 16
client threads (so requests queue), every fourth one fast, the rest standard, prompts of 16-128 random token ids, 16-48 new tokens; every request has a 120 s
timeout and the run stops by itself. Reported: lost requests (no 200 with usage), p50/p90
latency per tier, and whether the ledger's token sums equal the sums of the responses' usage.
The random-weight model hits ``max_tokens`` on nearly every request, so the tiers differ by
scheduling only.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from etude.config import to_dict
from etude.engine import Engine, SamplingParams
from etude.engine.engine import derive_seed
from etude.env.coding import EnvConfig
from etude.env.pool import EnvPool
from etude.model.config import ModelConfig
from etude.model.tokenizer import train_default_tokenizer
from etude.model.transformer import build_model
from etude.parallel.checkpoint import export_safetensors
from etude.tasks.record import load_tasks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_serve.json"
TASKS = ROOT / "examples" / "tasks" / "handwritten"
GROUPS, SAMPLES, NEW_TOKENS, REPEATS = 8, 4, 96, 3
LOAD_REQUESTS, LOAD_CLIENTS = 200, 16


def demo_model(vocab: int):
    cfg = ModelConfig.preset(
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
        max_seq_len=3072,
    )
    return cfg, build_model(cfg, seed=0)


def rollout_prompts(tok) -> list[list[int]]:
    tasks = load_tasks(TASKS / "tasks.jsonl")
    with tempfile.TemporaryDirectory() as work:
        env_cfg = EnvConfig(max_tokens=3072, work_dir=work)
        with EnvPool(env_cfg, tokenizer=tok, base_dir=TASKS, max_workers=2) as pool:
            envs = [
                pool.make_env(tasks[g % len(tasks)]) for g in range(GROUPS) for _ in range(SAMPLES)
            ]
            pool.reset_many(envs)
            return [list(env.prompt_ids) for env in envs]


def throughput(model, tok, prompts) -> dict[str, float]:
    params = [
        SamplingParams(
            max_new_tokens=NEW_TOKENS,
            temperature=1.0,
            stop_token_ids=(tok.im_end_id,),
            seed=derive_seed(7, k),
        )
        for k in range(len(prompts))
    ]
    modes = {
        "per_group": (dict(max_batch_size=SAMPLES, min_shared_prefix=0), True),
        "per_group_shared": (dict(max_batch_size=SAMPLES), True),
        "continuous_no_sharing": (dict(max_batch_size=len(prompts), min_shared_prefix=0), False),
        "continuous": (dict(max_batch_size=len(prompts)), False),
    }
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(REPEATS):
        for mode, (settings, per_group) in modes.items():
            engine = Engine(model, decode_fn=tok.decode, **settings)
            start = time.perf_counter()
            if per_group:
                gens = []
                for g in range(GROUPS):
                    rows = slice(g * SAMPLES, (g + 1) * SAMPLES)
                    gens += engine.generate(prompts[rows], params[rows])
            else:
                gens = engine.generate(prompts, params)
            seconds = time.perf_counter() - start
            rates[mode].append(sum(len(g.token_ids) for g in gens) / seconds)
    return {m: statistics.median(v) for m, v in rates.items()}


class ServerProcess:
    def __init__(self, run_dir: Path, keys: Path, ledger: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "etude", "serve", str(run_dir), "--name", "bench",
             "--port", str(self.port), "--api-keys", str(keys), "--ledger", str(ledger),
             "--max-batch-size", "8"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        import httpx

        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("etude serve did not come up within 120 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def load_test(cfg, model, tok, work: Path) -> dict[str, float]:
    import httpx

    run_dir = work / "run"
    export_safetensors(model, run_dir / "export", to_dict(cfg))
    tok.save(run_dir / "tokenizer")
    keys = work / "keys.txt"
    keys.write_text("bench:bench-secret-0001\n")
    ledger = work / "usage.sqlite"
    server = ServerProcess(run_dir, keys, ledger)
    rng = random.Random(0)
    jobs = [
        {
            "model": "bench",
            "prompt": [rng.randrange(10, tok.vocab_size) for _ in range(rng.randint(16, 128))],
            "max_tokens": rng.randint(16, 48),
            "temperature": 1.0,
            "seed": i,
            "tier": "fast" if i % 4 == 0 else "standard",
        }
        for i in range(LOAD_REQUESTS)
    ]
    client = httpx.Client(
        base_url=server.url,
        headers={"Authorization": "Bearer bench-secret-0001"},
        timeout=120,
        limits=httpx.Limits(max_connections=LOAD_CLIENTS),
    )

    def send(body):
        start = time.perf_counter()
        try:
            r = client.post("/v1/completions", json=body)
            data = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        return body["tier"], time.perf_counter() - start, data

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(LOAD_CLIENTS) as pool:
            results = list(pool.map(send, jobs))
        wall = time.perf_counter() - start
        metrics = client.get("/metrics").text
    finally:
        client.close()
        server.stop()
    ok = [(tier, sec, data) for tier, sec, data in results if data and "usage" in data]
    latency = {t: sorted(sec for tier, sec, _ in ok if tier == t) for t in ("fast", "standard")}
    db = sqlite3.connect(ledger)
    ledger_prompt, ledger_completion, rows = db.execute(
        "SELECT SUM(prompt_tokens), SUM(completion_tokens), COUNT(*) FROM usage"
    ).fetchone()
    db.close()
    reported_prompt = sum(d["usage"]["prompt_tokens"] for _, _, d in ok)
    reported_completion = sum(d["usage"]["completion_tokens"] for _, _, d in ok)
    preemptions = next(
        (
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("etude_preemptions ")
        ),
        0.0,
    )

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    fast_p50, standard_p50 = pct(latency["fast"], 0.5), pct(latency["standard"], 0.5)
    return {
        "load_requests": LOAD_REQUESTS,
        "load_clients": LOAD_CLIENTS,
        "lost_requests": LOAD_REQUESTS - len(ok),
        "load_seconds": wall,
        "load_generated_tokens_per_s": reported_completion / wall,
        "fast_p50_s": fast_p50,
        "fast_p90_s": pct(latency["fast"], 0.9),
        "standard_p50_s": standard_p50,
        "standard_p90_s": pct(latency["standard"], 0.9),
        "fast_p50_over_standard_p50": fast_p50 / standard_p50,
        "ledger_rows": rows,
        "ledger_tokens_match": int(
            (ledger_prompt, ledger_completion, rows)
            == (reported_prompt, reported_completion, len(ok))
        ),
        "preemptions": preemptions,
    }


def main() -> None:
    torch.set_num_threads(1)
    tok = train_default_tokenizer(2048)
    cfg, model = demo_model(tok.vocab_size)
    prompts = rollout_prompts(tok)
    rates = throughput(model, tok, prompts)
    results: dict[str, float] = {f"{m}_tokens_per_s": v for m, v in rates.items()}
    results["continuous_over_per_group"] = rates["continuous"] / rates["per_group"]
    results["continuous_no_sharing_over_per_group"] = (
        rates["continuous_no_sharing"] / rates["per_group"]
    )
    results["continuous_over_per_group_shared"] = rates["continuous"] / rates["per_group_shared"]
    results["mean_prompt_tokens"] = sum(map(len, prompts)) / len(prompts)
    with tempfile.TemporaryDirectory() as work:
        results.update(load_test(cfg, model, tok, Path(work)))
    print(f"{'engine mode':<24} {'tokens/s':>10}")
    for mode, rate in rates.items():
        print(f"{mode:<24} {rate:>10.0f}")
    print()
    for key, value in results.items():
        print(f"{key:<40} {value:>12.4g}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
