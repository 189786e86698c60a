"""``etude sft`` then ``etude train`` end to end on CPU: finite metrics, checkpoints, resume.

A tiny model is warm-started on oracle episodes of one hand-written task (a couple of SFT steps:
enough to exercise the job, not to act well), then trained with RL for three steps on one-turn
episodes. A run interrupted after step 2 and resumed must continue the step count and reproduce
the uninterrupted run's step-3 metrics and final weights (rollouts are seeded by (seed, step)
and one-turn episodes see no timing-dependent observation).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from etude.model.tokenizer import Tokenizer, default_corpus
from etude.parallel.checkpoint import CHECKPOINT_DIR
from etude.report.metrics import read_metrics
from etude.rl.cli import add_rl_parsers

pytestmark = pytest.mark.slow  # two jobs with oracle episodes and sandboxed test runs: minutes

ROOT = Path(__file__).parents[2]
TASKS = ROOT / "examples" / "tasks" / "handwritten" / "tasks.jsonl"
MODEL = [
    "model.preset='tiny'",
    "model.vocab_size=512",
    "model.dim=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.num_dense_layers=1",
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.expert_ffn_dim=32",
    "model.dense_ffn_dim=64",
    "model.max_seq_len=4096",
]
STEP_KEYS = (
    "loss",
    "pg_loss",
    "reward",
    "pass_rate",
    "hints",
    "kl",
    "entropy",
    "clip_frac",
    "err/unknown_tool",
    "err/no_tool_call",
    "rollout_tok/s",
    "train_tok/s",
)


def etude(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="etude")
    add_rl_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def train_args(run: Path, init: Path, steps: int) -> list[str]:
    return [
        "train",
        str(ROOT / "configs" / "rl-tiny.toml"),
        f"tasks.path='{TASKS}'",
        "tasks.limit=1",
        "tasks.curriculum=true",
        "env.max_turns=1",
        "env.max_tokens=4000",
        "rollout.tasks_per_step=1",
        "rollout.group_size=2",
        "rollout.max_new_tokens=12",
        "rollout.num_workers=2",
        "rl.micro_batch_size=1",
        "teacher.beta=1.0",
        f"train.init='{init}'",
        f"train.steps={steps}",
        "train.checkpoint_every=2",
        f"train.run_dir='{run}'",
        "train.progress=false",
    ]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sft")
    Tokenizer.train(default_corpus(200_000), 512).save(run / "tokenizer")
    code = etude(
        "sft",
        str(ROOT / "configs" / "sft-tiny.toml"),
        *MODEL,
        f"data.tasks='{TASKS}'",
        "data.episodes_per_task=1",
        "data.max_seq_len=4096",
        "train.steps=2",
        "train.batch_size=1",
        "train.warmup_steps=1",
        f"train.run_dir='{run}'",
        "train.progress=false",
    )
    assert code == 0
    return run


def test_sft_writes_a_warm_start(warm_start: Path) -> None:
    for name in ("export/model.safetensors", "tokenizer/tokenizer.json", "sft_trajectories.jsonl"):
        assert (warm_start / name).is_file(), name
    summary = json.loads((warm_start / "hint_preference.json").read_text())
    assert summary["episodes"] == 3 and summary["examples"] >= 1
    assert [m["step"] for m in read_metrics(warm_start)] == [1, 2]


def test_train_metrics_checkpoint_and_resume(warm_start: Path, tmp_path: Path) -> None:
    run = tmp_path / "rl"
    assert etude(*train_args(run, warm_start, 3)) == 0
    full = {m["step"]: m for m in read_metrics(run)}
    assert sorted(full) == [1, 2, 3]
    for step, m in full.items():
        for key in STEP_KEYS:
            assert isinstance(m[key], int | float) and math.isfinite(m[key]), (step, key, m[key])
    ckpts = run / CHECKPOINT_DIR
    assert (ckpts / "step_000002").is_dir() and (ckpts / "step_000003").is_dir()
    assert (ckpts / "latest").read_text().strip() == "step_000003"
    assert len(list((run / "trajectories").glob("step_*.jsonl"))) == 3
    pool = json.loads((ckpts / "step_000002" / "pool.json").read_text())
    assert sum(t["attempts"] for t in pool["tasks"].values()) == 2 * 2  # 2 steps x G
    final = load_file(str(run / "export" / "model.safetensors"))

    # interrupted after step 2: drop the later checkpoint and rerun the same command
    shutil.rmtree(ckpts / "step_000003")
    (ckpts / "latest").write_text("step_000002")
    assert etude(*train_args(run, warm_start, 3)) == 0
    resumed = {m["step"]: m for m in read_metrics(run)}
    assert sorted(resumed) == [1, 2, 3]
    for key in ("reward", "hints", "err/no_tool_call", "kl_tokens", "trained_tokens"):
        assert resumed[3][key] == full[3][key], key
    for key in ("loss", "pg_loss", "kl", "entropy"):
        assert resumed[3][key] == pytest.approx(full[3][key], rel=1e-4, abs=1e-6), key
    again = load_file(str(run / "export" / "model.safetensors"))
    for name, tensor in final.items():
        torch.testing.assert_close(again[name], tensor, rtol=1e-5, atol=1e-6)
