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
from collections.abc import Callable
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
    """The newest complete checkpoint of a run, or None.

    When ``latest`` names a directory that is gone (deleted by hand, or the instant of a
    re-save), the newest complete ``step_N`` directory (one with ``extra.json``) is used
    instead, with a warning.
    """
    ckpt_root = Path(run_dir) / CHECKPOINT_DIR
    pointer = ckpt_root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = ckpt_root / name
    if path.is_dir():
        return path
    complete = sorted(
        p
        for p in ckpt_root.glob("step_*")
        if p.is_dir() and p.name[5:].isdigit() and (p / "extra.json").is_file()
    )
    if not complete:
        warnings.warn(
            f"{pointer} names {name!r}, which does not exist, and no other complete checkpoint "
            "is there: starting from the beginning",
            stacklevel=2,
        )
        return None
    warnings.warn(
        f"{pointer} names {name!r}, which does not exist; resuming from the newest complete "
        f"checkpoint, {complete[-1].name}",
        stacklevel=2,
    )
    return complete[-1]


def check_checkpoint_files(path: str | Path) -> None:
    """A ``ValueError`` naming the first missing or truncated file of a DCP checkpoint.

    DCP's ``.metadata`` records, per tensor, the file, offset and length that hold it; a file
    shorter than its last byte (a copy or a disk that stopped half-way) is reported here, in
    one line, instead of as a deserialization traceback.
    """
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    meta_file = path / ".metadata"
    if not meta_file.is_file():
        raise ValueError(f"checkpoint file {meta_file} is missing; {_FIX.format(path=path)}")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated pickle raises anything from EOFError to UnpicklingError
        raise ValueError(
            f"checkpoint file {meta_file} is unreadable ({type(e).__name__}); "
            + _FIX.format(path=path)
        ) from None
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel, end in sorted(need.items()):
        f = path / rel
        size = f.stat().st_size if f.is_file() else -1
        if size < end:
            what = "missing" if size < 0 else f"truncated ({size:,} of {end:,} bytes)"
            raise ValueError(f"checkpoint file {f} is {what}; " + _FIX.format(path=path))


_FIX = (
    "delete the directory {path} to resume from the previous checkpoint, or start the run "
    "in a new directory"
)


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
    check_checkpoint_files(path)
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


# ---------------------------------------------------------------- Hugging Face checkpoints


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint directory (``ValueError`` if absent)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{hf_dir} has no config.json; pass a Hugging Face model directory")
    return json.loads(path.read_text())


def hf_weight_files(hf_dir: str | Path) -> dict[str, str]:
    """Tensor name -> file name, from ``model.safetensors.index.json`` or one safetensors file."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = hf_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(
            f"{hf_dir} has neither model.safetensors.index.json nor model.safetensors; etude "
            "reads safetensors checkpoints only (convert .bin files with transformers first)"
        )
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def _local_region(target: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(writable local tensor, global offset of its first element) of a plain or DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = target.to_local()
        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        assert tuple(shape) == tuple(local.shape), (shape, local.shape)
        return local, tuple(offset)
    return target, (0,) * target.dim()


def _copy_overlap(
    local: torch.Tensor, offset: tuple[int, ...], src: torch.Tensor, src_offset: tuple[int, ...]
) -> int:
    """Copy the part of ``src`` (at global ``src_offset``) that falls in ``local``; elements."""
    dst_index, src_index = [], []
    for lo, n, s_lo, s_n in zip(offset, local.shape, src_offset, src.shape):
        start, stop = max(lo, s_lo), min(lo + n, s_lo + s_n)
        if start >= stop:
            return 0
        dst_index.append(slice(start - lo, stop - lo))
        src_index.append(slice(start - s_lo, stop - s_lo))
    part = src[tuple(src_index)]
    local[tuple(dst_index)].copy_(part)
    return part.numel()


@torch.no_grad()
def load_hf_checkpoint(
    model: nn.Module, hf_dir: str | Path, *, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Fill a `Transformer` (meta-device, materialized, or FSDP2/EP-sharded) from a Hugging Face
    checkpoint directory, one safetensors file at a time.

    Each rank reads every tensor of a file once, converts it to etude's layout
    (``etude.model.hf_adapter``: names, transposes, RoPE permutation, FP8 block dequantization)
    and copies only the part that falls in its own shards, so a rank holds its shards plus one
    source tensor at a time, never the whole model. A model still on the meta device is
    allocated on ``device`` first. Returns ``{"loaded": n, "skipped": [names]}``; raises
    ``ValueError`` for a tensor with no counterpart, a shape that does not match or a
    parameter the checkpoint does not fill completely.
    """
    from safetensors import safe_open

    from etude.model.hf_adapter import dequantize_fp8_blocks, target_of, to_etude

    cfg = model.cfg
    hf_config = read_hf_config(hf_dir)
    rope_interleave = bool(hf_config.get("rope_interleave", True))
    quant = hf_config.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "fp8":
        raise ValueError(
            f"{hf_dir}: quantization_config.quant_method={quant.get('quant_method')!r}; etude "
            "dequantizes only DeepSeek-style fp8 block checkpoints (quant_method 'fp8')"
        )
    block = tuple(quant.get("weight_block_size") or (128, 128))
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        model.tie_weights()
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    filled = dict.fromkeys(targets, 0)
    regions = {name: _local_region(t) for name, t in targets.items()}
    files = hf_weight_files(hf_dir)
    skipped: list[str] = []
    loaded = 0
    for file_name in sorted(set(files.values())):
        with safe_open(str(Path(hf_dir) / file_name), "pt") as f:
            for hf_name in f.keys():
                target = target_of(cfg, hf_name)
                if target is None:
                    skipped.append(hf_name)
                    continue
                if target.name not in targets:
                    raise ValueError(
                        f"checkpoint tensor {hf_name!r} maps to {target.name!r}, which this "
                        "model does not have; check the config against the checkpoint"
                    )
                local, offset = regions[target.name]
                tensor = f.get_tensor(hf_name)
                if tensor.dtype == torch.float8_e4m3fn:
                    scale_name = hf_name + "_scale_inv"
                    if scale_name not in files:
                        raise ValueError(
                            f"FP8 tensor {hf_name!r} has no {scale_name!r} in the checkpoint"
                        )
                    with safe_open(str(Path(hf_dir) / files[scale_name]), "pt") as g:
                        scale_inv = g.get_tensor(scale_name)
                    tensor = dequantize_fp8_blocks(tensor, scale_inv, local.dtype, block)
                tensor = to_etude(cfg, target, tensor, rope_interleave=rope_interleave)
                full_shape = tuple(targets[target.name].shape)
                if target.expert is None:
                    want, src_offset = full_shape, (0,) * len(full_shape)
                else:
                    want, src_offset = full_shape[1:], (target.expert, 0, 0)
                    tensor = tensor[None]
                if tuple(tensor.shape[-len(want) :]) != want or (
                    target.expert is None and tuple(tensor.shape) != want
                ):
                    raise ValueError(
                        f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)} but "
                        f"{target.name} needs {want}; the config does not match the weights"
                    )
                filled[target.name] += _copy_overlap(
                    local, offset, tensor.to(local.device), src_offset
                )
                loaded += 1
    # a softmax router has no selection bias in the checkpoint; counts restart from zero
    for name, buffer in model.named_buffers():
        if filled[name] == 0 and (
            name.endswith(".tokens_per_expert") or cfg.router_score == "softmax"
        ):
            buffer.zero_()
            filled[name] = regions[name][0].numel()
    incomplete = [n for n, count in filled.items() if count != regions[n][0].numel()]
    if incomplete:
        raise ValueError(
            f"the checkpoint does not fill {incomplete[:3]}{' ...' if len(incomplete) > 3 else ''}"
            f" ({filled[incomplete[0]]} of {regions[incomplete[0]][0].numel()} local elements); "
            "the checkpoint and the config do not match"
        )
    return {"loaded": loaded, "skipped": skipped}


def export_hf(
    model: nn.Module,
    out_dir: str | Path,
    *,
    family: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write a Hugging Face directory (``config.json``, safetensors shards + index) on rank 0.

    ``family`` defaults to ``etude.model.hf_config.family_of(model.cfg)``; the architecture name
    it writes is one that ``transformers`` and vLLM load. Files are written to a temporary name
    and renamed. ``dtype`` casts floating tensors (default: as they are).
    """
    from safetensors.torch import save_file

    from etude.model.hf_adapter import from_etude, hf_names
    from etude.model.hf_config import hf_config_from_model

    cfg = model.cfg
    config = hf_config_from_model(cfg, family)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    full.update({n: b for n, b in model.named_buffers() if n.endswith(".expert_bias")})
    if _rank() != 0:
        return None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for hf_name, target in hf_names(cfg):
        value = full[target.name].detach().cpu()
        if target.expert is not None:
            value = value[target.expert]
        value = from_etude(cfg, target, value)
        if dtype is not None and value.is_floating_point() and not hf_name.endswith("_bias"):
            value = value.to(dtype)
        nbytes = value.numel() * value.element_size()
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf_name] = value.clone()
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards):
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".shard.")
        os.close(fd)
        try:
            save_file(shard, tmp, metadata={"format": "pt"})
            os.replace(tmp, out_dir / name)
        except BaseException:
            os.unlink(tmp)
            raise
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        total = sum(v.numel() * v.element_size() for s in shards for v in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_text_atomic(out_dir / "model.safetensors.index.json", json.dumps(index, indent=2))
    _write_text_atomic(out_dir / "config.json", json.dumps(config, indent=2))
    return out_dir


def load_hf_model(
    hf_dir: str | Path, *, device: torch.device | str = "cpu", **overrides: Any
) -> tuple[nn.Module, Any, str]:
    """(`Transformer`, `ModelConfig`, family) of a Hugging Face directory, built on the meta
    device and filled by `load_hf_checkpoint`: the one loader behind ``etude model import`` and
    every recipe's ``init = "hf:PATH"``. ``overrides`` replace config fields."""
    from etude.model.hf_config import model_config_from_hf
    from etude.model.transformer import Transformer

    cfg, family = model_config_from_hf(read_hf_config(hf_dir), **overrides)
    with torch.device("meta"):
        model = Transformer(cfg)
    load_hf_checkpoint(model, hf_dir, device=device)
    return model, cfg, family


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tiktoken.model",
)
"""Tokenizer and chat-template files copied along with an import or export."""


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files present in ``src`` into ``dst``; returns their names."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def import_hf(
    hf_dir: str | Path, out_dir: str | Path, *, chat_format: str | None = None
) -> dict[str, Any]:
    """``etude model import``: a Hugging Face directory -> an etude model directory.

    Writes ``OUT/export/model.safetensors`` + ``OUT/export/config.json`` (etude's own names and
    `ModelConfig`, what ``train.init = OUT`` and ``etude generate`` read), ``OUT/tokenizer/``
    (the tokenizer and chat-template files) and ``OUT/hf_source.json`` (family, source, skipped
    tensors, ``chat_format``: the one given, else the one ``etude.model.chat_family`` detects,
    else None). Returns that source record.
    """
    from etude.config import to_dict
    from etude.model.chat_family import check_chat_format, detect_chat_format

    if chat_format is not None:
        check_chat_format(chat_format, "--chat-format")
    else:
        try:
            chat_format = detect_chat_format(hf_dir)
        except ValueError:
            chat_format = None  # the weights import; a conversation needs --chat-format
    model, cfg, family = load_hf_model(hf_dir)
    report: dict[str, Any] = {
        "family": family,
        "source": str(Path(hf_dir).resolve()),
        "chat_format": chat_format,
    }
    out_dir = Path(out_dir)
    export_safetensors(model, out_dir / "export", to_dict(cfg))
    report["tokenizer_files"] = copy_tokenizer_files(hf_dir, out_dir / "tokenizer")
    _write_text_atomic(out_dir / "hf_source.json", json.dumps(report, indent=2))
    return report


def check_hf_init(init: str) -> None:
    """Check a recipe's ``init = "hf:PATH"`` before a run starts (``ValueError`` naming it)."""
    path = Path(init[3:])
    if not (path / "config.json").is_file():
        raise ValueError(
            f"train.init={init!r}: {path} has no config.json; pass hf:DIR with a Hugging Face "
            "model directory (config.json, safetensors, tokenizer.json)"
        )
    from etude.model.hf_config import model_config_from_hf

    model_config_from_hf(read_hf_config(path))
    hf_weight_files(path)


def load_hf_policy(
    hf_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    shard: Callable[[nn.Module], None] | None = None,
) -> tuple[nn.Module, Any, Any]:
    """(model, tokenizer, `ModelConfig`) for ``init = "hf:PATH"``: `load_hf_model` on
    ``device`` and the directory's tokenizer (``etude.model.hf_tokenizer``).

    With ``shard`` (under ``torchrun``: the trainer's FSDP2 wrapping), the model is built on the
    meta device, ``shard`` wraps it, and `load_hf_checkpoint` fills each rank's own shards: no
    rank holds the whole policy while it loads.
    """
    from etude.model.hf_tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(hf_dir)
    if shard is None:
        model, cfg, _ = load_hf_model(hf_dir, device=device)
        return model, tok, cfg
    from etude.model.hf_config import model_config_from_hf
    from etude.model.transformer import Transformer

    cfg, _ = model_config_from_hf(read_hf_config(hf_dir))
    with torch.device("meta"):
        model = Transformer(cfg)
    shard(model)
    load_hf_checkpoint(model, hf_dir, device=device)
    return model, tok, cfg
