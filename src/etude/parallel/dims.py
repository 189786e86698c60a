"""Parallel degrees of a run and the two device meshes built from them (the dual mesh).

A run on W ranks has four degrees: ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP shards
of the dense weights), ``cp`` (context parallelism: a sequence split over ranks) and ``ep``
(expert parallelism: the experts of a MoE layer split over ranks). ``W = dp_replicate * dp_shard
* cp``; ``ep`` does not multiply the world size: it is *folded* into ``dp_shard x cp`` (the same
idea as torchtitan's ``ParallelDims`` and Megatron-Core's "MoE parallel folding"), which leaves a
derived expert-FSDP degree ``efsdp = dp_shard * cp / ep``. So CP=2 and EP=8 run on 8 ranks, not 16.

Two meshes cover the same ranks::

    dense mesh   (dp_replicate, dp_shard, cp)     attention, dense FFN, router, shared experts,
                                                  embeddings: FSDP over dp_shard x cp (HSDP when
                                                  dp_replicate > 1); cp ranks split sequences
    expert mesh  (dp_replicate, efsdp, ep)        routed experts: split over ep, FSDP over efsdp

Rank layout (row-major, last axis fastest)::

    rank = ((r * dp_shard) + s) * cp + c  =  ((r * efsdp) + f) * ep + e

so the ``ep`` ranks of one group are consecutive (within a node when ep <= GPUs per node) and
contain whole ``cp`` groups. Both meshes are ``DeviceMesh._unflatten`` views of one 1-D world
mesh: an expert DTensor sharded over ``ep`` and FSDP's ``efsdp`` mesh must be non-overlapping
sub-meshes of one root mesh.

``ParallelDims`` is pure arithmetic and validation (no process group): errors name the bad
degree and list the valid choices. ``ParallelDims.build_mesh`` makes the ``DualMesh`` once a
process group exists. Not here: applying the meshes to a model (``etude.parallel.fsdp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from etude.model.config import ModelConfig

_MESHES: dict[tuple, DeviceMesh] = {}
"""Meshes built so far, by (process group, device type, world size, sizes, names)."""

DENSE_AXES = ("dp_replicate", "dp_shard", "cp")
EXPERT_AXES = ("dp_replicate", "efsdp", "ep")


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """The ``[parallel]`` section of a recipe: how a run spreads over its ranks."""

    dp_replicate: int = 1
    """HSDP replicas: dense and expert gradients are all-reduced across them."""
    dp_shard: int = -1
    """FSDP shards of the dense weights; -1 fills the world size (world / (dp_replicate * cp))."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks."""
    ep: int = 1
    """Expert-parallel degree: experts are split over this many ranks, folded into dp_shard x cp
    (must divide dp_shard * cp and model.num_experts)."""
    cp_attention: Literal["auto", "allgather", "ring"] = "auto"
    """CP attention: ``allgather`` gathers K/V over the cp ranks (every device); ``ring`` is
    PyTorch's ``context_parallel`` (ring attention; CUDA only); ``auto``: ring on CUDA, else
    allgather."""
    init: Literal["replicated", "sharded"] = "replicated"
    """Weight init of a sharded model: ``replicated`` builds the full model on each rank's CPU
    and keeps its shards (bit-identical to one process; needs the full model in host memory);
    ``sharded`` initializes the shards in place (same distribution, other values)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        value = self.dp_shard
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
            raise ValueError(
                f"parallel.dp_shard must be a positive integer or -1 (fill the world size), "
                f"got {value!r}"
            )
        if self.cp_attention not in ("auto", "allgather", "ring"):
            raise ValueError(
                f"parallel.cp_attention must be 'auto', 'allgather' or 'ring', got "
                f"{self.cp_attention!r}"
            )
        if self.init not in ("replicated", "sharded"):
            raise ValueError(f"parallel.init must be 'replicated' or 'sharded', got {self.init!r}")


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Resolved and checked degrees for ``world_size`` ranks (see the module docstring)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int

    def __post_init__(self) -> None:
        W = self.world_size
        if not isinstance(W, int) or W < 1:
            raise ValueError(f"world size must be a positive integer, got {W!r}")
        for name in ("dp_replicate", "dp_shard", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        if W % self.dp_replicate:
            raise ValueError(
                f"parallel.dp_replicate={self.dp_replicate} does not divide the world size {W}; "
                f"valid dp_replicate: {_choices(divisors(W))}"
            )
        rest = W // self.dp_replicate
        if rest % self.cp:
            raise ValueError(
                f"parallel.cp={self.cp} does not divide world size / dp_replicate = {rest}; "
                f"valid cp: {_choices(divisors(rest))}"
            )
        if self.dp_replicate * self.dp_shard * self.cp != W:
            raise ValueError(
                f"parallel.dp_shard={self.dp_shard} does not fill the world size: dp_replicate * "
                f"dp_shard * cp = {self.dp_replicate} * {self.dp_shard} * {self.cp} = "
                f"{self.dp_replicate * self.dp_shard * self.cp} != {W}; set "
                f"parallel.dp_shard={rest // self.cp} (or -1 to fill)"
            )
        folded = self.dp_shard * self.cp
        if folded % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} must divide dp_shard * cp = {self.dp_shard} * {self.cp} "
                f"= {folded} (experts are split over the ranks of dp_shard x cp); valid ep: "
                f"{_choices(divisors(folded))}"
            )

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve ``dp_shard=-1`` against ``world_size`` and check every degree."""
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if not isinstance(world_size, int) or world_size < 1:
                raise ValueError(f"world size must be a positive integer, got {world_size!r}")
            if world_size % cfg.dp_replicate:
                raise ValueError(
                    f"parallel.dp_replicate={cfg.dp_replicate} does not divide the world size "
                    f"{world_size}; valid dp_replicate: {_choices(divisors(world_size))}"
                )
            rest = world_size // cfg.dp_replicate
            if rest % cfg.cp:
                raise ValueError(
                    f"parallel.cp={cfg.cp} does not divide world size / dp_replicate = {rest}; "
                    f"valid cp: {_choices(divisors(rest))}"
                )
            dp_shard = rest // cfg.cp
        return cls(
            dp_replicate=cfg.dp_replicate,
            dp_shard=dp_shard,
            cp=cfg.cp,
            ep=cfg.ep,
            world_size=world_size,
        )

    @property
    def efsdp(self) -> int:
        """FSDP degree of the expert weights: ``dp_shard * cp / ep``."""
        return self.dp_shard * self.cp // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different sequences (cp ranks share them)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """FSDP degree of the dense weights: ``dp_shard * cp`` (cp ranks shard weights too)."""
        return self.dp_shard * self.cp

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        """One line for logs: ``dense (dp_replicate 1, dp_shard 4, cp 2) | expert (...)``."""
        return (
            f"world {self.world_size} | dense (dp_replicate {self.dp_replicate}, dp_shard "
            f"{self.dp_shard}, cp {self.cp}) | expert (dp_replicate {self.dp_replicate}, efsdp "
            f"{self.efsdp}, ep {self.ep})"
        )

    def check_model(self, cfg: ModelConfig) -> None:
        """Check the degrees against a model's shapes (experts split by ``ep``, FSDP on dim 1)."""
        if self.cp > 1 and cfg.attention == "mla":
            raise ValueError(
                f"parallel.cp={self.cp}: context parallelism covers grouped-query attention only; "
                "an MLA model (model.attention='mla') needs parallel.cp=1"
            )
        if self.ep == 1:
            return
        folded = self.dp_shard * self.cp
        if cfg.num_experts == 0:
            raise ValueError(
                f"parallel.ep={self.ep} needs a mixture-of-experts model but model.num_experts=0; "
                "set parallel.ep=1"
            )
        if cfg.num_experts % self.ep:
            valid = divisors(math.gcd(cfg.num_experts, folded))
            raise ValueError(
                f"parallel.ep={self.ep} must divide model.num_experts={cfg.num_experts}; valid "
                f"ep: {_choices(valid)}"
            )
        # experts are whole blocks on their ep rank; FSDP cuts them along dim 1 or 2 (dim 0
        # would interleave with the ep split), and FSDP2 needs those dims to divide evenly
        if cfg.dim % self.efsdp and cfg.expert_ffn_dim % self.efsdp:
            valid = [
                ep
                for ep in divisors(math.gcd(cfg.num_experts, folded))
                if ep == 1  # no EP: experts shard with the dense weights, on dim 0
                or cfg.dim % (folded // ep) == 0
                or cfg.expert_ffn_dim % (folded // ep) == 0
            ]
            raise ValueError(
                f"parallel.ep={self.ep} leaves efsdp = dp_shard * cp / ep = {self.efsdp}, which "
                f"divides neither model.dim={cfg.dim} nor model.expert_ffn_dim="
                f"{cfg.expert_ffn_dim} (expert weights are FSDP-sharded on one of them); valid "
                f"ep: {_choices(valid)}"
            )

    def check_seq_len(self, seq_len: int) -> None:
        """A sequence splits into ``2 * cp`` equal load-balanced chunks."""
        if self.cp == 1 or seq_len % (2 * self.cp) == 0:
            return
        rest = self.world_size // self.dp_replicate
        valid = [c for c in divisors(rest) if seq_len % (2 * c) == 0]
        raise ValueError(
            f"data.seq_len={seq_len} must be divisible by 2 * parallel.cp = {2 * self.cp} "
            f"(each cp rank holds two load-balanced causal chunks); valid cp: {_choices(valid)}"
        )

    def coordinate(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on both meshes, and its data-parallel index ``dp``."""
        assert 0 <= rank < self.world_size, (rank, self.world_size)
        r, rest = divmod(rank, self.dp_shard * self.cp)
        s, c = divmod(rest, self.cp)
        f, e = divmod(rest, self.ep)
        return {
            "dp_replicate": r,
            "dp_shard": s,
            "cp": c,
            "efsdp": f,
            "ep": e,
            "dp": r * self.dp_shard + s,
        }

    def axis_groups(self, axis: str) -> list[list[int]]:
        """The rank groups along one axis (ranks that differ only in that coordinate).

        ``axis`` is any of ``dp_replicate, dp_shard, cp, efsdp, ep`` or ``fsdp`` (the
        dense FSDP group). Pure arithmetic: tests compare the meshes' process groups to it.
        """
        coords = [self.coordinate(r) for r in range(self.world_size)]
        if axis == "fsdp":
            keys = [(c["dp_replicate"],) for c in coords]
        elif axis in ("dp_replicate", "dp_shard", "cp"):
            keys = [tuple(c[a] for a in DENSE_AXES if a != axis) for c in coords]
        elif axis in ("efsdp", "ep"):
            keys = [tuple(c[a] for a in EXPERT_AXES if a != axis) for c in coords]
        else:
            raise ValueError(
                f"unknown mesh axis {axis!r}; valid axes: {', '.join(DENSE_AXES)}, efsdp, ep, fsdp"
            )
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, key in enumerate(keys):
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def build_mesh(self, device_type: str) -> DualMesh:
        """Both meshes over the initialized default process group (collective on every rank)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            got = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise ValueError(
                f"ParallelDims were resolved for world size {self.world_size} but the process "
                f"group has {got}; init the process group first (torchrun) with that many ranks"
            )
        # meshes are interned per process group: DTensor's sharding cache compares meshes by
        # value and may hand back an equal mesh object from an earlier model, while FSDP
        # checks a parameter's mesh by identity; one object per distinct mesh avoids both
        pg_key = (dist.group.WORLD, device_type, self.world_size)  # holds the group: no id reuse
        world = _MESHES.get((*pg_key, "world"))
        if world is None:
            world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
            _MESHES[(*pg_key, "world")] = world

        def view(sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
            key = (*pg_key, sizes, names)
            if key not in _MESHES:
                _MESHES[key] = world._unflatten(0, sizes, names)
            return _MESHES[key]

        dense = view((self.dp_replicate, self.dp_shard, self.cp), DENSE_AXES)
        expert = view((self.dp_replicate, self.efsdp, self.ep), EXPERT_AXES)
        fsdp = view((self.dp_replicate, self.fsdp), ("dp_replicate", "fsdp"))
        if self.dp_replicate == 1:
            key = (*pg_key, (self.fsdp,), ("fsdp",))
            fsdp = _MESHES[key] = _MESHES.get(key) or fsdp["fsdp"]
        return DualMesh(
            dims=self,
            world=world,
            dense=dense,
            expert=expert,
            fsdp=fsdp,
            cp=dense["cp"],
            ep=expert["ep"],
        )


@dataclass(frozen=True)
class DualMesh:
    """The device meshes of a run, all views of one 1-D ``world`` mesh.

    ``dense``: (dp_replicate, dp_shard, cp); ``expert``: (dp_replicate, efsdp, ep); ``fsdp``: the
    mesh the dense weights are ``fully_shard``-ed on, (dp_replicate, fsdp) for HSDP or (fsdp,),
    with ``fsdp = dp_shard x cp`` flattened; ``cp`` and ``ep``: the 1-D axes of CP and EP.
    """

    dims: ParallelDims
    world: DeviceMesh
    dense: DeviceMesh
    expert: DeviceMesh
    fsdp: DeviceMesh
    cp: DeviceMesh
    ep: DeviceMesh

    @property
    def device_type(self) -> str:
        return self.world.device_type

    def coordinate(self) -> dict[str, int]:
        """This rank's coordinates (see ``ParallelDims.coordinate``)."""
        return self.dims.coordinate(self.world.get_rank())
