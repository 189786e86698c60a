"""Engine decode speed against a no-cache recompute loop, and forward FLOP/s utilization.

Run: ``.venv/bin/python benchmarks/bench_engine.py`` (writes benchmarks/results/bench_engine.json).

Both generators run greedy decoding of the same prompts with the same tiny MoE model in the same
process, so their ratio is meaningful on a noisy machine. The recompute baseline runs a full
forward over prompt + generated tokens for every new token (what generation costs without a KV
cache). Model FLOPs per forward use the usual dense estimate: 2 * active matmul parameters per
token (embedding lookups excluded, the lm head included) plus 4 * T^2 * H * Dh per layer for
causal attention scores and values (half of the full 8 * T^2 * H * Dh); they are divided by
this machine's measured fp32 matmul FLOP/s (a 1024^3 matmul).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from etude.engine import Engine, SamplingParams
from etude.model.config import ModelConfig
from etude.model.info import count_params
from etude.model.transformer import build_model

RESULTS = Path(__file__).parent / "results" / "bench_engine.json"


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_flops_per_s(n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n**3 / best_of(lambda: a @ b, repeats=5)


def recompute_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding with a full forward per token (equal-length prompts, no cache)."""
    seqs = torch.tensor(prompts)
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits = model(seqs)[:, -1]
            seqs = torch.cat([seqs, logits.argmax(-1, keepdim=True)], dim=1)
    return seqs[:, len(prompts[0]) :].tolist()


def forward_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    counts = count_params(cfg)
    matmul_params = (
        counts["active"] - counts["active_by_part"]["embedding"] - counts["active_by_part"]["norm"]
    )
    attn = 4 * seq * seq * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return batch * (2 * matmul_params * seq + attn)


def main() -> dict[str, float]:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, seed=0).eval()
    batch, prompt_len, new_tokens = 8, 64, 64
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).tolist()
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)

    cached = engine.generate(prompts, params)
    baseline = recompute_generate(model, prompts, new_tokens)
    agree = sum(a.token_ids == b for a, b in zip(cached, baseline)) / batch

    t_engine = best_of(lambda: engine.generate(prompts, params))
    t_recompute = best_of(lambda: recompute_generate(model, prompts, new_tokens))
    engine_tps = batch * new_tokens / t_engine
    recompute_tps = batch * new_tokens / t_recompute

    seq = 256
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    with torch.inference_mode():
        model(tokens)
        t_fwd = best_of(lambda: model(tokens))
    model_flops = forward_flops(cfg, batch, seq) / t_fwd
    peak = matmul_flops_per_s()

    results = {
        "engine_decode_tok_per_s": engine_tps,
        "recompute_decode_tok_per_s": recompute_tps,
        "engine_speedup_vs_recompute": engine_tps / recompute_tps,
        "greedy_agreement": agree,
        "forward_gflop_per_s": model_flops / 1e9,
        "matmul_gflop_per_s": peak / 1e9,
        "forward_fraction_of_matmul": model_flops / peak,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "forward_seq_len": seq,
        "threads": torch.get_num_threads(),
    }
    print(f"{'measure':<34}{'value':>14}")
    print("-" * 48)
    for key in (
        "engine_decode_tok_per_s",
        "recompute_decode_tok_per_s",
        "engine_speedup_vs_recompute",
        "greedy_agreement",
        "forward_gflop_per_s",
        "matmul_gflop_per_s",
        "forward_fraction_of_matmul",
    ):
        print(f"{key:<34}{results[key]:>14.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return results


if __name__ == "__main__":
    main()
