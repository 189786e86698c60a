"""Checkpoints: ``torch.distributed.checkpoint`` (DCP) save/load and safetensors export.

Layout of a run directory::

    RUN/checkpoints/step_000100/   DCP shards (model, optimizer) + extra.json
    RUN/checkpoints/latest         text file naming the newest complete checkpoint

Atomicity: a checkpoint is written into ``step_N.partial`` and renamed to ``step_N`` only after
every rank has finished writing; ``latest`` is replaced by a rename too. A save interrupted at any
point leaves the previous checkpoint and the ``latest`` pointer intact; a stale ``.partial``
directory is removed by the next save. Saving again a step that already exists renames the old
copy to ``step_N.old`` first and removes it after the new one is in place: for the instant
between those two renames ``latest`` names a missing directory, but nothing is deleted early.

DCP stores tensors by fully-qualified name with their global shapes, so a checkpoint saved
under one parallel layout (FSDP2 DTensors on any mesh) loads into another layout or world size,
and into a single process (one code path: with no process group the collectives are skipped).

Not covered here: which state to save. Callers pass the model, the optimizer and a JSON-able
``extra`` dict (step, data position, curriculum state, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

CHECKPOINT_DIR = "checkpoints"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    ckpt_root = Path(run_dir) / CHECKPOINT_DIR
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        path = ckpt_root / pointer.read_text().strip()
        if path.is_dir():
            return path
    return None


def _app_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    keep_last: int | None = 2,
) -> Path:
    """Save model (+ optimizer, + extra JSON) as checkpoint ``step``; collective over all ranks."""
    ckpt_root = Path(run_dir) / CHECKPOINT_DIR
    final = ckpt_root / step_dir_name(step)
    partial = ckpt_root / (step_dir_name(step) + ".partial")
    if _rank() == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)
    _barrier()
    with warnings.catch_warnings():  # DCP warns that one process means no process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_app_state(model, optimizer), checkpoint_id=str(partial))
    if _rank() == 0:
        (partial / "extra.json").write_text(json.dumps({"step": step, **(extra or {})}, indent=2))
    _barrier()  # every rank's shards are on disk before the rename makes them visible
    if _rank() == 0:
        # a re-save of the same step (e.g. a periodic save, then the final one) moves the old
        # copy aside rather than deleting it first: ``latest`` may name it, and an interrupt
        # between a delete and the rename would leave no checkpoint at all
        replaced = ckpt_root / (step_dir_name(step) + ".old")
        if final.exists():
            if replaced.exists():
                shutil.rmtree(replaced)
            os.replace(final, replaced)
        os.replace(partial, final)
        _write_text_atomic(ckpt_root / "latest", final.name)
        shutil.rmtree(replaced, ignore_errors=True)
        if keep_last is not None:
            done = sorted(
                p for p in ckpt_root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()
            )
            for old in done[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``) in place; returns its extra dict."""
    path = Path(path)
    if not (path / "extra.json").is_file():
        raise ValueError(
            f"{path} is not a complete etude checkpoint (no extra.json); pass a step_N directory"
        )
    state = _app_state(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return json.loads((path / "extra.json").read_text())


def export_safetensors(
    model: nn.Module, out_dir: str | Path, config: dict[str, Any]
) -> Path | None:
    """Write ``model.safetensors`` (full, unsharded tensors) and ``config.json`` on rank 0."""
    from safetensors.torch import save_file

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if _rank() != 0:
        return None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, storages = {}, set()
    for name, value in full.items():
        tensor = value.detach().contiguous()
        # tied weights (embedding = head) share storage, which safetensors refuses to write: the
        # second name gets its own copy; a strict load fills both names of the tied parameter
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".model.")
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, out_dir / "model.safetensors")
    except BaseException:
        os.unlink(tmp)
        raise
    _write_text_atomic(out_dir / "config.json", json.dumps(config, indent=2))
    return out_dir / "model.safetensors"


def load_safetensors(model: nn.Module, path: str | Path) -> None:
    """Load a safetensors export into an unsharded model (strict: every key must match)."""
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(path)), strict=True)
