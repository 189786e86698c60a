"""``etude report RUN_DIR [RUN_DIR2]``: the argument parser and command body of the run report.

``add_report_parser(subparsers)`` registers the subcommand on the ``etude`` parser; the command
writes one self-contained ``report.html`` (``etude.report.html``) and prints its path. User
mistakes (a missing run directory, a bad value) are ``ValueError`` naming the setting, which the
``etude`` entry point turns into one line and exit code 2.

What it does not do: open a browser or serve the page (open the file; it works from file://).
"""

from __future__ import annotations

import argparse
from pathlib import Path

# the default of etude.report.html.build_report, repeated so that parsing imports nothing heavy
DEFAULT_MAX_TRAJECTORIES = 120


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0 (0 embeds no trajectory)")
    return value


def cmd_report(args: argparse.Namespace) -> int:
    from etude.report.html import write_report

    run_dirs = [args.run_dir] + ([args.run_dir2] if args.run_dir2 else [])
    for d in run_dirs:
        if not Path(d).is_dir():
            raise ValueError(
                f"run directory {d!r} does not exist; pass a directory written by a training "
                "run (etude demo / etude rl), e.g. runs/demo"
            )
    path = write_report(run_dirs, args.out, max_trajectories=args.max_trajectories)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB); open it in a browser")
    return 0


def add_report_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``etude report`` on the ``etude`` subcommand set; returns its parser."""
    p = subparsers.add_parser(
        "report",
        help="write a self-contained report.html (plots, task table, trajectory viewer)",
        description=(
            "Build one self-contained HTML report from a run directory's own files "
            "(metrics.jsonl, trajectories, tasks, curriculum pool, monitor.json, tokenizer): "
            "plots of reward and pass rate, tool-call errors, hints and KL on hinted turns, "
            "monitor flags, curriculum pool and throughput; a table of tasks; and a trajectory "
            "viewer. With a second run directory the line plots overlay both runs (e.g. "
            "feedback vs no feedback). The page needs no network and opens from file://."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory to report on")
    p.add_argument(
        "run_dir2",
        metavar="RUN_DIR2",
        nargs="?",
        default=None,
        help="optional second run directory, overlaid on the first (drawn dashed / second color)",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="HTML file to write (default: RUN_DIR/report.html)",
    )
    p.add_argument(
        "--max-trajectories",
        metavar="N",
        type=_count,
        default=DEFAULT_MAX_TRAJECTORIES,
        help=(
            "most trajectories embedded in the viewer, over both runs; flagged, hinted and "
            "KL-carrying ones are kept first, spread over the run; 0 embeds none "
            f"(default: {DEFAULT_MAX_TRAJECTORIES}). Bounds the file's size; figures and the "
            "task table always use every trajectory"
        ),
    )
    p.set_defaults(func=cmd_report)
    return p
