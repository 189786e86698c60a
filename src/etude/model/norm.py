"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), the only normalization the models use.

Computed in fp32 and cast back to the input dtype, as the Llama, Qwen and DeepSeek reference
implementations do. Not here: LayerNorm, norms with a bias or a learned offset.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from etude.model.meta import ParamMeta


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def param_meta(self) -> dict[str, ParamMeta]:
        return {"weight": ParamMeta(kind="norm")}

    def forward(self, x_BTD: Tensor) -> Tensor:
        x32_BTD = x_BTD.float()
        x32_BTD = x32_BTD * torch.rsqrt(x32_BTD.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32_BTD * self.weight.float()).to(x_BTD.dtype)
