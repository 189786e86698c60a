"""Warm start (``etude sft RECIPE``): supervised training on oracle-agent episodes and hint-following.

A model trained from scratch can not act in the environment, and RL needs a policy that
sometimes succeeds at the protocol. So the warm start imitates the scripted oracle
(``etude.env.oracle``), which solves tasks through the tools, with a chosen rate of injected
mistakes (unknown tools, broken JSON, bad arguments, test edits, skipped tests).

Hint-following: a pretrained LLM follows a hint because pretraining taught it to read
instructions; a tiny model trained from scratch does not, and then the hinted teacher of
``etude.rl.teacher`` equals the student and its KL teaches nothing. So the data also holds, for
each injected mistake that a detector (``etude.rl.feedback``) flags: the context up to the
mistaken turn, the detector's hint as a system message, then the oracle's corrected turn (loss
on that turn only). After training, `hint_preference` measures on those examples whether the
hinted model prefers the corrected turn where the unhinted one prefers the mistake.

Recovery (``data.recovery_mistakes``): a mistake the policy makes on its own (broken call
JSON) is taught by what follows it, not by imitation: in the episode the mistaken turn carries no
loss, the environment's real error observation follows it, and the oracle's next (planned) turn
is trained like every other, so the model learns to go on after its own malformed call. The
kinds not listed are imitated (``train_on_mistakes``).

Data: ``data.episodes_per_task`` oracle episodes per task (seeds 0..n-1), cached in
``RUN/sft_trajectories.jsonl`` so a resumed run trains on the same data. Episodes are whole: one
longer than ``data.max_seq_len`` or not ending in a passing submit is left out, never cut
(``data.whole_episodes``; the hint-following examples of a left-out episode stay).
Batches are drawn from (seed, step); checkpoints and resume as in ``etude.pretrain``.

`load_policy` is shared with the RL trainer; the run plumbing (process group, device, LR
schedule, model section) is ``etude.runtime``.

Not here: packing, a validation split, real (non-oracle) demonstrations.

Legend: B examples per batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from etude.config import from_dict, to_dict
from etude.env.coding import EnvConfig
from etude.env.oracle import MISTAKE_KINDS
from etude.env.trajectory import Trajectory
from etude.model.config import ModelConfig
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START, Tokenizer
from etude.optim import OptimConfig
from etude.rl.feedback import FeedbackConfig, build_detectors, detect_feedback
from etude.rl.teacher import hint_message_ids
from etude.runtime import init_distributed, lr_factor, resolve_device, resolve_model_config

__all__ = ["init_distributed", "load_policy", "resolve_device", "run_sft"]


@dataclass(kw_only=True, slots=True)
class SFTDataConfig:
    """The ``[data]`` section of an SFT recipe: which oracle episodes, which examples."""

    tasks: str = "examples/tasks/handwritten/tasks.jsonl"
    """A tasks.jsonl file; relative workspaces resolve against its directory."""
    episodes_per_task: int = 8
    """Oracle episodes per task (seeds 0..n-1)."""
    mistake_rate: float = 0.2
    """Probability of an injected mistake before each planned turn."""
    clean_episodes: int = 0
    """Oracle episodes per task without injected mistakes, besides the ``episodes_per_task``
    with them (seeds after theirs). A small warm start memorizes each task's edit in the context
    of its own episodes: one that saw the edit only after its injected detours loses it on the
    clean path that RL (and text feedback above all) teaches it to take."""
    mistakes: tuple[str, ...] = ("unknown_tool",)
    """Mistake kinds the oracle injects (see etude.env.oracle.MISTAKE_KINDS)."""
    train_on_mistakes: bool = True
    """Imitate mistaken turns too (RL then has mistakes to correct); False: no kind is imitated,
    as if every kind were in ``recovery_mistakes``."""
    recovery_mistakes: tuple[str, ...] = ()
    """Kinds of ``mistakes`` taught as recovery, not imitation: their turns carry no loss (the
    model must not learn to make them), while the rest of the episode keeps its loss, so the
    turn right after one (the oracle's planned turn, written after the environment's real error
    observation, e.g. ``Malformed tool call: ...`` for ``malformed_json``) teaches how to go on
    after that mistake. Meant for mistakes a tiny policy makes on its own (broken call JSON:
    docs/text-feedback.md), which an imitating warm start never saw anyone go on after.
    ``skip_tests`` can not be recovered from (it ends the episode)."""
    hint_examples: bool = True
    """Add the hint-following examples (mistake context + hint + corrected turn)."""
    hint_weight: int = 2
    """How many times each hint-following example enters the pool."""
    max_seq_len: int = 2048
    """Tokens per example (longer hint examples are dropped; longer episodes too, see
    ``whole_episodes``)."""
    whole_episodes: bool = True
    """Train only on whole episodes that end in a passing submit: a longer one is left out,
    never cut mid-episode (a cut episode teaches reading files but never an edit or a submit).
    False: cut every episode at ``max_seq_len``."""

    def __post_init__(self) -> None:
        self.mistakes = tuple(self.mistakes)
        unknown = sorted(set(self.mistakes) - set(MISTAKE_KINDS))
        if unknown:
            raise ValueError(
                f"data.mistakes: unknown kind {unknown[0]!r}; choose from {MISTAKE_KINDS}"
            )
        if not 0.0 <= self.mistake_rate <= 1.0:
            raise ValueError(f"data.mistake_rate={self.mistake_rate} must lie in [0, 1]")
        if self.episodes_per_task < 1 or self.hint_weight < 1:
            raise ValueError("data.episodes_per_task and data.hint_weight must be >= 1")
        self.recovery_mistakes = tuple(self.recovery_mistakes)
        outside = sorted(set(self.recovery_mistakes) - set(self.mistakes))
        if outside:
            raise ValueError(
                f"data.recovery_mistakes: {outside[0]!r} is not in data.mistakes "
                f"{list(self.mistakes)}; add it there (the oracle must make the mistake to "
                "recover from it)"
            )
        if "skip_tests" in self.recovery_mistakes:
            raise ValueError(
                "data.recovery_mistakes: 'skip_tests' ends the episode, so no turn recovers "
                "from it; remove it (or set it in data.mistakes only, to imitate it)"
            )
        if self.clean_episodes < 0:
            raise ValueError(f"data.clean_episodes={self.clean_episodes} must be >= 0")
        if self.max_seq_len < 64:
            raise ValueError(f"data.max_seq_len={self.max_seq_len} must be >= 64")


@dataclass(kw_only=True, slots=True)
class SFTTrainConfig:
    """The ``[train]`` section of an SFT recipe."""

    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 4
    """Examples per step."""
    warmup_steps: int = 10
    """Linear warmup, then cosine decay to ``min_lr_ratio``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    grad_clip: float = 1.0
    """Max gradient norm; 0 = off."""
    seed: int = 0
    """Seeds weight init and batch draws."""
    log_every: int = 10
    """Steps between console lines."""
    checkpoint_every: int = 100
    """Steps between checkpoints (and one at the end)."""
    run_dir: str = "runs/sft"
    """Config, metrics, data cache, checkpoints, export and tokenizer go here."""
    device: str = "auto"
    """``auto``, ``cpu`` or ``cuda``."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("train.steps and train.batch_size must be >= 1")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps]")
        if self.log_every < 1 or self.checkpoint_every < 1:
            raise ValueError("train.log_every and train.checkpoint_every must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r}: use auto, cpu or cuda")


@dataclass(kw_only=True, slots=True)
class SFTRecipe:
    """An SFT recipe: ``configs/sft-tiny.toml``."""

    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    """``preset`` names a ModelConfig preset; other keys override its fields."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """Limits of the oracle episodes (the oracle needs its whole plan: keep them generous)."""
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    """Detectors whose hints the hint-following examples carry (use the RL run's set)."""
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


# ---------------------------------------------------------------- shared with the RL trainer


def load_policy(
    init: str, model_section: dict[str, Any], run_dir: Path, *, device: torch.device, seed: int
) -> tuple[nn.Module, Tokenizer, ModelConfig]:
    """The starting policy and its tokenizer.

    With ``init`` (a run directory of ``etude sft``/``etude train``): its export and tokenizer.
    Without: a fresh model from ``model_section`` and the run's tokenizer (trained once on the
    local corpus by rank 0 and saved to ``run_dir/tokenizer``).
    """
    from etude.model.tokenizer import train_default_tokenizer
    from etude.model.transformer import build_model
    from etude.parallel.checkpoint import load_safetensors

    if init.startswith("hf:"):
        from etude.parallel.checkpoint import load_hf_policy

        model, tok, mcfg = load_hf_policy(init[3:], device=device)
    elif init:
        import json

        export = Path(init) / "export"
        mcfg = from_dict(ModelConfig, json.loads((export / "config.json").read_text()), "model")
        model = build_model(mcfg, device=device, seed=seed)
        load_safetensors(model, export / "model.safetensors")
        tok = Tokenizer.load(Path(init) / "tokenizer")
    else:
        mcfg = resolve_model_config(model_section)
        model = build_model(mcfg, device=device, seed=seed)
        tok_dir = run_dir / "tokenizer"
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 and not (tok_dir / "tokenizer.json").is_file():
            train_default_tokenizer(mcfg.vocab_size).save(tok_dir)
        if dist.is_initialized():
            dist.barrier()
        tok = Tokenizer.load(tok_dir)
    if tok.vocab_size > mcfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.vocab_size} ids but model.vocab_size={mcfg.vocab_size}; "
            "raise model.vocab_size"
        )
    return model, tok, mcfg


# ---------------------------------------------------------------- the data


@dataclass(kw_only=True, slots=True)
class Example:
    """Token ids and the loss mask of one training sequence."""

    ids: list[int]
    mask: list[int]
    kind: str
    """``episode`` or ``hint:KIND`` (a hint-following example)."""
    contrast: list[int] = field(default_factory=list)
    """Hint examples: the mistaken turn's generated ids (for `hint_preference`)."""
    hint_start: int = 0
    """Hint examples: where the hint message starts (where the mistaken turn started)."""
    hint_len: int = 0
    """Hint examples: how many ids the hint message takes."""


def episode_complete(traj: Trajectory, max_len: int) -> bool:
    """Whether an episode fits ``max_len`` tokens and ends in a submit that passed."""
    return (
        len(traj.token_ids) <= max_len
        and traj.finish_reason == "submit"
        and float(traj.reward or 0.0) >= 1.0
    )


def _generated_ids(tok: Tokenizer, text: str) -> list[int]:
    return [*tok.encode(text, allow_special=(TOOL_CALL_START, TOOL_CALL_END)), tok.im_end_id]


def oracle_examples(
    trajectories: Sequence[Trajectory], tok: Tokenizer, cfg: SFTDataConfig, feedback: FeedbackConfig
) -> list[Example]:
    """Episode examples and hint-following examples (see the module docstring)."""
    detectors = build_detectors(feedback)
    out = []
    for traj in trajectories:
        ids = traj.token_ids
        offsets = traj.turn_offsets()
        oracle_turns = traj.info.get("oracle_turns", [])
        assistant = [i for i, _ in traj.assistant_turns()]
        mask = []
        for i, turn in enumerate(traj.turns):
            k = assistant.index(i) if i in assistant else -1
            mistaken = oracle_turns[k]["mistake"] if 0 <= k < len(oracle_turns) else None
            imitate = cfg.train_on_mistakes and mistaken not in cfg.recovery_mistakes
            keep = not mistaken or imitate
            mask += turn.trainable if keep else [0] * len(turn.token_ids)
        cut = cfg.max_seq_len
        if cfg.whole_episodes and not episode_complete(traj, cfg.max_seq_len):
            mask = []
        if any(mask[1:cut]):
            out.append(Example(ids=ids[:cut], mask=mask[:cut], kind="episode"))
        if not cfg.hint_examples:
            continue
        hints: dict[int, str] = {}
        for item in detect_feedback(traj, detectors):
            hints[item.turn] = (
                (hints[item.turn] + "\n" + item.hint) if item.turn in hints else item.hint
            )
        for k, oracle_turn in enumerate(oracle_turns):
            if not oracle_turn["mistake"] or not oracle_turn["corrected"] or k >= len(assistant):
                continue
            i = assistant[k]
            if i not in hints:
                continue
            turn = traj.turns[i]
            header = turn.trainable.index(1)
            start = offsets[i]
            hint_ids = hint_message_ids(tok, hints[i])
            context = ids[:start] + hint_ids + turn.token_ids[:header]
            corrected = _generated_ids(tok, oracle_turn["corrected"])
            example_ids = context + corrected
            if len(example_ids) > cfg.max_seq_len:
                continue
            mistaken = turn.token_ids[header : header + sum(turn.trainable)]
            example = Example(
                ids=example_ids,
                mask=[0] * len(context) + [1] * len(corrected),
                kind=f"hint:{oracle_turn['mistake']}",
                contrast=mistaken,
                hint_start=start,
                hint_len=len(hint_ids),
            )
            out.extend([example] * cfg.hint_weight)
    return out


def collect_oracle_trajectories(cfg: SFTRecipe, tok: Tokenizer) -> list[Trajectory]:
    """``episodes_per_task`` oracle episodes per task with injected mistakes, then
    ``clean_episodes`` without."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from etude.env.oracle import OracleAgent
    from etude.env.pool import EnvPool
    from etude.tasks.record import load_tasks

    path = Path(cfg.data.tasks)
    tasks = load_tasks(path)
    out = []
    progress = Progress(
        TextColumn("oracle episodes"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        disable=not cfg.train.progress,
        transient=True,
    )
    with (
        EnvPool(cfg.env, tokenizer=tok, base_dir=path.parent, max_workers=4) as pool,
        progress,
    ):
        per_task = cfg.data.episodes_per_task + cfg.data.clean_episodes
        bar = progress.add_task("oracle", total=per_task * len(tasks))
        for seed in range(per_task):
            rate = cfg.data.mistake_rate if seed < cfg.data.episodes_per_task else 0.0

            def agent(task, seed=seed, rate=rate):
                return OracleAgent(
                    task,
                    base_dir=str(path.parent),
                    mistake_rate=rate,
                    mistakes=cfg.data.mistakes or MISTAKE_KINDS,
                    seed=seed,
                )

            out.extend(pool.run_episodes(tasks, agent))
            progress.update(bar, advance=len(tasks))
    return out


# ---------------------------------------------------------------- training


def masked_nll(model: nn.Module, batch: Sequence[Example], device: torch.device) -> Tensor:
    """Mean next-token NLL over the masked tokens of ``batch`` (right-padded)."""
    length = max(len(e.ids) for e in batch)
    ids_BT = torch.zeros(len(batch), length, dtype=torch.long)
    mask_BT = torch.zeros(len(batch), length)
    for b, e in enumerate(batch):
        ids_BT[b, : len(e.ids)] = torch.tensor(e.ids)
        mask_BT[b, : len(e.ids)] = torch.tensor(e.mask, dtype=torch.float)
    ids_BT, mask_BT = ids_BT.to(device), mask_BT.to(device)
    logits_BTV = model(ids_BT)[:, :-1].float()
    nll_BT = torch.nn.functional.cross_entropy(
        logits_BTV.flatten(0, 1), ids_BT[:, 1:].flatten(), reduction="none"
    ).view_as(mask_BT[:, 1:])
    return (nll_BT * mask_BT[:, 1:]).sum() / mask_BT[:, 1:].sum().clamp(min=1.0)


@torch.no_grad()
def hint_preference(
    model: nn.Module, examples: Sequence[Example], device: torch.device
) -> dict[str, float]:
    """Does the hinted model prefer the corrected turn where the unhinted one made the mistake?

    Per distinct hint example, at the first token where the corrected and the mistaken turns
    differ: p(corrected token) with the hint vs without it. ``hint_pref`` is the fraction of
    examples where the hint raises it; ``p_valid_hinted``/``p_valid_unhinted`` the means.
    """
    seen, rows = set(), []
    for e in examples:
        if not e.kind.startswith("hint:") or id(e) in seen:
            continue
        seen.add(id(e))
        corrected_start = e.mask.index(1)
        corrected = e.ids[corrected_start:]
        d = next((k for k, (a, b) in enumerate(zip(corrected, e.contrast)) if a != b), None)
        if d is None:
            continue
        hinted_ids = e.ids[: corrected_start + d]
        # the unhinted context: the same ids without the hint message
        plain_ids = hinted_ids[: e.hint_start] + hinted_ids[e.hint_start + e.hint_len :]
        pair = []
        for context in (hinted_ids, plain_ids):
            logits = model(torch.tensor([context], device=device))[0, -1]
            pair.append(torch.softmax(logits.float(), -1)[corrected[d]].item())
        rows.append(pair)
    if not rows:
        return {"hint_examples": 0.0}
    return {
        "hint_examples": float(len(rows)),
        "hint_pref": sum(h > p for h, p in rows) / len(rows),
        "p_valid_hinted": sum(h for h, _ in rows) / len(rows),
        "p_valid_unhinted": sum(p for _, p in rows) / len(rows),
    }


def _lr_factor(step: int, cfg: SFTTrainConfig) -> float:
    return lr_factor(
        step,
        warmup_steps=cfg.warmup_steps,
        total_steps=cfg.steps,
        schedule="cosine",
        min_lr_ratio=cfg.min_lr_ratio,
    )


def run_sft(cfg: SFTRecipe) -> dict[str, float]:
    """Build the data (or read its cache), train (or resume), export; returns final metrics."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from etude.env.trajectory import read_jsonl, write_jsonl
    from etude.optim import build_optimizer
    from etude.parallel.checkpoint import (
        export_safetensors,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from etude.report.metrics import (
        MetricsLogger,
        StepClock,
        format_step_line,
        prepare_run_dir,
        write_json_atomic,
    )

    tc = cfg.train
    device, rank, world_size = init_distributed(tc.device)
    if world_size > 1:
        raise ValueError("etude sft runs in one process; launch it without torchrun")
    run_dir = prepare_run_dir(tc.run_dir, to_dict(cfg))
    torch.manual_seed(tc.seed)
    model, tok, mcfg = load_policy("", cfg.model, run_dir, device=device, seed=tc.seed)
    if cfg.data.max_seq_len > mcfg.max_seq_len:
        raise ValueError(
            f"data.max_seq_len={cfg.data.max_seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}"
        )

    cache = run_dir / "sft_trajectories.jsonl"
    if cache.is_file():
        trajectories = read_jsonl(cache)
    else:
        t0 = time.perf_counter()
        trajectories = collect_oracle_trajectories(cfg, tok)
        write_jsonl(cache, trajectories)
        print(f"{len(trajectories)} oracle episodes in {time.perf_counter() - t0:.1f} s")
    examples = oracle_examples(trajectories, tok, cfg.data, cfg.feedback)
    if not examples:
        raise ValueError("no SFT examples: raise data.max_seq_len or data.episodes_per_task")
    num_hint = sum(e.kind.startswith("hint:") for e in examples)
    num_whole = sum(episode_complete(t, cfg.data.max_seq_len) for t in trajectories)
    lengths = sorted(len(t.token_ids) for t in trajectories)
    num_recovery = sum(
        turn["mistake"] in cfg.data.recovery_mistakes
        for t in trajectories
        if episode_complete(t, cfg.data.max_seq_len) or not cfg.data.whole_episodes
        for turn in t.info.get("oracle_turns", [])
    )
    print(
        f"sft data: {num_whole}/{len(trajectories)} oracle episodes whole within "
        f"data.max_seq_len={cfg.data.max_seq_len} (lengths {lengths[0]}-{lengths[-1]} tokens, "
        f"median {lengths[len(lengths) // 2]}), {len(examples) - num_hint} episode and "
        f"{num_hint} hint-following examples, {num_recovery} mistakes recovered from "
        "(no loss on the mistaken turn)"
    )

    optimizer = build_optimizer(model, cfg.optim)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    logger = MetricsLogger(run_dir, config=to_dict(cfg))
    start_step = 0
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        start_step = int(load_checkpoint(ckpt, model, optimizer)["step"])
        logger.truncate_after(start_step)
        print(f"resumed from {ckpt} at step {start_step}")

    metrics: dict[str, float] = {}
    progress = Progress(
        TextColumn("sft"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        disable=not tc.progress,
        transient=True,
    )
    model.train()
    with progress:
        bar = progress.add_task("sft", total=tc.steps, completed=start_step, info="")
        clock = StepClock(start_step, tc.steps)
        for step in range(start_step, tc.steps):
            t0 = time.perf_counter()
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = base * _lr_factor(step, tc)
            rng = random.Random(f"sft:{tc.seed}:{step}")
            batch = [rng.choice(examples) for _ in range(tc.batch_size)]
            loss = masked_nll(model, batch, device)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf")
            )
            optimizer.step()
            model.update_expert_bias()
            tokens = sum(len(e.ids) for e in batch)
            metrics = {
                "loss": loss.item(),
                "grad_norm": float(grad_norm),
                "lr": optimizer.param_groups[0]["lr"],
                "tok/s": tokens / (time.perf_counter() - t0),
            }
            done = step + 1
            logger.log(done, metrics)
            progress.update(bar, advance=1, info=f"loss {metrics['loss']:.3f}")
            if done % tc.log_every == 0 or done == tc.steps:
                progress.console.print(
                    format_step_line(
                        done,
                        metrics,
                        ("loss", "grad_norm", "tok/s"),
                        total=tc.steps,
                        eta_s=clock.eta(done),
                    )
                )
            if done % tc.checkpoint_every == 0 or done == tc.steps:
                save_checkpoint(run_dir, done, model, optimizer, {"examples": len(examples)})

    model.eval()
    pref = hint_preference(model, examples, device)
    summary = {
        "examples": float(len(examples)),
        "hint_examples_in_pool": float(num_hint),
        "episodes": float(len(trajectories)),
        "whole_episodes": float(num_whole),
        "recovery_turns": float(num_recovery),
        **pref,
    }
    write_json_atomic(run_dir / "hint_preference.json", summary)
    print("hint preference: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    export_safetensors(model, run_dir / "export", to_dict(mcfg))
    logger.close()
    return {"step": tc.steps, **metrics, **summary}
