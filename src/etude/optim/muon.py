"""Muon at natural granularity: batched Newton-Schulz, block views, and the single-process optimizer.

Muon (https://kellerjordan.github.io/posts/muon/) replaces the update of a weight matrix by the
orthogonalized momentum: the nearest semi-orthogonal matrix ``U V^T`` of ``M = U S V^T``,
approximated by a few Newton-Schulz iterations. etude orthogonalizes each *natural block* on its
own, as the model's parameter metadata declares it (``etude.model.meta``): one attention head of a
q/k/v projection (rows) or of the output projection (columns), one expert of a stacked
``[E, D, F]`` weight, or a whole matrix. Blocks of one parameter share a shape, so they run as one
batched iteration.

What is here:
- ``zeropower_via_newtonschulz``: the batched iteration on ``[N, M, K]``, quintic (Keller Jordan's
  coefficients) or Polar Express (Amsel et al. 2025, https://arxiv.org/abs/2505.16932);
- ``ns_flops``, ``update_scale``: the cost and the per-block update scale;
- ``split_blocks`` / ``merge_blocks``: ``[N, M, K]`` views of a parameter for each metadata kind;
- ``Muon``: one ``torch.optim.Optimizer`` that holds Muon groups (hidden matrices, per block) and
  AdamW groups (embeddings, head, norms, router), with one ``state_dict``.

What is not here: the sharded (DTensor / FSDP2) path, which lives in ``etude.optim.sharded`` and
subclasses ``Muon``; ``Muon`` itself refuses DTensor parameters. Routing parameters to groups from
model metadata is ``etude.optim.groups.build_optimizer``.

Non-finite gradients: ``step`` raises ``FloatingPointError`` naming the parameters *before* it
touches any parameter or state, so a caller may catch it and skip the batch (one device sync per
step; ``check_finite=False`` turns the check off). Zero gradients give a zero orthogonal update
(no NaN); parameters whose gradient is ``None`` are skipped (no decay, no state change).

Legend: N blocks in a batch (heads, experts, or 1), M and K rows and columns of one block,
S = min(M, K), L = max(M, K) (the iteration runs on the wide ``[S, L]`` orientation).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from etude.model.meta import MUON_KINDS, ParamMeta

QUINTIC_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic (a, b, c), tuned for the largest slope at zero; 5 steps leave singular
values roughly in [0.7, 1.2] rather than at 1, which does not hurt training."""

# Polar Express (Amsel, Persson, Musco, Gower 2025, Algorithm 1, https://arxiv.org/abs/2505.16932):
# the degree-5 polynomial of each step is the minimax-optimal one for the interval of singular
# values left by the previous steps (lower bound 1e-3 at the start); after 8 steps the optimal
# polynomial no longer changes. The paper divides every polynomial but the last by a safety factor
# (a/1.01, b/1.01^3, c/1.01^5) and normalizes by 1.01 * ||G||_F so that bf16 rounding cannot push a
# singular value past the interval on which the polynomials are designed.
_POLAR_EXPRESS_OPTIMAL = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_SAFETY = 1.01
POLAR_EXPRESS_COEFFICIENTS = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_OPTIMAL[:-1]
) + (_POLAR_EXPRESS_OPTIMAL[-1],)
"""Per-step (a, b, c) of Polar Express with the paper's safety factor; later steps repeat the last."""

NS_COEFFICIENTS = ("quintic", "polar_express")
NS_DTYPES = ("auto", "float32", "bfloat16")
ADJUST_LR = ("match_rms_adamw", "original")
NS_EPS = 1e-7


def ns_coefficient_schedule(coefficients: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of ``steps`` iterations for a named coefficient set."""
    if coefficients == "quintic":
        return [QUINTIC_COEFFICIENTS] * steps
    if coefficients == "polar_express":
        table = list(POLAR_EXPRESS_COEFFICIENTS)
        return table[:steps] + [table[-1]] * max(0, steps - len(table))
    raise ValueError(f"ns_coefficients={coefficients!r}: use one of {', '.join(NS_COEFFICIENTS)}")


def resolve_ns_dtype(ns_dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (bf16 matmul is ~25x slower there), bfloat16 on accelerators."""
    if isinstance(ns_dtype, torch.dtype):
        return ns_dtype
    if ns_dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if ns_dtype in ("float32", "bfloat16"):
        return getattr(torch, ns_dtype)
    raise ValueError(f"ns_dtype={ns_dtype!r}: use one of {', '.join(NS_DTYPES)}")


def zeropower_via_newtonschulz(
    G_NMK: Tensor,
    steps: int = 5,
    coefficients: str = "quintic",
    dtype: torch.dtype | None = None,
    eps: float = NS_EPS,
) -> Tensor:
    """Approximate ``U V^T`` of every block of ``G_NMK`` (``[N, M, K]``, or one ``[M, K]`` matrix).

    Each block is normalized by its own Frobenius norm (so its spectral norm is at most 1), turned
    wide (rows <= columns: the Gram matrix is then the small one), and iterated
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``. Computes and returns in ``dtype``
    (default: float32 on CPU, bfloat16 elsewhere). A zero block stays zero.
    """
    if G_NMK.ndim == 2:
        return zeropower_via_newtonschulz(G_NMK.unsqueeze(0), steps, coefficients, dtype, eps)[0]
    assert G_NMK.ndim == 3, f"expected [N, M, K] blocks, got shape {tuple(G_NMK.shape)}"
    schedule = ns_coefficient_schedule(coefficients, steps)
    X = G_NMK.to(resolve_ns_dtype("auto", G_NMK.device) if dtype is None else dtype)
    if X.shape[0] == 0:
        return X.clone()
    tall = X.shape[1] > X.shape[2]
    if tall:
        X = X.mT  # [N, S, L]
    norm_N11 = X.norm(dim=(-2, -1), keepdim=True)
    if coefficients == "polar_express":
        X = X / (norm_N11 * POLAR_EXPRESS_SAFETY + eps)
    else:
        X = X / norm_N11.clamp(min=eps)
    for a, b, c in schedule:
        A_NSS = X @ X.mT
        B_NSS = torch.baddbmm(A_NSS, A_NSS, A_NSS, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B_NSS, X, beta=a)  # a X + B X
    return X.mT if tall else X


def ns_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` iterations on one m x n block: per step A = X X^T (2 S^2 L),
    A^2 (2 S^3) and B X (2 S^2 L), with S = min(m, n) and L = max(m, n)."""
    short, long = min(m, n), max(m, n)
    return steps * (4 * short * short * long + 2 * short**3)


def update_scale(m: int, n: int, adjust_lr: str) -> float:
    """Factor on the learning rate for one m x n block's orthogonal update.

    ``match_rms_adamw`` (Moonlight, https://arxiv.org/abs/2502.16982): ``0.2 * sqrt(max(m, n))``,
    so the update's RMS is 0.2 like AdamW's and AdamW's lr and weight decay carry over.
    ``original`` (Keller Jordan): ``sqrt(max(1, m / n))``.
    """
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr == "original":
        return math.sqrt(max(1.0, m / n))
    raise ValueError(f"adjust_lr={adjust_lr!r}: use one of {', '.join(ADJUST_LR)}")


def split_blocks(x: Tensor, meta: ParamMeta) -> Tensor:
    """The natural blocks of ``x`` as an ``[N, M, K]`` view (no copy) for a Muon ``meta``.

    heads_dim0 ``[H*Dh, D]`` -> ``[H, Dh, D]``; heads_dim1 ``[D, H*Dh]`` -> ``[H, D, Dh]`` (a
    strided view); experts ``[E, D, F]`` -> itself; matrix ``[M, K]`` -> ``[1, M, K]``. Writing into
    the view writes into ``x``.
    """
    meta.block_shape(tuple(x.shape))  # checks rank and divisibility
    if meta.kind == "heads_dim0":
        return x.unflatten(0, (meta.num_blocks, -1))
    if meta.kind == "heads_dim1":
        return x.unflatten(1, (meta.num_blocks, -1)).permute(1, 0, 2)
    if meta.kind == "experts":
        return x
    assert meta.kind == "matrix", meta
    return x.unsqueeze(0)


def merge_blocks(blocks_NMK: Tensor, meta: ParamMeta) -> Tensor:
    """Inverse of ``split_blocks``: the parameter-shaped tensor of ``[N, M, K]`` blocks.

    A view for heads_dim0 (contiguous blocks), experts and matrix, and for heads_dim1 when the
    blocks are ``split_blocks``' own view; other heads_dim1 inputs are copied into place.
    """
    assert blocks_NMK.ndim == 3 and blocks_NMK.shape[0] == meta.num_blocks, (blocks_NMK.shape, meta)
    if meta.kind == "heads_dim0":
        return blocks_NMK.flatten(0, 1)
    if meta.kind == "heads_dim1":
        return blocks_NMK.permute(1, 0, 2).flatten(1)
    if meta.kind == "experts":
        return blocks_NMK
    assert meta.kind == "matrix", meta
    return blocks_NMK[0]


def local_tensor(x: Tensor) -> Tensor:
    """The rank-local shard of a DTensor (shares its storage), or ``x`` itself."""
    return x.to_local() if isinstance(x, DTensor) else x


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices at natural block granularity, AdamW for the rest, in one object.

    Param groups carry ``algorithm`` (``"muon"`` or ``"adamw"``). A Muon group also carries the
    block metadata of its parameters: ``kind`` and ``num_blocks`` (or a ``meta`` ParamMeta, which
    is unpacked into those two keys); a group of 2-D parameters without metadata is one block per
    matrix, as in plain Muon. Build the groups from a model with
    ``etude.optim.build_optimizer``, which reads the model's metadata.

    Muon update of a parameter with gradient g (momentum mu, lr, weight decay wd)::

        buf <- mu * buf + (1 - mu) * g                  (the EMA form of torch.optim.Muon)
        u   <- (1 - mu) * g + mu * buf   if nesterov else buf
        O   <- NS(u) block by block                     (zeropower_via_newtonschulz)
        p   <- p * (1 - lr * wd) - lr * update_scale(m, n) * O

    AdamW groups use ``torch.optim.adamw``'s functional update (``betas``, ``eps``,
    ``weight_decay``), with the same state keys as ``torch.optim.AdamW``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: str = "quintic",
        ns_dtype: str = "auto",
        adjust_lr: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        check_finite: bool = True,
    ) -> None:
        defaults = dict(
            algorithm="muon",
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            adjust_lr=adjust_lr,
            betas=betas,
            eps=eps,
        )
        self.check_finite = check_finite
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        meta = param_group.pop("meta", None)
        if meta is not None:
            param_group["kind"], param_group["num_blocks"] = meta.kind, meta.num_blocks
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1], len(self.param_groups) - 1)

    def _check_group(self, group: dict[str, Any], index: int) -> None:
        where = f"param group {index}"
        if group["algorithm"] not in ("muon", "adamw"):
            raise ValueError(f"{where}: algorithm={group['algorithm']!r}; use 'muon' or 'adamw'")
        if not group["lr"] >= 0.0:
            raise ValueError(f"{where}: lr={group['lr']} must be >= 0")
        if not group["weight_decay"] >= 0.0:
            raise ValueError(f"{where}: weight_decay={group['weight_decay']} must be >= 0")
        if group["algorithm"] == "adamw":
            beta1, beta2 = group["betas"]
            if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
                raise ValueError(f"{where}: betas={group['betas']} must lie in [0, 1)")
            if not group["eps"] > 0.0:
                raise ValueError(f"{where}: eps={group['eps']} must be > 0")
            return
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"{where}: momentum={group['momentum']} must lie in [0, 1)")
        if not (isinstance(group["ns_steps"], int) and 1 <= group["ns_steps"] <= 100):
            raise ValueError(f"{where}: ns_steps={group['ns_steps']!r} must be an int in [1, 100]")
        ns_coefficient_schedule(group["ns_coefficients"], 1)
        resolve_ns_dtype(group["ns_dtype"], torch.device("cpu"))
        update_scale(1, 1, group["adjust_lr"])
        if "kind" not in group:
            shapes = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
            if shapes:
                raise ValueError(
                    f"{where}: Muon parameters of shape {shapes[0]} have no block metadata; pass "
                    "kind=/num_blocks= (or meta=ParamMeta(...)) in the group, or build the "
                    "optimizer with etude.optim.build_optimizer(model, cfg)"
                )
            group["kind"], group["num_blocks"] = "matrix", 1
        if group["kind"] not in MUON_KINDS:
            raise ValueError(f"{where}: kind={group['kind']!r} is not a Muon kind {MUON_KINDS}")
        meta = ParamMeta(kind=group["kind"], num_blocks=group["num_blocks"])
        for p in group["params"]:
            if not _fits(meta, tuple(p.shape)):
                raise ValueError(
                    f"{where}: a parameter of shape {tuple(p.shape)} does not split into "
                    f"{meta.num_blocks} {meta.kind} blocks; fix the module's param_meta()"
                )

    @staticmethod
    def group_meta(group: dict[str, Any]) -> ParamMeta:
        return ParamMeta(kind=group["kind"], num_blocks=group["num_blocks"])

    def _param_name(self, group_index: int, param_index: int) -> str:
        group = self.param_groups[group_index]
        names = group.get("param_names")
        if names is not None:
            return names[param_index]
        return f"param_groups[{group_index}]['params'][{param_index}]"

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.check_finite:
            self._check_gradients()
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_step(group)
        self._muon_step([g for g in self.param_groups if g["algorithm"] == "muon"])
        return loss

    def _gradient_flags(self) -> Tensor:
        """``[P, 2]`` float on CPU: per parameter (all groups, in order) has-gradient, non-finite.

        One device sync for all parameters (the per-parameter checks stay on the device)."""
        has_grad, bad = [], []
        for group in self.param_groups:
            for p in group["params"]:
                has_grad.append(p.grad is not None)
                if p.grad is not None:
                    bad.append(~torch.isfinite(local_tensor(p.grad)).all())
        flags_P2 = torch.zeros(len(has_grad), 2)
        flags_P2[:, 0] = torch.tensor(has_grad, dtype=torch.float32)
        if bad:
            device = bad[0].device
            flags_P2[flags_P2[:, 0] > 0, 1] = torch.stack([b.to(device) for b in bad]).float().cpu()
        return flags_P2

    def _reduce_gradient_flags(self, flags_P2: Tensor) -> Tensor:
        """Combine flags over ranks; a single process has nothing to combine."""
        return flags_P2

    def _check_gradients(self) -> None:
        flags_P2 = self._reduce_gradient_flags(self._gradient_flags())
        if not bool(flags_P2[:, 1].any()):
            return
        names = []
        flat = 0
        for gi, group in enumerate(self.param_groups):
            for pi in range(len(group["params"])):
                if flags_P2[flat, 1] > 0:
                    names.append(self._param_name(gi, pi))
                flat += 1
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        raise FloatingPointError(
            f"non-finite gradient (NaN or Inf) in {', '.join(names[:5])}{more}; no parameter or "
            "optimizer state was changed. Lower the learning rate, clip gradients, or catch "
            "FloatingPointError to skip this batch"
        )

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                # the same state keys and scalar step as torch.optim.AdamW (DCP-compatible)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _momentum_update(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """Advance the momentum buffer of ``p``; return the (Nesterov) update, rank-local."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = local_tensor(state["momentum_buffer"])
        g = local_tensor(p.grad)
        mu = group["momentum"]
        buf.lerp_(g, 1.0 - mu)
        return g.lerp(buf, mu) if group["nesterov"] else buf

    def _muon_step(self, groups: Sequence[dict[str, Any]]) -> None:
        """The reference path: each parameter's blocks in one batched iteration, in place."""
        for group in groups:
            meta = self.group_meta(group)
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if isinstance(p, DTensor):
                    raise ValueError(
                        "Muon got a DTensor parameter (FSDP2); use etude.optim.ShardedMuon, "
                        "which build_optimizer returns"
                    )
                u = self._momentum_update(p, group)
                m, n = meta.block_shape(tuple(p.shape))
                O_NMK = zeropower_via_newtonschulz(
                    split_blocks(u, meta),
                    group["ns_steps"],
                    group["ns_coefficients"],
                    resolve_ns_dtype(group["ns_dtype"], p.device),
                )
                p.mul_(1.0 - lr * wd)
                split_blocks(p, meta).add_(
                    O_NMK, alpha=-lr * update_scale(m, n, group["adjust_lr"])
                )


def _fits(meta: ParamMeta, shape: tuple[int, ...]) -> bool:
    if meta.kind == "experts":
        return len(shape) == 3 and shape[0] == meta.num_blocks
    if len(shape) != 2:
        return False
    if meta.kind == "heads_dim0":
        return shape[0] % meta.num_blocks == 0
    if meta.kind == "heads_dim1":
        return shape[1] % meta.num_blocks == 0
    return meta.num_blocks == 1
