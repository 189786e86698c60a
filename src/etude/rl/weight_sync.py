"""Weight sync: the trainer's new weights reach the rollout side after every optimizer step.

Three ways, one interface (``push(model, version) -> SyncRecord``), chosen by
``rollout.sync.kind``:

- ``in_process``: the rollout engine's module lives in the trainer's process; its parameters and
  buffers are copied in place (``copy_full_weights``; nothing to do when the engine runs the
  policy module itself, as in the synchronous one-process loop).
- ``file``: a safetensors export per version, ``DIR/v000012/{model.safetensors, config.json}``,
  then ``DIR/LATEST`` (``{"version": 12, "path": "v000012"}``) replaced atomically, so a reader
  sees the previous version or the whole new one, never half a file. Rollout workers on other
  processes or machines (a shared file system) poll it with ``FileWeightWatcher``. The newest
  ``keep`` versions stay on disk (a worker may still be reading the one before).
- ``http``: the file sync, then the rollout backend's ``update_weights(path, version)``: for
  ``etude serve`` a ``POST /v1/weights/reload`` with ``{"path": ..., "version": ...}`` (the
  server loads the export and answers once the new weights are live). The server and the
  trainer share the file system; the weights do not travel in the request.

Every push is timed (``SyncRecord.seconds``: export, rename, and the engine's load or the
server's acknowledged reload) and, with
``track_changes``, compared to the previous version: the fraction of bytes that changed
(``changed_bytes / total_bytes``, element granularity: a parameter element whose value changed
counts its whole size). That fraction is what a delta sync could save; Muon's dense orthogonal
updates and AdamW's per-element updates differ in it.

Collective: under data parallelism every rank calls ``push`` (gathering sharded parameters is a
collective); only rank 0 writes files and sends the request.

vLLM (0.32): its documented RL weight-update interface (``/pause``,
``/init_weight_transfer_engine``, ``/update_weights``, ``/finish_weight_update``, ``/resume``)
moves tensors by NCCL or CUDA IPC, GPUs only; on CPU the development-mode ``/collective_rpc``
with ``reload_weights`` reloads a checkpoint directory in place (``make test-vllm`` tries it;
``docs/async-rl.md`` says what passed). Neither is wrapped here.

Not here: NCCL broadcast of weights from trainer ranks to inference GPUs, delta (sparse) sync,
quantized sync.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from etude.tasks.record import write_atomic

SYNC_KINDS = ("in_process", "file", "http")
LATEST = "LATEST"


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """The ``[rollout.sync]`` section: how new weights reach the rollout engine."""

    kind: str = "in_process"
    """``in_process`` (copy into the engine's module), ``file`` (safetensors + LATEST, which the
    engine loads) or ``http`` (file, then the rollout server's reload endpoint)."""
    directory: str = ""
    """Where ``file``/``http`` write versions ('' = RUN/weights)."""
    keep: int = 2
    """``file``/``http``: versions kept on disk (>= 2: a reader may hold the previous one)."""
    track_changes: bool = False
    """Measure the fraction of weight bytes that changed per push (keeps a CPU copy)."""

    def __post_init__(self) -> None:
        if self.kind not in SYNC_KINDS:
            raise ValueError(f"rollout.sync.kind={self.kind!r}: use one of {', '.join(SYNC_KINDS)}")
        if self.keep < 2:
            raise ValueError(f"rollout.sync.keep={self.keep} must be >= 2")


@dataclass(kw_only=True, slots=True)
class SyncRecord:
    """One push."""

    version: int
    seconds: float
    total_bytes: int
    changed_bytes: int | None = None
    """Bytes of elements that differ from the previous push (None: not tracked, or the first)."""

    @property
    def changed_fraction(self) -> float | None:
        if self.changed_bytes is None or self.total_bytes == 0:
            return None
        return self.changed_bytes / self.total_bytes

    def metrics(self) -> dict[str, float]:
        out = {"sync/seconds": self.seconds, "sync/version": float(self.version)}
        if self.changed_fraction is not None:
            out["sync/changed_bytes_frac"] = self.changed_fraction
        return out


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer as a full CPU tensor on every rank (gathers DTensors:
    collective; each rank's engine needs the whole state). On CPU an unsharded model's tensors
    share storage with its parameters: clone to keep a snapshot."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # not cpu_offload: with it only rank 0 receives the state, and the other ranks' engines
    # would get an empty dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: value.detach().cpu() for name, value in state.items()}


def changed_bytes(previous: dict[str, Tensor], current: dict[str, Tensor]) -> tuple[int, int]:
    """(bytes of elements whose value changed, total bytes) between two state dicts.

    Compared bit for bit (a NaN that stays NaN has not changed); a tensor whose name or shape is
    new counts as wholly changed.
    """
    changed = total = 0
    for name, new in current.items():
        size = new.numel() * new.element_size()
        total += size
        old = previous.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            changed += size
            continue
        # compare the raw bits: as integers of the element's width
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
        diff = old.contiguous().view(bits) != new.contiguous().view(bits)
        changed += int(diff.sum()) * new.element_size()
    return changed, total


class ChangeMeter:
    """Keeps the last pushed weights and measures what changed since (``track_changes``)."""

    def __init__(self) -> None:
        self._previous: dict[str, Tensor] | None = None

    def measure(self, state: dict[str, Tensor]) -> int | None:
        snapshot = {name: t.clone() for name, t in state.items()}
        previous, self._previous = self._previous, snapshot
        if previous is None:
            return None
        return changed_bytes(previous, snapshot)[0]


def _state_bytes(state: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class InProcessSync:
    """Moves the policy's weights into the in-process engine through its backend.

    ``backend.update_weights`` copies under the backend's lock and sets its policy version, so
    a generation in flight on another thread finishes with the old weights and the next one
    sees the new. A sharded policy is gathered to full tensors first (collective).
    """

    def __init__(self, backend: Any, *, track_changes: bool = False) -> None:
        self.backend = backend
        self._meter = ChangeMeter() if track_changes else None

    @property
    def engine_model(self) -> nn.Module:
        return self.backend.engine.model

    def push(self, model: nn.Module, version: int) -> SyncRecord:
        start = time.perf_counter()
        sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
        with torch.no_grad():
            self.backend.update_weights(full_state_dict(model) if sharded else model, version)
        seconds = time.perf_counter() - start
        target = self.engine_model
        state = {**dict(target.named_parameters()), **dict(target.named_buffers())}
        changed = None
        if self._meter is not None:
            changed = self._meter.measure({k: v.detach().cpu() for k, v in state.items()})
        return SyncRecord(
            version=version, seconds=seconds, total_bytes=_state_bytes(state), changed_bytes=changed
        )


def version_dir_name(version: int) -> str:
    return f"v{version:06d}"


class FileSync:
    """Writes each version as a safetensors export and points ``LATEST`` at it atomically."""

    def __init__(
        self,
        directory: str | Path,
        model_config: dict[str, Any],
        *,
        keep: int = 2,
        track_changes: bool = False,
        backend: Any = None,
    ) -> None:
        self.directory = Path(directory)
        self.model_config = model_config
        self.keep = keep
        self.backend = backend
        """Told to load each version (``update_weights(path, version)``) once it is written:
        the in-process engine reads the file, an HTTP backend asks its server to."""
        self._meter = ChangeMeter() if track_changes else None

    def write(self, model: nn.Module, version: int) -> tuple[Path | None, int, int | None]:
        """Export ``model`` as ``version``; (export dir on rank 0 else None, bytes, changed)."""
        from safetensors.torch import save_file

        state = full_state_dict(model)
        changed = self._meter.measure(state) if self._meter is not None else None
        if _rank() != 0:
            return None, _state_bytes(state), changed
        out = self.directory / version_dir_name(version)
        out.mkdir(parents=True, exist_ok=True)
        tensors, storages = {}, set()
        for name, tensor in state.items():
            tensor = tensor.contiguous()
            # tied weights share storage, which safetensors refuses: the second name gets a copy
            ptr = tensor.untyped_storage().data_ptr()
            tensors[name] = tensor.clone() if ptr in storages else tensor
            storages.add(ptr)
        tmp = out / ".model.safetensors.tmp"
        save_file(tensors, str(tmp))
        tmp.replace(out / "model.safetensors")
        write_atomic(out / "config.json", json.dumps(self.model_config, indent=2).encode())
        write_atomic(
            self.directory / LATEST,
            json.dumps({"version": version, "path": out.name}).encode(),
        )
        self._prune()
        return out, _state_bytes(state), changed

    def _prune(self) -> None:
        versions = sorted(p for p in self.directory.glob("v[0-9]*") if p.is_dir())
        for old in versions[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def push(self, model: nn.Module, version: int) -> SyncRecord:
        """Write ``version``; then the backend (if any) loads it, on every rank."""
        start = time.perf_counter()
        _, total, changed = self.write(model, version)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # rank 0's files are complete before any rank reads them
        if self.backend is not None:
            path = (self.directory / version_dir_name(version)).resolve()
            self.backend.update_weights(path, version)
        return SyncRecord(
            version=version,
            seconds=time.perf_counter() - start,
            total_bytes=total,
            changed_bytes=changed,
        )


def latest_version(directory: str | Path) -> tuple[int, Path] | None:
    """(version, export dir) that ``LATEST`` names, or None before the first push."""
    directory = Path(directory)
    try:
        data = json.loads((directory / LATEST).read_text())
    except FileNotFoundError:
        return None
    return int(data["version"]), directory / data["path"]


class FileWeightWatcher:
    """The reading side of ``FileSync``: loads a newer version into a plain module when there is
    one (a rollout worker calls ``poll`` between generations)."""

    def __init__(self, directory: str | Path, version: int = -1) -> None:
        self.directory = Path(directory)
        self.version = version

    def poll(self, model: nn.Module) -> int | None:
        """Load the newest version if it is newer than the one held; the new version or None."""
        from etude.parallel.checkpoint import load_safetensors

        found = latest_version(self.directory)
        if found is None or found[0] <= self.version:
            return None
        version, path = found
        with torch.no_grad():
            load_safetensors(model, path / "model.safetensors")
        self.version = version
        return version


def build_weight_sync(
    cfg: WeightSyncConfig,
    *,
    backend: Any,
    model_config: dict[str, Any],
    run_dir: str | Path,
) -> InProcessSync | FileSync:
    """The sync ``cfg`` asks for, feeding ``backend`` (the rollout engine: an ``EngineBackend``
    in process, an ``HTTPBackend`` for a server)."""
    if cfg.kind == "in_process":
        if backend is None or not hasattr(backend, "engine"):
            raise ValueError(
                "rollout.sync.kind='in_process' needs the rollout engine in the trainer's "
                "process; use 'file' or 'http' for rollout workers elsewhere"
            )
        return InProcessSync(backend, track_changes=cfg.track_changes)
    if cfg.kind == "http" and hasattr(backend, "engine"):
        raise ValueError(
            "rollout.sync.kind='http' needs rollouts through a server: set rollout.server_url"
        )
    directory = Path(cfg.directory) if cfg.directory else Path(run_dir) / "weights"
    return FileSync(
        directory, model_config, keep=cfg.keep, track_changes=cfg.track_changes, backend=backend
    )
