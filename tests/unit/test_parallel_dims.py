"""ParallelDims without a process group: valid and invalid layouts, rank arithmetic, CP layout.

Errors are matched exactly: each names the bad degree and lists the valid choices. The rank
arithmetic (coordinates, axis groups) is what the meshes are checked against in the
distributed tests. The sequence layout of context parallelism (load-balanced chunks) is pure
too, and must coincide with PyTorch's head-tail layout that its ring attention assumes.
"""

from __future__ import annotations

import re

import pytest
import torch

from etude.config import from_dict
from etude.model.config import ModelConfig
from etude.parallel.context import (
    load_balanced_positions,
    resolve_cp_mode,
    shard_sequence,
    unshard_sequence,
)
from etude.parallel.dims import ParallelConfig, ParallelDims, divisors


def dims(world: int, **cfg) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**cfg), world)


def raises(message: str):
    return pytest.raises(ValueError, match=f"^{re.escape(message)}$")


@pytest.mark.parametrize(
    ("world", "cfg", "expect"),
    [
        (1, {}, (1, 1, 1, 1, 1)),
        (8, {}, (1, 8, 1, 1, 8)),
        (8, dict(cp=2, ep=8), (1, 4, 2, 8, 1)),  # the seed's CP=2 x EP=8 on 8 ranks
        (8, dict(dp_replicate=2, cp=2, ep=4), (2, 2, 2, 4, 1)),
        (8, dict(dp_replicate=2, ep=2), (2, 4, 1, 2, 2)),
        (8, dict(ep=4), (1, 8, 1, 4, 2)),
        (16, dict(dp_replicate=2, dp_shard=4, cp=2, ep=2), (2, 4, 2, 2, 4)),
    ],
)
def test_valid_layouts_resolve(world, cfg, expect):
    d = dims(world, **cfg)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.ep, d.efsdp) == expect
    assert d.dp_replicate * d.dp_shard * d.cp == world
    assert d.dp == d.dp_replicate * d.dp_shard and d.fsdp == d.dp_shard * d.cp
    assert d.efsdp * d.ep == d.fsdp  # ep folds into dp_shard x cp: no extra ranks


def test_describe_names_both_meshes():
    line = dims(8, cp=2, ep=8).describe()
    assert line == (
        "world 8 | dense (dp_replicate 1, dp_shard 4, cp 2) | expert (dp_replicate 1, efsdp 1, "
        "ep 8)"
    )


@pytest.mark.parametrize(
    ("world", "cfg", "message"),
    [
        (
            8,
            dict(dp_replicate=3),
            "parallel.dp_replicate=3 does not divide the world size 8; valid dp_replicate: "
            "1, 2, 4, 8",
        ),
        (
            8,
            dict(dp_replicate=2, cp=3),
            "parallel.cp=3 does not divide world size / dp_replicate = 4; valid cp: 1, 2, 4",
        ),
        (
            8,
            dict(dp_shard=2),
            "parallel.dp_shard=2 does not fill the world size: dp_replicate * dp_shard * cp = "
            "1 * 2 * 1 = 2 != 8; set parallel.dp_shard=8 (or -1 to fill)",
        ),
        (
            8,
            dict(dp_replicate=2, dp_shard=2, cp=4),
            "parallel.dp_shard=2 does not fill the world size: dp_replicate * dp_shard * cp = "
            "2 * 2 * 4 = 16 != 8; set parallel.dp_shard=1 (or -1 to fill)",
        ),
        (
            8,
            dict(cp=2, ep=3),
            "parallel.ep=3 must divide dp_shard * cp = 4 * 2 = 8 (experts are split over the "
            "ranks of dp_shard x cp); valid ep: 1, 2, 4, 8",
        ),
        (
            8,
            dict(dp_replicate=2, ep=8),
            "parallel.ep=8 must divide dp_shard * cp = 4 * 1 = 4 (experts are split over the "
            "ranks of dp_shard x cp); valid ep: 1, 2, 4",
        ),
    ],
)
def test_invalid_layouts_name_the_degree_and_the_choices(world, cfg, message):
    with raises(message):
        dims(world, **cfg)


def test_direct_construction_checks_the_same_rules():
    with raises("parallel.cp must be a positive integer, got 0"):
        ParallelDims(dp_replicate=1, dp_shard=8, cp=0, ep=1, world_size=8)
    with raises("world size must be a positive integer, got 0"):
        ParallelDims(dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=0)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            dict(dp_shard=0),
            "parallel.dp_shard must be a positive integer or -1 (fill the world size), got 0",
        ),
        (dict(ep=0), "parallel.ep must be a positive integer, got 0"),
        (dict(cp=-1), "parallel.cp must be a positive integer, got -1"),
        (
            dict(cp_attention="flash"),
            "parallel.cp_attention must be 'auto', 'allgather' or 'ring', got 'flash'",
        ),
    ],
)
def test_config_rejects_bad_values(cfg, message):
    with raises(message):
        ParallelConfig(**cfg)


def test_config_from_recipe_table():
    cfg = from_dict(ParallelConfig, {"cp": 2, "ep": 4}, "parallel")
    assert (cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.ep) == (1, -1, 2, 4)
    with pytest.raises(ValueError, match="unknown config key 'parallel.tp'"):
        from_dict(ParallelConfig, {"tp": 2}, "parallel")


def tiny(**overrides) -> ModelConfig:
    return ModelConfig.preset("tiny", **overrides)


def test_model_checks_experts_divide_by_ep():
    dims(8, cp=2, ep=8).check_model(tiny())  # 8 experts over 8 ranks: fine
    with raises("parallel.ep=8 must divide model.num_experts=12; valid ep: 1, 2, 4"):
        dims(8, cp=2, ep=8).check_model(tiny(num_experts=12))
    with raises(
        "parallel.ep=2 needs a mixture-of-experts model but model.num_experts=0; set parallel.ep=1"
    ):
        dims(8, ep=2).check_model(tiny(num_experts=0))
    dims(8).check_model(tiny(num_experts=0))  # no EP: nothing to check


def test_model_checks_expert_fsdp_dims_divide():
    # efsdp = 8 / 2 = 4 divides neither dim 6 nor expert width 10
    with raises(
        "parallel.ep=2 leaves efsdp = dp_shard * cp / ep = 4, which divides neither "
        "model.dim=6 nor model.expert_ffn_dim=10 (expert weights are FSDP-sharded on one of "
        "them); valid ep: 1, 4, 8"
    ):
        dims(8, ep=2).check_model(tiny(dim=6, expert_ffn_dim=10))
    dims(8, ep=4).check_model(tiny(dim=6, expert_ffn_dim=10))  # efsdp 2 divides 6


def test_seq_len_must_split_into_two_chunks_per_cp_rank():
    dims(8, cp=4).check_seq_len(64)
    with raises(
        "data.seq_len=20 must be divisible by 2 * parallel.cp = 8 (each cp rank holds two "
        "load-balanced causal chunks); valid cp: 1, 2"
    ):
        dims(8, cp=4).check_seq_len(20)
    dims(8).check_seq_len(7)  # no CP: any length


def test_coordinates_follow_row_major_rank_layout():
    d = dims(8, dp_replicate=2, cp=2, ep=4)  # dense (2, 2, 2), expert (2, 1, 4)
    for rank in range(8):
        c = d.coordinate(rank)
        assert rank == (c["dp_replicate"] * d.dp_shard + c["dp_shard"]) * d.cp + c["cp"]
        assert rank == (c["dp_replicate"] * d.efsdp + c["efsdp"]) * d.ep + c["ep"]
        assert c["dp"] == c["dp_replicate"] * d.dp_shard + c["dp_shard"]
    assert d.coordinate(5) == dict(dp_replicate=1, dp_shard=0, cp=1, efsdp=0, ep=1, dp=2)


@pytest.mark.parametrize(
    ("cfg", "axis", "groups"),
    [
        (dict(cp=2, ep=8), "cp", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (dict(cp=2, ep=8), "ep", [list(range(8))]),
        (dict(cp=2, ep=8), "dp_shard", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (dict(cp=2, ep=8), "efsdp", [[r] for r in range(8)]),
        (dict(dp_replicate=2, ep=2), "ep", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (dict(dp_replicate=2, ep=2), "efsdp", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        (dict(dp_replicate=2, ep=2), "dp_replicate", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (dict(dp_replicate=2, ep=2), "fsdp", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)
def test_axis_groups(cfg, axis, groups):
    assert dims(8, **cfg).axis_groups(axis) == groups


@pytest.mark.parametrize(
    "cfg",
    [dict(cp=2, ep=8), dict(dp_replicate=2, cp=2, ep=4), dict(cp=2, ep=2), dict(cp=4, ep=2)],
)
def test_ep_groups_nest_with_cp_groups_and_axes_partition_the_ranks(cfg):
    d = dims(16, **cfg)
    for axis in ("dp_replicate", "dp_shard", "cp", "efsdp", "ep", "fsdp"):
        flat = sorted(r for g in d.axis_groups(axis) for r in g)
        assert flat == list(range(16)), axis
    cp_groups = d.axis_groups("cp")
    for ep_group in d.axis_groups("ep"):
        members = set(ep_group)
        for cp_group in map(set, cp_groups):
            # ep >= cp: whole cp groups inside; ep < cp: inside one cp group
            nested = cp_group <= members or members <= cp_group or not cp_group & members
            assert nested, (ep_group, cp_group)
        # consecutive ranks: an ep group stays inside a node of 8 when ep <= 8
        assert ep_group == list(range(ep_group[0], ep_group[0] + len(ep_group)))


def test_unknown_axis_is_an_error():
    with raises("unknown mesh axis 'tp'; valid axes: dp_replicate, dp_shard, cp, efsdp, ep, fsdp"):
        dims(8).axis_groups("tp")


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]


# sequence layout of context parallelism


def test_load_balanced_positions_pair_head_and_tail_chunks():
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert load_balanced_positions(8, 1, 0).tolist() == list(range(8))
    with pytest.raises(ValueError, match="must be divisible by 2 \\* cp = 8"):
        load_balanced_positions(12, 4, 0)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_then_unshard_is_identity_and_work_is_balanced(cp):
    x_BT = torch.arange(3 * 16).view(3, 16)
    parts = [shard_sequence(x_BT, cp, r) for r in range(cp)]
    assert all(p.shape == (3, 16 // cp) for p in parts)
    assert torch.equal(unshard_sequence(parts), x_BT)
    # causal attention work of a rank: keys at or before each of its query positions
    work = [int((load_balanced_positions(16, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize(("seq_len", "cp"), [(16, 2), (24, 4), (64, 8)])
def test_layout_coincides_with_pytorch_head_tail_load_balancer(seq_len, cp):
    """The ring path lets PyTorch's context_parallel shard the buffers; the allgather path
    shards them itself: both must put the same tokens on the same rank."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    order = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0]
    for rank, chunk in enumerate(order.view(cp, -1)):
        assert chunk.tolist() == load_balanced_positions(seq_len, cp, rank).tolist()


def test_cp_mode_resolution():
    assert resolve_cp_mode("auto", "cpu") == "allgather"
    assert resolve_cp_mode("auto", "cuda") == "ring"
    assert resolve_cp_mode("allgather", "cuda") == "allgather"
    with raises(
        "parallel.cp_attention='ring' needs CUDA (PyTorch's ring attention has no cpu kernel); "
        "set parallel.cp_attention='allgather'"
    ):
        resolve_cp_mode("ring", "cpu")
