"""Dual-mesh training on gloo (CPU) against one process with the same seed and data.

Every layout runs the pretraining step of ``etude.pretrain`` (global batch sliced over the
data-parallel ranks, sequences split over cp, loss divided by the global token count, both-mesh
gradient clipping, sharded Muon or AdamW, expert loads summed before the bias update) on a
model built on the meta device, ``parallelize``-d and materialized; the reference is the
single-process path of the same module. Compared: the loss of every step, every full gradient
of the first step, the total gradient norm, and every parameter and router bias after the last
step.

Layouts (dp_replicate, dp_shard, cp, ep): world 4 in the default suite, all in one spawn (each
layout builds its own meshes over the same process group); world 8 (the issue's five layouts)
marked slow. Plus: the meshes' process groups against ``ParallelDims.axis_groups``, and the
placements the parameters end up with.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from launch import run_distributed

pytestmark = pytest.mark.distributed

MODEL = dict(
    preset="tiny",
    vocab_size=96,
    dim=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    dense_ffn_dim=48,
    num_dense_layers=1,
    num_experts=8,
    num_experts_per_tok=2,
    expert_ffn_dim=16,
    num_shared_experts=1,
    max_seq_len=32,
    bias_update_rate=0.01,
)
GLOBAL_BATCH, SEQ_LEN, STEPS, SEED, CLIP = 8, 16, 3, 7, 0.5
TOKENS = GLOBAL_BATCH * SEQ_LEN

LAYOUTS_4 = {
    "fsdp4": dict(dp_shard=4),
    "hsdp2x2": dict(dp_replicate=2, dp_shard=2),
    "cp2_dp2_ep4": dict(dp_shard=2, cp=2, ep=4),
    "ep2_efsdp2": dict(dp_shard=4, ep=2),
    "ep2_rep2": dict(dp_replicate=2, dp_shard=2, ep=2),
}
LAYOUTS_8 = {
    "fsdp8": dict(dp_shard=8),
    "hsdp2x4": dict(dp_replicate=2, dp_shard=4),
    "cp2_dp4_ep8": dict(dp_shard=4, cp=2, ep=8),
    "ep4_efsdp2": dict(dp_shard=8, ep=4),
    "ep2_rep2": dict(dp_replicate=2, dp_shard=4, ep=2),
}


def model_config():
    from etude.pretrain import resolve_model_config

    return resolve_model_config(MODEL)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens_BT = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ_LEN + 1), generator=gen)
    return tokens_BT[:, :-1], tokens_BT[:, 1:]


def optim_config(name: str):
    from etude.optim import OptimConfig

    # Adam's update is m / (sqrt(v) + eps), ~ g / (|g| + eps) at first: gradient entries near
    # eps turn fp32 reduction-order noise (~1e-9) into update differences of order lr. A
    # larger eps and (AdamW everywhere) a smaller lr keep the comparison at fp32 precision;
    # the parameters still move ~1000x the tolerance per step
    lr = 0.02 if name == "muon" else 2e-3
    return OptimConfig(name=name, lr=lr, weight_decay=0.1, bucket_mb=0.01, adamw_eps=1e-6)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class Run:
    """A model, its optimizer and the step of the single-process or the sharded path."""

    def __init__(
        self, optim: str, layout: dict[str, int] | None = None, skew: bool = False
    ) -> None:
        from etude.model.transformer import Transformer, build_model
        from etude.optim import build_optimizer

        self.mesh = None
        if layout is None:
            self.model = build_model(model_config(), device="cpu", seed=SEED)
        else:
            from etude.parallel import ParallelConfig, ParallelDims
            from etude.parallel.fsdp import materialize, parallelize

            dims = ParallelDims.from_config(ParallelConfig(**layout), dist.get_world_size())
            self.mesh = dims.build_mesh("cpu")
            with torch.device("meta"):
                self.model = Transformer(model_config())
            parallelize(self.model, self.mesh)
            materialize(self.model, "cpu", seed=SEED)
        if skew:
            # every token picks experts 0 and 1: with ep > 1 the other ep ranks' experts get no
            # row at all and must still run both all-to-alls and their backward
            for name, buffer in self.model.named_buffers():
                if name.endswith("expert_bias"):
                    buffer[:2] = 10.0
        self.opt = build_optimizer(self.model, optim_config(optim))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        from etude.pretrain import data_parallel_slice

        inputs, targets = global_batch(step)
        if self.mesh is None:
            return inputs, targets
        dims = self.mesh.dims
        return data_parallel_slice((inputs, targets), dims.dp, self.mesh.coordinate()["dp"])

    def loss(self, step: int, backward: bool) -> float:
        from etude.pretrain import all_reduce_sum, next_token_loss, sharded_next_token_loss

        inputs, targets = self.batch(step)
        if self.mesh is None:
            loss = next_token_loss(self.model, inputs, targets)
            if backward:
                loss.backward()
            return loss.item()
        part = sharded_next_token_loss(
            self.model,
            inputs,
            targets,
            mesh=self.mesh,
            cp_mode="allgather",
            num_global_tokens=TOKENS,
            backward=backward,
        )
        return all_reduce_sum(part).item()

    def eval_loss(self, step: int) -> float:
        self.model.eval()
        with torch.no_grad():
            loss = self.loss(step, backward=False)
        self.model.train()
        return loss

    def train_step(self, step: int, out: dict[str, Any]) -> None:
        from etude.parallel.fsdp import clip_grad_norm, sync_expert_load

        self.opt.zero_grad(set_to_none=True)
        out["losses"].append(self.loss(step, backward=True))
        if step == 0:
            out["grads"] = {n: full(p.grad) for n, p in self.model.named_parameters()}
        if self.mesh is None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        else:
            norm = clip_grad_norm(self.model.parameters(), CLIP)
        out["norms"].append(float(norm))
        self.opt.step()
        sync_expert_load(self.model)
        self.model.update_expert_bias()

    def state(self, out: dict[str, Any]) -> dict[str, Any]:
        out["params"] = {n: full(p) for n, p in self.model.named_parameters()}
        out["biases"] = {
            n: b.clone() for n, b in self.model.named_buffers() if n.endswith("expert_bias")
        }
        return out

    def continuation(self) -> dict[str, float]:
        """Loss on batch STEPS, one more step on it, loss on batch STEPS + 1."""
        before = self.eval_loss(STEPS)
        self.train_step(STEPS, {"losses": [], "norms": []})
        return {"before": before, "after": self.eval_loss(STEPS + 1)}


def single_process_run(optim: str, steps: int = STEPS, skew: bool = False) -> dict[str, Any]:
    """The reference: ``etude.pretrain``'s single-process step on the whole global batch."""
    run = Run(optim, skew=skew)
    out: dict[str, Any] = {"losses": [], "norms": []}
    for step in range(steps):
        run.train_step(step, out)
    return run.state(out)


def sharded_run(
    layout: dict[str, int], optim: str, steps: int, checkpoint_dir: str | None, skew: bool = False
) -> dict[str, Any]:
    """One layout on the current process group; full tensors come back from rank 0 only.

    With ``checkpoint_dir``: save model and optimizer after the last step (DCP), then report
    the loss continuation that a run loading it must reproduce.
    """
    from torch.distributed.tensor import DTensor

    from etude.parallel.checkpoint import save_checkpoint

    run = Run(optim, layout, skew)
    mesh, model = run.mesh, run.model
    out: dict[str, Any] = {"losses": [], "norms": []}
    for step in range(steps):
        run.train_step(step, out)
    run.state(out)
    out["placements"] = {
        n: (tuple(p.device_mesh.mesh_dim_names), tuple(str(pl) for pl in p.placements))
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    out["local_shapes"] = {
        n: tuple(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)
    }
    out["groups"] = {
        axis: sorted(dist.get_process_group_ranks(m.get_group()))
        for axis, m in (
            ("cp", mesh.cp),
            ("ep", mesh.ep),
            ("efsdp", mesh.expert["efsdp"]),
            ("dp_replicate", mesh.dense["dp_replicate"]),
            ("dp_shard", mesh.dense["dp_shard"]),
        )
    }
    # the router biases must agree on every rank, not only on rank 0
    bias = torch.cat(list(out["biases"].values()))
    gathered = [torch.empty_like(bias) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, bias)
    out["biases_agree"] = all(torch.equal(g, bias) for g in gathered)
    if checkpoint_dir is not None:
        save_checkpoint(checkpoint_dir, steps, model, run.opt)
        out["continuation"] = run.continuation()
    return out if dist.get_rank() == 0 else {"groups": out["groups"]}


def resumed_run(layout: dict[str, int] | None, optim: str, checkpoint_dir: str) -> dict[str, float]:
    """Load the checkpoint into a fresh model of ``layout`` (None: one process), continue."""
    from etude.parallel.checkpoint import latest_checkpoint, load_checkpoint

    run = Run(optim, layout)
    extra = load_checkpoint(latest_checkpoint(checkpoint_dir), run.model, run.opt)
    assert extra["step"] == STEPS, extra
    return run.continuation()


def sharded_init(layout: dict[str, int]) -> dict[str, torch.Tensor]:
    """``materialize(init="sharded")``: every rank initializes only its shards."""
    from etude.model.transformer import Transformer
    from etude.parallel import ParallelConfig, ParallelDims
    from etude.parallel.fsdp import materialize, parallelize

    mesh = ParallelDims.from_config(ParallelConfig(**layout), dist.get_world_size()).build_mesh(
        "cpu"
    )
    with torch.device("meta"):
        model = Transformer(model_config())
    parallelize(model, mesh)
    materialize(model, "cpu", seed=SEED, init="sharded")
    state = {n: full(p) for n, p in model.named_parameters()}
    state.update({n: b.clone() for n, b in model.named_buffers()})
    return state


def run_jobs(jobs: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Several layouts in one spawn: each builds its own meshes over the same process group.

    A job is ``(name, layout, optim, steps, checkpoint_dir or None[, skew])``, or
    ``(name, layout)`` for a sharded initialization.
    """
    return {job[0]: sharded_run(*job[1:]) if len(job) > 2 else sharded_init(job[1]) for job in jobs}


def resume_jobs(layout: dict[str, int], optim: str, checkpoint_dir: str) -> dict[str, float]:
    return resumed_run(layout, optim, checkpoint_dir)


def assert_matches(name: str, got: dict[str, Any], ref: dict[str, Any]) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (name, "loss", step, a, b)
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
        assert a == pytest.approx(b, rel=1e-5), (name, "grad norm", step, a, b)
    assert set(got["grads"]) == set(ref["grads"])
    for n, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-6, msg=f"{name} grad {n}")
    assert set(got["params"]) == set(ref["params"])
    for n, p in ref["params"].items():
        torch.testing.assert_close(got["params"][n], p, rtol=1e-4, atol=1e-6, msg=f"{name} {n}")
    assert set(got["biases"]) == set(ref["biases"]) and ref["biases"]
    for n, b in ref["biases"].items():
        torch.testing.assert_close(got["biases"][n], b, rtol=0, atol=1e-6, msg=f"{name} {n}")
    assert got["biases_agree"], name


def check_layout_structure(name: str, layout: dict[str, int], world: int, results) -> None:
    """Process groups equal the pure rank arithmetic; experts are split over ep as asked."""
    from etude.parallel import ParallelConfig, ParallelDims

    dims = ParallelDims.from_config(ParallelConfig(**layout), world)
    for rank, res in enumerate(results):
        for axis, ranks in res[name]["groups"].items():
            expect = next(g for g in dims.axis_groups(axis) if rank in g)
            assert ranks == expect, (name, rank, axis, ranks, expect)
    got = results[0][name]
    E, D, F = MODEL["num_experts"], MODEL["dim"], MODEL["expert_ffn_dim"]
    w1 = "layers.1.ffn.experts.w1"
    mesh_names, placements = got["placements"][w1]
    if dims.ep > 1:
        # whole experts per ep rank (dim 0), FSDP over efsdp on dim 1
        assert mesh_names == ("dp_replicate", "efsdp", "ep"), mesh_names
        assert placements == ("R", "S(1)", "S(0)"), placements
        assert got["local_shapes"][w1] == (E // dims.ep, D // dims.efsdp, F)
    else:
        assert placements[-1] == "S(0)", placements
        assert got["local_shapes"][w1][0] == -(-E // dims.fsdp)
    q_names, q_placements = got["placements"]["layers.0.attention.q_proj.weight"]
    assert q_names[-1] == "fsdp" and q_placements[-1] == "S(0)", (q_names, q_placements)


@pytest.fixture(scope="module")
def reference_muon() -> dict[str, Any]:
    return single_process_run("muon")


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> Any:
    return tmp_path_factory.mktemp("dual_mesh_ckpt")


@pytest.fixture(scope="module")
def world4(checkpoint_root) -> list[dict[str, Any]]:
    """The world-4 layouts (Muon), one AdamW layout, and a checkpoint save, in one spawn."""
    jobs = [
        (name, layout, "muon", STEPS, str(checkpoint_root) if name == "cp2_dp2_ep4" else None)
        for name, layout in LAYOUTS_4.items()
    ]
    jobs.append(("adamw_cp2_dp2_ep2", dict(dp_shard=2, cp=2, ep=2), "adamw", 2, None))
    jobs.append(("skewed_cp2_dp2_ep4", dict(dp_shard=2, cp=2, ep=4), "muon", 2, None, True))
    jobs.append(("init_sharded", dict(dp_shard=4, ep=2)))
    return run_distributed(run_jobs, 4, jobs, timeout_s=600)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_world4_layout_matches_one_process(world4, reference_muon, name):
    check_layout_structure(name, LAYOUTS_4[name], 4, world4)
    assert_matches(name, world4[0][name], reference_muon)


def test_world4_adamw_with_cp_and_ep_matches_one_process(world4):
    assert_matches(
        "adamw_cp2_dp2_ep2", world4[0]["adamw_cp2_dp2_ep2"], single_process_run("adamw", 2)
    )


def test_world4_expert_parallel_with_idle_experts_matches_one_process(world4):
    """All tokens routed to experts 0 and 1 (ep rank 0): three ep ranks hold idle experts."""
    ref = single_process_run("muon", 2, skew=True)
    assert_matches("skewed_cp2_dp2_ep4", world4[0]["skewed_cp2_dp2_ep4"], ref)


def test_world4_sharded_init_draws_every_shard_from_the_init_distribution(world4):
    """Not the single-process values (DTensor random ops), but the same law on every shard:
    norms are ones, buffers zeros, and each FSDP or EP shard of a matrix is a fresh N(0, std)
    draw (no two shards equal, each with the configured std)."""
    state = world4[0]["init_sharded"]
    reference = Run("muon").model.state_dict()
    assert set(state) >= set(reference)
    std = model_config().init_std
    for name, value in state.items():
        assert torch.isfinite(value).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        elif "expert_bias" in name or "tokens_per_expert" in name:
            assert torch.equal(value, torch.zeros_like(value)), name
        else:
            assert not torch.equal(value, reference[name]), name
            halves = value.flatten(0, -2).chunk(2) if value.dim() > 1 else value.chunk(2)
            assert not torch.equal(halves[0], halves[1][: len(halves[0])]), name
            assert 0.8 * std < float(value.std()) < 1.2 * std, (name, float(value.std()))


def test_checkpoint_from_world4_loads_at_world2_and_world1(world4, checkpoint_root):
    """Saved at (dp_shard 2, cp 2, ep 4): the loss on the next batch and after one more step
    (optimizer state resharded too) are the same at (cp 2, ep 2) on 2 ranks and on 1 process."""
    saved = world4[0]["cp2_dp2_ep4"]["continuation"]
    world2 = run_distributed(
        resume_jobs, 2, dict(dp_shard=1, cp=2, ep=2), "muon", str(checkpoint_root), timeout_s=300
    )[0]
    world1 = resumed_run(None, "muon", str(checkpoint_root))
    for got in (world2, world1):
        assert got["before"] == pytest.approx(saved["before"], rel=1e-5), (got, saved)
        assert got["after"] == pytest.approx(saved["after"], rel=1e-5), (got, saved)


@pytest.mark.slow
def test_world8_layouts_match_one_process_and_checkpoint_loads_at_4_and_1(reference_muon, tmp_path):
    """The issue's five world-8 layouts; the checkpoint of (dp_shard 4, cp 2, ep 8) loads at
    world 4 (dp_shard 2, ep 2) and in one process with the same losses."""
    jobs = [
        (name, layout, "muon", STEPS, str(tmp_path) if name == "cp2_dp4_ep8" else None)
        for name, layout in LAYOUTS_8.items()
    ]
    results = run_distributed(run_jobs, 8, jobs, timeout_s=1200)
    for name, layout in LAYOUTS_8.items():
        check_layout_structure(name, layout, 8, results)
        assert_matches(name, results[0][name], reference_muon)
    saved = results[0]["cp2_dp4_ep8"]["continuation"]
    world4 = run_distributed(resume_jobs, 4, dict(dp_shard=4, ep=2), "muon", str(tmp_path))[0]
    world1 = resumed_run(None, "muon", str(tmp_path))
    for got in (world4, world1):
        assert got["before"] == pytest.approx(saved["before"], rel=1e-5), (got, saved)
        assert got["after"] == pytest.approx(saved["after"], rel=1e-5), (got, saved)
