"""``etude train`` on two gloo ranks (FSDP2) against one process: same metrics within tolerance.

Both runs start from the same fresh tiny model (same seed, same tokenizer placed in the run
directories) and roll out the same groups: sampling is seeded per group, so the two ranks'
shares together equal the single process's batch. Episode-level numbers (reward, error rates,
hints, token counts) must match exactly at step 1; losses, KL and entropy within float
tolerance; and the exported weights after the last step must agree.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import run_distributed
from safetensors.torch import load_file

from etude.config import load_config
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.report.metrics import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
TASKS = ROOT / "examples" / "tasks" / "handwritten" / "tasks.jsonl"
EXACT = ("reward", "pass_rate", "hints", "err/unknown_tool", "err/no_tool_call", "trained_tokens")
CLOSE = ("loss", "pg_loss", "kl", "entropy", "clip_frac")


def overrides(run_dir: Path) -> list[str]:
    return [
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
        "tasks.limit=2",
        "env.max_turns=1",
        "env.max_tokens=4000",
        "rollout.tasks_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.num_workers=2",
        "rl.micro_batch_size=1",
        "teacher.beta=1.0",
        "train.init=''",
        "train.steps=2",
        "train.checkpoint_every=2",
        f"train.run_dir='{run_dir}'",
        "train.progress=false",
    ]


def train_job(run_dir: str, init: str = "") -> int:
    from etude.rl.trainer import TrainRecipe, run_train

    extra = [f"train.init='{init}'"] if init else []
    recipe = load_config(
        TrainRecipe, ROOT / "configs" / "rl-tiny.toml", overrides(Path(run_dir)) + extra
    )
    run_train(recipe)
    return dist.get_world_size()


@pytest.mark.parametrize("init", ["fresh", "hf"])
def test_two_ranks_match_one_process(tmp_path: Path, init: str) -> None:
    """``hf``: the policy starts from a Hugging Face directory, which two ranks load straight
    into their FSDP2 shards (``load_hf_policy(shard=...)``) and one process loads whole."""
    tok = Tokenizer.train(default_corpus(200_000), 512)
    runs = {n: tmp_path / f"world{n}" for n in (1, 2)}
    for run in runs.values():
        tok.save(run / "tokenizer")
    init_arg = ""
    if init == "hf":
        from etude.config import load_config as load
        from etude.model.transformer import build_model
        from etude.parallel.checkpoint import export_hf
        from etude.rl.trainer import TrainRecipe
        from etude.runtime import resolve_model_config

        recipe = load(TrainRecipe, ROOT / "configs" / "rl-tiny.toml", overrides(tmp_path))
        model = build_model(resolve_model_config(recipe.model), seed=3)
        export_hf(model, tmp_path / "hf")
        tok.save(tmp_path / "hf")
        init_arg = f"hf:{tmp_path / 'hf'}"
    assert run_distributed(train_job, 1, str(runs[1]), init_arg, timeout_s=900) == [1]
    assert run_distributed(train_job, 2, str(runs[2]), init_arg, timeout_s=900) == [2, 2]
    one = {m["step"]: m for m in read_metrics(runs[1])}
    two = {m["step"]: m for m in read_metrics(runs[2])}
    assert sorted(one) == sorted(two) == [1, 2]
    for step in (1, 2):
        for key in CLOSE + EXACT:
            assert math.isfinite(one[step][key]) and math.isfinite(two[step][key]), key
    for key in EXACT:
        assert one[1][key] == two[1][key], (key, one[1][key], two[1][key])
    for step in (1, 2):
        for key in CLOSE:
            assert two[step][key] == pytest.approx(one[step][key], rel=2e-3, abs=1e-5), (step, key)
    # each rank wrote its own share of the trajectories
    assert len(list((runs[2] / "trajectories").glob("step_000001.rank*.jsonl"))) == 2
    a = load_file(str(runs[1] / "export" / "model.safetensors"))
    b = load_file(str(runs[2] / "export" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-4)
