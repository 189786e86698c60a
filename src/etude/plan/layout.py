"""Parallel layouts on paper: the degrees of a job and where each mesh axis puts its ranks.

A ``Layout`` is the set of degrees ``dp_replicate``, ``dp_shard``, ``cp``, ``ep`` over
``dp_replicate * dp_shard * cp`` GPUs, laid out one of two ways:

- ``dual`` (docs/architecture.md, "Dual mesh"): the dense mesh ``(dp_replicate, dp_shard, cp)`` holds
  non-expert weights (FSDP over ``dp_shard x cp``, HSDP over ``dp_replicate``); the expert mesh
  ``(expert_replicate, efsdp, ep)`` holds expert weights over the same ranks, ``ep`` innermost,
  so ``ep`` is formed from ``dp_shard x cp`` and ``efsdp = dp_shard * cp / ep``. CP and EP
  overlap: ``cp=2, ep=8`` fits on ``lcm(2, 8) = 8`` GPUs. ``expert_replicate`` defaults to
  ``dp_replicate`` (the two meshes of ``etude.parallel``); a smaller value is the seed's
  "separate HSDP layouts": narrow dense FSDP groups, a wider expert sharding mesh.
- ``shared``: one mesh ``(dp_replicate, dp_shard, cp)`` for every weight, ``ep`` carved out of
  ``dp_shard`` (expert parallelism as a sub-axis of data parallelism, with context parallelism a
  separate dimension: Megatron-Core before "MoE parallel folding"); experts are FSDP-sharded
  over the rest, ``(dp_shard / ep) x cp``. CP and EP cannot overlap: ``cp * ep`` GPUs at least.

Ranks are row-major over the mesh (the last axis varies fastest), as ``DeviceMesh`` lays out
``torch.arange(world).view(shape)``; nodes hold consecutive ranks. ``axis_ranks`` gives the
members of the group of rank 0 along one axis, ``group_index`` each rank's place in its group.

What this module does not do: build process groups (``etude.parallel`` does), or know about the
model beyond ``check_model`` (number of experts and sequence length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

MESHES = ("dual", "shared")
"""Layout kinds: two meshes over the same ranks, or one mesh for every weight."""

AXES = ("dp_replicate", "dense_fsdp", "cp", "ep", "efsdp", "expert_replicate")
"""Communication axes of a layout (``dense_fsdp`` is ``dp_shard x cp`` flattened)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def min_gpus(cp: int, ep: int, mesh: str) -> int:
    """Fewest GPUs that hold context parallelism ``cp`` and expert parallelism ``ep``.

    Dual mesh: ``ep`` must divide ``dp_shard * cp`` and ``cp`` divides the world, so the world
    is a multiple of ``lcm(cp, ep)``. Shared mesh: ``ep`` divides ``dp_shard``, so ``cp * ep``.
    """
    return math.lcm(cp, ep) if mesh == "dual" else cp * ep


@dataclass(kw_only=True, slots=True)
class Layout:
    """Degrees of parallelism of one job and the mesh kind that places them."""

    dp_replicate: int = 1
    """HSDP replicas of the dense weights (gradients all-reduced across them)."""
    dp_shard: int = 1
    """FSDP shards of the dense weights within a replica (with ``cp``: FSDP over dp_shard x cp)."""
    cp: int = 1
    """Context parallelism: ranks that split one sequence (K/V all-gathered across them)."""
    ep: int = 1
    """Expert parallelism: ranks that split the experts of a layer (tokens all-to-all'd)."""
    expert_replicate: int | None = None
    """Dual mesh only: HSDP replicas of the expert weights; None: ``dp_replicate``."""
    mesh: Literal["dual", "shared"] = "dual"
    """``dual``: dense and expert meshes over the same ranks; ``shared``: one mesh for all."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"layout.{name} must be a positive integer, got {value!r}")
        if self.mesh not in MESHES:
            raise ValueError(f"layout.mesh must be one of {', '.join(MESHES)}, got {self.mesh!r}")
        world, inner = self.num_gpus, self.dp_shard * self.cp
        if self.mesh == "shared":
            if self.expert_replicate not in (None, self.dp_replicate):
                raise ValueError(
                    f"layout.expert_replicate={self.expert_replicate} needs the dual mesh: a "
                    "shared mesh has one replicate degree; unset it or set mesh='dual'"
                )
            if self.dp_shard % self.ep:
                raise ValueError(
                    f"layout.ep={self.ep} must divide dp_shard={self.dp_shard} in a shared mesh "
                    f"(ep is carved from dp_shard, cp={self.cp} is a separate dim, so cp*ep = "
                    f"{self.cp * self.ep} GPUs per replica at least); valid ep: "
                    f"{_choices(_divisors(self.dp_shard))}; or use mesh='dual'"
                )
            return
        r_e = self.expert_replicate
        if r_e is None:
            if inner % self.ep:
                raise ValueError(
                    f"layout.ep={self.ep} must divide dp_shard*cp = {self.dp_shard}*{self.cp} = "
                    f"{inner} (the expert-parallel axis is formed from dp_shard x cp); valid ep: "
                    f"{_choices(_divisors(inner))}"
                )
            return
        if not isinstance(r_e, int) or isinstance(r_e, bool) or r_e < 1:
            raise ValueError(
                f"layout.expert_replicate must be a positive integer or None, got {r_e!r}"
            )
        if world % r_e or (world // r_e) % self.ep:
            valid = [d for d in _divisors(world) if (world // d) % self.ep == 0]
            raise ValueError(
                f"layout.expert_replicate={r_e} must divide the {world} GPUs into replicas "
                f"that each hold ep={self.ep} expert shards; valid expert_replicate: "
                f"{_choices(valid)}"
            )

    @staticmethod
    def for_gpus(
        num_gpus: int,
        *,
        dp_replicate: int = 1,
        dp_shard: int | None = None,
        cp: int = 1,
        ep: int = 1,
        expert_replicate: int | None = None,
        mesh: str = "dual",
    ) -> Layout:
        """The layout over ``num_gpus`` GPUs; ``dp_shard`` None takes the GPUs left over."""
        for name, value in (("num_gpus", num_gpus), ("dp_replicate", dp_replicate), ("cp", cp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"layout.{name} must be a positive integer, got {value!r}")
        if dp_shard is None:
            if num_gpus % (dp_replicate * cp):
                valid = [d for d in _divisors(num_gpus) if (num_gpus // d) % cp == 0]
                raise ValueError(
                    f"{num_gpus} GPUs do not split into dp_replicate={dp_replicate} x cp={cp} "
                    f"x dp_shard; valid dp_replicate for cp={cp}: {_choices(valid)}"
                )
            dp_shard = num_gpus // (dp_replicate * cp)
        elif dp_replicate * dp_shard * cp != num_gpus:
            raise ValueError(
                f"layout.dp_replicate*dp_shard*cp = {dp_replicate}*{dp_shard}*{cp} = "
                f"{dp_replicate * dp_shard * cp} must equal the GPU count {num_gpus}; set "
                "dp_shard to GPUs / (dp_replicate * cp) or leave it unset"
            )
        return Layout(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            cp=cp,
            ep=ep,
            expert_replicate=expert_replicate,
            mesh=mesh,  # type: ignore[arg-type]
        )

    def check_model(self, *, num_experts: int, seq_len: int) -> None:
        """Raise ``ValueError`` if the model's experts or sequence length do not fit the layout."""
        if num_experts == 0 and self.ep > 1:
            raise ValueError(
                f"layout.ep={self.ep} needs a mixture-of-experts model; this one has no "
                "experts: set ep=1"
            )
        if num_experts and num_experts % self.ep:
            inner = self.dp_shard if self.mesh == "shared" else self.expert_shard
            valid = [d for d in _divisors(num_experts) if inner % d == 0]
            raise ValueError(
                f"layout.ep={self.ep} must divide the {num_experts} experts of a layer; valid "
                f"ep for this layout: {_choices(valid)}"
            )
        if seq_len % (2 * self.cp):
            raise ValueError(
                f"seq_len={seq_len} must be a multiple of 2*cp = {2 * self.cp} (context "
                "parallelism splits a sequence into 2*cp load-balanced causal chunks); pick "
                "another seq_len or cp"
            )

    @property
    def num_gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def dense_fsdp(self) -> int:
        """Ranks one dense weight is sharded over (``dp_shard x cp``)."""
        return self.dp_shard * self.cp

    @property
    def expert_replicate_degree(self) -> int:
        return self.dp_replicate if self.expert_replicate is None else self.expert_replicate

    @property
    def expert_shard(self) -> int:
        """Ranks one expert weight (all experts of a layer) is split over: ``efsdp * ep``."""
        return self.num_gpus // self.expert_replicate_degree

    @property
    def efsdp(self) -> int:
        """FSDP degree of the expert weights (within one expert-parallel rank's experts)."""
        return self.expert_shard // self.ep

    @property
    def data_parallel(self) -> int:
        """Ranks that read different sequences (every rank but the cp ones of a sequence)."""
        return self.num_gpus // self.cp

    def describe(self) -> str:
        """One line: ``dp_replicate x dp_shard x cp, ep`` and the derived expert degrees."""
        text = (
            f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp}, "
            f"ep {self.ep}, efsdp {self.efsdp}"
        )
        if self.expert_replicate_degree != self.dp_replicate:
            text += f", expert_replicate {self.expert_replicate_degree}"
        return text

    def _shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], dict[str, tuple[str, tuple]]]:
        """Dense mesh shape, expert mesh shape, and per axis (mesh, dims of that mesh)."""
        R, S, C, E = self.dp_replicate, self.dp_shard, self.cp, self.ep
        if self.mesh == "shared":
            # one mesh (R, S/E, E, C): ep is the inner part of dp_shard, cp the innermost dim
            full = (R, S // E, E, C)
            axes = {
                "dp_replicate": ("expert", (0,)),
                "dense_fsdp": ("expert", (1, 2, 3)),
                "cp": ("expert", (3,)),
                "ep": ("expert", (2,)),
                "efsdp": ("expert", (1, 3)),
                "expert_replicate": ("expert", (0,)),
            }
            return (R, S, C), full, axes
        expert = (self.expert_replicate_degree, self.efsdp, E)
        axes = {
            "dp_replicate": ("dense", (0,)),
            "dense_fsdp": ("dense", (1, 2)),
            "cp": ("dense", (2,)),
            "ep": ("expert", (2,)),
            "efsdp": ("expert", (1,)),
            "expert_replicate": ("expert", (0,)),
        }
        return (R, S, C), expert, axes

    def axis_size(self, axis: str) -> int:
        """Number of ranks in one group along ``axis`` (one of ``AXES``)."""
        dense, expert, axes = self._shapes()
        which, dims = axes[axis]
        shape = dense if which == "dense" else expert
        return math.prod(shape[d] for d in dims)

    def axis_ranks(self, axis: str) -> list[int]:
        """Global ranks of the group along ``axis`` that contains rank 0."""
        dense, expert, axes = self._shapes()
        which, dims = axes[axis]
        shape = dense if which == "dense" else expert
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        ranks = [0]
        for d in dims:
            ranks = [r + i * strides[d] for r in ranks for i in range(shape[d])]
        return sorted(ranks)

    def group_index(self, axis: str, ranks: np.ndarray) -> np.ndarray:
        """Each rank's index within its group along ``axis`` (group dims flattened row-major)."""
        dense, expert, axes = self._shapes()
        which, dims = axes[axis]
        shape = dense if which == "dense" else expert
        coords = np.unravel_index(ranks, shape)
        index = np.zeros_like(ranks)
        for d in dims:
            index = index * shape[d] + coords[d]
        return index
