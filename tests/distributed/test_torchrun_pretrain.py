"""``torchrun --nproc-per-node 4 -m etude pretrain configs/tiny-moe.toml parallel.cp=2
parallel.ep=4`` on CPU (gloo), two steps, against ``etude pretrain`` in one process.

The distributed run uses 2 data-parallel ranks of ``batch_size`` sequences each, so the
single-process run with twice the batch sees the same global batch: the logged losses must
agree. Also checked: only rank 0 writes metrics and the export, and the DCP checkpoint exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from etude.report.metrics import read_metrics

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "model.vocab_size=384",
    "model.dim=64",
    "model.num_layers=2",
    "model.expert_ffn_dim=32",
    "data.max_bytes=40000",
    "data.seq_len=32",
    "train.steps=2",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.checkpoint_every=2",
    "train.sample_tokens=4",
    "train.progress=false",
]


def etude(args: list[str], *, nproc: int | None = None) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "etude"]
    if nproc is not None:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        launcher += ["-m", "etude"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_torchrun_cp2_ep4_matches_one_process(tmp_path):
    recipe = str(ROOT / "configs" / "tiny-moe.toml")
    dist_run, single_run = tmp_path / "torchrun", tmp_path / "single"
    proc = etude(
        ["pretrain", recipe, "parallel.cp=2", "parallel.ep=4", "data.batch_size=2"]
        + SMALL
        + [f"train.run_dir={dist_run}"],
        nproc=4,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("step 1/") == 1, proc.stdout  # rank 0 logs, the others do not
    assert "dp_shard 2, cp 2" in proc.stdout and "ep 4" in proc.stdout, proc.stdout
    proc = etude(["pretrain", recipe, "data.batch_size=4", *SMALL, f"train.run_dir={single_run}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    got, ref = read_metrics(dist_run), read_metrics(single_run)
    assert [m["step"] for m in got] == [1, 2] == [m["step"] for m in ref]
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
    assert got[1]["val_loss"] == pytest.approx(ref[1]["val_loss"], rel=1e-4)
    assert (dist_run / "checkpoints" / "step_000002" / "extra.json").is_file()
    assert (dist_run / "export" / "model.safetensors").is_file()
    assert (dist_run / "sample.txt").is_file()
