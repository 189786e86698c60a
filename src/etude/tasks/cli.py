"""``etude tasks build|show|check``: the task factory from the command line.

``add_tasks_parser(subparsers)`` registers the three commands on the main parser; each sets
``func(args) -> int`` like every other etude command:

- ``etude tasks build REPO --out DIR [--config TOML] [key=value ...]``: build tasks
  (``TaskBuildConfig`` keys, e.g. ``max_tasks=30 proposals.max_lines=100``); progress on stderr,
  a summary on stdout; exit 0 when at least one task was made;
- ``etude tasks show DIR``: one line per task (id, symbols, F2P/P2P counts, difficulty, leak scan);
- ``etude tasks check DIR``: re-validate every record (``validate.check_record``); exit 1 if any
  fails;
- ``etude tasks export DIR --format swebench --out FILE``: records for an SWE-bench style
  harness (``etude.tasks.export``).

What it does not do: parse anything itself beyond argparse, or catch ``ValueError`` (the main
CLI turns it into a one-line error and exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from etude.config import apply_overrides, from_dict, load_toml


def tasks_build_main(args: argparse.Namespace) -> int:
    """Build tasks from ``args.repo`` into ``args.out`` (see ``add_tasks_parser`` for the flags)."""
    from etude.tasks.build import TaskBuildConfig, build_tasks, log_to_stderr

    data: dict[str, Any] = {}
    if args.config:
        data = load_toml(args.config)
        data = data.get("tasks", data)
    flags = {
        "max_tasks": args.max_tasks,
        "detail_level": args.detail,
        "backend": args.backend,
        "workers": args.workers,
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    cfg = from_dict(TaskBuildConfig, apply_overrides(data, list(args.overrides)), "tasks")
    records, report = build_tasks(
        args.repo, args.out, cfg, log=None if args.quiet else log_to_stderr
    )
    print(
        f"{report.valid} valid tasks of {report.candidates} candidates "
        f"(yield {report.yield_:.0%}) in {report.seconds_total:.0f}s, "
        f"{report.seconds_per_task:.1f}s per candidate; wrote {Path(args.out) / 'tasks.jsonl'}"
    )
    for reason, count in sorted(report.reject_counts.items(), key=lambda kv: -kv[1]):
        print(f"  rejected ({reason}): {count}")
    return 0 if records else 1


def _difficulty(d: dict[str, float]) -> str:
    return f"{int(d.get('deleted_lines', 0))} lines"


def format_tasks_table(records: list[Any]) -> str:
    """The ``show`` table as text."""
    rows = [("id", "symbols", "F2P", "P2P", "difficulty", "detail", "leak scan")]
    for r in records:
        etude = r.etude
        symbols = ", ".join(etude.symbols) if etude else ""
        if len(symbols) > 48:
            symbols = symbols[:45] + "..."
        scan = etude.leak_scan if etude else None
        leak = (
            "-"
            if not scan
            else ("clean" if scan.get("clean") else f"{scan.get('num_hits', '?')} hits")
        )
        rows.append(
            (
                r.instance_id,
                symbols,
                str(len(r.FAIL_TO_PASS)),
                str(len(r.PASS_TO_PASS)),
                _difficulty(etude.difficulty) if etude else "",
                etude.detail_level if etude else "",
                leak,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def tasks_show_main(directory: str | Path) -> int:
    """Print the task table of ``DIR/tasks.jsonl``."""
    from etude.tasks.record import load_tasks

    records = load_tasks(directory)
    print(format_tasks_table(records))
    print(f"{len(records)} tasks")
    return 0


def tasks_check_main(
    directory: str | Path, *, backend: str = "auto", workers: int = 2, timeout: float = 600.0
) -> int:
    """Re-validate every task of ``DIR``; print one line per task; 0 if all pass, else 1."""
    from etude.sandbox import SandboxConfig, make_sandbox
    from etude.tasks.record import load_tasks
    from etude.tasks.validate import check_record

    if workers < 1:
        raise ValueError(f"--workers={workers} must be >= 1")
    path = Path(directory)
    base = path if path.is_dir() else path.parent
    records = load_tasks(path)
    sandbox = make_sandbox(
        backend,  # type: ignore[arg-type]
        SandboxConfig(backend=backend, timeout_s=timeout, cpu_seconds=int(timeout) + 1),  # type: ignore[arg-type]
    )
    failed = 0
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(check_record, r, base, sandbox, timeout=timeout) for r in records]
        for record, future in zip(records, futures):
            result = future.result()
            if result.ok:
                print(f"ok    {record.instance_id}")
            else:
                failed += 1
                print(f"FAIL  {record.instance_id}: " + "; ".join(result.problems))
    print(f"{len(records) - failed} of {len(records)} tasks valid")
    return 0 if failed == 0 else 1


def tasks_export_main(directory: str | Path, out: str | Path, fmt: str) -> int:
    """Export the tasks of ``DIR`` to ``out`` in ``fmt`` (``etude.tasks.export``)."""
    from etude.tasks.export import export_records
    from etude.tasks.record import load_tasks

    path = Path(directory)
    base = path if path.is_dir() else path.parent
    count = export_records(load_tasks(path), base.resolve(), Path(out), fmt)
    print(f"wrote {count} {fmt} records to {out}")
    return 0


def add_tasks_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``etude tasks build|show|check|export`` on the main parser's subparsers."""
    sp = subparsers.add_parser("tasks", help="feature-deletion tasks: build, show, check")
    tsub = sp.add_subparsers(dest="tasks_command", metavar="SUBCOMMAND", required=True)

    bp = tsub.add_parser("build", help="build validated tasks with clean workspaces from a repo")
    bp.add_argument("repo", help="a Python repository or unpacked sdist with a pytest suite")
    bp.add_argument("--out", required=True, help="new or empty output directory")
    bp.add_argument("--config", help="TOML file (a [tasks] table, or TaskBuildConfig keys)")
    bp.add_argument("--max-tasks", type=int, help="stop after this many valid tasks")
    bp.add_argument(
        "--detail", choices=["full", "docstring", "tests"], help="problem statement detail"
    )
    bp.add_argument("--backend", choices=["auto", "bwrap", "local"], help="sandbox backend")
    bp.add_argument("--workers", type=int, help="tasks validated at once")
    bp.add_argument("--quiet", action="store_true", help="no progress lines")
    bp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. proposals.max_lines=100")
    bp.set_defaults(func=tasks_build_main)

    shp = tsub.add_parser("show", help="print a table of the tasks in DIR")
    shp.add_argument("dir", help="directory holding tasks.jsonl (or the file)")
    shp.set_defaults(func=lambda args: tasks_show_main(args.dir))

    cp = tsub.add_parser("check", help="re-validate every task in DIR")
    cp.add_argument("dir", help="directory holding tasks.jsonl (or the file)")
    cp.add_argument(
        "--backend", default="auto", choices=["auto", "bwrap", "local"], help="sandbox backend"
    )
    cp.add_argument("--workers", type=int, default=2, help="tasks checked at once")
    cp.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    cp.set_defaults(
        func=lambda args: tasks_check_main(
            args.dir, backend=args.backend, workers=args.workers, timeout=args.timeout
        )
    )
    ep = tsub.add_parser("export", help="write the tasks of DIR for another harness")
    ep.add_argument("dir", help="directory holding tasks.jsonl (or the file)")
    ep.add_argument("--format", default="swebench", choices=["swebench"], help="record format")
    ep.add_argument("--out", required=True, help="JSONL file to write")
    ep.set_defaults(func=lambda args: tasks_export_main(args.dir, args.out, args.format))
    return sp


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m etude.tasks.cli``) until the main CLI wires these in."""
    parser = argparse.ArgumentParser(prog="etude")
    add_tasks_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"etude tasks: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
