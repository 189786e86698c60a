"""``etude serve PATH`` and ``etude serve usage``: argument handling for the server.

The server listens on 127.0.0.1 unless ``--host`` says otherwise. Without ``--api-keys`` it
refuses to start unless ``--no-auth`` is given (local experiments; the ledger then names every
request ``anonymous``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_serve_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "target",
        help="run directory, export, checkpoint step or Hugging Face directory to serve; or "
        "'usage' to print the usage ledger",
    )
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument(
        "--api-keys",
        default=os.environ.get("ETUDE_API_KEYS", ""),
        help="keys file, NAME:SECRET per line",
    )
    sp.add_argument("--no-auth", action="store_true", help="serve without API keys")
    sp.add_argument("--ledger", default="etude-usage.sqlite", help="SQLite usage ledger file")
    sp.add_argument(
        "--name", default="", help="model name in the API (default: the directory name)"
    )
    sp.add_argument("--device", default="cpu")
    sp.add_argument("--max-batch-size", type=int, default=32, help="rows of the running batch")
    sp.add_argument(
        "--latency-batch-size", type=int, default=0,
        help="decode batch cap while a fast-tier request is present (0 = none)",
    )  # fmt: skip
    sp.add_argument("--max-seq-len", type=int, default=0, help="context length (0 = the model's)")
    sp.add_argument("--default-tier", default="fast", choices=["fast", "standard"])
    sp.add_argument("--fast-prices", default="3.00,15.00", help="$ per million input,output tokens")
    sp.add_argument(
        "--standard-prices", default="0.50,2.50", help="$ per million input,output tokens"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from etude.serve.metering import default_tiers, format_usage, load_api_keys, read_usage

    if args.target == "usage":
        print(format_usage(read_usage(args.ledger)))
        return 0
    if not args.api_keys and not args.no_auth:
        raise ValueError(
            "etude serve needs --api-keys FILE (NAME:SECRET per line), or --no-auth to serve "
            "without keys"
        )
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} must be in 1..65535")
    import uvicorn

    from etude.serve.app import ServeConfig, build_app
    from etude.serve.loading import load_served

    tiers = default_tiers(args.fast_prices, args.standard_prices)
    keys = None if args.no_auth else load_api_keys(args.api_keys)
    served = load_served(args.target, device=args.device, name=args.name)
    cfg = ServeConfig(
        api_keys=keys,
        ledger_path=str(Path(args.ledger)),
        tiers=tiers,
        default_tier=args.default_tier,
        max_batch_size=args.max_batch_size,
        latency_batch_size=args.latency_batch_size,
        max_seq_len=args.max_seq_len or None,
    )
    app = build_app(served, cfg)
    print(
        f"etude serve: {served.name} ({served.source}) on http://{args.host}:{args.port}/v1, "
        f"ledger {cfg.ledger_path}",
        flush=True,
    )
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
    )
    return 0


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser(
        "serve",
        help="OpenAI-compatible server with tiers and a usage ledger; 'etude serve usage' prints it",
    )
    add_serve_arguments(sp)
    sp.set_defaults(func=cmd_serve)
