"""Context parallelism (CP): each sequence split over the ``cp`` ranks, attention made whole.

Layout (load-balanced causal chunks). A sequence of T tokens is cut into ``2 * cp`` equal
chunks; cp rank i holds chunks ``i`` and ``2*cp - 1 - i``, in that order. Under a causal mask
the early chunks are cheap and the late ones expensive, so pairing them gives every rank the
same attention work (the "head-tail" layout of PyTorch's context parallel and of Megatron-LM's
CP). Tokens, targets and positions are sharded the same way; RoPE reads the true positions.

Attention, two ways:

- ``allgather`` (every device, the CPU path): a rank projects its local Q, K, V, all-gathers K
  and V (and their positions) over the cp group and attends its queries to all T keys under
  ``causal_mask(local positions, gathered positions)``. The all-gather's backward is a
  reduce-scatter, so dK/dV from every rank's queries sum at the rank owning those tokens.
  Memory: each rank holds K/V of the whole sequence for one layer at a time.
- ``ring`` (CUDA): PyTorch's ``context_parallel`` (ring attention over flash/efficient SDPA,
  K/V rotating between ranks; its own head-tail sharding of the buffers, the same layout as
  ours). It has no CPU kernel.

Every other layer is per token, so with global-token loss normalization (sum over the rank's
tokens / tokens of the global batch) the sum of the cp ranks' gradients equals the unsplit
gradient, and FSDP's reduction over ``dp_shard x cp`` produces it.

Not here: packed documents with per-document masks, KV caches (generation runs unsharded),
striped or zig-zag variants other than head-tail.

Legend: B batch, T local tokens (the rank's two chunks), S gathered key slots (= cp * T),
H query heads, G key/value heads, K head width, R rotary frequencies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from etude.model.attention import Attention, KVCache, causal_mask


def load_balanced_positions(
    seq_len: int, cp: int, cp_rank: int, device: torch.device | str | None = None
) -> Tensor:
    """Positions (int64, ``[seq_len / cp]``) held by ``cp_rank``: chunks ``i`` and ``2cp-1-i``."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2 * cp = {2 * cp} for "
            "load-balanced context parallelism; pick data.seq_len accordingly"
        )
    assert 0 <= cp_rank < cp, (cp_rank, cp)
    chunk = seq_len // (2 * cp)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp - 1 - cp_rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat((head, tail))


def shard_sequence(x_BT: Tensor, cp: int, cp_rank: int, dim: int = 1) -> Tensor:
    """The part of ``x`` (sequence along ``dim``) that cp rank ``cp_rank`` holds."""
    if cp == 1:
        return x_BT
    index = load_balanced_positions(x_BT.shape[dim], cp, cp_rank, device=x_BT.device)
    return x_BT.index_select(dim, index)


def unshard_sequence(parts: Sequence[Tensor], dim: int = 1) -> Tensor:
    """Inverse of `shard_sequence`: the cp ranks' parts (in cp-rank order) -> whole sequences."""
    cp = len(parts)
    local = parts[0].shape[dim]
    seq_len = local * cp
    out = torch.empty_like(torch.cat(list(parts), dim=dim))
    for rank, part in enumerate(parts):
        index = load_balanced_positions(seq_len, cp, rank, device=part.device)
        out.index_copy_(dim, index, part)
    return out


class _GatheredPositions:
    """All-gathered positions of the forward in progress, shared by the layers of one model.

    Every layer of a forward receives the same ``positions_BT`` tensor object, so the gather
    runs once per forward: the cache is keyed on that object (held, so its id cannot be reused).
    """

    def __init__(self) -> None:
        self.key: Tensor | None = None
        self.value: Tensor | None = None

    def get(self, positions_BT: Tensor, group: Any, cp: int) -> Tensor:
        if self.key is not positions_BT:
            local_TB = positions_BT.mT.contiguous()
            gathered_ST = torch.empty(
                (cp * local_TB.shape[0], local_TB.shape[1]),
                dtype=local_TB.dtype,
                device=local_TB.device,
            )
            dist.all_gather_single(gathered_ST, local_TB, group=group)
            self.key, self.value = positions_BT, gathered_ST.mT
        assert self.value is not None
        return self.value


class ContextParallelAttention(Attention):
    """`Attention` whose forward attends local queries to the K/V of the whole sequence.

    Made from a built `Attention` by `apply_context_parallel` (class swap, as ``fully_shard``
    does): parameters, names and metadata are unchanged, so checkpoints move between layouts.
    ``cp_mode`` is ``allgather`` or ``ring`` (see the module docstring).
    """

    cp_group: Any
    cp_size: int
    cp_mode: str
    cp_positions: _GatheredPositions

    def forward(
        self,
        x_BTD: Tensor,
        cos_BTR: Tensor,
        sin_BTR: Tensor,
        *,
        mask_B1TS: Tensor | None = None,
        cache: KVCache | None = None,
        positions_BT: Tensor,
    ) -> Tensor:
        if cache is not None or mask_B1TS is not None:
            raise ValueError(
                "a context-parallel model does not run with a KV cache or an explicit mask; "
                "generate with an unsharded model (load the checkpoint or the safetensors export)"
            )
        batch, seq, _ = x_BTD.shape
        q_BHTK, k_BGTK, v_BGTK = self.project_qkv(x_BTD, cos_BTR, sin_BTR)
        if self.cp_mode == "ring":
            out_BHTK = self._attend_ring(q_BHTK, k_BGTK, v_BGTK)
        else:
            out_BHTK = self._attend_allgather(q_BHTK, k_BGTK, v_BGTK, positions_BT)
        out_BTD = out_BHTK.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out_BTD)

    def _attend_allgather(
        self, q_BHTK: Tensor, k_BGTK: Tensor, v_BGTK: Tensor, positions_BT: Tensor
    ) -> Tensor:
        from torch.distributed._functional_collectives import all_gather_single_autograd

        # one collective for K and V, gathered along dim 0: [T, 2, B, G, K] -> [S, 2, B, G, K]
        kv_T2BGK = torch.stack((k_BGTK, v_BGTK)).permute(3, 0, 1, 2, 4).contiguous()
        kv_S2BGK = all_gather_single_autograd(kv_T2BGK, 0, self.cp_group)
        k_BGSK, v_BGSK = kv_S2BGK.permute(1, 2, 3, 0, 4).unbind(0)
        k_positions_BS = self.cp_positions.get(positions_BT, self.cp_group, self.cp_size)
        mask_B1TS = causal_mask(positions_BT, k_positions_BS)
        return self.attend(q_BHTK, k_BGSK, v_BGSK, mask_B1TS)

    def _attend_ring(self, q_BHTK: Tensor, k_BGTK: Tensor, v_BGTK: Tensor) -> Tensor:
        # inside torch's context_parallel() this SDPA call is the ring attention; K/V heads are
        # repeated to the query heads first, as the ring kernels take no enable_gqa
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k_BGTK = k_BGTK.repeat_interleave(groups, dim=1)
            v_BGTK = v_BGTK.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, is_causal=True)


def resolve_cp_mode(setting: str, device_type: str) -> str:
    """``auto`` -> ``ring`` on CUDA, ``allgather`` elsewhere; ``ring`` off CUDA is an error."""
    if setting == "auto":
        return "ring" if device_type == "cuda" else "allgather"
    if setting == "ring" and device_type != "cuda":
        raise ValueError(
            f"parallel.cp_attention='ring' needs CUDA (PyTorch's ring attention has no "
            f"{device_type} kernel); set parallel.cp_attention='allgather'"
        )
    return setting


def apply_context_parallel(model: nn.Module, cp_mesh: Any, mode: str) -> None:
    """Make every `Attention` of ``model`` context-parallel over the 1-D ``cp_mesh``."""
    assert mode in ("allgather", "ring"), mode
    shared = _GatheredPositions()
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = ContextParallelAttention
            module.cp_group = cp_mesh.get_group()
            module.cp_size = cp_mesh.size()
            module.cp_mode = mode
            module.cp_positions = shared


@contextlib.contextmanager
def context_parallel_batch(
    cp_mesh: Any, mode: str, tensors_BT: Sequence[Tensor]
) -> Iterator[list[Tensor]]:
    """This rank's part of each ``[B, T, ...]`` tensor (sequence on dim 1), for the with-block.

    Run the forward and the backward inside the block: in ``ring`` mode PyTorch's
    ``context_parallel`` shards the tensors in place (its head-tail layout) and routes SDPA
    through ring attention until the block ends; in ``allgather`` mode the parts are slices and
    the model's `ContextParallelAttention` does the gathering.
    """
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if mode == "allgather" or cp == 1:
        yield [shard_sequence(t, cp, rank) for t in tensors_BT]
        return
    from torch.distributed.tensor.experimental import context_parallel

    buffers = [t.contiguous().clone() for t in tensors_BT]
    with context_parallel(
        cp_mesh,
        buffers=buffers,
        buffer_seq_dims=[1] * len(buffers),
        no_restore_buffers=set(buffers),
    ):
        yield buffers
