"""Sharded Muon against the naive gather-everything baseline, and Muon against AdamW in pretraining.

Run: ``.venv/bin/python benchmarks/bench_muon.py`` (writes benchmarks/results/bench_muon.json).
Options: ``--world-size 4 --steps 5 --pretrain-steps 100 --seeds 0 1 2 --skip-pretrain``
(``--skip-pretrain`` keeps the previous run's pretrain numbers in the JSON).

Table 1 (CPU, gloo, W processes): the MoE model with expert-heavy shapes scaled down from Kimi K2
(the ``kimi-k2`` preset with dim 7168 -> 256, 64 -> 8 heads of 32, 384 -> 32 experts of width
2048 -> 64, 6 layers, the first dense), sharded by FSDP2, takes Muon steps on synthetic
gradients under two layouts: ``experts_dim0`` (FSDP's default Shard(0): experts and heads lie
whole on their ranks, the output projection, dense and shared FFNs are cut) and ``experts_dim1``
(expert weights sharded on dim 1, as an expert-parallel layout does: every expert is cut).
For each layout, etude's ``ShardedMuon`` and the naive baseline (every rank gathers every full
update with ``full_tensor()`` and runs Newton-Schulz on all blocks) report, per rank: NS FLOPs
(max and max/mean balance), bytes sent, the rank's Muon parameter bytes, and optimizer step
time (median over steps of the slowest rank; the two methods alternate step by step, so load
from other processes hits both alike). Both compute the same update (checked).
Targets: sharded FLOPs per rank <= 1.1 / W of the baseline's, bytes per rank <= 2 (W-1)/W of the
rank's parameter bytes, a faster step.

Table 2: final training loss of ``etude pretrain`` (``etude.pretrain.run_pretrain``) on the tiny
model with Muon and with AdamW (same learning rates, the schedule of the recipe), per seed;
skipped with a note when ``etude.pretrain`` does not import.

Bytes: the sharded count is what the optimizer hands to ``all_to_all_single`` for other ranks
(both directions, padding included); the baseline's is what an all-gather must deliver from each
rank, (W-1) times its shard.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from etude.model.meta import collect_param_meta
from etude.optim import OptimConfig, build_optimizer
from etude.optim.muon import (
    merge_blocks,
    ns_flops,
    split_blocks,
    update_scale,
    zeropower_via_newtonschulz,
)

RESULTS = Path(__file__).parent / "results" / "bench_muon.json"
LAYOUTS = ("experts_dim0", "experts_dim1")


def kimi_like_config():
    from etude.model import ModelConfig

    return ModelConfig.preset(
        "kimi-k2",
        vocab_size=1024,
        dim=256,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        dense_ffn_dim=640,
        num_experts=32,
        num_experts_per_tok=4,
        expert_ffn_dim=64,
        max_seq_len=512,
        init_std=0.02,
    )


def build_sharded(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from etude.model.transformer import build_model

    model = build_model(kimi_like_config(), device="cpu", seed=0)
    metas = collect_param_meta(model)
    experts = {id(p) for n, p in model.named_parameters() if metas[n].kind == "experts"}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def placement(p: torch.nn.Parameter) -> Shard:
        return Shard(1) if layout == "experts_dim1" and id(p) in experts else Shard(0)

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh)
    return model


def set_grads(model, step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    for i, (_, p) in enumerate(model.named_parameters()):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i))
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)


class NaiveMuon:
    """The baseline: gather each full update (``full_tensor``), NS on every block on every rank,
    keep this rank's slice. Same update as etude's Muon; momentum stays sharded."""

    def __init__(self, model, cfg: OptimConfig) -> None:
        metas = collect_param_meta(model)
        self.cfg = cfg
        self.entries = [
            (p, metas[n]) for n, p in model.named_parameters() if metas[n].optimizer == "muon"
        ]
        self.bufs = [torch.zeros_like(p.to_local()) for p, _ in self.entries]
        self.stats: dict[str, int] = {}

    @torch.no_grad()
    def step(self) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        W = dist.get_world_size()
        c, mu = self.cfg, self.cfg.momentum
        self.stats = {"ns_flops": 0, "bytes_sent": 0}
        for (p, meta), buf in zip(self.entries, self.bufs):
            g = p.grad.to_local()
            buf.lerp_(g, 1 - mu)
            u = g.lerp(buf, mu)
            full = DTensor.from_local(
                u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
            u_full = full.full_tensor()
            self.stats["bytes_sent"] += (W - 1) * u.numel() * u.element_size()
            m, n = meta.block_shape(tuple(p.shape))
            O_NMK = zeropower_via_newtonschulz(
                split_blocks(u_full, meta), c.ns_steps, c.ns_coefficients
            )
            self.stats["ns_flops"] += meta.num_blocks * ns_flops(m, n, c.ns_steps)
            # this rank's slice of the full result, cut locally (src_data_rank=None: no transfer)
            mine = distribute_tensor(
                merge_blocks(O_NMK, meta), p.device_mesh, p.placements, src_data_rank=None
            )
            x = p.to_local()
            x.mul_(1 - c.lr * c.weight_decay)
            x.add_(mine.to_local(), alpha=-c.lr * update_scale(m, n, c.adjust_lr))


def timed_step(model, opt, step: int) -> float:
    """One optimizer step; the time of the slowest rank (the step ends when it ends)."""
    set_grads(model, step)
    dist.barrier()
    t0 = time.perf_counter()
    opt.step()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def muon_param_bytes(model) -> int:
    metas = collect_param_meta(model)
    return sum(
        p.to_local().numel() * p.element_size()
        for n, p in model.named_parameters()
        if metas[n].optimizer == "muon"
    )


def rank_worker(rank: int, world_size: int, store_path: str, steps: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    cfg = OptimConfig(lr=0.02, weight_decay=0.1, bucket_mb=1.0)
    result: dict[str, Any] = {}
    for layout in LAYOUTS:
        models = {method: build_sharded(layout) for method in ("sharded", "naive")}
        opts = {
            "sharded": build_optimizer(models["sharded"], cfg),
            "naive": NaiveMuon(models["naive"], cfg),
        }
        times: dict[str, list[float]] = {"sharded": [], "naive": []}
        for step in range(steps + 1):  # step 0 warms up (plans, allocations)
            for method in ("sharded", "naive"):  # alternate: load changes hit both alike
                elapsed = timed_step(models[method], opts[method], step)
                if step > 0:
                    times[method].append(elapsed)
        for method in ("sharded", "naive"):
            result[f"{layout}.{method}"] = {
                "step_s": statistics.median(times[method]),
                "ns_flops": opts[method].stats["ns_flops"],
                "bytes_sent": opts[method].stats["bytes_sent"],
                "param_bytes": muon_param_bytes(models[method]),
            }
        metas = collect_param_meta(models["naive"])
        params = {
            method: {n: p.full_tensor() for n, p in model.named_parameters()}
            for method, model in models.items()
        }
        result[f"{layout}.max_abs_diff"] = max(
            (params["sharded"][n] - params["naive"][n]).abs().max().item()
            for n in params["naive"]
            if metas[n].optimizer == "muon"
        )
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def sharding_table(world_size: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            rank_worker,
            args=(world_size, os.path.join(tmp, "store"), steps, tmp),
            nprocs=world_size,
            start_method="spawn",
        )
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world_size)]
    out: dict[str, Any] = {"world_size": world_size, "steps_timed": steps}
    for layout in LAYOUTS:
        for method in ("sharded", "naive"):
            per_rank = [r[f"{layout}.{method}"] for r in ranks]
            flops = [r["ns_flops"] for r in per_rank]
            sent = [r["bytes_sent"] for r in per_rank]
            params = [r["param_bytes"] for r in per_rank]
            key = f"{layout}.{method}"
            out[f"{key}.ns_gflop_per_rank_max"] = max(flops) / 1e9
            out[f"{key}.ns_flop_balance_max_over_mean"] = max(flops) / statistics.mean(flops)
            out[f"{key}.mbytes_sent_per_rank_max"] = max(sent) / 2**20
            out[f"{key}.mbytes_params_per_rank_max"] = max(params) / 2**20
            out[f"{key}.sent_over_param_bytes_max"] = max(s / p for s, p in zip(sent, params))
            out[f"{key}.step_s"] = per_rank[0]["step_s"]
        s, n = f"{layout}.sharded", f"{layout}.naive"
        out[f"{layout}.flops_per_rank_sharded_over_naive"] = (
            out[f"{s}.ns_gflop_per_rank_max"] / out[f"{n}.ns_gflop_per_rank_max"]
        )
        out[f"{layout}.speedup_vs_naive"] = out[f"{n}.step_s"] / out[f"{s}.step_s"]
        out[f"{layout}.max_abs_diff_sharded_vs_naive"] = ranks[0][f"{layout}.max_abs_diff"]
        W = world_size
        out[f"{layout}.target_flops_ok"] = (
            out[f"{layout}.flops_per_rank_sharded_over_naive"] <= 1.1 / W
        )
        out[f"{layout}.target_bytes_ok"] = out[f"{s}.sent_over_param_bytes_max"] <= 2 * (W - 1) / W
        out[f"{layout}.target_faster_ok"] = out[f"{layout}.speedup_vs_naive"] > 1.0
    return out


def print_sharding_table(r: dict[str, Any]) -> None:
    W = r["world_size"]
    print(f"\nSharded Muon vs naive full_tensor() baseline, CPU gloo, world size {W}")
    head = (
        "layout",
        "method",
        "NS GFLOP/rank",
        "max/mean",
        "MiB sent/rank",
        "sent/params",
        "step s",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for layout in LAYOUTS:
        for method in ("sharded", "naive"):
            k = f"{layout}.{method}"
            print(
                f"| {layout} | {method} | {r[k + '.ns_gflop_per_rank_max']:.2f} "
                f"| {r[k + '.ns_flop_balance_max_over_mean']:.2f} "
                f"| {r[k + '.mbytes_sent_per_rank_max']:.2f} "
                f"| {r[k + '.sent_over_param_bytes_max']:.2f} | {r[k + '.step_s']:.3f} |"
            )
    print()
    for layout in LAYOUTS:
        print(
            f"{layout}: FLOPs/rank sharded/naive {r[layout + '.flops_per_rank_sharded_over_naive']:.3f} "
            f"(target <= {1.1 / W:.3f}), sent/params {r[layout + '.sharded.sent_over_param_bytes_max']:.2f} "
            f"(target <= {2 * (W - 1) / W:.2f}), speedup {r[layout + '.speedup_vs_naive']:.2f}x, "
            f"max |sharded - naive| {r[layout + '.max_abs_diff_sharded_vs_naive']:.1e}"
        )


def pretrain_loss_table(seeds: list[int], steps: int) -> dict[str, Any]:
    """Final loss of ``etude pretrain`` on the tiny model, Muon vs AdamW, per seed."""
    from etude.config import from_dict
    from etude.pretrain import PretrainConfig, run_pretrain

    out: dict[str, Any] = {"pretrain.steps": steps}
    for name in ("muon", "adamw"):
        losses = []
        for seed in seeds:
            with tempfile.TemporaryDirectory() as run_dir:
                cfg = from_dict(
                    PretrainConfig,
                    {
                        "model": {"preset": "tiny"},
                        "data": {"max_bytes": 1_000_000, "seq_len": 128, "batch_size": 8},
                        "train": {
                            "steps": steps,
                            "warmup_steps": min(20, steps),
                            "seed": seed,
                            "run_dir": run_dir,
                            "progress": False,
                            "log_every": steps,
                            "eval_every": steps,
                            "checkpoint_every": steps,
                            "sample_tokens": 8,
                        },
                        "optim": {"name": name},
                    },
                )
                metrics = run_pretrain(cfg)
            losses.append(metrics.get("val_loss", metrics["loss"]))
            out[f"pretrain.{name}.seed{seed}.val_loss"] = losses[-1]
        out[f"pretrain.{name}.mean_val_loss"] = statistics.mean(losses)
    return out


def print_pretrain_table(r: dict[str, Any], seeds: list[int]) -> None:
    print(f"\netude pretrain, tiny model, {r['pretrain.steps']} steps: validation loss")
    print("| optimizer | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |")
    print("|---|" + "---|" * (len(seeds) + 1))
    for name in ("muon", "adamw"):
        cells = " | ".join(f"{r[f'pretrain.{name}.seed{s}.val_loss']:.3f}" for s in seeds)
        print(f"| {name} | {cells} | {r[f'pretrain.{name}.mean_val_loss']:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed optimizer steps per method")
    ap.add_argument("--pretrain-steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--skip-pretrain", action="store_true")
    args = ap.parse_args()

    results = sharding_table(args.world_size, args.steps)
    print_sharding_table(results)
    if not args.skip_pretrain:
        try:
            import etude.pretrain  # noqa: F401
        except ImportError as e:
            print(f"\npretrain table skipped: etude.pretrain does not import ({e})")
        else:
            results.update(pretrain_loss_table(args.seeds, args.pretrain_steps))
            print_pretrain_table(results, args.seeds)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if args.skip_pretrain and RESULTS.exists():  # keep the last pretrain table
        previous = json.loads(RESULTS.read_text())
        results = {**{k: v for k, v in previous.items() if k.startswith("pretrain.")}, **results}
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
