"""``parallelize(model, mesh)``: EP, CP and FSDP2 on the dual mesh, and the step-time helpers.

The model is built parallelism-free (on the meta device); this module shards it afterwards, in
a fixed order (each step needs the one before it):

1. EP: every MoE layer's `GroupedExperts` becomes `ExpertParallelExperts`, its weights DTensors
   on the expert mesh ``(dp_replicate, efsdp, ep)`` sharded ``Shard(0)`` over ``ep`` (whole
   experts per rank). First, because FSDP must see these weights as DTensors already.
2. CP: every `Attention` becomes `ContextParallelAttention` over the dense mesh's ``cp`` axis
   (parameters unchanged; only its forward differs).
3. FSDP on the experts (only when ep > 1): ``fully_shard(moe.experts, mesh=expert mesh,
   dp_mesh_dims=(shard efsdp, replicate dp_replicate))`` with ``shard_placement_fn`` putting
   FSDP's shard on dim 1 (or 2): dim 0 is already split by ``ep``, and FSDP on it would
   interleave with that split (``_StridedShard``) and cut experts for the optimizer. Each
   expert stays whole along dim 0, so sharded Muon exchanges only over ``efsdp``.
4. FSDP on each transformer block over the dense FSDP mesh (``dp_shard x cp`` flattened; HSDP
   with ``dp_replicate``): attention, norms, dense FFN, router and shared experts together;
   the block's experts are already their own group and are skipped.
5. FSDP on the root: embeddings, final norm, head (a tied head stays with its embedding).
6. Gradient reduction: the loss is divided by the tokens of the *global* batch on every rank,
   so gradients must be *summed* over data-parallel ranks. FSDP2 averages by default (divides
   by its mesh size), which would be wrong twice over: dense weights would be averaged over
   ``dp_shard x cp`` ranks and expert weights over only ``efsdp`` ranks while their gradients
   already hold the tokens of all ``ep`` ranks (EP times too large). So every group gets
   divide factor 1 and sum-only collectives (gloo has no PREMUL_SUM).
7. Explicit prefetch when ep > 1: the EP all-to-all syncs the host on its split sizes, which
   would delay FSDP's implicit next-layer all-gather; each block prefetches the next block (and
   its experts) in forward and the previous one in backward.

Step-time helpers: `clip_grad_norm` (one total norm over parameters on both meshes and plain
tensors), `sync_expert_load` (sum the MoE load counts over all ranks before the balancing
update), `load_full_state` (copy a full, unsharded state into a sharded model).

Not here: tensor or pipeline parallelism, float8, activation checkpointing, torch.compile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from etude.model.moe import MoE
from etude.parallel.context import apply_context_parallel
from etude.parallel.dims import DualMesh
from etude.parallel.expert import make_expert_parallel


def _expert_shard_placement(efsdp: int) -> Any:
    from torch.distributed.tensor import Shard

    def placement(param: nn.Parameter) -> Any:
        for d in (1, 2):
            if param.shape[d] % efsdp == 0:
                return Shard(d)
        raise ValueError(
            f"expert weight of shape {tuple(param.shape)} cannot be FSDP-sharded evenly over "
            f"efsdp={efsdp} on dim 1 or 2; choose parallel.ep so that dp_shard * cp / ep "
            "divides model.dim or model.expert_ffn_dim"
        )

    return placement


def parallelize(model: nn.Module, mesh: DualMesh, *, cp_mode: str = "allgather") -> nn.Module:
    """Apply EP, CP and FSDP2 to a `Transformer` in place (see the module docstring for order).

    Call on the meta-device model (then ``to_empty`` and initialize, see `materialize`) or on
    a materialized one. ``cp_mode``: ``allgather`` or ``ring`` (``etude.parallel.context``).
    """
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    dims = mesh.dims
    dims.check_model(model.cfg)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    # 1. EP
    if dims.ep > 1:
        for moe in moes:
            make_expert_parallel(moe.experts, mesh.expert)
    # 2. CP
    if dims.cp > 1:
        apply_context_parallel(model, mesh.cp, cp_mode)
    fsdp_modules = []
    # 3. FSDP on experts over efsdp (x dp_replicate)
    expert_groups: dict[int, nn.Module] = {}
    if dims.ep > 1:
        mesh_dims = DataParallelMeshDims(
            shard="efsdp", replicate="dp_replicate" if dims.dp_replicate > 1 else None
        )
        for moe in moes:
            fully_shard(
                moe.experts,
                mesh=mesh.expert,
                dp_mesh_dims=mesh_dims,
                shard_placement_fn=_expert_shard_placement(dims.efsdp),
            )
            fsdp_modules.append(moe.experts)
            expert_groups[id(moe)] = moe.experts
    # 4. FSDP on blocks over the dense mesh
    blocks = list(model.layers)
    for block in blocks:
        fully_shard(block, mesh=mesh.fsdp)
        fsdp_modules.append(block)
    # 5. root: embeddings, final norm, head
    fully_shard(model, mesh=mesh.fsdp)
    fsdp_modules.append(model)
    # 6. sum, not average, over data-parallel ranks (loss is divided by global tokens)
    for module in fsdp_modules:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    # 7. explicit prefetch across the EP all-to-all's host sync
    if dims.ep > 1:
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch(_with_experts(blocks[i + 1], expert_groups))
            if i > 0:
                block.set_modules_to_backward_prefetch(_with_experts(blocks[i - 1], expert_groups))
    return model


def _with_experts(block: nn.Module, expert_groups: Mapping[int, nn.Module]) -> list[nn.Module]:
    ffn = getattr(block, "ffn", None)
    out = [block]
    if ffn is not None and id(ffn) in expert_groups:
        out.append(expert_groups[id(ffn)])
    return out


def materialize(
    model: nn.Module, device: torch.device | str, *, seed: int, init: str = "replicated"
) -> nn.Module:
    """Allocate a (sharded) meta-device `Transformer` on ``device`` and initialize it.

    ``init="replicated"``: build the full model from ``seed`` on the CPU (as one process would)
    and keep this rank's shards: bit-identical to the single-process model, at the cost of the
    full model in host memory for a moment. ``init="sharded"``: ``init_weights(seed)`` on the
    shards themselves (DTensor random ops: the same distribution, other values).
    """
    from etude.model.transformer import build_model

    model.to_empty(device=device)
    model.tie_weights()
    if init == "replicated":
        full = build_model(model.cfg, device="cpu", seed=seed)
        load_full_state(model, {**dict(full.named_parameters()), **dict(full.named_buffers())})
    elif init == "sharded":
        model.init_weights(seed)
    else:
        raise ValueError(f"parallel.init must be 'replicated' or 'sharded', got {init!r}")
    return model


@torch.no_grad()
def load_full_state(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy a full (unsharded) state dict into a sharded model: each rank keeps its shards.

    Every rank passes the same full tensors (e.g. built from the same seed), so no
    communication is needed: the local shard of a DTensor is cut out of the full tensor
    (``distribute_tensor`` with ``src_data_rank=None``). Buffers are copied whole.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    missing = sorted(set(targets) - set(state))
    if missing:
        raise ValueError(f"full state is missing {missing[:5]}; pass the model's state_dict()")
    for name, target in targets.items():
        full = state[name]
        if isinstance(target, DTensor):
            shard = distribute_tensor(
                full.to(target.to_local().device),
                target.device_mesh,
                target.placements,
                src_data_rank=None,
            )
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float) -> Tensor:
    """Clip gradients to a total L2 norm of ``max_norm``; return the total norm (before clip).

    The norm covers every gradient, on the dense mesh, the expert mesh or plain: each rank adds
    the squares of its local shards, divided by how many ranks hold the same shard (the sizes
    of the mesh axes the gradient is replicated on; a plain tensor is on every rank), and one
    all-reduce over all ranks sums them. (``torch.nn.utils.clip_grad_norm_`` on DTensors of two
    meshes fails: "All operands in aten.stack must have the same mesh".) The scale is
    ``min(1, max_norm / (norm + 1e-6))`` as in ``clip_grad_norm_``, which this equals on one
    process up to summation order. ``max_norm = inf`` only measures.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    world = dist.get_world_size() if distributed else 1
    locals_, weights = [], []
    for g in grads:
        if isinstance(g, DTensor):
            copies = 1
            for axis, placement in enumerate(g.placements):
                assert isinstance(placement, Shard | Replicate), placement
                if isinstance(placement, Replicate):
                    copies *= g.device_mesh.size(axis)
            locals_.append(g.to_local())
        else:
            copies = world
            locals_.append(g)
        weights.append(1.0 / copies)
    device = locals_[0].device
    squares = torch.stack(
        [torch.linalg.vector_norm(x.float()).to(device) ** 2 * w for x, w in zip(locals_, weights)]
    )
    total_sq = squares.sum()
    if distributed:
        dist.all_reduce(total_sq)
    total = total_sq.sqrt()
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for x in locals_:
            x.mul_(coef.to(x.device, x.dtype))
    return total


@torch.no_grad()
def sync_expert_load(model: nn.Module) -> None:
    """Sum every MoE layer's ``tokens_per_expert`` over all ranks (one all-reduce).

    Each rank counts the token copies its own tokens sent to each expert; the balancing update
    (``Transformer.update_expert_bias``) must see the global load, identical on every rank, or
    the router biases would drift apart. No-op without a process group.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        return
    flat = torch.cat([m.tokens_per_expert for m in moes])
    dist.all_reduce(flat)
    for m, part in zip(moes, flat.split([m.tokens_per_expert.numel() for m in moes])):
        m.tokens_per_expert.copy_(part)
