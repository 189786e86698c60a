"""Runs that survive: ``etude train`` SIGKILLed after a step, then the same command again.

The rerun must lose at most one step (a checkpoint every step), log every step exactly once in
``metrics.jsonl``, keep the rows written before the kill as they were, end with a checkpoint at
the last step, and continue the step count (not restart it). Also: a ``checkpoints/latest``
naming a missing directory falls back to the newest complete checkpoint with a warning, and a
truncated checkpoint file is a one-line error naming the file with exit code 2.

A tiny model from scratch (no warm start), one-turn episodes of one hand-written task.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etude.parallel.checkpoint import CHECKPOINT_DIR, latest_checkpoint
from etude.report.metrics import read_metrics

ROOT = Path(__file__).parents[2]
TASKS = ROOT / "examples" / "tasks" / "handwritten" / "tasks.jsonl"
STEPS = 3


def command(run: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "etude",
        "train",
        str(ROOT / "configs" / "rl-tiny.toml"),
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
        f"tasks.path='{TASKS}'",
        "tasks.limit=1",
        "env.max_turns=1",
        "env.max_tokens=4000",
        "rollout.tasks_per_step=1",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.num_workers=2",
        "train.init=''",
        f"train.steps={STEPS}",
        "train.checkpoint_every=1",
        f"train.run_dir='{run}'",
        "train.progress=false",
    ]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_to_end(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(run), env=env(), capture_output=True, text=True, timeout=600, cwd=ROOT
    )


def test_sigkill_after_a_step_then_rerun(tmp_path: Path) -> None:
    run = tmp_path / "rl"
    proc = subprocess.Popen(
        command(run), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT
    )
    deadline = time.monotonic() + 300
    try:
        # kill as soon as step 1 is logged: its checkpoint may or may not be on disk yet
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.is_file() and any(m["step"] >= 1 for m in read_metrics(metrics)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = {m["step"]: m for m in read_metrics(run)}
    assert before and max(before) < STEPS
    saved = latest_checkpoint(run)
    saved_step = int(saved.name[5:]) if saved is not None else 0
    assert saved_step >= max(before) - 1  # at most one step lost

    done = run_to_end(run)
    assert done.returncode == 0, done.stderr[-2000:]
    if saved_step:
        assert f"at step {saved_step}" in done.stdout + done.stderr
    rows = read_metrics(run)
    steps = [m["step"] for m in rows]
    assert steps == list(range(1, STEPS + 1))  # every step once, in order
    after = {m["step"]: m for m in rows}
    for step in range(1, saved_step + 1):  # rows before the checkpoint are kept as they were
        assert after[step]["loss"] == before[step]["loss"]
    assert latest_checkpoint(run) == run / CHECKPOINT_DIR / f"step_{STEPS:06d}"

    # a second rerun has nothing left to do and changes no row
    again = run_to_end(run)
    assert again.returncode == 0 and [m["step"] for m in read_metrics(run)] == steps

    # latest naming a missing directory: the newest complete checkpoint, with a warning
    ckpts = run / CHECKPOINT_DIR
    (ckpts / "latest").write_text("step_999999")
    with pytest.warns(UserWarning, match="step_999999.*does not exist"):
        assert latest_checkpoint(run) == ckpts / f"step_{STEPS:06d}"

    # a truncated shard: one line naming the file, exit code 2, no traceback
    (ckpts / "latest").write_text(f"step_{STEPS:06d}")
    shard = next((ckpts / f"step_{STEPS:06d}").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    broken = run_to_end(run)
    assert broken.returncode == 2
    lines = [line for line in broken.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(shard) in lines[0] and "truncated" in lines[0], broken.stderr
