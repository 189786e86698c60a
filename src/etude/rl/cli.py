"""Argument parsing of ``etude train`` and ``etude sft``; ``etude.cli`` registers them.

Thin on purpose: each command loads its recipe (TOML + dotted overrides, ``etude.config``) and
imports the heavy modules only when it runs. User mistakes surface as ``ValueError`` and the main
CLI turns them into one line and exit code 2.
"""

from __future__ import annotations

import argparse


def cmd_train(args: argparse.Namespace) -> int:
    from etude.config import load_config
    from etude.rl.trainer import TrainRecipe, run_train

    run_train(load_config(TrainRecipe, args.config, args.overrides))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from etude.config import load_config
    from etude.rl.sft import SFTRecipe, run_sft

    run_sft(load_config(SFTRecipe, args.config, args.overrides))
    return 0


def add_rl_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``train`` and ``sft`` on the ``etude`` command's subparsers."""
    sp = subparsers.add_parser(
        "train", help="RL with text feedback: rollouts, GRPO-style loss, hinted-teacher KL"
    )
    sp.add_argument("config", help="TOML recipe, e.g. configs/rl-tiny.toml")
    sp.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.steps=5 teacher.beta=0"
    )
    sp.set_defaults(func=cmd_train)

    sp = subparsers.add_parser(
        "sft", help="warm start: supervised training on oracle episodes and hint-following"
    )
    sp.add_argument("config", help="TOML recipe, e.g. configs/sft-tiny.toml")
    sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50")
    sp.set_defaults(func=cmd_sft)
