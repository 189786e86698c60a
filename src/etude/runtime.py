"""Run plumbing shared by the three training jobs (pretrain, SFT, RL): process group, device,
sums over ranks, the learning-rate schedule and the model section of a recipe.

It sits on the lowest floor, beside ``etude.config`` and ``etude.model``: the jobs
(``etude.pretrain``, ``etude.rl.sft``, ``etude.rl.trainer``) import it; it imports none of them.

One code path from 1 rank to N: without a process group (a plain ``python`` process) every
collective here is the identity, so the same job runs in a unit test and under ``torchrun``.

What it does not do: parallelize a model (``etude.parallel``), checkpoint (``etude.parallel.
checkpoint``), or log (``etude.report.metrics``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from etude.config import from_dict, to_dict
from etude.model.config import ModelConfig


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """``auto`` (cuda when available, else cpu), ``cpu`` or ``cuda`` (one GPU per rank)."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train.device={name!r}: use auto, cpu or cuda")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device='cuda' but no CUDA device is available; use cpu or auto")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(device_setting: str = "auto") -> tuple[torch.device, int, int]:
    """Join torchrun's process group when launched with WORLD_SIZE > 1; (device, rank, world).

    gloo on CPU, nccl on CUDA (one GPU per process, ``LOCAL_RANK``). Without torchrun's
    environment: ``(device, 0, 1)`` and no process group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        use_cuda = device_setting == "cuda" or (
            device_setting == "auto" and torch.cuda.is_available()
        )
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, size = world()
    return resolve_device(device_setting, int(os.environ.get("LOCAL_RANK", "0"))), rank, size


@overload
def all_reduce_sum(values: torch.Tensor) -> torch.Tensor: ...
@overload
def all_reduce_sum(values: Sequence[float]) -> list[float]: ...
def all_reduce_sum(values: torch.Tensor | Sequence[float]) -> torch.Tensor | list[float]:
    """Sum over ranks: a tensor (a summed copy) or a list of floats (summed in float64).

    The identity (a copy) in one process.
    """
    single = world()[1] == 1
    if isinstance(values, torch.Tensor):
        if single:
            return values.clone()
        out = values.clone()
        dist.all_reduce(out)
        return out
    if single:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: Literal["cosine", "constant"] = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the base learning rate at ``step`` (counted from 0).

    Linear warmup over ``warmup_steps``, then ``constant`` or a cosine decay to ``min_lr_ratio``
    at ``total_steps`` (Loshchilov and Hutter 2017, SGDR).
    """
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"lr schedule {schedule!r}: use cosine or constant")
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def resolve_model_config(section: dict[str, Any]) -> ModelConfig:
    """``{"preset": "tiny", "dim": 96}`` -> a checked ModelConfig (unknown keys are errors)."""
    section = dict(section)
    preset = section.pop("preset", "tiny")
    base = to_dict(ModelConfig.preset(preset))
    return from_dict(ModelConfig, {**base, **section}, "model")
