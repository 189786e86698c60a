"""``etude plan``: the command line of the cost model and its plain-text table.

``add_plan_parser(subparsers)`` registers the ``plan`` subcommand (the ``etude`` CLI calls it);
``plan_main(args)`` runs ``etude.plan.cost.plan`` for the dual and the shared mesh and prints
``format_plan``'s table, optionally writing every number to JSON. ``python -m
etude.plan.report ...`` runs the same command without the rest of the CLI.

With no layout flag (``--dp-replicate``, ``--dp-shard``, ``--cp``, ``--ep``,
``--expert-replicate``) it searches the layouts of ``--gpus`` instead (``etude.plan.search``) and
prints the best few by step time and why the others were ruled out.

What this module does not do: compute anything itself (``etude.plan.cost`` and
``etude.plan.search`` do).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.1f}"


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:,.2f} GB"


def _seconds(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:,.0f} s"


def _count(value: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.4g}{suffix}"
    return f"{value:,.0f}"


AXIS_LABELS = {
    "dense_fsdp": "dense FSDP (dp_shard x cp)",
    "efsdp": "expert FSDP (efsdp)",
    "dp_replicate": "dense HSDP all-reduce",
    "expert_replicate": "expert HSDP all-reduce",
    "ep": "EP all-to-all",
    "cp": "CP K/V all-gather",
}
"""Row labels of the communication section, in table order."""


def format_plan(result: dict[str, Any], *, model_name: str = "model") -> str:
    """The plain-text table of a ``plan`` result (dual mesh and shared mesh side by side)."""
    dual, shared = result["dual"], result["shared"]
    cluster, settings = result["cluster"], result["settings"]
    cols = [dual, shared]
    width = 34
    params, batch = dual["params"], dual["batch"]
    nodes = -(-cluster["num_gpus"] // cluster["gpus_per_node"])
    lines = [
        f"etude plan: {model_name} on {cluster['num_gpus']:,} x {cluster['gpu_name']} "
        f"({nodes:,} node{'s' if nodes > 1 else ''} of {cluster['gpus_per_node']})",
        f"model: {_count(params['total'])} parameters ({_count(params['expert'])} in routed "
        f"experts), {_count(params['active'])} active per token; "
        f"{dual['muon']['num_blocks']:,} Muon blocks (meta-device build)",
        f"step: {batch['batch_tokens']:,} tokens = {batch['micro_batches']} micro-batch(es) of "
        f"{settings['micro_batch_size']} x {settings['seq_len']} tokens per data-parallel rank; "
        f"{settings['dtype']} compute, {settings['param_dtype']} parameters, "
        f"{settings['grad_dtype']} gradients, {settings['master_dtype']} master weights, "
        f"{settings['optim_dtype']} optimizer state, activation checkpointing "
        f"{settings['activation_checkpointing']}, {settings['ns_steps']} Newton-Schulz steps",
        "",
        f"{'':<40}" + "".join(f"{c['mesh'] + ' mesh':<{width}}" for c in cols).rstrip(),
    ]

    def row(label: str, fn: Any) -> None:
        """``fn(column)`` for every mesh that can hold the layout, "-" for one that cannot."""
        cells = [fn(c) if c["feasible"] else "-" for c in cols]
        lines.append(f"  {label:<38}" + "".join(f"{v:<{width}}" for v in cells).rstrip())

    def axis_cell(a: dict[str, Any]) -> str:
        if a["size"] == 1:
            return "-"
        where = "node" if a["in_node"] else "nodes"
        return f"{_gb(a['bytes'])} {_seconds(a['seconds'])} [{a['size']}/{where}]"

    lines.append("layout")
    row(
        "dp_replicate x dp_shard x cp",
        lambda c: "{dp_replicate} x {dp_shard} x {cp}".format(**c["layout"]),
    )
    row(
        "ep x efsdp, expert replicas",
        lambda c: "{ep} x {efsdp}, {expert_replicate}".format(**c["layout"]),
    )
    lay = dual["layout"]
    minimum = [str(c["layout"]["min_gpus_for_cp_ep"]) for c in cols]
    label = f"fewest GPUs for cp={lay['cp']}, ep={lay['ep']}"
    lines.append(f"  {label:<38}" + "".join(f"{v:<{width}}" for v in minimum).rstrip())
    lines.append("memory per GPU (GiB)")
    for key, label in (
        ("parameters", f"parameters ({settings['param_dtype']}, sharded)"),
        ("master", f"master weights ({settings['master_dtype']}, sharded)"),
        ("gradients", f"gradients ({settings['grad_dtype']}, sharded)"),
        ("optimizer", f"optimizer state ({settings['optim_dtype']})"),
        ("fsdp_buffers", "FSDP gather/reduce buffers"),
        ("activations", "activations"),
        ("total", "total"),
    ):
        row(label, lambda c, key=key: _gib(c["memory"][key]))
    row(
        "capacity",
        lambda c: (
            f"{_gib(c['memory']['capacity'])} "
            f"({'fits' if c['memory']['total'] <= c['memory']['capacity'] else 'does NOT fit'})"
        ),
    )
    lines.append("training step per GPU: sent, time [group size/in one node or across nodes]")
    for axis, label in AXIS_LABELS.items():
        row(label, lambda c, axis=axis: axis_cell(c["comm"][axis]))
    row("all axes, serial", lambda c: _seconds(c["train"]["comm_s_serial"]))
    mfu = cluster["model_flops_utilization"]
    row(f"forward + backward compute (MFU {mfu})", lambda c: _seconds(c["train"]["compute_s"]))
    lines.append("Muon optimizer step (sharded schedule), per rank")
    row("Newton-Schulz FLOPs, whole model", lambda c: f"{c['muon']['ns_flops_total']:.3e}")
    row("Newton-Schulz FLOPs, busiest rank", lambda c: f"{c['muon']['ns_flops_per_rank_max']:.3e}")
    row("  perfectly balanced", lambda c: f"{c['muon']['ns_flops_ideal']:.3e}")
    row("all-to-all sent, busiest rank", lambda c: _gb(c["muon"]["alltoall_bytes_per_rank_max"]))
    row("all-to-all calls", lambda c: f"{c['muon']['collectives']:,}")
    row("elementwise (momentum, AdamW; HBM)", lambda c: _seconds(c["muon"]["elementwise_s"]))
    eff = cluster["matmul_efficiency"]
    row(f"Newton-Schulz compute ({eff} of peak)", lambda c: _seconds(c["muon"]["compute_s"]))
    row("all-to-all communication", lambda c: _seconds(c["muon"]["comm_s"]))
    row("step, overlapped: elem + max(NS, a2a)", lambda c: _seconds(c["muon"]["step_s_overlap"]))
    row("step, serial: elem + NS + a2a", lambda c: _seconds(c["muon"]["step_s_serial"]))
    if not shared["feasible"]:
        lines += ["", f"shared mesh: not possible with these degrees: {shared['reason']}"]
    return "\n".join(lines)


def resolve_model(config: str):
    """A preset name (``tiny``, ``small``, ``kimi-k2``) or a TOML recipe's ``[model]`` section
    (``preset = ...`` plus field overrides) as a checked ``ModelConfig``."""
    from etude.config import from_dict, load_toml, to_dict
    from etude.model.config import ModelConfig

    if not config.endswith(".toml"):
        return ModelConfig.preset(config)
    section = dict(load_toml(config).get("model", {}))
    base = to_dict(ModelConfig.preset(section.pop("preset", "tiny")))
    return from_dict(ModelConfig, {**base, **section}, "model")


def plan_main(args: argparse.Namespace) -> int:
    """Run ``etude plan`` with parsed ``args``; ``ValueError`` on a bad setting."""
    from etude.plan.cluster import ClusterConfig
    from etude.plan.cost import plan
    from etude.plan.layout import Layout
    from etude.plan.settings import PlanSettings

    cfg = resolve_model(args.config)
    overrides: dict[str, Any] = {}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    if args.matmul_efficiency is not None:
        overrides["matmul_efficiency"] = args.matmul_efficiency
    cluster = ClusterConfig.preset(args.gpu, args.gpus, **overrides)
    settings = PlanSettings(
        seq_len=args.seq_len,
        batch_tokens=args.batch_tokens,
        micro_batch_size=args.micro_batch,
        ns_steps=args.ns_steps,
        dtype=args.dtype,
        param_dtype=args.param_dtype,
        grad_dtype=args.grad_dtype,
        master_dtype=args.master_dtype,
        optim_dtype=args.optim_dtype,
        activation_checkpointing=args.activation_checkpointing,
        bucket_mb=args.bucket_mb,
    )
    flags = (args.dp_replicate, args.dp_shard, args.cp, args.ep, args.expert_replicate)
    if all(flag is None for flag in flags):
        from etude.plan.search import format_search, search_layouts

        result = search_layouts(cfg, cluster, settings)
        print(format_search(result, model_name=args.config, gpu=args.gpu))
        if args.json:
            _write_json(Path(args.json), result)
        return 0
    layout = Layout.for_gpus(
        args.gpus,
        dp_replicate=1 if args.dp_replicate is None else args.dp_replicate,
        dp_shard=args.dp_shard,
        cp=1 if args.cp is None else args.cp,
        ep=1 if args.ep is None else args.ep,
        expert_replicate=args.expert_replicate,
    )
    result = plan(cfg, cluster, layout, settings)
    result["model"]["name"] = args.config
    print(format_plan(result, model_name=args.config))
    if args.json:
        _write_json(Path(args.json), result)
    return 0


def _write_json(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=2, default=float)
    os.replace(tmp, out)


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``add_subparsers()`` object; sets ``func=plan_main``."""
    sp = subparsers.add_parser(
        "plan",
        help="memory, communication and Muon step time of a layout at cluster scale (on paper)",
        description="Analytic cost model of a model config on a cluster, for the dual mesh and "
        "a single shared mesh (see docs/plan.md).",
    )
    sp.add_argument(
        "--config", default="kimi-k2", help="a preset (tiny, small, kimi-k2) or a TOML recipe"
    )
    sp.add_argument("--gpus", type=int, default=8, help="GPUs in the job (world size)")
    sp.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per node (default: the preset's 8)"
    )
    sp.add_argument("--gpu", choices=("h100", "h200"), default="h100", help="GPU preset")
    sp.add_argument(
        "--dp-replicate", type=int, default=None, help="HSDP replicas (dense mesh; default 1)"
    )
    sp.add_argument(
        "--dp-shard", type=int, default=None, help="FSDP shards (default: GPUs left over)"
    )
    sp.add_argument("--cp", type=int, default=None, help="context-parallel degree (default 1)")
    sp.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default 1)")
    sp.add_argument(
        "--expert-replicate",
        type=int,
        default=None,
        help="dual mesh: HSDP replicas of the expert weights (default: --dp-replicate)",
    )
    sp.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    sp.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="tokens per optimizer step (default: one micro-batch per data-parallel rank)",
    )
    sp.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per rank per forward/backward"
    )
    sp.add_argument("--ns-steps", type=int, default=5, help="Newton-Schulz iterations")
    sp.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="compute, communication and Newton-Schulz dtype",
    )
    sp.add_argument(
        "--param-dtype", choices=("bf16", "fp32"), default="bf16", help="sharded parameters"
    )
    sp.add_argument(
        "--grad-dtype", choices=("bf16", "fp32"), default="bf16", help="sharded gradients"
    )
    sp.add_argument(
        "--master-dtype",
        choices=("fp32", "bf16", "none"),
        default="fp32",
        help="the optimizer's master weights (none: the parameters are the master copy)",
    )
    sp.add_argument(
        "--optim-dtype", choices=("fp32", "bf16"), default="fp32", help="optimizer state"
    )
    sp.add_argument(
        "--activation-checkpointing",
        choices=("full", "none"),
        default="full",
        help="recompute every block in backward (full) or keep all activations",
    )
    sp.add_argument(
        "--bucket-mb", type=float, default=32.0, help="MiB per sharded-Muon all-to-all bucket"
    )
    sp.add_argument(
        "--matmul-efficiency",
        type=float,
        default=None,
        help="achieved fraction of peak FLOP/s for Newton-Schulz (default: the preset's 0.6)",
    )
    sp.add_argument("--json", metavar="OUT", default=None, help="also write every number here")
    sp.set_defaults(func=plan_main)
    return sp


def main(argv: list[str] | None = None) -> int:
    """``python -m etude.plan.report [flags]``: the ``plan`` subcommand alone."""
    parser = argparse.ArgumentParser(prog="etude")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"etude plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
