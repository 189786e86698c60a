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

Distributed (``torchrun --nproc-per-node N -m etude pretrain RECIPE parallel.cp=2 ...``): the
process group comes from torchrun's environment (gloo on CPU, nccl on CUDA); the model is built
on the meta device, ``etude.parallel.parallelize``-d on the dual mesh (EP, CP, FSDP2) and then
materialized. Step ``s`` draws ``batch_size * dp`` sequences exactly as one process drawing that
many would; data-parallel rank d keeps sequences ``[d * batch_size, (d + 1) * batch_size)`` and
the cp ranks split each of them (load-balanced chunks). Each rank's loss is the sum of its
tokens' cross-entropy divided by the tokens of the global batch, so the ranks' losses and
gradients sum to the global mean's (FSDP sums gradients, see ``etude.parallel.fsdp``). Gradient
clipping combines both meshes; only rank 0 logs and writes files other than checkpoint shards.
With one process (plain ``etude pretrain``) the path is the single-device one, unchanged.

Not covered: data mixtures, packing with document masks, evaluation suites.

Legend: B sequences, T tokens per sequence, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from etude.config import to_dict
from etude.model.config import ModelConfig
from etude.optim import OptimConfig
from etude.parallel.dims import ParallelConfig
from etude.runtime import all_reduce_sum, init_distributed, resolve_model_config
from etude.runtime import lr_factor as schedule_factor

__all__ = ["all_reduce_sum", "init_distributed", "resolve_model_config", "run_pretrain"]


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
    """Sequences per optimizer step per data-parallel rank (the global batch is batch_size *
    dp_replicate * dp_shard; cp ranks share their sequences)."""
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
    """A pretraining recipe: ``configs/pretrain-tiny.toml`` and friends."""

    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    """``preset`` names a ModelConfig preset; other keys override its fields."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def model_config(self) -> ModelConfig:
        return resolve_model_config(self.model)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Warmup then cosine decay; ``step`` counts from 0 (``etude.runtime.lr_factor``)."""
    return schedule_factor(
        step,
        warmup_steps=cfg.warmup_steps,
        total_steps=cfg.steps,
        schedule="cosine",
        min_lr_ratio=cfg.min_lr_ratio,
    )


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


def data_parallel_slice(tensors_BT, dp: int, dp_rank: int):
    """Data-parallel rank ``dp_rank``'s sequences of a global batch: a contiguous slice of B/dp."""
    out = []
    for t in tensors_BT:
        if t.shape[0] % dp:
            raise ValueError(
                f"global batch of {t.shape[0]} sequences does not split over {dp} data-parallel "
                "ranks; use a multiple of dp_replicate * dp_shard"
            )
        per_rank = t.shape[0] // dp
        out.append(t[dp_rank * per_rank : (dp_rank + 1) * per_rank])
    return out


def sharded_next_token_loss(
    model, inputs_BT, targets_BT, *, mesh, cp_mode: str, num_global_tokens: int, backward: bool
):
    """This rank's share of the global mean next-token loss (and its backward, if asked).

    ``inputs_BT``/``targets_BT`` are the rank's data-parallel sequences, whole; the cp ranks
    split them here. Returns ``sum over the rank's tokens of CE / num_global_tokens`` (detached):
    summed over all ranks it is the global batch's mean loss, and so are the gradients.
    """
    import torch
    import torch.nn.functional as F

    from etude.parallel.context import context_parallel_batch

    batch, seq = inputs_BT.shape
    positions_BT = torch.arange(seq, device=inputs_BT.device).expand(batch, seq)
    with context_parallel_batch(mesh.cp, cp_mode, [inputs_BT, targets_BT, positions_BT]) as (
        x_BT,
        y_BT,
        pos_BT,
    ):
        logits_BTV = model(x_BT, positions_BT=pos_BT)
        loss = F.cross_entropy(
            logits_BTV.flatten(0, 1).float(), y_BT.flatten(), reduction="sum"
        ) / float(num_global_tokens)
        if backward:
            loss.backward()
    return loss.detach()


def run_pretrain(cfg: PretrainConfig) -> dict[str, float]:
    """Train (or resume) per ``cfg``; returns final metrics (loss, val_loss, step).

    Under torchrun every rank calls this; the result is the same on every rank.
    """
    import torch
    import torch.distributed as dist
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from etude.model.transformer import Transformer, build_model
    from etude.optim import build_optimizer
    from etude.parallel.checkpoint import (
        export_safetensors,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from etude.parallel.dims import ParallelDims
    from etude.report.metrics import MetricsLogger, StepClock, format_step_line, prepare_run_dir

    tc, dc = cfg.train, cfg.data
    mcfg = cfg.model_config()
    device, rank, world_size = init_distributed(tc.device)
    try:
        dims = ParallelDims.from_config(cfg.parallel, world_size)
        dims.check_model(mcfg)
        dims.check_seq_len(dc.seq_len)
    except ValueError:
        if world_size > 1:
            dist.destroy_process_group()
        raise
    parallel = dims.is_parallel
    is_main = rank == 0

    def barrier() -> None:
        if parallel:
            dist.barrier()

    # rank 0 writes the run directory, the tokenizer and the token cache; the others read them
    run_dir = Path(tc.run_dir)
    if is_main:
        prepare_run_dir(run_dir, to_dict(cfg))
    texts = _corpus(dc)
    if is_main:
        tok = load_or_train_tokenizer(run_dir, mcfg.vocab_size, texts)
        stream = token_stream(tok, texts, run_dir / "tokens.pt")
    barrier()
    if not is_main:
        tok = load_or_train_tokenizer(run_dir, mcfg.vocab_size, texts)
        stream = token_stream(tok, texts, run_dir / "tokens.pt")
    num_val = max(int(len(stream) * dc.val_fraction), dc.seq_len * 2)
    train_stream, val_stream = stream[:-num_val], stream[-num_val:]

    torch.manual_seed(tc.seed)
    mesh, cp_mode, dp_rank = None, "allgather", 0
    if not parallel:
        model = build_model(mcfg, device=device, seed=tc.seed)
    else:
        from etude.parallel.context import resolve_cp_mode
        from etude.parallel.fsdp import materialize, parallelize

        mesh = dims.build_mesh(device.type)
        cp_mode = resolve_cp_mode(cfg.parallel.cp_attention, device.type)
        dp_rank = mesh.coordinate()["dp"]
        with torch.device("meta"):
            model = Transformer(mcfg)
        parallelize(model, mesh, cp_mode=cp_mode)
        materialize(model, device, seed=tc.seed, init=cfg.parallel.init)
        if is_main:
            print(f"parallel: {dims.describe()} | cp attention {cp_mode}")
    optimizer = build_optimizer(model, cfg.optim)
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    start_step = 0
    logger = MetricsLogger(run_dir, config=to_dict(cfg), enabled=is_main)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        extra = load_checkpoint(ckpt, model, optimizer)
        start_step = extra["step"]
        logger.truncate_after(start_step)
        if is_main:
            print(f"resumed from {ckpt} at step {start_step}")

    global_batch = dc.batch_size * dims.dp
    tokens_per_step = global_batch * dc.seq_len

    def batch_for(stream_part, step: int):
        inputs, targets = sample_batch(stream_part, step, tc.seed, global_batch, dc.seq_len, device)
        if not parallel:
            return inputs, targets
        return data_parallel_slice((inputs, targets), dims.dp, dp_rank)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            losses = []
            for i in range(tc.eval_batches):
                inputs, targets = batch_for(val_stream, -1 - i)
                if parallel:
                    part = sharded_next_token_loss(
                        model,
                        inputs,
                        targets,
                        mesh=mesh,
                        cp_mode=cp_mode,
                        num_global_tokens=tokens_per_step,
                        backward=False,
                    )
                    losses.append(all_reduce_sum(part).item())
                else:
                    losses.append(next_token_loss(model, inputs, targets).item())
        model.train()
        return sum(losses) / len(losses)

    metrics: dict[str, float] = {}
    model.train()
    progress = Progress(
        TextColumn("pretrain"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        disable=not (tc.progress and is_main),
        transient=True,
    )
    with progress:
        bar = progress.add_task("pretrain", total=tc.steps, completed=start_step, info="")
        clock = StepClock(start_step, tc.steps)
        for step in range(start_step, tc.steps):
            t0 = time.perf_counter()
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = base * lr_factor(step, tc)
            inputs, targets = batch_for(train_stream, step)
            max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
            if not parallel:
                loss = next_token_loss(model, inputs, targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            else:
                from etude.parallel.fsdp import clip_grad_norm, sync_expert_load

                optimizer.zero_grad(set_to_none=True)
                loss = sharded_next_token_loss(
                    model,
                    inputs,
                    targets,
                    mesh=mesh,
                    cp_mode=cp_mode,
                    num_global_tokens=tokens_per_step,
                    backward=True,
                )
                loss = all_reduce_sum(loss)
                grad_norm = clip_grad_norm(model.parameters(), max_norm)
            optimizer.step()
            if parallel:
                sync_expert_load(model)
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
            if is_main and (done % tc.log_every == 0 or done == tc.steps):
                progress.console.print(
                    format_step_line(
                        done,
                        metrics,
                        ("loss", "val_loss", "grad_norm", "tok/s"),
                        total=tc.steps,
                        eta_s=clock.eta(done),
                    )
                )
            if done % tc.checkpoint_every == 0 or done == tc.steps:
                save_checkpoint(
                    run_dir, done, model, optimizer, {"tokens_seen": done * tokens_per_step}
                )

    export_safetensors(model, run_dir / "export", to_dict(mcfg))
    if is_main:
        sample_model = model
        if parallel:
            from etude.parallel.checkpoint import load_safetensors

            # the sharded, context-parallel model cannot generate alone: reload the export
            sample_model = build_model(mcfg, device=device, seed=tc.seed)
            load_safetensors(sample_model, run_dir / "export" / "model.safetensors")
        _write_sample(sample_model, tok, tc, run_dir)
    logger.close()
    if parallel:
        barrier()
        dist.destroy_process_group()
    return {"step": tc.steps, **metrics}


def _write_sample(model, tok, tc: TrainConfig, run_dir: Path) -> None:
    from etude.engine import Engine, SamplingParams

    engine = Engine(model, decode_fn=tok.decode)
    prompt = tok.encode(tc.sample_prompt)
    gen = engine.generate(
        [prompt],
        SamplingParams(max_new_tokens=tc.sample_tokens, temperature=0.8, top_k=50, seed=tc.seed),
    )[0]
    sample = tc.sample_prompt + tok.decode(gen.token_ids)
    print("sample:\n" + sample)
    (run_dir / "sample.txt").write_text(sample)
