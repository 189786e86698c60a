"""Sharded Muon on FSDP2 over gloo (CPU) against single-process Muon on the same logical blocks.

Each test spawns W processes (``launch.run_distributed``), shards a model with ``fully_shard``,
steps ``etude.optim.build_optimizer``'s optimizer with the same gradients on every rank layout,
and compares every parameter (gathered with ``full_tensor()``) to the reference path
(``etude.optim.Muon``, one process, each parameter's blocks batched on their own). Gradients are
synthetic and deterministic (a seed per parameter name and step), so the comparison isolates the
optimizer; one test runs real FSDP2 forward/backward on the tiny MoE model.

Layouts covered: world sizes 1, 2, 4, 8; a 2x2 HSDP mesh; heads cut by shard boundaries (18
rows over 8 ranks); empty shards; experts on dim 0 (whole on one rank) and on dim 1 (cut); a
parameter whose gradient stays None; two shard axes (expert-parallel on dim 0 x FSDP on dim 1).
Plus: zero bytes when all blocks align, the async schedule's call order, and DCP resharding of
the optimizer state from 4 ranks to 2 and to 1.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launch import run_distributed
from torch import nn

from etude.model.meta import ParamMeta, collect_param_meta
from etude.optim import Muon, OptimConfig, build_optimizer

pytestmark = pytest.mark.distributed

STEPS = 3
CFG = dict(lr=0.02, weight_decay=0.1, adamw_weight_decay=0.05, bucket_mb=0.002)


class AwkwardBlocks(nn.Module):
    """Every block kind in sizes that divide badly over 2, 4 and 8 ranks."""

    def __init__(self, seed: int = 0, with_unused: bool = True) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=gen) * 0.1)

        self.q = weight(18, 12)  # 9 heads of 2 rows: 18 rows over 8 ranks cut heads, 2 ranks empty
        self.o = weight(12, 18)  # 6 heads of 3 columns, cut along rows by Shard(0)
        self.experts = weight(6, 10, 14)  # experts on dim 0: whole on their rank
        # sharded on dim 1 (FSDP2 needs dims > 0 to divide evenly): every expert is cut
        self.experts_cut = weight(4, 8, 7)
        self.wide = weight(18, 20)
        self.small = weight(5, 7)  # 5 rows over 8 ranks: 3 empty shards
        if with_unused:
            self.unused = weight(8, 6)  # its gradient stays None
        self.norm = nn.Parameter(torch.ones(12))
        self.embed = weight(30, 12)

    def param_meta(self) -> dict[str, ParamMeta]:
        meta = {
            "q": ParamMeta(kind="heads_dim0", num_blocks=9),
            "o": ParamMeta(kind="heads_dim1", num_blocks=6),
            "experts": ParamMeta(kind="experts", num_blocks=6),
            "experts_cut": ParamMeta(kind="experts", num_blocks=4),
            "wide": ParamMeta(kind="matrix"),
            "small": ParamMeta(kind="matrix"),
            "norm": ParamMeta(kind="norm"),
            "embed": ParamMeta(kind="embedding"),
        }
        if hasattr(self, "unused"):
            meta["unused"] = ParamMeta(kind="matrix")
        return meta


class AlignedBlocks(nn.Module):
    """Blocks that FSDP's Shard(0) over 4 ranks never cuts: heads on dim 0 and experts."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.q = nn.Parameter(torch.randn(8 * 3, 10, generator=gen))  # 8 heads of 3 rows
        self.experts = nn.Parameter(torch.randn(8, 6, 5, generator=gen))

    def param_meta(self) -> dict[str, ParamMeta]:
        return {
            "q": ParamMeta(kind="heads_dim0", num_blocks=8),
            "experts": ParamMeta(kind="experts", num_blocks=8),
        }


class ExpertParallelBlocks(nn.Module):
    """Parameters for a 2x2 (efsdp, ep) mesh: experts split over ep on dim 0 (whole experts) and
    over efsdp on dim 1 (cut), heads split on dim 0 by both axes (whole heads)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.experts = nn.Parameter(torch.randn(4, 6, 5, generator=gen))
        self.q = nn.Parameter(torch.randn(4 * 3, 8, generator=gen))  # 4 heads of 3 rows

    def param_meta(self) -> dict[str, ParamMeta]:
        return {
            "experts": ParamMeta(kind="experts", num_blocks=4),
            "q": ParamMeta(kind="heads_dim0", num_blocks=4),
        }


def build(name: str) -> nn.Module:
    if name == "tiny":
        from etude.model import ModelConfig, build_model

        return build_model(ModelConfig.preset("tiny"), device="cpu", seed=0)
    if name == "aligned":
        return AlignedBlocks()
    if name == "expert_parallel":
        return ExpertParallelBlocks()
    assert name in ("awkward", "awkward_all_used"), name
    return AwkwardBlocks(with_unused=name == "awkward")


def synthetic_grad(name: str, shape: torch.Size, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
    return torch.randn(shape, generator=gen)


def skips_grad(name: str) -> bool:
    return name == "unused"


def set_grads(model: nn.Module, step: int, backward: bool = False) -> None:
    """Synthetic gradients, or (``backward``) those of next-token loss on a fixed batch, the same
    batch on every rank (FSDP2 then averages W equal gradients)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if backward:
        import torch.nn.functional as F

        tokens_BT = torch.randint(0, 2048, (2, 17), generator=torch.Generator().manual_seed(step))
        logits_BTV = model(tokens_BT[:, :-1])
        model.zero_grad(set_to_none=True)
        F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten()).backward()
        return
    for name, p in model.named_parameters():
        if skips_grad(name):
            p.grad = None
            continue
        g = synthetic_grad(name, p.shape, step)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def shard(model: nn.Module, mesh_shape: tuple[int, ...]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    if isinstance(model, ExpertParallelBlocks):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("efsdp", "ep"))
        layout = {"experts": (Shard(1), Shard(0)), "q": (Shard(0), Shard(0))}
        for name, placements in layout.items():
            full = getattr(model, name).detach()
            setattr(model, name, nn.Parameter(distribute_tensor(full, mesh, placements)))
        return
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    cut = getattr(model, "experts_cut", None)

    def placement(p: nn.Parameter) -> Shard:
        return Shard(1) if p is cut else Shard(0)

    for layer in getattr(model, "layers", []):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


class RecordedWork:
    """A real all-to-all handle that notes when it is waited on."""

    def __init__(self, work: Any, call: int, events: list[tuple[str, int]]) -> None:
        self.work, self.call, self.events = work, call, events

    def wait(self) -> Any:
        self.events.append(("wait", self.call))
        return self.work.wait()


def record_all_to_all(events: list[tuple[str, int]], sizes: list[int]) -> None:
    """Route ``dist.all_to_all_single`` through a recorder (the real collective still runs)."""
    real = dist.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        call = len(sizes)
        sizes.append(input.numel() * input.element_size())
        events.append(("issue", call))
        work = real(output, input, output_split_sizes, input_split_sizes, **kw)
        return RecordedWork(work, call, events) if kw.get("async_op") else work

    dist.all_to_all_single = recording


def app_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def load_app_state(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """DCP load into whatever layout ``model`` has now (resharding as needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = app_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def run_scenario(sc: dict[str, Any]) -> dict[str, Any]:
    """Shard a model, optionally load a checkpoint, take optimizer steps, optionally save."""
    import torch.distributed.checkpoint as dcp

    if sc["model"] == "cut_twice":
        return {"error": blocks_cut_twice()}
    model = build(sc["model"])
    if sc.get("mesh"):
        shard(model, sc["mesh"])
    events: list[tuple[str, int]] = []
    sizes: list[int] = []
    real = dist.all_to_all_single
    if sc.get("record"):
        record_all_to_all(events, sizes)
    try:
        opt = build_optimizer(model, OptimConfig(**{**CFG, **sc.get("cfg", {})}))
        if "load" in sc:
            load_app_state(model, opt, sc["load"])
        start = sc.get("start", 0)
        for step in range(start, start + sc.get("steps", STEPS)):
            set_grads(model, step, backward=sc.get("backward", False))
            opt.step()
        if "save" in sc:
            dcp.save(app_state(model, opt), checkpoint_id=sc["save"])
    finally:
        dist.all_to_all_single = real
    exchange_sizes = sorted({b.size for plan in opt._plans.values() for b in plan if b.needs_comm})
    return {
        "params": gathered(model),
        "stats": dict(opt.stats),
        "events": events,
        "sizes": sizes,
        "exchange_sizes": exchange_sizes,
    }


def sharded_run(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker: run the scenarios in order on this rank."""
    return [run_scenario(sc) for sc in scenarios]


def blocks_cut_twice() -> str:
    """Worker: experts cut by two mesh axes at once must be refused, on every rank alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = ExpertParallelBlocks()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    model.experts = nn.Parameter(
        distribute_tensor(model.experts.detach(), mesh, (Shard(1), Shard(2)))
    )
    model.q = nn.Parameter(distribute_tensor(model.q.detach(), mesh, (Shard(0), Shard(0))))
    opt = build_optimizer(model, OptimConfig(**CFG))
    set_grads(model, 0)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return "no error"


def reference_run(model_name: str, steps: int = STEPS, backward: bool = False):
    """Single-process Muon (the reference path), parameters grouped straight from metadata."""
    model = build(model_name)
    c = OptimConfig(**CFG)
    groups = []
    for name, meta in collect_param_meta(model).items():
        p = dict(model.named_parameters())[name]
        if meta.optimizer == "muon":
            groups.append({"params": [p], "kind": meta.kind, "num_blocks": meta.num_blocks})
        else:
            groups.append(
                {
                    "params": [p],
                    "algorithm": "adamw",
                    "lr": c.resolved_adamw_lr,
                    "weight_decay": c.adamw_weight_decay,
                }
            )
    opt = Muon(
        groups, lr=c.lr, weight_decay=c.weight_decay, momentum=c.momentum, ns_dtype="float32"
    )
    for step in range(steps):
        set_grads(model, step, backward=backward)
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_params_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    out = {name: reference_run(name) for name in ("awkward", "tiny", "aligned", "expert_parallel")}
    out["tiny_backward"] = reference_run("tiny", steps=1, backward=True)
    out["awkward_all_used"] = reference_run("awkward_all_used", steps=4)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("dcp") / "step2")


@pytest.fixture(scope="module")
def world4(checkpoint) -> list[list[dict[str, Any]]]:
    scenarios = [
        {"model": "awkward", "mesh": (4,), "record": True},
        {"model": "awkward", "mesh": (4,), "cfg": {"async_comm": False}},
        {"model": "tiny", "mesh": (4,)},
        {"model": "awkward", "mesh": (2, 2)},
        {"model": "aligned", "mesh": (4,), "record": True},
        {"model": "expert_parallel", "mesh": (2, 2)},
        {"model": "awkward_all_used", "mesh": (4,), "steps": 2, "save": checkpoint},
        {"model": "cut_twice"},
    ]
    return run_distributed(sharded_run, 4, scenarios)


@pytest.fixture(scope="module")
def world2(world4, checkpoint) -> list[list[dict[str, Any]]]:
    scenarios = [
        {"model": "awkward", "mesh": (2,)},
        {"model": "tiny", "mesh": (2,)},
        {"model": "tiny", "mesh": (2,), "backward": True, "steps": 1},
        {"model": "awkward_all_used", "mesh": (2,), "load": checkpoint, "start": 2, "steps": 2},
    ]
    return run_distributed(sharded_run, 2, scenarios)


def test_world1_matches_single_process(reference):
    scenarios = [{"model": "awkward", "mesh": (1,)}, {"model": "tiny", "mesh": (1,)}]
    ((awkward, tiny),) = run_distributed(sharded_run, 1, scenarios)
    assert_params_match(awkward["params"], reference["awkward"])
    assert_params_match(tiny["params"], reference["tiny"])
    assert awkward["stats"]["bytes_sent"] == 0 and tiny["stats"]["collectives"] == 0


def test_world2_matches_single_process(world2, reference):
    for awkward, tiny, _, _ in world2:
        assert_params_match(awkward["params"], reference["awkward"])
        assert_params_match(tiny["params"], reference["tiny"])


def test_world2_fsdp_backward_matches_single_process(world2, reference):
    """One step on FSDP2's own gradients (forward, backward, reduce-scatter), which differ from
    one process's by float rounding (~1e-7). Muon smooths that; AdamW's first step is close to
    lr * sign(g), which turns rounding in near-zero entries into ~1e-5 (lr 0.02), and later
    steps amplify it further (MoE routing), so this test takes one step."""
    metas = collect_param_meta(build("tiny"))
    want = reference["tiny_backward"]
    for _, _, tiny_backward, _ in world2:
        got = tiny_backward["params"]
        for name, meta in metas.items():
            tol = 1e-6 if meta.optimizer == "muon" else 1e-4
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=tol, msg=name)


def test_world4_matches_single_process(world4, reference):
    for awkward_async, awkward_sync, tiny, hsdp, aligned, ep, *_ in world4:
        assert_params_match(awkward_async["params"], reference["awkward"])
        assert_params_match(awkward_sync["params"], reference["awkward"])
        assert_params_match(tiny["params"], reference["tiny"])
        assert_params_match(hsdp["params"], reference["awkward"])
        assert_params_match(aligned["params"], reference["aligned"])
        assert_params_match(ep["params"], reference["expert_parallel"])


def test_exchange_runs_over_the_axis_that_cuts_blocks(world4):
    for rank_results in world4:
        flat, hsdp, ep = rank_results[0], rank_results[3], rank_results[5]
        assert flat["exchange_sizes"] == [4]
        assert hsdp["exchange_sizes"] == [2], "HSDP: the shard axis only, replicas repeat"
        assert ep["exchange_sizes"] == [2], "two shard axes: only efsdp cuts experts"
        assert hsdp["stats"]["bytes_sent"] > 0 and ep["stats"]["bytes_sent"] > 0


def test_unused_parameter_is_untouched(world4):
    start = AwkwardBlocks().unused.detach()
    for rank_results in world4:
        torch.testing.assert_close(rank_results[0]["params"]["unused"], start, rtol=0, atol=0)


def test_aligned_blocks_send_nothing(world4):
    for rank_results in world4:
        aligned = rank_results[4]
        assert aligned["sizes"] == [] and aligned["events"] == []
        assert aligned["stats"]["bytes_sent"] == 0 and aligned["stats"]["collectives"] == 0
        assert aligned["stats"]["ns_flops"] > 0


def test_async_schedule_issues_next_bucket_before_waiting(world4):
    for rank_results in world4:
        events = rank_results[0]["events"]
        num_calls = sum(kind == "issue" for kind, _ in events)
        per_step = num_calls // STEPS
        assert per_step >= 6, "too few buckets with communication to test the overlap"
        assert [call for kind, call in events if kind == "issue"] == list(range(num_calls))
        issued = set()
        for kind, call in events:
            if kind == "issue":
                issued.add(call)
            elif (call + 1) % per_step != 0:
                # all-to-all c+1 (the next bucket's gather, or this bucket's return) is in
                # flight before the rank blocks on c; only a step's last call has no successor
                assert call + 1 in issued, f"waited on all-to-all {call} before issuing {call + 1}"
        waits = sorted(call for kind, call in events if kind == "wait")
        assert waits == list(range(num_calls)), "every all-to-all is waited on exactly once"


def test_byte_count_matches_the_collectives(world4):
    for rank_results in world4:
        awkward = rank_results[0]
        per_step = len(awkward["sizes"]) // STEPS
        last_step = awkward["sizes"][-per_step:]
        # the optimizer's count leaves out the 1-element pad each rank "sends" itself
        assert awkward["stats"]["bytes_sent"] == sum(last_step) - 4 * per_step
        assert awkward["stats"]["collectives"] == per_step


def test_dcp_reshards_optimizer_from_4_to_2_ranks(world2, reference):
    for *_, resumed in world2:
        assert_params_match(resumed["params"], reference["awkward_all_used"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reshards_optimizer_from_4_ranks_to_one_process(world4, checkpoint, reference):
    resumed = run_scenario(
        {"model": "awkward_all_used", "load": checkpoint, "start": 2, "steps": 2}
    )
    assert_params_match(resumed["params"], reference["awkward_all_used"])


def test_blocks_cut_by_two_mesh_axes_are_refused(world4):
    messages = [rank_results[-1]["error"] for rank_results in world4]
    assert all("cut by mesh axes [0, 1]" in m for m in messages), messages


def eight_rank_run() -> list[dict[str, Any]]:
    return sharded_run([{"model": "awkward", "mesh": (8,)}, {"model": "tiny", "mesh": (8,)}])


@pytest.mark.slow
def test_world8_matches_single_process(reference):
    results = run_distributed(eight_rank_run, 8, timeout_s=300)
    for awkward, tiny in results:
        assert_params_match(awkward["params"], reference["awkward"])
        assert_params_match(tiny["params"], reference["tiny"])
