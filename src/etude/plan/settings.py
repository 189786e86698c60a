"""The step settings of ``etude plan``: tokens, dtypes, checkpointing, Muon buckets.

``PlanSettings`` says what one training step does (sequence length, tokens per step, micro-batch,
Newton-Schulz steps, the dtype of compute, parameters, gradients, master weights and optimizer
state, activation checkpointing, the sharded Muon bucket size) and validates each setting with a
``ValueError`` that names it. ``DTYPE_BYTES`` gives the bytes per element of the dtypes a plan can
name.

What this module does not do: describe the cluster (``etude.plan.cluster``) or the layout
(``etude.plan.layout``), or compute any cost (``etude.plan.cost`` and the modules it calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from etude.plan.layout import Layout

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
"""Bytes per element of the dtypes a plan can name."""


@dataclass(kw_only=True, slots=True)
class PlanSettings:
    """What one training step does: tokens, dtypes, checkpointing, Newton-Schulz steps."""

    seq_len: int = 4096
    """Tokens per sequence."""
    batch_tokens: int | None = None
    """Tokens per optimizer step over the whole job; None: one micro-batch per data-parallel
    rank."""
    micro_batch_size: int = 1
    """Sequences per data-parallel rank in one forward/backward (gradient accumulation covers
    the rest of the batch)."""
    ns_steps: int = 5
    """Newton-Schulz iterations per Muon step."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype: gathered weights, activations, EP/CP payloads, Newton-Schulz and its
    all-to-all."""
    param_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the sharded parameters FSDP holds and gathers (mixed precision: bf16)."""
    grad_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the sharded gradients (FSDP reduce-scatters and HSDP all-reduces in it)."""
    master_dtype: Literal["fp32", "bf16", "none"] = "fp32"
    """Dtype of the optimizer's master copy of the sharded parameters; ``none``: the
    parameters themselves are the master copy (no extra memory)."""
    optim_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the optimizer state (Muon momentum, AdamW moments)."""
    activation_checkpointing: Literal["full", "none"] = "full"
    """``full``: every transformer block recomputes its forward in backward; ``none``: keep all."""
    bucket_mb: float = 32.0
    """MiB of whole blocks per all-to-all bucket of the sharded Muon step."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "ns_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"plan.{name} must be a positive integer, got {value!r}")
        if self.batch_tokens is not None and (
            not isinstance(self.batch_tokens, int) or self.batch_tokens < 1
        ):
            raise ValueError(
                f"plan.batch_tokens must be a positive integer or None, got {self.batch_tokens!r}"
            )
        if self.master_dtype not in (*DTYPE_BYTES, "none"):
            raise ValueError(
                f"plan.master_dtype must be one of {', '.join(DTYPE_BYTES)}, none; got "
                f"{self.master_dtype!r}"
            )
        for name in ("dtype", "param_dtype", "grad_dtype", "optim_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(
                    f"plan.{name} must be one of {', '.join(DTYPE_BYTES)}, got "
                    f"{getattr(self, name)!r}"
                )
        if self.activation_checkpointing not in ("full", "none"):
            raise ValueError(
                "plan.activation_checkpointing must be 'full' or 'none', got "
                f"{self.activation_checkpointing!r}"
            )
        if not self.bucket_mb > 0:
            raise ValueError(f"plan.bucket_mb must be > 0 MiB, got {self.bucket_mb!r}")

    def resolved_batch_tokens(self, layout: Layout) -> int:
        """Tokens per step; a multiple of one micro-batch over every data-parallel rank."""
        per_round = self.micro_batch_size * self.seq_len * layout.data_parallel
        if self.batch_tokens is None:
            return per_round
        if self.batch_tokens % per_round:
            raise ValueError(
                f"plan.batch_tokens={self.batch_tokens} must be a multiple of micro_batch_size "
                f"* seq_len * data-parallel ranks = {self.micro_batch_size} * {self.seq_len} * "
                f"{layout.data_parallel} = {per_round}; e.g. batch_tokens="
                f"{max(1, round(self.batch_tokens / per_round)) * per_round}"
            )
        return self.batch_tokens
