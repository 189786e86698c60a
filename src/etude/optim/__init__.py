"""etude.optim: Muon at natural granularity (per head, per expert), sharded over FSDP2.

``OptimConfig`` and ``build_optimizer`` import without torch (recipes load without it); the
torch-backed names (``Muon``, ``ShardedMuon``, ``zeropower_via_newtonschulz``, ...) load on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from etude.optim.groups import OptimConfig, build_optimizer

if TYPE_CHECKING:
    from etude.optim.muon import (
        POLAR_EXPRESS_COEFFICIENTS,
        QUINTIC_COEFFICIENTS,
        Muon,
        merge_blocks,
        ns_flops,
        split_blocks,
        update_scale,
        zeropower_via_newtonschulz,
    )
    from etude.optim.sharded import ShardedMuon

_LAZY = {
    "Muon": "etude.optim.muon",
    "POLAR_EXPRESS_COEFFICIENTS": "etude.optim.muon",
    "QUINTIC_COEFFICIENTS": "etude.optim.muon",
    "merge_blocks": "etude.optim.muon",
    "ns_flops": "etude.optim.muon",
    "split_blocks": "etude.optim.muon",
    "update_scale": "etude.optim.muon",
    "zeropower_via_newtonschulz": "etude.optim.muon",
    "ShardedMuon": "etude.optim.sharded",
}

__all__ = [
    "POLAR_EXPRESS_COEFFICIENTS",
    "QUINTIC_COEFFICIENTS",
    "Muon",
    "OptimConfig",
    "ShardedMuon",
    "build_optimizer",
    "merge_blocks",
    "ns_flops",
    "split_blocks",
    "update_scale",
    "zeropower_via_newtonschulz",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'etude.optim' has no attribute {name!r}")
