"""etude.plan: hand-computed arithmetic, the owner rule against ShardedMuon's own, validation."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from etude.model.config import ModelConfig
from etude.model.info import count_params
from etude.model.meta import ParamMeta
from etude.plan.cluster import ClusterConfig
from etude.plan.cost import estimate, plan
from etude.plan.layout import Layout, min_gpus
from etude.plan.memory import activation_bytes_per_token
from etude.plan.muon_schedule import OwnerBalancer, block_pieces, simulate_muon
from etude.plan.report import add_plan_parser, format_plan, main
from etude.plan.settings import PlanSettings
from etude.plan.sharding import ParamRecord, block_span, model_inventory


def hand_cfg(**overrides) -> ModelConfig:
    """2 layers (1 dense, 1 MoE), every count below is worked out by hand from these shapes."""
    fields = dict(
        vocab_size=64,
        dim=16,
        num_layers=2,
        num_dense_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        dense_ffn_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        expert_ffn_dim=8,
        num_shared_experts=1,
    )
    return ModelConfig.preset("tiny", **{**fields, **overrides})


# embedding 64*16, head 64*16, attention 2 * (q 256 + k 128 + v 128 + o 256), dense FFN 3*16*32,
# experts 3*4*16*8, shared expert 3*16*8, router 4*16, norms 5*16
TOTAL = 1024 + 1024 + 1536 + 1536 + 1536 + 384 + 64 + 80
EXPERT = 1536
MUON = TOTAL - 1024 - 1024 - 64 - 80


def f(m: int, n: int) -> int:
    s, l = min(m, n), max(m, n)  # noqa: E741
    return 5 * (4 * s * s * l + 2 * s**3)


# Newton-Schulz blocks: q, k, v heads (4, 16) x (4 + 2 + 2) x 2 layers, o heads (16, 4) x 4 x 2,
# dense w1, w3 (32, 16) and w2 (16, 32), experts w1, w3 (16, 8) x 4 x 2 and w2 (8, 16) x 4,
# shared w1, w3 (8, 16) and w2 (16, 8)
NS_EXPERT = 12 * f(16, 8)
NS_TOTAL = 16 * f(4, 16) + 8 * f(16, 4) + 2 * f(32, 16) + f(16, 32) + NS_EXPERT + 3 * f(8, 16)


def test_hand_counts_and_newton_schulz_flops():
    assert f(4, 16) == 5 * (4 * 16 * 16 + 2 * 64) == 5760
    assert f(32, 16) == 5 * (4 * 256 * 32 + 2 * 4096) == 204800
    assert NS_TOTAL == 1_136_640 and NS_EXPERT == 307_200
    cfg = hand_cfg()
    records = model_inventory(cfg)
    assert sum(r.numel for r in records) == TOTAL == count_params(cfg)["total"] == 7184
    assert sum(r.numel for r in records if r.is_expert) == EXPERT
    assert sum(r.numel for r in records if r.meta.optimizer == "muon") == MUON
    schedule = simulate_muon(records, Layout.for_gpus(1), PlanSettings())
    assert schedule.ns_flops_total == NS_TOTAL
    assert schedule.expert_flops_total == NS_EXPERT
    assert schedule.num_blocks == 16 + 8 + 3 + 12 + 3
    assert schedule.whole_flops == NS_TOTAL and not schedule.groups  # one rank holds all


def test_newton_schulz_flops_match_sharded_muon_stats():
    from etude.model.transformer import build_model
    from etude.optim import OptimConfig, build_optimizer

    cfg = hand_cfg()
    model = build_model(cfg, device="cpu", seed=0)
    opt = build_optimizer(model, OptimConfig())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.stats["ns_flops"] == NS_TOTAL


def test_flops_distributed_by_the_schedule():
    # 4 GPUs: dense blocks cut over dp_shard x cp = 4 ranks, one whole expert per ep rank
    cfg = hand_cfg()
    layout = Layout.for_gpus(4, cp=2, ep=4)
    assert (layout.dp_shard, layout.efsdp) == (2, 1)
    schedule = simulate_muon(model_inventory(cfg), layout, PlanSettings())
    assert schedule.whole_flops == 3 * f(16, 8)  # w1, w3, w2 of this rank's expert
    dense = schedule.groups["dense_fsdp"]
    assert dense.size == 4 and dense.ns_flops_W.sum() == NS_TOTAL - NS_EXPERT
    assert dense.ns_flops_W.max() - dense.ns_flops_W.min() <= f(32, 16)  # one block at most
    # 4 experts over efsdp 2 x ep 2 would keep experts whole too; over 8 GPUs ep 2, efsdp 4 cuts
    # each expert into row slices exchanged over efsdp (2 local experts % 4 != 0)
    layout = Layout.for_gpus(8, ep=2)
    schedule = simulate_muon(model_inventory(cfg), layout, PlanSettings())
    experts = schedule.groups["efsdp"]
    assert experts.size == 4 and experts.blocks == 3 * 2
    assert experts.ns_flops_W.sum() == NS_EXPERT // 2  # the half held by this ep rank


def test_owner_rule_and_bytes_by_hand():
    # a 10 x 3 matrix cut on dim 0 over 4 ranks: chunks of 3 rows, the last one row
    pieces = block_pieces(0, 10, 3, 10, 4)
    assert pieces.ranks.tolist() == [0, 1, 2, 3] and pieces.volumes.tolist() == [9, 9, 9, 3]
    bal = OwnerBalancer(4)
    assert bal.assign([pieces], 100) == [0]  # all tied: the largest holder, lowest rank
    assert bal.bytes_W.tolist() == [30 - 9, 9, 9, 3]  # rank 0 returns 21, the others send
    assert bal.assign([pieces], 100) == [1]  # rank 0 is loaded now
    assert bal.assign([pieces, pieces], 100) == [2, 3]  # fewest blocks in the bucket first
    assert bal.assign([pieces] * 5, 100) == [0, 1, 2, 3, 0]
    assert bal.load_W.tolist() == [300, 200, 200, 200]
    assert bal.exchanges == 4 and bal.buckets == 4
    # a block whole on rank 2 stays there and counts in its bucket
    whole = block_pieces(6, 9, 3, 10, 4)
    assert whole.single and whole.ranks.tolist() == [2]
    assert bal.assign([pieces, whole], 100) == [1, 2]


def _sharded_reference(specs, order, bucket_sizes, W):
    """Owners, loads and bytes from ``ShardedMuon``'s own bucket builder
    (``etude.optim.exchange.make_bucket``, the rule itself), one call per rank of the exchange
    group."""
    from torch.distributed.tensor import Shard

    from etude.optim import exchange

    metas = [meta for _, meta, _ in specs]
    layouts = []
    for shape, _, dim in specs:
        boxes = tuple(exchange.shard_box(shape, (W,), (j,), (Shard(dim),)) for j in range(W))
        layouts.append(boxes)
    blocks = []
    for entry, b in order:
        shape, meta, _ = specs[entry]
        box = exchange.block_box(meta, shape, b)
        parts = tuple(
            (j, piece)
            for j, member in enumerate(layouts[entry])
            if (piece := exchange.intersect_boxes(box, member)) is not None
        )
        blocks.append(exchange.Block(entry, b, box, parts))
    owners, load, sent = [], [0] * W, [0] * W
    m, n = metas[0].block_shape(specs[0][0])
    setting = (m, n, torch.float32, 5, "quintic")
    start = 0
    for size in bucket_sizes:
        chunk = blocks[start : start + size]
        start += size
        before = list(load)
        for me in range(W):
            ex = [exchange.ExchangeLayout(object(), W, me, boxes) for boxes in layouts]
            scratch = load if me == 0 else list(before)
            bucket = exchange.make_bucket(chunk, metas, ex, setting, torch.device("cpu"), scratch)
            if me == 0:
                owners.append(list(bucket.owners))
            sent[me] += sum(h * w for j in range(W) for _, _, (h, w) in bucket.send[j])
            sent[me] += sum(h * w for j in range(W) for _, _, (h, w) in bucket.recv[j])
    return owners, load, sent


@pytest.mark.parametrize("W", [2, 3, 4, 5])
def test_owner_rule_matches_sharded_muon_builder(W):
    # parameters whose blocks are all 6 x 7, cut in every way the plan meets: heads on dim 0
    # (some whole, some split unevenly), heads on dim 1 and whole matrices cut by rows, experts
    # cut on dim 1
    specs = [
        ((30, 7), ParamMeta(kind="heads_dim0", num_blocks=5), 0),
        ((18, 7), ParamMeta(kind="heads_dim0", num_blocks=3), 0),
        ((6, 35), ParamMeta(kind="heads_dim1", num_blocks=5), 0),
        ((6, 7), ParamMeta(kind="matrix"), 0),
        ((4, 6, 7), ParamMeta(kind="experts", num_blocks=4), 1),
    ]
    rng = random.Random(W)
    for _ in range(3):
        order = [(e, b) for e, (_, meta, _) in enumerate(specs) for b in range(meta.num_blocks)]
        rng.shuffle(order)
        sizes = []
        while sum(sizes) < len(order):
            sizes.append(min(rng.randint(1, 2 * W + 1), len(order) - sum(sizes)))
        flops = f(6, 7)
        want_owners, want_load, want_sent = _sharded_reference(specs, order, sizes, W)
        bal = OwnerBalancer(W)
        got, start = [], 0
        for size in sizes:
            bucket = []
            for entry, b in order[start : start + size]:
                shape, meta, dim = specs[entry]
                rec = ParamRecord(f"p{entry}", shape, meta)
                lo, hi, width = block_span(rec, b, dim)
                bucket.append(block_pieces(lo, hi, width, shape[dim], W))
            got.append(bal.assign(bucket, flops))
            start += size
        assert got == want_owners
        assert bal.load_W.tolist() == want_load
        assert bal.bytes_W.tolist() == want_sent


def test_memory_comm_and_activations_by_hand():
    cfg = hand_cfg()
    cluster = ClusterConfig.preset("h100", 4)
    settings = PlanSettings(seq_len=8)
    layout = Layout.for_gpus(4, ep=4)  # dense FSDP over 4, one whole expert per rank
    est = estimate(cfg, cluster, layout, settings)
    # every dim 0 divides by 4: a quarter of every dense weight, one of the four experts
    local = (TOTAL - EXPERT) // 4 + EXPERT // 4
    mem = est["memory"]
    # bf16 parameters and gradients, an fp32 master copy (the defaults real runs use)
    assert mem["parameters"] == mem["gradients"] == 2 * local == 2 * TOTAL // 4
    assert mem["master"] == 4 * local
    lean = estimate(cfg, cluster, layout, PlanSettings(seq_len=8, master_dtype="none"))
    assert lean["memory"]["master"] == 0
    assert lean["memory"]["total"] == mem["total"] - 4 * local
    # Muon: one fp32 momentum; AdamW (embedding, head, router, norms): two fp32 moments
    assert mem["optimizer"] == 4 * MUON // 4 + 8 * (TOTAL - MUON) // 4
    # per token, bf16: attention 2 (2*16 + 8*4 + 2*2*4*1 + 4*4) + 4*4; dense FFN 2 (2*16 + 3*32);
    # MoE 2 (3*16 + 2*2*16 + 3*2*8 + 3*8) + 4*4 + 12*2; residual 2*16
    per_token = activation_bytes_per_token(cfg, layout, settings)
    assert per_token["dense_layer"] == 208 + 256 + 32
    assert per_token["moe_layer"] == 208 + 408 + 32
    assert per_token["logits"] == 64 * (2 + 8) and per_token["checkpoints"] == 2 * 2 * 16
    assert mem["activations"] == 8 * (64 + 2 * 648 + 640)
    comm = est["comm"]
    # FSDP: two bf16 all-gathers and one bf16 reduce-scatter of the dense weights, (n-1)/n each
    assert comm["dense_fsdp"]["bytes"] == pytest.approx(3 / 4 * (TOTAL - EXPERT) * (2 + 2 + 2))
    # EP: 8 tokens x top-2 x 16 x 2 bytes per all-to-all, 3/4 to other ranks; dispatch and
    # combine in forward, recompute and backward: 6 calls
    assert comm["ep"]["collectives"] == 6
    assert comm["ep"]["bytes"] == pytest.approx(6 * 8 * 2 * 16 * 2 * 3 / 4)
    for axis in ("efsdp", "cp", "dp_replicate", "expert_replicate"):
        assert comm[axis]["bytes"] == 0
    muon = est["muon"]
    assert muon["ns_flops_total"] == NS_TOTAL
    assert muon["ns_flops_per_rank_max"] >= muon["ns_flops_ideal"]
    assert muon["ns_flops_ideal"] == (NS_TOTAL - NS_EXPERT) / 4 + NS_EXPERT / 4
    assert muon["step_s_serial"] >= muon["step_s_overlap"] > 0


def test_all_to_all_bytes_of_the_muon_step_by_hand():
    # dense_fsdp 2: the dense FFN w1 [32, 16] is one block, 16 rows on each rank; its owner
    # (rank 0 or 1) receives 256 elements and returns 256 (bf16: 2 bytes each)
    cfg = hand_cfg(num_experts=0, num_layers=1, num_dense_layers=1)
    records = [r for r in model_inventory(cfg) if r.name.endswith("ffn.w1.weight")]
    layout = Layout.for_gpus(2)
    schedule = simulate_muon(records, layout, PlanSettings())
    group = schedule.groups["dense_fsdp"]
    assert sorted(group.bytes_W.tolist()) == [2 * 256, 2 * 256]
    assert group.collectives == 2 and sorted(group.ns_flops_W.tolist()) == [0, f(32, 16)]


def test_dual_mesh_needs_fewer_gpus_than_shared_for_cp2_ep8():
    assert min_gpus(2, 8, "dual") == 8 and min_gpus(2, 8, "shared") == 16
    dual = Layout.for_gpus(8, cp=2, ep=8)
    assert (dual.dp_shard, dual.efsdp, dual.num_gpus) == (4, 1, 8)
    with pytest.raises(ValueError, match="valid ep: 1, 2, 4; or use mesh='dual'"):
        Layout.for_gpus(8, cp=2, ep=8, mesh="shared")
    shared = Layout.for_gpus(16, cp=2, ep=8, mesh="shared")
    assert shared.num_gpus == 16
    cfg = hand_cfg(num_experts=8)
    out = plan(cfg, ClusterConfig.preset("h100", 8), dual, PlanSettings(seq_len=8))
    assert out["dual"]["feasible"] and not out["shared"]["feasible"]
    assert out["shared"]["layout"]["min_gpus_for_cp_ep"] == 16
    assert "ep=8 must divide dp_shard=4" in out["shared"]["reason"]


def test_ep_group_stays_in_node_on_the_dual_mesh_only():
    layout = dict(dp_shard=8, cp=2, ep=8)
    dual = Layout(**layout)
    shared = Layout(**layout, mesh="shared")
    assert dual.axis_ranks("ep") == list(range(8))
    assert shared.axis_ranks("ep") == list(range(0, 16, 2))  # stride cp: spans two nodes
    assert dual.axis_ranks("dense_fsdp") == shared.axis_ranks("dense_fsdp") == list(range(16))
    assert dual.axis_ranks("efsdp") == [0, 8] and shared.axis_ranks("efsdp") == [0, 1]
    ranks = np.arange(16)
    assert dual.group_index("ep", ranks).tolist() == [r % 8 for r in range(16)]
    assert shared.group_index("ep", ranks).tolist() == [(r // 2) % 8 for r in range(16)]
    cfg = hand_cfg(num_experts=8)
    out = plan(cfg, ClusterConfig.preset("h100", 16), dual, PlanSettings(seq_len=8))
    ep_dual, ep_shared = out["dual"]["comm"]["ep"], out["shared"]["comm"]["ep"]
    assert ep_dual["in_node"] and not ep_shared["in_node"]
    assert ep_dual["bytes"] == ep_shared["bytes"] and ep_dual["seconds"] < ep_shared["seconds"]


def test_layout_validation_messages():
    with pytest.raises(
        ValueError,
        match=r"layout.ep=3 must divide dp_shard\*cp = 4\*2 = 8 \(the expert-parallel axis is "
        r"formed from dp_shard x cp\); valid ep: 1, 2, 4, 8",
    ):
        Layout(dp_shard=4, cp=2, ep=3)
    with pytest.raises(ValueError, match="layout.cp must be a positive integer, got 0"):
        Layout(cp=0)
    with pytest.raises(ValueError, match=r"layout.dp_replicate\*dp_shard\*cp = 2\*3\*2 = 12 "):
        Layout.for_gpus(8, dp_replicate=2, dp_shard=3, cp=2)
    with pytest.raises(ValueError, match="valid dp_replicate for cp=2: 1, 2, 3, 6"):
        Layout.for_gpus(12, dp_replicate=5, cp=2)
    with pytest.raises(ValueError, match="valid expert_replicate: 1, 2, 4"):
        Layout(dp_replicate=8, dp_shard=2, ep=4, expert_replicate=8)
    with pytest.raises(ValueError, match="needs the dual mesh"):
        Layout(dp_replicate=2, dp_shard=4, ep=2, expert_replicate=1, mesh="shared")
    with pytest.raises(ValueError, match="must divide the 6 experts of a layer; valid ep"):
        Layout(dp_shard=8, ep=4).check_model(num_experts=6, seq_len=8)
    with pytest.raises(ValueError, match=r"seq_len=6 must be a multiple of 2\*cp = 4"):
        Layout(dp_shard=2, cp=2).check_model(num_experts=8, seq_len=6)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        Layout(dp_shard=2, ep=2).check_model(num_experts=0, seq_len=8)
    # the seed's separate HSDP layouts: dense FSDP inside a node, experts sharded wider
    wide = Layout(dp_replicate=4, dp_shard=4, cp=2, ep=8, expert_replicate=1)
    assert (wide.dense_fsdp, wide.expert_shard, wide.efsdp) == (8, 32, 4)


def test_cluster_and_settings_validation():
    with pytest.raises(ValueError, match="cluster.num_gpus \\(12\\) must be a multiple of"):
        ClusterConfig.preset("h100", 12)
    with pytest.raises(ValueError, match="unknown GPU preset 'a100'; valid presets: h100, h200"):
        ClusterConfig.preset("a100", 8)
    with pytest.raises(ValueError, match="cluster.comm_efficiency must lie in"):
        ClusterConfig.preset("h200", 8, comm_efficiency=1.5)
    with pytest.raises(ValueError, match="plan.dtype must be one of bf16, fp32"):
        PlanSettings(dtype="fp16")
    settings = PlanSettings(seq_len=8, batch_tokens=100)
    with pytest.raises(ValueError, match="batch_tokens=100 must be a multiple of .* = 32"):
        settings.resolved_batch_tokens(Layout(dp_shard=4))
    assert PlanSettings(seq_len=8, batch_tokens=64).resolved_batch_tokens(Layout(dp_shard=4)) == 64
    with pytest.raises(ValueError, match="covers 4 GPUs .* the cluster has 8"):
        estimate(hand_cfg(), ClusterConfig.preset("h100", 8), Layout(dp_shard=4), PlanSettings())


def test_cli_prints_table_and_writes_json(tmp_path, capsys):
    import argparse

    out = tmp_path / "plan.json"
    argv = ["--config", "tiny", "--gpus", "8", "--cp", "2", "--ep", "8", "--seq-len", "256"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dual mesh" in text and "shared mesh: not possible" in text
    assert "fewest GPUs for cp=2, ep=8" in text
    data = json.loads(out.read_text())
    assert data["dual"]["layout"]["min_gpus_for_cp_ep"] == 8
    assert (
        data["dual"]["muon"]["ns_flops_total"]
        == simulate_muon(
            model_inventory(ModelConfig.preset("tiny")), Layout.for_gpus(1), PlanSettings()
        ).ns_flops_total
    )
    assert main(["--config", "tiny", "--gpus", "8", "--ep", "3"]) == 2
    assert "layout.ep=3 must divide" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--gpus", "16", "--gpu", "h200", "--dp-replicate", "2"])
    assert (args.gpus, args.gpu, args.dp_replicate, args.config) == (16, "h200", 2, "kimi-k2")
    # half the matmul efficiency doubles the Newton-Schulz time
    base = [*argv, "--json", str(out)]
    main(base)
    fast = json.loads(out.read_text())["dual"]["muon"]["compute_s"]
    main([*base, "--matmul-efficiency", "0.3"])
    slow = json.loads(out.read_text())["dual"]["muon"]["compute_s"]
    assert slow == pytest.approx(2 * fast)


def test_format_plan_of_a_feasible_shared_mesh():
    cfg = hand_cfg(num_experts=8)
    layout = Layout.for_gpus(16, cp=2, ep=8)
    out = plan(cfg, ClusterConfig.preset("h200", 16), layout, PlanSettings(seq_len=8))
    text = format_plan(out, model_name="hand")
    assert out["shared"]["feasible"] and "not possible" not in text
    assert "EP all-to-all" in text and "[8/node]" in text and "[8/nodes]" in text


def test_expert_rows_must_split_evenly_when_experts_are_cut():
    # 16 GPUs, ep 1: efsdp 16 over 4 experts cuts them on dim 1; w2's 8 rows do not divide by 16
    with pytest.raises(ValueError, match=r"efsdp=16 \(from ep=1\) cannot shard .*w2 \[4, 8, 16\]"):
        simulate_muon(model_inventory(hand_cfg()), Layout.for_gpus(16), PlanSettings())


def _sharded_muon_stats(bucket_mb: float) -> dict:
    """One ShardedMuon step on the FSDP2-sharded dense hand model (every block and the root on
    a 1-D mesh over all ranks); this rank's ``stats``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from etude.model.transformer import build_model
    from etude.optim import OptimConfig, build_optimizer

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(hand_cfg(num_experts=0), device="cpu", seed=0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(model, OptimConfig(bucket_mb=bucket_mb))
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = p.detach().clone()
        p.grad.to_local().copy_(torch.randn(p.to_local().shape, generator=gen))
    opt.step()
    return dict(opt.stats)


@pytest.mark.slow
@pytest.mark.distributed
def test_schedule_matches_sharded_muon_on_fsdp2(monkeypatch):
    """The plan's per-rank FLOPs, calls and bytes equal what ShardedMuon reports on 4 gloo ranks
    (slow: four processes start torch; the owner rule alone is checked fast above)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "distributed"))
    from launch import run_distributed

    # buckets of ~4 blocks of 8 x 16 fp32: many buckets, the load carried from one to the next
    W, bucket_mb = 4, 0.002
    stats = run_distributed(_sharded_muon_stats, W, bucket_mb)
    settings = PlanSettings(dtype="fp32", bucket_mb=bucket_mb)  # NS runs in fp32 on CPU
    records = model_inventory(hand_cfg(num_experts=0))
    schedule = simulate_muon(records, Layout.for_gpus(W), settings)
    dense = schedule.groups["dense_fsdp"]
    assert [s["ns_flops"] for s in stats] == (schedule.whole_flops + dense.ns_flops_W).tolist()
    assert [s["collectives"] for s in stats] == [dense.collectives] * W
    for s, sent in zip(stats, dense.bytes_W.tolist()):
        # the optimizer pads an empty split to one element (4 bytes), the plan does not
        assert 0 <= s["bytes_sent"] - sent <= 4 * (W - 1) * dense.collectives
