"""etude.parallel: dual-mesh FSDP2 (dense mesh + expert mesh), expert and context parallelism.

``ParallelConfig`` and ``ParallelDims`` import without torch (recipes and layouts are checked
without it); the torch-backed names load on first use. See ``docs/parallel.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from etude.parallel.dims import DualMesh, ParallelConfig, ParallelDims

if TYPE_CHECKING:
    from etude.parallel.context import (
        ContextParallelAttention,
        apply_context_parallel,
        context_parallel_batch,
        load_balanced_positions,
        shard_sequence,
        unshard_sequence,
    )
    from etude.parallel.expert import ExpertParallelExperts, make_expert_parallel
    from etude.parallel.fsdp import (
        clip_grad_norm,
        load_full_state,
        materialize,
        parallelize,
        sync_expert_load,
    )

_LAZY = {
    "ContextParallelAttention": "etude.parallel.context",
    "apply_context_parallel": "etude.parallel.context",
    "context_parallel_batch": "etude.parallel.context",
    "load_balanced_positions": "etude.parallel.context",
    "shard_sequence": "etude.parallel.context",
    "unshard_sequence": "etude.parallel.context",
    "ExpertParallelExperts": "etude.parallel.expert",
    "make_expert_parallel": "etude.parallel.expert",
    "clip_grad_norm": "etude.parallel.fsdp",
    "load_full_state": "etude.parallel.fsdp",
    "materialize": "etude.parallel.fsdp",
    "parallelize": "etude.parallel.fsdp",
    "sync_expert_load": "etude.parallel.fsdp",
}

__all__ = [
    "ContextParallelAttention",
    "DualMesh",
    "ExpertParallelExperts",
    "ParallelConfig",
    "ParallelDims",
    "apply_context_parallel",
    "clip_grad_norm",
    "context_parallel_batch",
    "load_balanced_positions",
    "load_full_state",
    "make_expert_parallel",
    "materialize",
    "parallelize",
    "shard_sequence",
    "sync_expert_load",
    "unshard_sequence",
]
assert set(__all__) == {"DualMesh", "ParallelConfig", "ParallelDims", *_LAZY}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'etude.parallel' has no attribute {name!r}")
