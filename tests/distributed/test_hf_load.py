"""A sharded Hugging Face checkpoint loaded straight into FSDP2 / expert-parallel shards.

transformers writes a tiny DeepSeek-V3 (MLA, YaRN, group-limited routing, shared experts)
checkpoint split into many safetensors files; every rank builds the model on the meta device,
``parallelize``s it for a layout and calls ``load_hf_checkpoint``, which fills only the rank's
own shards (dense weights on the FSDP mesh, experts split over ``ep`` and FSDP-sharded over
``efsdp``). The logits of a forward under each layout must equal the single-process import's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import run_distributed

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed

LAYOUTS_2 = {"fsdp2_ep2": dict(dp_shard=2, ep=2)}  # dense weights FSDP 2, experts EP 2
LAYOUTS_4 = {  # slow: four spawned processes on a 2-core machine take ~1 minute
    "fsdp4": dict(dp_shard=4),
    "ep2_efsdp2": dict(dp_shard=4, ep=2),
    "hsdp2_ep2": dict(dp_replicate=2, dp_shard=2, ep=2),
    "ep4": dict(dp_shard=4, ep=4),
}


def tokens() -> torch.Tensor:
    return torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(4))


def sharded_logits(hf_dir: str, layouts: dict[str, dict[str, int]]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from etude.model.hf_config import model_config_from_hf
    from etude.model.transformer import Transformer
    from etude.parallel import ParallelConfig, ParallelDims
    from etude.parallel.checkpoint import load_hf_checkpoint, read_hf_config
    from etude.parallel.fsdp import parallelize

    out = {}
    cfg, _ = model_config_from_hf(read_hf_config(hf_dir))
    for name, layout in layouts.items():
        dims = ParallelDims.from_config(ParallelConfig(**layout), dist.get_world_size())
        with torch.device("meta"):
            model = Transformer(cfg)
        parallelize(model, dims.build_mesh("cpu"))
        load_hf_checkpoint(model, hf_dir)
        local = sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor))
        total = sum(p.numel() for p in model.parameters())
        assert local < total, (name, local, total)  # this rank holds shards, not the model
        with torch.no_grad():
            out[name] = model.eval()(tokens())
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # the parity tests' models
    from test_hf_parity import hf_model

    from etude.parallel.checkpoint import hf_weight_files, load_hf_model

    path = tmp_path_factory.mktemp("hf") / "deepseek"
    hf_model("deepseek_v3_q_lora").save_pretrained(path, max_shard_size="40KB")
    assert len(set(hf_weight_files(path).values())) > 4
    model, _, _ = load_hf_model(path)
    with torch.no_grad():
        return str(path), model.eval()(tokens())


def check(checkpoint, world, layouts):
    path, want = checkpoint
    results = run_distributed(sharded_logits, world, path, layouts, timeout_s=300)
    for rank, per_layout in enumerate(results):
        assert set(per_layout) == set(layouts)
        for name, got in per_layout.items():
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{name} rank {rank}")


def test_world_2_sharded_load_gives_single_process_logits(checkpoint):
    check(checkpoint, 2, LAYOUTS_2)


@pytest.mark.slow
def test_world_4_sharded_load_gives_single_process_logits(checkpoint):
    check(checkpoint, 4, LAYOUTS_4)


def policy_logits(hf_dir: str) -> torch.Tensor:
    """The RL trainer's ``init = "hf:PATH"`` under torchrun: the policy built on meta, wrapped
    by the trainer's FSDP2 sharding, then filled shard by shard."""
    from torch.distributed.tensor import DTensor

    from etude.parallel.checkpoint import load_hf_policy
    from etude.rl.run_setup import shard_policy

    model, _, _ = load_hf_policy(hf_dir, shard=shard_policy)
    local = sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor))
    assert local < sum(p.numel() for p in model.parameters())  # shards, not the model
    with torch.no_grad():
        return model.eval()(tokens())


def test_trainer_hf_init_loads_into_shards(checkpoint):
    from etude.model.tokenizer import Tokenizer

    path, want = checkpoint
    Tokenizer.train(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=300).save(path)
    for rank, got in enumerate(run_distributed(policy_logits, 2, path, timeout_s=300)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"rank {rank}")
