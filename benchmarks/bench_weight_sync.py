"""Weight sync after each optimizer step: seconds per push (in process, file, HTTP to etude serve)
and the fraction of weight bytes that changed per step under Muon vs AdamW.

Run: ``.venv/bin/python benchmarks/bench_weight_sync.py`` (writes
benchmarks/results/bench_weight_sync.json).

Workload: the demo's model shapes (and the ``small`` preset) trained for a few optimizer steps on
next-token loss over random token batches; after each step the new weights are pushed three
ways, one after another in the same process, so the ratios are meaningful on a loaded machine:

- ``in_process``: ``EngineBackend.update_weights`` into a separate engine module (copy);
- ``file``: ``FileSync`` (safetensors export, ``LATEST`` renamed atomically) and a reader that
  loads it (``FileWeightWatcher``), i.e. what a rollout worker on another process pays too;
- ``http``: ``FileSync`` + ``POST /v1/weights/reload`` to an ``etude serve`` on 127.0.0.1,
  acknowledged once the server holds the new weights (``HTTPBackend.update_weights``).

Changed bytes: element by element, bit for bit, against the previous step's weights, in fp32
(the trainer's weights) and cast to bf16 (what a bf16 inference server would receive: a small
update often rounds to the same bf16 value). The loss is not RL's; the fraction depends on the
optimizer's update rule (Muon's orthogonalized update touches every element of a matrix; AdamW's
per-element update too, but scaled per element), the learning rate and the precision.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from etude.engine import Engine
from etude.engine.backends import EngineBackend, HTTPBackend, HTTPBackendConfig
from etude.model.config import ModelConfig
from etude.model.transformer import build_model
from etude.optim import OptimConfig, build_optimizer
from etude.rl.weight_sync import (
    FileSync,
    FileWeightWatcher,
    InProcessSync,
    changed_bytes,
    full_state_dict,
)

RESULTS = Path(__file__).parent / "results" / "bench_weight_sync.json"
STEPS = 5
DEMO_SHAPES = dict(
    vocab_size=4096,
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
    max_seq_len=512,
)


def model_config(size: str) -> ModelConfig:
    if size == "demo":
        return ModelConfig.preset("tiny", **DEMO_SHAPES)
    return ModelConfig.preset("small", max_seq_len=512)


def train_step(model, optimizer, cfg: ModelConfig, generator: torch.Generator) -> None:
    ids = torch.randint(0, cfg.vocab_size, (4, 128), generator=generator)
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


class ServedPolicy:
    """etude serve on 127.0.0.1 holding the run's weights, and the sync that reloads it."""

    def __init__(self, model, cfg: ModelConfig, root: Path) -> None:
        from etude.config import to_dict
        from etude.model.tokenizer import train_default_tokenizer
        from etude.parallel.checkpoint import export_safetensors
        from etude.rl.server_process import ServerProcess

        export_safetensors(model, root / "run" / "export", to_dict(cfg))
        train_default_tokenizer(cfg.vocab_size).save(root / "run" / "tokenizer")
        self.server = ServerProcess(root / "run", log_path=root / "serve.log")
        self.backend = HTTPBackend(HTTPBackendConfig(url=self.server.url))
        self.files = FileSync(root / "http-weights", to_dict(cfg), keep=2, backend=self.backend)

    def push(self, model, version: int) -> float:
        record = self.files.push(model, version)
        assert self.backend.policy_version == version
        return record.seconds

    def close(self) -> None:
        self.backend.close()
        self.server.close()


def run(size: str, optimizer_name: str, with_http: bool) -> dict[str, float]:
    cfg = model_config(size)
    torch.manual_seed(0)
    model = build_model(cfg, seed=0)
    model.train()
    optimizer = build_optimizer(model, OptimConfig(name=optimizer_name, lr=0.002))
    backend = EngineBackend(Engine(copy.deepcopy(model)))
    in_process = InProcessSync(backend)
    generator = torch.Generator().manual_seed(1)
    out: dict[str, list[float]] = {k: [] for k in ("in_process", "file", "file_read", "http")}
    fractions: dict[str, list[float]] = {"fp32": [], "bf16": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = FileSync(Path(tmp) / "weights", {"size": size}, keep=2)
        reader = copy.deepcopy(model)
        watcher = FileWeightWatcher(Path(tmp) / "weights")
        server = ServedPolicy(model, cfg, Path(tmp)) if with_http else None
        previous = {k: v.clone() for k, v in full_state_dict(model).items()}
        try:
            for step in range(1, STEPS + 1):
                train_step(model, optimizer, cfg, generator)
                out["in_process"].append(in_process.push(model, step).seconds)
                out["file"].append(files.push(model, step).seconds)
                t0 = time.perf_counter()
                assert watcher.poll(reader) == step
                out["file_read"].append(time.perf_counter() - t0)
                if server is not None:
                    out["http"].append(server.push(model, step))
                current = {k: v.clone() for k, v in full_state_dict(model).items()}
                changed, total = changed_bytes(previous, current)
                fractions["fp32"].append(changed / total)
                as_bf16 = {k: v.to(torch.bfloat16) for k, v in current.items()}
                changed, total = changed_bytes(
                    {k: v.to(torch.bfloat16) for k, v in previous.items()}, as_bf16
                )
                fractions["bf16"].append(changed / total)
                previous = current
        finally:
            if server is not None:
                server.close()
    total_bytes = sum(v.numel() * v.element_size() for v in previous.values())
    row = {"weight_mb": total_bytes / 2**20}
    for key, values in out.items():
        if values:
            row[f"{key}_s"] = sorted(values)[len(values) // 2]
    for key, values in fractions.items():
        row[f"changed_frac_{key}"] = sum(values) / len(values)
    return row


def main() -> None:
    torch.set_num_threads(1)
    results: dict[str, float] = {"steps": STEPS}
    print(
        f"{'size':6} {'optim':6} {'MiB':>7} {'in-proc s':>10} {'file s':>8} {'read s':>8} "
        f"{'http s':>8} {'chg fp32':>9} {'chg bf16':>9}"
    )
    for size in ("demo", "small"):
        for name in ("muon", "adamw"):
            row = run(size, name, with_http=True)
            for key, value in row.items():
                results[f"{size}_{name}_{key}"] = round(value, 6)
            http = f"{row['http_s']:8.4f}"
            print(
                f"{size:6} {name:6} {row['weight_mb']:7.2f} {row['in_process_s']:10.4f} "
                f"{row['file_s']:8.4f} {row['file_read_s']:8.4f} {http} "
                f"{row['changed_frac_fp32']:9.4f} {row['changed_frac_bf16']:9.4f}"
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
