"""The model's parameters as ``etude plan`` sees them, and where each lies under a layout.

``model_inventory`` builds the model on the meta device (nothing allocated), so every parameter
count and Muon block shape is the model's own; ``muon_order`` lists the Muon parameters in the
order ``ShardedMuon`` sees them. ``shard_param`` says how one parameter lies on a rank and which
axis exchanges pieces of its Muon blocks; ``block_span`` gives a block's extent along a dim.

Sharding assumed (what ``etude.parallel`` does, docs/architecture.md "Dual mesh"): FSDP2 shards every
dense weight on dim 0 over ``dp_shard x cp`` (``torch.chunk`` sizes: ceil, trailing shards
short or empty). Expert weights ``[E, M, K]`` are split over ``ep`` on dim 0, then over
``efsdp`` on dim 0 when it divides the local experts (whole experts per rank), else on dim 1
(every expert cut into row slices; FSDP2 needs ``M`` to divide by ``efsdp`` there, else
``ValueError``). The shared mesh shards the same way over the same degrees;
it differs in which ranks form the ep and efsdp groups (and so in their bandwidth) and in the
GPUs it needs.

What this module does not do: pipeline or tensor parallelism, or any cost (memory, bytes,
time: ``etude.plan.memory``, ``etude.plan.comm``, ``etude.plan.muon_schedule``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from etude.model.config import ModelConfig
from etude.model.meta import ParamMeta
from etude.plan.layout import Layout


@dataclass(frozen=True, slots=True)
class ParamRecord:
    """One parameter of the model: name, full shape and its metadata."""

    name: str
    shape: tuple[int, ...]
    meta: ParamMeta

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_expert(self) -> bool:
        """Held by the expert mesh (stacked routed experts); everything else is dense."""
        return self.meta.kind == "experts"

    @property
    def layer(self) -> int | None:
        """Transformer block index, or None for the embedding, final norm and output head."""
        parts = self.name.split(".")
        return int(parts[1]) if parts[0] == "layers" else None


def model_inventory(cfg: ModelConfig) -> list[ParamRecord]:
    """Every parameter of ``Transformer(cfg)`` built on the meta device (nothing allocated)."""
    import torch

    from etude.model.meta import collect_param_meta
    from etude.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    metas = collect_param_meta(model)
    return [ParamRecord(n, tuple(p.shape), metas[n]) for n, p in model.named_parameters()]


def muon_order(records: Sequence[ParamRecord]) -> list[ParamRecord]:
    """Muon parameters in the order ``ShardedMuon`` sees them: ``build_optimizer`` makes one
    group per (kind, num_blocks) in order of first appearance, each in model order."""
    groups: dict[tuple[str, int], list[ParamRecord]] = {}
    for rec in records:
        if rec.meta.optimizer == "muon":
            groups.setdefault((rec.meta.kind, rec.meta.num_blocks), []).append(rec)
    return [rec for recs in groups.values() for rec in recs]


@dataclass(frozen=True, slots=True)
class ParamShard:
    """How one parameter lies on a rank under a layout."""

    local_numel: int
    """Elements on the fullest rank (rank 0 of its groups: ceil-sized chunks)."""
    axis: str | None
    """Axis whose ranks exchange pieces of its Muon blocks (``dense_fsdp``/``efsdp``), or None
    when every rank holds whole blocks."""
    group_size: int = 1
    """Ranks of the exchange axis."""
    dim: int = 0
    """Tensor dim the exchange axis cuts."""
    blocks: int = 0
    """Muon blocks an exchange group sees (local experts of one ep rank, or all blocks)."""
    whole_blocks: int = 0
    """Without exchange: Muon blocks held whole by every rank."""


def shard_param(rec: ParamRecord, layout: Layout) -> ParamShard:
    """Where ``rec`` lies (same rule on both meshes; see the module docstring)."""
    shape, meta = rec.shape, rec.meta
    muon = meta.optimizer == "muon"
    if not rec.is_expert:
        W = layout.dense_fsdp
        local = -(-shape[0] // W) * math.prod(shape[1:])
        if not muon:
            return ParamShard(local_numel=local, axis=None)
        if W == 1:
            return ParamShard(local_numel=local, axis=None, whole_blocks=meta.num_blocks)
        return ParamShard(
            local_numel=local, axis="dense_fsdp", group_size=W, dim=0, blocks=meta.num_blocks
        )
    num_local, (_, m, k) = shape[0] // layout.ep, shape
    W = layout.efsdp
    if W == 1:
        return ParamShard(local_numel=num_local * m * k, axis=None, whole_blocks=num_local)
    if num_local % W == 0:
        per_rank = num_local // W
        return ParamShard(local_numel=per_rank * m * k, axis=None, whole_blocks=per_rank)
    if m % W:
        # FSDP2 shards dims > 0 only evenly ("FSDP does not support uneven sharding on dim 1")
        raise ValueError(
            f"efsdp={W} (from ep={layout.ep}) cannot shard {rec.name} {list(shape)}: its "
            f"{num_local} local experts do not split evenly over {W} ranks, and dim 1 ({m}) "
            f"does not either (FSDP2 shards dims > 0 only evenly); choose ep (or "
            f"expert_replicate) so that efsdp divides {num_local} or {m}"
        )
    return ParamShard(
        local_numel=num_local * (m // W) * k, axis="efsdp", group_size=W, dim=1, blocks=num_local
    )


def block_span(rec: ParamRecord, block: int, dim: int) -> tuple[int, int, int]:
    """(lo, hi, width) of a Muon block: its extent along tensor ``dim`` and the elements per
    index of that extent (the rest of the block)."""
    m, n = rec.meta.block_shape(rec.shape)
    if dim == rec.meta.block_dim and rec.meta.kind != "experts":
        assert dim == 0 and rec.meta.kind == "heads_dim0", rec
        return block * m, (block + 1) * m, n
    extent = rec.shape[dim]
    return 0, extent, m * n // extent
