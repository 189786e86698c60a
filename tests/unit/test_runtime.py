"""The shared run plumbing: LR schedule shapes, sums over ranks without a process group, the
model section of a recipe."""

from __future__ import annotations

import pytest
import torch

from etude.runtime import all_reduce_sum, init_distributed, lr_factor, resolve_model_config, world


def test_lr_schedules() -> None:
    warm = [lr_factor(s, warmup_steps=4, total_steps=20) for s in range(4)]
    assert warm == [0.25, 0.5, 0.75, 1.0]
    cosine = [lr_factor(s, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for s in range(4, 21)]
    assert cosine[0] == pytest.approx(1.0) and cosine[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(cosine, cosine[1:]))
    flat = [lr_factor(s, warmup_steps=2, total_steps=9, schedule="constant") for s in range(9)]
    assert flat == [0.5] + [1.0] * 8
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(0, warmup_steps=0, total_steps=1, schedule="linear")  # type: ignore[arg-type]


def test_one_process_is_the_identity() -> None:
    device, rank, size = init_distributed("cpu")
    assert (device.type, rank, size) == ("cpu", 0, 1) and world() == (0, 1)
    t = torch.tensor([1.0, 2.0])
    out = all_reduce_sum(t)
    assert out.tolist() == [1.0, 2.0] and out is not t
    assert all_reduce_sum([1, 2.5]) == [1.0, 2.5]


def test_model_section() -> None:
    cfg = resolve_model_config({"preset": "tiny", "dim": 48})
    assert cfg.dim == 48
    with pytest.raises(ValueError):
        resolve_model_config({"preset": "tiny", "no_such_field": 1})
