"""The pretraining job end to end on a small corpus: loss falls, resume continues the same curve."""

import json
import shutil

from etude.config import from_dict
from etude.parallel.checkpoint import CHECKPOINT_DIR
from etude.pretrain import PretrainConfig, run_pretrain
from etude.report.metrics import read_metrics


def recipe(run_dir, steps=6, **train):
    data = {
        "model": {
            "preset": "tiny",
            "vocab_size": 512,
            "dim": 64,
            "num_layers": 2,
            "num_experts": 4,
            "expert_ffn_dim": 64,
        },
        "data": {"max_bytes": 200_000, "seq_len": 64, "batch_size": 4},
        "train": {
            "steps": steps,
            "warmup_steps": 1,
            "log_every": 2,
            "eval_every": 3,
            "checkpoint_every": 3,
            "run_dir": str(run_dir),
            "sample_tokens": 8,
            "progress": False,
            **train,
        },
        "optim": {"name": "muon", "lr": 0.02},
    }
    return from_dict(PretrainConfig, data)


def test_pretrain_writes_run_dir_and_resume_continues_the_curve(tmp_path):
    run = tmp_path / "run"
    run_pretrain(recipe(run))
    full = {m["step"]: m["loss"] for m in read_metrics(run)}
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert full[6] < full[1]
    for name in (
        "config.json",
        "versions.json",
        "sample.txt",
        "export/model.safetensors",
        "tokenizer/tokenizer.json",
    ):
        assert (run / name).is_file(), name
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 6

    # simulate a run interrupted after step 3: drop the later checkpoint and metrics, run again
    ckpts = run / CHECKPOINT_DIR
    shutil.rmtree(ckpts / "step_000006")
    (ckpts / "latest").write_text("step_000003")
    run_pretrain(recipe(run))
    resumed = {m["step"]: m["loss"] for m in read_metrics(run)}
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == full[step], (step, resumed[step], full[step])
