"""Peak memory per rank while loading a sharded Hugging Face checkpoint into FSDP2/EP shards.

Run: ``.venv/bin/python benchmarks/bench_load.py`` (writes benchmarks/results/bench_load.json).

A DeepSeek-V3-shaped model (MLA, 32 experts per MoE layer, ~50M parameters, fp32) is exported
with ``export_hf`` into safetensors shards of at most 32 MiB. Then 1, 2 and 4 gloo processes each
build the model on the meta device, ``parallelize`` it (FSDP over all ranks, experts split over
``ep = world``) and ``load_hf_checkpoint`` it. Each rank resets its peak resident set
(``/proc/self/clear_refs``), loads, and reports ``VmHWM - VmRSS_before``: the peak memory the load
itself added, file pages that ``safe_open`` maps included. The goal of the loader is
``peak <= 1.5 x largest shard + the rank's own parameters`` (it holds its shards plus one source
tensor at a time, never the model). Linux only (``/proc``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).parent / "results" / "bench_load.json"
MIB = 2**20
SHARD_BYTES = 32 * MIB
MODEL = dict(
    vocab_size=8000,
    dim=512,
    num_layers=4,
    num_dense_layers=1,
    num_heads=8,
    num_kv_heads=8,
    head_dim=96,
    attention="mla",
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    rope_scaling="yarn",
    yarn_factor=4.0,
    yarn_original_max_seq_len=1024,
    yarn_mscale_all_dim=1.0,
    dense_ffn_dim=1024,
    num_experts=32,
    num_experts_per_tok=4,
    expert_ffn_dim=256,
    num_shared_experts=1,
    router_num_groups=4,
    router_topk_groups=2,
    max_seq_len=4096,
)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _load_on_rank(rank: int, world: int, workdir: str, hf_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from torch.distributed.tensor import DTensor

    from etude.model.hf_config import model_config_from_hf
    from etude.model.transformer import Transformer
    from etude.parallel import ParallelConfig, ParallelDims
    from etude.parallel.checkpoint import load_hf_checkpoint, read_hf_config
    from etude.parallel.fsdp import parallelize

    cfg, _ = model_config_from_hf(read_hf_config(hf_dir))
    with torch.device("meta"):
        model = Transformer(cfg)
    if world > 1:
        layout = ParallelConfig(dp_shard=world, ep=world)
        parallelize(model, ParallelDims.from_config(layout, world).build_mesh("cpu"))
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    load_hf_checkpoint(model, hf_dir)
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM") - before
    own = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in model.parameters()
    )
    result = {"peak_bytes": peak * 1024, "own_param_bytes": own, "seconds": seconds}
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(world: int, hf_dir: str) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="etude_bench_load_") as workdir:
        mp.start_processes(
            _load_on_rank, args=(world, workdir, hf_dir), nprocs=world, start_method="spawn"
        )
        return [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    from etude.model.config import ModelConfig
    from etude.model.transformer import build_model
    from etude.parallel.checkpoint import export_hf

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = ModelConfig.preset("tiny", **MODEL)
    with tempfile.TemporaryDirectory(prefix="etude_bench_ckpt_") as tmp:
        model = build_model(cfg, seed=0)
        export_hf(model, tmp, max_shard_bytes=SHARD_BYTES)
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        del model
        shards = [p.stat().st_size for p in Path(tmp).glob("*.safetensors")]
        largest = max(shards)
        results: dict[str, float] = {
            "model_bytes": total_bytes,
            "num_shards": len(shards),
            "largest_shard_bytes": largest,
        }
        print(
            f"model {total_bytes / MIB:.1f} MiB in {len(shards)} shards, largest {largest / MIB:.1f} MiB"
        )
        print(
            f"{'world':>5} {'rank':>4} {'own params MiB':>15} {'peak MiB':>9} {'goal MiB':>9} {'ratio':>6}"
        )
        for world in (1, 2, 4):
            ranks = measure(world, tmp)
            worst = 0.0
            for rank, r in enumerate(ranks):
                goal = 1.5 * largest + r["own_param_bytes"]
                ratio = r["peak_bytes"] / goal
                worst = max(worst, ratio)
                print(
                    f"{world:>5} {rank:>4} {r['own_param_bytes'] / MIB:>15.1f} "
                    f"{r['peak_bytes'] / MIB:>9.1f} {goal / MIB:>9.1f} {ratio:>6.2f}"
                )
            results[f"world{world}_peak_bytes_max"] = max(r["peak_bytes"] for r in ranks)
            results[f"world{world}_own_param_bytes_max"] = max(r["own_param_bytes"] for r in ranks)
            results[f"world{world}_peak_over_goal_max"] = worst
            results[f"world{world}_load_seconds_max"] = max(r["seconds"] for r in ranks)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
