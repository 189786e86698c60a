"""Optimizer settings and the model-level builder: parameters routed by their metadata.

``build_optimizer(model, cfg)`` reads ``etude.model.meta.collect_param_meta(model)`` (never the
parameter names) and puts each hidden matrix in a Muon group with its natural blocks (heads on
dim 0 or 1, experts, whole matrix) and everything else (embeddings, output head, norms, router,
biases) in an AdamW group. It works on a plain model and on an FSDP2-sharded one (``fully_shard``
keeps the modules and FQNs, so the metadata is the same before and after sharding) and returns
``etude.optim.ShardedMuon`` for both (one code path from 1 rank to N), or ``torch.optim.AdamW``
everywhere for ``name = "adamw"`` baselines.

This module imports torch only inside ``build_optimizer``, so recipes that hold an
``OptimConfig`` load and check without torch. It does not schedule learning rates: schedulers
scale every group's ``lr`` (Muon and AdamW groups alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from etude.model.meta import collect_param_meta

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """The ``[optim]`` section of a recipe."""

    name: Literal["muon", "adamw"] = "muon"
    """``muon``: Muon for hidden matrices (per head / per expert) + AdamW for the rest;
    ``adamw``: AdamW everywhere (a baseline), with the same learning rates and weight decays."""
    lr: float = 3e-3
    """Peak learning rate of the hidden matrices; with ``adjust_lr = "match_rms_adamw"`` an
    AdamW learning rate carries over unchanged."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the hidden matrices (p <- p * (1 - lr * weight_decay))."""
    momentum: float = 0.95
    """Muon momentum (EMA of gradients), in [0, 1)."""
    nesterov: bool = True
    """Orthogonalize the Nesterov look-ahead (1 - momentum) * g + momentum * buf."""
    ns_steps: int = 5
    """Newton-Schulz iterations per step."""
    ns_coefficients: Literal["quintic", "polar_express"] = "quintic"
    """``quintic``: (3.4445, -4.7750, 2.0315) every step; ``polar_express``: per-step optimal
    polynomials of Amsel et al. 2025 (https://arxiv.org/abs/2505.16932)."""
    ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Newton-Schulz compute (and exchange) dtype; ``auto``: float32 on CPU, bfloat16 on GPU."""
    adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Per-block update scale: ``0.2 * sqrt(max(m, n))`` (RMS of AdamW, Moonlight) or the
    original ``sqrt(max(1, m / n))``."""
    adamw_lr: float | None = None
    """Learning rate of the AdamW parameters (embeddings, head, norms, router); None: ``lr``."""
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    adamw_eps: float = 1e-8
    """AdamW epsilon."""
    adamw_weight_decay: float = 0.0
    """Decoupled weight decay of the AdamW parameters."""
    bucket_mb: float = 32.0
    """MiB of whole blocks per all-to-all bucket of the sharded path (more buckets: more overlap
    of communication with Newton-Schulz, more collectives)."""
    async_comm: bool = True
    """Pipeline the sharded path: issue bucket k+1's all-to-all before waiting on bucket k."""
    check_finite: bool = True
    """Raise FloatingPointError naming the parameters when a gradient holds NaN/Inf, before
    anything changes (one device sync per step)."""

    def __post_init__(self) -> None:
        for name in ("lr", "adamw_eps", "bucket_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be > 0")
        if self.adamw_lr is not None and not self.adamw_lr > 0:
            raise ValueError(
                f"optim.adamw_lr={self.adamw_lr} must be > 0 (or unset to use optim.lr)"
            )
        for name in ("weight_decay", "adamw_weight_decay"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be >= 0")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optim.momentum={self.momentum} must lie in [0, 1), e.g. 0.95")
        if not 1 <= self.ns_steps <= 100:
            raise ValueError(f"optim.ns_steps={self.ns_steps} must lie in [1, 100], e.g. 5")
        if len(self.adamw_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adamw_betas):
            raise ValueError(f"optim.adamw_betas={self.adamw_betas} must be two values in [0, 1)")

    @property
    def resolved_adamw_lr(self) -> float:
        return self.lr if self.adamw_lr is None else self.adamw_lr


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """One optimizer for ``model`` per ``cfg``, its parameters routed by their metadata.

    Muon groups: one per distinct (kind, num_blocks), each holding ``kind`` and ``num_blocks``.
    One AdamW group for the rest. Groups carry parameter names (``param_names``) for error
    messages and state dicts. Frozen parameters (``requires_grad=False``) are left out.
    Raises ``ValueError`` naming any parameter without metadata.
    """
    import torch

    from etude.optim.sharded import ShardedMuon

    metas = collect_param_meta(model)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    hidden: dict[tuple[str, int], list] = {}
    rest = []
    for name, p in named:
        meta = metas[name]
        if meta.optimizer == "muon":
            hidden.setdefault((meta.kind, meta.num_blocks), []).append((name, p))
        else:
            rest.append((name, p))
    adamw_group = {
        "params": rest,
        "algorithm": "adamw",
        "lr": cfg.resolved_adamw_lr,
        "weight_decay": cfg.adamw_weight_decay,
    }
    if cfg.name == "adamw":
        matrices = [item for items in hidden.values() for item in items]
        groups = [{"params": matrices, "lr": cfg.lr, "weight_decay": cfg.weight_decay}]
        groups.append({k: v for k, v in adamw_group.items() if k != "algorithm"})
        return torch.optim.AdamW(
            [g for g in groups if g["params"]], betas=cfg.adamw_betas, eps=cfg.adamw_eps
        )
    groups = [
        {"params": items, "algorithm": "muon", "kind": kind, "num_blocks": num_blocks}
        for (kind, num_blocks), items in hidden.items()
    ]
    groups.append(adamw_group)
    return ShardedMuon(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        ns_steps=cfg.ns_steps,
        ns_coefficients=cfg.ns_coefficients,
        ns_dtype=cfg.ns_dtype,
        adjust_lr=cfg.adjust_lr,
        betas=cfg.adamw_betas,
        eps=cfg.adamw_eps,
        check_finite=cfg.check_finite,
        bucket_mb=cfg.bucket_mb,
        async_comm=cfg.async_comm,
    )
