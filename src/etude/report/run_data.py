"""Reading a run directory for the report: ``load_run`` returns a ``RunData``, read once.

The report shows only what a run wrote; this module is where those files are found and parsed.
What a run directory may hold (each part is optional; the report shows what is present):

- ``metrics.jsonl``: one object per step (``step``, ``time`` and metric keys). A resumed run may
  log a step twice: the later record wins; a half-written last line (a run still writing, or
  interrupted) is left out. Any other line that is not a JSON object with a ``step`` is a
  ``ValueError`` naming the file and line.
- ``trajectories/*.jsonl``, ``trajectories*.jsonl`` and ``eval_trajectories.jsonl``
  (``etude.env.trajectory``): the step is read from a ``step_N`` file name, else from
  ``info["policy_step"]``; the final evaluation's episodes have no step.
- ``tasks/tasks.jsonl`` (``etude.tasks.record``): the tasks.
- a curriculum pool state (``etude.tasks.curriculum``: a JSON file with ``version`` and per-task
  ``tasks`` statistics, found among the top-level JSON files and those one directory down), and
  its ``PATH.tasks.jsonl`` of spawned variants, added to the tasks.
- ``monitor.json`` (``etude.monitor.report.summarize``), ``config.json``, ``versions.json``,
  ``eval.json``, ``stages.json`` (an ``etude demo`` run's stages), and ``tokenizer/`` (decodes
  tokens for the KL heat map; a tokenizer that fails to load is a warning, not an error).

What it does not do: compute what the report shows from these files (``etude.report.summary``,
``etude.report.figures``), render HTML, or write anything.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etude.env.trajectory import Trajectory, read_jsonl
from etude.model.tokenizer import Tokenizer
from etude.tasks.record import TaskRecord, load_tasks

_STEP_FILE = re.compile(r"step_(\d+)")
_SKIP_KEYS = {"step", "time"}


@dataclass(kw_only=True, slots=True)
class RunData:
    """What one run directory holds, read once."""

    path: Path
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    trajectories: list[tuple[int | None, str, Trajectory]] = field(default_factory=list)
    """(step, source ``file:line``, trajectory), in file order."""
    tasks: list[TaskRecord] = field(default_factory=list)
    curriculum: dict[str, Any] | None = None
    curriculum_path: str | None = None
    monitor: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None
    stages: dict[str, Any] | None = None
    """``stages.json`` of an ``etude demo`` run: per stage, its seconds (the whole job's wall
    time is their sum, over every invocation that did work)."""
    tokenizer: Tokenizer | None = None

    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for record in self.metrics:
            for key, value in record.items():
                if key not in _SKIP_KEYS and finite_number(value) is not None:
                    seen.setdefault(key, None)
        return list(seen)

    def column(
        self, key: str, *, unless_zero: str | None = None
    ) -> tuple[list[float], list[float | None]]:
        """Steps and values of ``key`` over the records that have it (non-finite -> None).

        ``unless_zero``: a count key; where a record has it and it is 0 the value is None (a
        mean over nothing, e.g. ``kl`` of a step with ``kl_tokens`` 0, is a gap, not a zero).
        """
        xs, ys = [], []
        for record in self.metrics:
            if key in record:
                xs.append(float(record["step"]))
                empty = unless_zero is not None and record.get(unless_zero) == 0
                ys.append(None if empty else finite_number(record[key]))
        return xs, ys

    def last(self, key: str) -> float | None:
        for record in reversed(self.metrics):
            if finite_number(record.get(key)) is not None:
                return finite_number(record[key])
        return None


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); rewrite or remove it") from None


def _is_pool_state(data: Any) -> bool:
    tasks = data.get("tasks") if isinstance(data, dict) else None
    return (
        "version" in data
        and isinstance(tasks, dict)
        and all(isinstance(s, dict) and "attempts" in s for s in tasks.values())
    )


def _find_curriculum(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    named = ("pool.json", "curriculum.json", "curriculum/pool.json", "tasks/pool.json")
    candidates = [run_dir / n for n in named]
    candidates += sorted(run_dir.glob("*.json")) + sorted(run_dir.glob("*/*.json"))
    skip = {"config.json", "versions.json", "monitor.json", "eval.json"}
    for path in dict.fromkeys(candidates):
        if path.name in skip or not path.is_file() or path.stat().st_size > 50_000_000:
            continue
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if _is_pool_state(data):
            return data, str(path.relative_to(run_dir))
    return None, None


EVAL_TRAJECTORIES = "eval_trajectories.jsonl"


def _trajectory_files(run_dir: Path) -> list[Path]:
    files = (
        sorted((run_dir / "trajectories").glob("*.jsonl"))
        + sorted(run_dir.glob("trajectories*.jsonl"))
        + [run_dir / EVAL_TRAJECTORIES]
    )
    return [f for f in dict.fromkeys(files) if f.is_file()]


def load_run(run_dir: str | Path, *, name: str | None = None) -> RunData:
    """Read a run directory; a missing directory is a ``ValueError`` naming it."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ValueError(
            f"run directory {str(path)!r} does not exist; pass the directory a training run wrote "
            "(it holds metrics.jsonl)"
        )
    run = RunData(path=path, name=name or path.resolve().name)
    for attr, file in (("config", "config.json"), ("versions", "versions.json")):
        if (path / file).is_file():
            setattr(run, attr, _read_json(path / file))
    if (path / "eval.json").is_file():
        run.evaluation = _read_json(path / "eval.json")
    if (path / "monitor.json").is_file():
        run.monitor = _read_json(path / "monitor.json")
    if (path / "stages.json").is_file():
        run.stages = _read_json(path / "stages.json")
    metrics_path = path / "metrics.jsonl"
    by_step: dict[int, dict[str, Any]] = {}
    if metrics_path.is_file():
        lines = metrics_path.read_text().splitlines()
        last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if lineno == last:
                    break  # an append that a running or interrupted run left half-written
                raise ValueError(f"{metrics_path}:{lineno}: not a JSON object") from None
            if not isinstance(record, dict) or finite_number(record.get("step")) is None:
                raise ValueError(f"{metrics_path}:{lineno}: a metrics record needs a 'step'")
            by_step[int(record["step"])] = record  # a resumed run re-logs steps: last wins
    run.metrics = [by_step[s] for s in sorted(by_step)]
    for file in _trajectory_files(path):
        match = _STEP_FILE.search(file.name)
        for n, traj in enumerate(read_jsonl(file)):
            step = int(match.group(1)) if match else traj.info.get("policy_step")
            if file.name == EVAL_TRAJECTORIES:
                step = None  # the final evaluation: no training step
            step = step if isinstance(step, int) and not isinstance(step, bool) else None
            run.trajectories.append((step, f"{file.relative_to(path)}:{n + 1}", traj))
    if (path / "tasks" / "tasks.jsonl").is_file():
        run.tasks = load_tasks(path / "tasks" / "tasks.jsonl")
    run.curriculum, run.curriculum_path = _find_curriculum(path)
    if run.curriculum is not None:
        records = path / (run.curriculum_path + ".tasks.jsonl")
        known = {t.instance_id for t in run.tasks}
        if records.is_file():
            run.tasks += [r for r in load_tasks(records) if r.instance_id not in known]
    if (path / "tokenizer" / "tokenizer.json").is_file():
        try:
            run.tokenizer = Tokenizer.load(path / "tokenizer")
        except ValueError as e:
            warnings.warn(f"tokenizer not used, KL heat maps show cells only: {e}", stacklevel=2)
    return run
