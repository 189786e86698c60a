"""etude.plan: an analytic cost model of a training layout at cluster scale, on paper.

For a model config (built on the meta device, so counts and block shapes are exact), a cluster
(GPU count, FLOP/s, memory, NVLink and NIC bandwidth) and a layout (``dp_replicate``,
``dp_shard``, ``cp``, ``ep``), ``plan`` estimates per-GPU memory, bytes per step on each mesh
axis, and the sharded Muon optimizer step (Newton-Schulz FLOPs per rank, all-to-all bytes,
step time), for the dual mesh and for a single shared mesh. ``etude plan`` prints it; see
``docs/plan.md`` for the Kimi K2 example worked through.

What it is not: a simulator of kernels or of the network (one bandwidth per link class, fixed
efficiencies and latencies), or a layout search. Torch is imported only for the meta build.
"""

from __future__ import annotations

from etude.plan.cluster import GPU_PRESETS, ClusterConfig
from etude.plan.layout import MESHES, Layout, min_gpus

__all__ = ["GPU_PRESETS", "MESHES", "ClusterConfig", "Layout", "min_gpus"]
