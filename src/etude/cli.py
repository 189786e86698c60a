"""The ``etude`` command line: thin argument parsing; heavy modules are imported per command.

Every subcommand is a function ``cmd_NAME(args) -> int``. User mistakes (a bad key, a missing
file, a bad value) exit with code 2 and one line naming the setting and the fix; they are
raised as ``ValueError`` by the code below and turned into that line here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_pretrain(args: argparse.Namespace) -> int:
    from etude.config import load_config
    from etude.pretrain import PretrainConfig, run_pretrain

    cfg = load_config(PretrainConfig, args.config, args.overrides)
    run_pretrain(cfg)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import json

    from etude.engine import Engine, SamplingParams
    from etude.model.config import ModelConfig
    from etude.model.tokenizer import Tokenizer
    from etude.model.transformer import build_model
    from etude.parallel.checkpoint import load_safetensors

    run_dir = Path(args.run_dir)
    export = run_dir / "export"
    if not (export / "model.safetensors").is_file():
        raise ValueError(
            f"{export}/model.safetensors not found; pass a finished run directory (etude pretrain writes it)"
        )
    from etude.config import from_dict

    mcfg = from_dict(ModelConfig, json.loads((export / "config.json").read_text()), "model")
    model = build_model(mcfg, device="cpu", seed=0)
    load_safetensors(model, export / "model.safetensors")
    tok = Tokenizer.load(run_dir / "tokenizer")
    engine = Engine(model, decode_fn=tok.decode)
    params = SamplingParams(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    gen = engine.generate([tok.encode(args.prompt)], params)[0]
    print(args.prompt + tok.decode(gen.token_ids))
    return 0


def cmd_model_info(args: argparse.Namespace) -> int:
    from etude.config import load_toml
    from etude.model.info import format_model_info

    if (Path(args.config) / "config.json").is_file():  # a Hugging Face model directory
        from etude.model.hf_config import model_config_from_hf
        from etude.parallel.checkpoint import read_hf_config

        mcfg, _ = model_config_from_hf(read_hf_config(args.config))
    elif args.config.endswith(".toml"):
        from etude.pretrain import resolve_model_config

        mcfg = resolve_model_config(load_toml(args.config).get("model", {}))
    else:
        from etude.model.config import ModelConfig

        mcfg = ModelConfig.preset(args.config)
    print(format_model_info(mcfg))
    return 0


def cmd_model_import(args: argparse.Namespace) -> int:
    from etude.parallel.checkpoint import import_hf

    report = import_hf(args.hf_dir, args.out, chat_format=args.chat_format)
    print(f"imported {report['family']} from {args.hf_dir} into {args.out}")
    if report["chat_format"] is None:
        print(
            "chat format: unknown (the tokenizer matches none of etude's formats); pass "
            "--chat-format to record one"
        )
    else:
        print(f"chat format: {report['chat_format']}")
    return 0


def cmd_model_export(args: argparse.Namespace) -> int:
    import json

    from etude.config import from_dict
    from etude.model.config import ModelConfig
    from etude.model.transformer import build_model
    from etude.parallel.checkpoint import copy_tokenizer_files, export_hf, load_safetensors

    export = Path(args.run_dir) / "export"
    if not (export / "model.safetensors").is_file():
        raise ValueError(
            f"{export}/model.safetensors not found; pass a run directory (etude pretrain, sft, "
            "train and model import write one)"
        )
    mcfg = from_dict(ModelConfig, json.loads((export / "config.json").read_text()), "model")
    model = build_model(mcfg, device="cpu", seed=0)
    load_safetensors(model, export / "model.safetensors")
    export_hf(model, args.out, family=args.family)
    copy_tokenizer_files(Path(args.run_dir) / "tokenizer", args.out)
    print(f"wrote a Hugging Face directory to {args.out}")
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    from etude.monitor.report import monitor_main

    path = Path(args.path)
    if not path.exists():
        raise ValueError(
            f"{path} does not exist; pass a run directory or a trajectories .jsonl file"
        )
    monitor_main(
        path,
        rules_file=args.rules or "",
        canaries_file=args.canaries or "",
        min_severity=args.min_severity,
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from etude.demo import load_demo_recipe, run_demo

    config, overrides = args.config, list(args.overrides)
    if "=" in config and not config.endswith(
        ".toml"
    ):  # `etude demo rl.train.steps=4`: no recipe given
        config, overrides = "configs/demo.toml", [config, *overrides]
    if args.length:
        overrides.append(f"demo.length={args.length}")
    if args.no_feedback:
        overrides.append("demo.feedback=false")
    run_dir = args.run_dir or ("runs/demo-no-feedback" if args.no_feedback else None)
    if run_dir:
        overrides.append(f'demo.run_dir="{run_dir}"')
    run_demo(load_demo_recipe(config, overrides))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="etude", description="etude: an open training stack for agentic coding models."
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    sp = sub.add_parser(
        "pretrain", help="continued pretraining of the MoE model on a local code corpus"
    )
    sp.add_argument("config", help="TOML recipe, e.g. configs/pretrain-tiny.toml")
    sp.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 optim.lr=0.01"
    )
    sp.set_defaults(func=cmd_pretrain)

    sp = sub.add_parser(
        "demo",
        help="the whole loop on the bundled repo: tasks -> SFT -> RL with text feedback -> eval -> report",
        description="Build feature-deletion tasks from the bundled example repo, warm-start the tiny "
        "model by SFT, run RL with text feedback, the monitor and curriculum sampling, evaluate the "
        "final policy without hints, and write RUN_DIR/report.html. Run it again with the same run "
        "directory and it resumes where it stopped.",
    )
    sp.add_argument(
        "config",
        nargs="?",
        default="configs/demo.toml",
        help="TOML recipe (default: configs/demo.toml)",
    )
    sp.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. rl.train.steps=4 sft.train.steps=50"
    )
    sp.add_argument(
        "--run-dir",
        help="run directory (default: runs/demo, or runs/demo-no-feedback with --no-feedback)",
    )
    sp.add_argument(
        "--length",
        choices=["short", "default", "long"],
        help="scale SFT and RL steps: short 0.3x, long 3x",
    )
    sp.add_argument(
        "--no-feedback", action="store_true", help="the ablation: RL without the hinted-teacher KL"
    )
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("generate", help="sample a completion from a finished run")
    sp.add_argument("run_dir", help="run directory written by etude pretrain")
    sp.add_argument("--prompt", default="def ", help="text to continue")
    sp.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    sp.add_argument(
        "--temperature", type=float, default=0.8, help="sampling temperature (0 = greedy)"
    )
    sp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    sp.add_argument(
        "--top-k", type=int, default=50, help="sample among the k most likely tokens (0 = off)"
    )
    sp.add_argument("--seed", type=int, default=0, help="sampling seed")
    sp.set_defaults(func=cmd_generate)

    sp = sub.add_parser("model", help="model utilities")
    msub = sp.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    mp = msub.add_parser(
        "info", help="parameter counts per kind and per Muon block shape (meta device)"
    )
    mp.add_argument(
        "--config",
        default="tiny",
        help="a preset (tiny, small, kimi-k2, deepseek-v3), a TOML recipe or a Hugging Face dir",
    )
    mp.set_defaults(func=cmd_model_info)
    mp = msub.add_parser("import", help="Hugging Face checkpoint -> etude model directory")
    mp.add_argument("hf_dir", help="directory with config.json and safetensors (+ tokenizer)")
    mp.add_argument("--out", required=True, help="etude model directory to write")
    mp.add_argument(
        "--chat-format",
        default=None,
        help="etude, hermes, kimi_k2 or deepseek_v3 (default: detected from the tokenizer)",
    )
    mp.set_defaults(func=cmd_model_import)
    mp = msub.add_parser("export", help="etude run directory -> Hugging Face directory")
    mp.add_argument("run_dir", help="run directory with export/model.safetensors")
    mp.add_argument("--format", choices=["hf"], default="hf", help="output format")
    mp.add_argument("--out", required=True, help="directory to write")
    mp.add_argument(
        "--family",
        choices=["deepseek_v3", "glm4_moe", "qwen3_moe", "qwen3", "llama"],
        default=None,
        help="architecture to write (default: the one that computes this model exactly)",
    )
    mp.set_defaults(func=cmd_model_export)

    sp = sub.add_parser(
        "monitor", help="audit trajectories for reward hacking; writes monitor.json"
    )
    sp.add_argument(
        "path", help="a run directory (all trajectories*.jsonl under it) or one .jsonl file"
    )
    sp.add_argument("--rules", help="TOML/JSON file of extra rules (same id replaces a built-in)")
    sp.add_argument("--canaries", help="JSON file of honeypot canaries planted in the workspaces")
    sp.add_argument("--min-severity", type=int, default=3, help="severity counted as a hack (0-4)")
    sp.set_defaults(func=cmd_monitor)

    # subsystems register their own subcommands; these imports are argparse-only (no torch)
    from etude.plan.report import add_plan_parser
    from etude.report.cli import add_report_parser
    from etude.rl.cli import add_rl_parsers
    from etude.serve.cli import add_serve_parser
    from etude.tasks.cli import add_tasks_parser

    add_tasks_parser(sub)
    add_rl_parsers(sub)
    add_plan_parser(sub)
    add_report_parser(sub)
    add_serve_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"etude {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"etude {args.command}: interrupted; the last checkpoint is intact", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
