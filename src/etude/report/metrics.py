"""Metrics sinks and run directories.

Every run writes ``metrics.jsonl`` (one JSON object per logged step, always), ``config.toml``-like
``config.json`` (the resolved config) and ``versions.json`` (python, torch and library versions)
into its run directory. TensorBoard and Weights & Biases are optional sinks, imported lazily only
when asked for. Only rank 0 writes; other ranks get a logger that drops everything.

The console line is fixed-format so that runs can be compared by eye:
``step 120/300 | loss 2.31 | reward 0.42 | kl 0.013 | tok/s 48,211 | eta 4m 10s``. The line
carries its own ETA (`StepClock`): the progress bar is drawn only on a terminal, and a job's
log file (a cluster's, ``nohup``'s) must say how long is left too.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

from etude.tasks.record import write_atomic


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON through a temp file and a rename, so a reader never sees half a file."""
    write_atomic(Path(path), (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def library_versions() -> dict[str, str]:
    """Versions of the interpreter and the libraries a run's numbers depend on."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in ("etude", "torch", "tokenizers", "safetensors", "numpy", "libcst", "coverage"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def format_duration(seconds: float) -> str:
    """``45s``, ``4m 10s``, ``2h 05m``: a remaining time at the precision that matters."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


class StepClock:
    """The remaining time of a step loop, from the pace of the steps this process has run (a
    resumed loop counts from where it resumed, not from step 0)."""

    def __init__(self, first_step: int, total: int, *, now: float | None = None) -> None:
        self.first_step, self.total = first_step, total
        self.started = time.monotonic() if now is None else now

    def eta(self, done: int, *, now: float | None = None) -> float | None:
        """Seconds left after ``done`` steps; None before this process finished a step."""
        ran = done - self.first_step
        if ran <= 0:
            return None
        elapsed = (time.monotonic() if now is None else now) - self.started
        return elapsed / ran * max(0, self.total - done)


def format_step_line(
    step: int,
    metrics: dict[str, float],
    keys: tuple[str, ...],
    *,
    total: int | None = None,
    eta_s: float | None = None,
) -> str:
    """``step 120/300 | loss 2.31 | tok/s 48,211 | eta 4m 10s``: the listed keys that are
    present, in order; ``/total`` and the ETA where given."""
    parts = [f"step {step}" if total is None else f"step {step}/{total}"]
    for key in keys:
        if key not in metrics:
            continue
        v = metrics[key]
        if key.endswith("/s") or key.startswith("tok"):
            parts.append(f"{key} {v:,.0f}")
        elif isinstance(v, float) and v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4):
            parts.append(f"{key} {v:.3g}")
        elif isinstance(v, float):
            parts.append(f"{key} {v:.4f}" if abs(v) < 1 else f"{key} {v:.3f}")
        else:
            parts.append(f"{key} {v}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


class MetricsLogger:
    """Appends metric dicts to ``run_dir/metrics.jsonl`` and optional TensorBoard / W&B sinks."""

    def __init__(
        self,
        run_dir: str | Path | None,
        *,
        enabled: bool = True,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        config: dict | None = None,
    ):
        self.enabled = enabled and run_dir is not None
        self.path = Path(run_dir) / "metrics.jsonl" if self.enabled else None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
        if wandb_project:
            import wandb  # lazy: optional dependency

            self._wandb = wandb.init(project=wandb_project, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
            for k, v in metrics.items()
        }
        record = {"step": step, "time": time.time(), **clean}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run rewrites the steps after its checkpoint)."""
        if not self.enabled or not self.path.exists():
            return
        keep = [
            line
            for line, record in _parse_lines(self.path.read_text(), self.path)
            if record["step"] <= step
        ]
        write_atomic(self.path, "".join(line + "\n" for line in keep).encode("utf-8"))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _parse_lines(text: str, path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` per non-blank line. A malformed LAST line is dropped: it is an append
    that an interrupted run left half-written. A malformed line before it is a ``ValueError``."""
    lines = [line for line in text.splitlines() if line.strip()]
    out = []
    for number, line in enumerate(lines, start=1):
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(f"{path}: record {number} is not JSON ({e})") from None
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` file (or of ``RUN_DIR/metrics.jsonl``); a half-written
    last line (an interrupted run) is left out."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return [record for _, record in _parse_lines(path.read_text(), path)]


def prepare_run_dir(run_dir: str | Path, config: dict) -> Path:
    """Create the run directory and record the resolved config and library versions in it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", config)
    write_json_atomic(run_dir / "versions.json", library_versions())
    return run_dir
