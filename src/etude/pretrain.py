"""Continued pretraining of the MoE model on a code corpus that needs no download.

The corpus is the Python source of the installed standard library (and of etude itself): real
code, on every machine, read from disk. A byte-level BPE tokenizer is trained on it (or loaded
from the run directory), the text is tokenized once into a flat id stream, and training samples
random windows of ``seq_len + 1`` tokens. The sample positions of step ``s`` are drawn from a
generator seeded by ``(seed, s)``, so a resumed run sees exactly the batches an uninterrupted
run would have seen, and continues the same loss curve.

The loop: forward -> next-token cross-entropy -> backward -> grad clip -> Muon/AdamW step ->
aux-loss-free expert-bias update -> metrics; checkpoints (DCP) every ``checkpoint_every`` steps
and at the end; a safetensors export and a sample generation at the end.

Not covered: data mixtures, packing with document masks, evaluation suites.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from etude.config import from_dict, to_dict
from etude.model.config import ModelConfig
from etude.optim import OptimConfig


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where training text comes from and how it is cut into sequences."""

    source: Literal["stdlib", "etude"] = "stdlib"
    """``stdlib``: Python sources of the standard library plus etude; ``etude``: etude only."""
    max_bytes: int = 4_000_000
    """Upper bound on corpus size read from disk (bytes of source text)."""
    seq_len: int = 256
    """Tokens per training sequence."""
    batch_size: int = 16
    """Sequences per optimizer step (per data-parallel rank)."""
    val_fraction: float = 0.02
    """Share of the token stream held out for validation loss."""

    def __post_init__(self) -> None:
        if self.seq_len < 8:
            raise ValueError(f"data.seq_len={self.seq_len} is too short; use at least 8")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size} must be >= 1")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be in (0, 0.5)")
        if self.max_bytes < 10_000:
            raise ValueError(f"data.max_bytes={self.max_bytes} is too small; use at least 10000")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Length, schedule and bookkeeping of a pretraining run."""

    steps: int = 300
    """Optimizer steps in total (a resumed run stops at the same step)."""
    warmup_steps: int = 20
    """Linear learning-rate warmup; cosine decay to ``min_lr_ratio`` after it."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 turns clipping off."""
    seed: int = 0
    """Seeds weight init and the data order."""
    log_every: int = 10
    """Steps between console step lines (metrics go to JSONL every step)."""
    eval_every: int = 100
    """Steps between validation-loss measurements."""
    eval_batches: int = 4
    """Batches per validation measurement."""
    checkpoint_every: int = 100
    """Steps between DCP checkpoints (and one at the end)."""
    run_dir: str = "runs/pretrain"
    """Directory for config, metrics, tokenizer, checkpoints and the export."""
    sample_prompt: str = "def fibonacci(n):\n"
    """Prompt for the sample generation printed at the end."""
    sample_tokens: int = 64
    """Tokens generated for the sample."""
    device: str = "auto"
    """``auto`` (cuda when available, else cpu), ``cpu`` or ``cuda``."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"train.steps={self.steps} must be >= 1")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps]")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r}: use auto, cpu or cuda")
        for name in ("log_every", "eval_every", "checkpoint_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1")


@dataclass(kw_only=True, slots=True)
class PretrainConfig:
    """A pretraining recipe: ``configs/demo.toml`` and friends."""

    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    """``preset`` names a ModelConfig preset; other keys override its fields."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def model_config(self) -> ModelConfig:
        return resolve_model_config(self.model)


def resolve_model_config(section: dict[str, Any]) -> ModelConfig:
    """``{"preset": "tiny", "dim": 96}`` -> a checked ModelConfig (unknown keys are errors)."""
    section = dict(section)
    preset = section.pop("preset", "tiny")
    base = to_dict(ModelConfig.preset(preset))
    return from_dict(ModelConfig, {**base, **section}, "model")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Warmup then cosine decay; ``step`` counts from 0."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _corpus(cfg: DataConfig) -> list[str]:
    from etude.model.tokenizer import default_corpus

    texts = default_corpus(cfg.max_bytes)
    if cfg.source == "etude":
        root = Path(__file__).parent
        texts = [p.read_text() for p in sorted(root.rglob("*.py"))]
    return texts


def load_or_train_tokenizer(run_dir: Path, vocab_size: int, texts: list[str]):
    """The run's tokenizer: loaded from ``run_dir/tokenizer`` or trained once and saved there."""
    from etude.model.tokenizer import Tokenizer

    tok_dir = run_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        tok = Tokenizer.load(tok_dir)
    else:
        tok = Tokenizer.train(texts, vocab_size)
        tok.save(tok_dir)
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer in {tok_dir} has {tok.vocab_size} tokens but model.vocab_size={vocab_size}; "
            "delete the run directory or raise model.vocab_size"
        )
    return tok


def token_stream(tok, texts: list[str], cache: Path):
    """All texts as one id stream separated by end-of-text, cached in the run directory."""
    import torch

    if cache.is_file():
        return torch.load(cache)
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(text))
        ids.append(tok.eos_id)
    stream = torch.tensor(ids, dtype=torch.int32)
    tmp = cache.with_suffix(".tmp")
    torch.save(stream, tmp)
    tmp.replace(cache)
    return stream


def sample_batch(stream, step: int, seed: int, batch_size: int, seq_len: int, device):
    """Random windows of ``seq_len + 1`` tokens for ``step``; same (seed, step) -> same batch."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=g)
    windows = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


def next_token_loss(model, inputs_BT, targets_BT):
    import torch.nn.functional as F

    logits_BTV = model(inputs_BT)
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())


def run_pretrain(cfg: PretrainConfig) -> dict[str, float]:
    """Train (or resume) per ``cfg``; returns final metrics (loss, val_loss, step)."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from etude.engine import Engine, SamplingParams
    from etude.model.transformer import build_model
    from etude.optim import build_optimizer
    from etude.parallel.checkpoint import (
        export_safetensors,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from etude.report.metrics import MetricsLogger, format_step_line, prepare_run_dir

    tc, dc = cfg.train, cfg.data
    device = torch.device(
        "cuda"
        if tc.device == "auto" and torch.cuda.is_available()
        else ("cpu" if tc.device == "auto" else tc.device)
    )
    mcfg = cfg.model_config()
    run_dir = prepare_run_dir(tc.run_dir, to_dict(cfg))

    texts = _corpus(dc)
    tok = load_or_train_tokenizer(run_dir, mcfg.vocab_size, texts)
    stream = token_stream(tok, texts, run_dir / "tokens.pt")
    num_val = max(int(len(stream) * dc.val_fraction), dc.seq_len * 2)
    train_stream, val_stream = stream[:-num_val], stream[-num_val:]

    torch.manual_seed(tc.seed)
    model = build_model(mcfg, device=device, seed=tc.seed)
    optimizer = build_optimizer(model, cfg.optim)
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    start_step = 0
    logger = MetricsLogger(run_dir, config=to_dict(cfg))
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        extra = load_checkpoint(ckpt, model, optimizer)
        start_step = extra["step"]
        logger.truncate_after(start_step)
        print(f"resumed from {ckpt} at step {start_step}")

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [
                next_token_loss(
                    model,
                    *sample_batch(val_stream, -1 - i, tc.seed, dc.batch_size, dc.seq_len, device),
                ).item()
                for i in range(tc.eval_batches)
            ]
        model.train()
        return sum(losses) / len(losses)

    tokens_per_step = dc.batch_size * dc.seq_len
    metrics: dict[str, float] = {}
    model.train()
    progress = Progress(
        TextColumn("pretrain"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        disable=not tc.progress,
        transient=True,
    )
    with progress:
        bar = progress.add_task("pretrain", total=tc.steps, completed=start_step, info="")
        for step in range(start_step, tc.steps):
            t0 = time.perf_counter()
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = base * lr_factor(step, tc)
            inputs, targets = sample_batch(
                train_stream, step, tc.seed, dc.batch_size, dc.seq_len, device
            )
            loss = next_token_loss(model, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf")
            )
            optimizer.step()
            model.update_expert_bias()
            dt = time.perf_counter() - t0
            metrics = {
                "loss": loss.item(),
                "grad_norm": float(grad_norm),
                "lr": optimizer.param_groups[0]["lr"],
                "tok/s": tokens_per_step / dt,
            }
            done = step + 1
            if done % tc.eval_every == 0 or done == tc.steps:
                metrics["val_loss"] = evaluate()
            logger.log(done, metrics)
            progress.update(bar, advance=1, info=f"loss {metrics['loss']:.3f}")
            if done % tc.log_every == 0 or done == tc.steps:
                progress.console.print(
                    format_step_line(done, metrics, ("loss", "val_loss", "grad_norm", "tok/s"))
                )
            if done % tc.checkpoint_every == 0 or done == tc.steps:
                save_checkpoint(
                    run_dir, done, model, optimizer, {"tokens_seen": done * tokens_per_step}
                )

    export_safetensors(model, run_dir / "export", to_dict(mcfg))
    engine = Engine(model, decode_fn=tok.decode)
    prompt = tok.encode(tc.sample_prompt)
    gen = engine.generate(
        [prompt],
        SamplingParams(max_new_tokens=tc.sample_tokens, temperature=0.8, top_k=50, seed=tc.seed),
    )[0]
    sample = tc.sample_prompt + tok.decode(gen.token_ids)
    print("sample:\n" + sample)
    (run_dir / "sample.txt").write_text(sample)
    logger.close()
    return {"step": tc.steps, **metrics}
