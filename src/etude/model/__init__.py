"""etude.model: the parallelism-free MoE transformer of the Kimi K2 family.

``ModelConfig`` and ``PRESETS`` import without torch; the torch-backed names (``Transformer``,
``build_model``, ``KVCache``, ``count_params``, ...) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from etude.model.config import PRESETS, ModelConfig

if TYPE_CHECKING:
    from etude.model.attention import Attention, KVCache
    from etude.model.info import count_params, format_model_info
    from etude.model.moe import FeedForward, GroupedExperts, MoE, TopKRouter
    from etude.model.transformer import RMSNorm, Transformer, TransformerBlock, build_model

_LAZY = {
    "Attention": "etude.model.attention",
    "KVCache": "etude.model.attention",
    "FeedForward": "etude.model.moe",
    "GroupedExperts": "etude.model.moe",
    "MoE": "etude.model.moe",
    "TopKRouter": "etude.model.moe",
    "RMSNorm": "etude.model.transformer",
    "Transformer": "etude.model.transformer",
    "TransformerBlock": "etude.model.transformer",
    "build_model": "etude.model.transformer",
    "count_params": "etude.model.info",
    "format_model_info": "etude.model.info",
}

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "GroupedExperts",
    "KVCache",
    "MoE",
    "ModelConfig",
    "RMSNorm",
    "TopKRouter",
    "Transformer",
    "TransformerBlock",
    "build_model",
    "count_params",
    "format_model_info",
]
assert set(__all__) == {"PRESETS", "ModelConfig", *_LAZY}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'etude.model' has no attribute {name!r}")
