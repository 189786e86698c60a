"""The hardware a plan is made for: GPU count and node size, FLOP/s, memory, link bandwidths.

``ClusterConfig`` holds the numbers the cost model (``etude.plan.cost``) divides by;
``ClusterConfig.preset("h100" | "h200", num_gpus)`` fills them from public datasheets for nodes
of 8 SXM GPUs (DGX/HGX layout: NVLink 4 inside a node, one 400 Gb/s InfiniBand NIC per GPU
between nodes). Every number can be overridden.

Sources of the preset numbers:
- peak dense BF16 989 TFLOP/s and FP32 67 TFLOP/s (non-tensor-core): NVIDIA H100 and H200
  datasheets (the "1,979 TFLOP/s" there is with 2:4 sparsity; dense is half);
- memory: what ``nvidia-smi`` reports as total (H100 SXM 80GB: 81,559 MiB; H200 141GB:
  143,771 MiB); HBM bandwidth 3.35 TB/s (H100 HBM3) and 4.8 TB/s (H200 HBM3e);
- NVLink 4: 900 GB/s per GPU counted both directions, so 450 GB/s each way;
- between nodes: ConnectX-7 at 400 Gb/s per GPU, 50 GB/s each way (DGX H100/H200).

The efficiency factors are assumptions, not measurements: achieved over peak for large batched
bf16 matmuls (Newton-Schulz on [N, 2048, 7168] blocks), for a whole training step (model FLOP
utilization), for NCCL bus bandwidth and for streaming HBM. The latencies are a fixed cost per
collective. What this module does not do: measure anything (time Newton-Schulz and NCCL on the
real machine and override the factors with what they achieve).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

GPU_PRESETS = ("h100", "h200")
"""Names accepted by ``ClusterConfig.preset``."""


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """A cluster of identical GPUs in nodes of equal size."""

    num_gpus: int
    """Total GPUs (the world size of the training job)."""
    gpus_per_node: int = 8
    """GPUs that share the fast intra-node fabric (NVLink); nodes are filled in rank order."""
    gpu_name: str = "custom"
    """Label printed in the report."""
    gpu_flops: float
    """Peak dense bf16 matmul FLOP/s of one GPU."""
    gpu_flops_fp32: float
    """Peak fp32 FLOP/s of one GPU (used when the compute dtype is fp32)."""
    gpu_memory_bytes: int
    """Device memory of one GPU in bytes (as the driver reports its total)."""
    hbm_bw: float
    """Device memory bandwidth in bytes/s (elementwise optimizer work is bound by it)."""
    intra_node_bw: float
    """Bytes/s one GPU sends to the others in its node (one direction)."""
    inter_node_bw: float
    """Bytes/s one GPU sends out of its node (one direction; its NIC)."""
    matmul_efficiency: float = 0.6
    """Achieved over peak FLOP/s for Newton-Schulz's batched matmuls."""
    model_flops_utilization: float = 0.4
    """Achieved over peak FLOP/s for a forward and backward pass (attention, MoE, overheads)."""
    comm_efficiency: float = 0.8
    """Achieved over link bandwidth for collectives (NCCL bus bandwidth over line rate)."""
    hbm_efficiency: float = 0.8
    """Achieved over peak HBM bandwidth for fused elementwise updates."""
    intra_node_latency_s: float = 10e-6
    """Fixed cost of one collective whose group lies inside a node."""
    inter_node_latency_s: float = 30e-6
    """Fixed cost of one collective whose group spans nodes."""

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"cluster.{name} must be a positive integer, got {value!r}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"cluster.num_gpus ({self.num_gpus}) must be a multiple of gpus_per_node "
                f"({self.gpus_per_node}) or fit in one node; use whole nodes"
            )
        positive = ("gpu_flops", "gpu_flops_fp32", "gpu_memory_bytes", "hbm_bw")
        positive += ("intra_node_bw", "inter_node_bw")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"cluster.{name} must be a positive number, got {value!r}")
        factors = ("matmul_efficiency", "model_flops_utilization", "comm_efficiency")
        for name in (*factors, "hbm_efficiency"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value <= 1:
                raise ValueError(f"cluster.{name} must lie in (0, 1], got {value!r}")
        for name in ("intra_node_latency_s", "inter_node_latency_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"cluster.{name} must be >= 0 seconds, got {value!r}")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        """Node that holds global ``rank`` (ranks fill nodes in order)."""
        return rank // self.gpus_per_node

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in ``dtype`` (``bf16`` or ``fp32``)."""
        return self.gpu_flops if dtype == "bf16" else self.gpu_flops_fp32

    @staticmethod
    def preset(name: str, num_gpus: int, **overrides: Any) -> ClusterConfig:
        """Nodes of 8 ``name`` GPUs (see ``GPU_PRESETS``), ``num_gpus`` in all."""
        if name not in _GPU_FIELDS:
            raise ValueError(
                f"unknown GPU preset {name!r}; valid presets: {', '.join(GPU_PRESETS)}"
            )
        fields = {f.name for f in dataclasses.fields(ClusterConfig)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"unknown ClusterConfig field {unknown[0]!r}; valid fields: "
                f"{', '.join(sorted(fields))}"
            )
        return ClusterConfig(num_gpus=num_gpus, **{**_GPU_FIELDS[name], **overrides})


_MIB = 2**20
_GPU_FIELDS: dict[str, dict[str, Any]] = {
    "h100": dict(
        gpu_name="H100 SXM 80GB",
        gpus_per_node=8,
        gpu_flops=989e12,
        gpu_flops_fp32=67e12,
        gpu_memory_bytes=81_559 * _MIB,
        hbm_bw=3.35e12,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
    ),
    "h200": dict(
        gpu_name="H200 SXM 141GB",
        gpus_per_node=8,
        gpu_flops=989e12,
        gpu_flops_fp32=67e12,
        gpu_memory_bytes=143_771 * _MIB,
        hbm_bw=4.8e12,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
    ),
}
assert tuple(_GPU_FIELDS) == GPU_PRESETS
