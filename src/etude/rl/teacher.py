"""The hinted teacher: splice a hint before a turn, one no-grad forward, KL on that turn only.

For a trajectory with student ids ``x`` and a hinted assistant turn occupying ``x[s:e]`` (its
role header, generated ids, ``<|im_end|>`` and separator):

    teacher ids = x[:s] + hint_ids + x[s:e]

where ``hint_ids`` is the hint rendered as one system message with the chat template
(``<|im_start|>system\\n{hint}<|im_end|>\\n``). The splice is on token ids: nothing before or
inside the turn is re-rendered, so the turn's ids in the teacher are the very ids the student
generated, and position ids are simply recomputed (0..len-1, the model's default). A turn token
at student index ``j`` sits at teacher index ``j + len(hint_ids)``; the teacher's distribution for
it is the logits at the index before. Only the turn's trainable tokens (what the policy generated)
are targets; the hint and observation tokens never are. An empty hint splices in nothing: its
teacher is the student itself, so the KL is exactly zero and so is its gradient.

One forward of the teacher weights without grad gives the logits at those positions only
(``logits_index_BN``): the rollout's weights by default, or a frozen copy of the initial policy,
or an exponential moving average of the policy (`TeacherWeights`). The KL itself is
``etude.rl.losses.token_kl`` (fp32, full vocabulary, reverse by default).

What this module does not do: decide which turns get hints (``etude.rl.feedback``) or weigh the
KL against the RL loss (``etude.rl.trainer``: total = RL + beta * KL).

Legend: B teacher sequences, T tokens, N target tokens, V vocabulary.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from etude.engine.sampling import sampling_logprobs
from etude.env.trajectory import Trajectory
from etude.model.chat import encode_message
from etude.model.tokenizer import Tokenizer
from etude.rl.feedback import hints_by_turn
from etude.rl.losses import token_kl


@dataclass(kw_only=True, slots=True)
class TeacherConfig:
    """The ``[teacher]`` section: whose weights teach, and how the KL is measured."""

    source: Literal["rollout", "frozen", "ema"] = "rollout"
    """``rollout``: the weights that generated the batch; ``frozen``: the initial policy;
    ``ema``: an exponential moving average of the policy."""
    ema_decay: float = 0.95
    """``ema``: per-step decay (teacher <- decay * teacher + (1 - decay) * policy)."""
    beta: float = 0.1
    """Weight of the KL on hinted turns: total loss = RL loss + beta * KL loss (0 = off)."""
    kl_kind: Literal["reverse", "forward", "jsd"] = "reverse"
    """``reverse``: KL(student || teacher); ``forward``: KL(teacher || student); ``jsd``."""
    topk: int = 0
    """Sum the KL over the teacher's top-k tokens plus a tail bucket; 0 = the full vocabulary."""
    max_batch: int = 16
    """Most teacher sequences per forward (the hinted turns of a batch run in chunks)."""
    kl_span: Literal["turn", "to_divergence"] = "turn"
    """Which tokens of a hinted turn the KL covers. ``turn``: every generated token.
    ``to_divergence``: the tokens up to and including the first one the hinted teacher finds
    less likely than the student did by more than ``divergence_nats`` (all of them when there is
    none). After that token the teacher reads a prefix it would not have written (the unknown
    tool's name, say), so its distribution there is a doubtful target. Measured on the demo it
    did not stop the malformed calls from rising with feedback (docs/text-feedback.md)."""
    divergence_nats: float = 1.0
    """``kl_span = "to_divergence"``: how much less likely (log-probability, nats) the teacher
    must find the student's token for the turn to diverge there."""

    def __post_init__(self) -> None:
        if self.source not in ("rollout", "frozen", "ema"):
            raise ValueError(f"teacher.source={self.source!r}: use rollout, frozen or ema")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"teacher.ema_decay={self.ema_decay} must lie in [0, 1), e.g. 0.95")
        if not self.beta >= 0:
            raise ValueError(f"teacher.beta={self.beta} must be >= 0 (0 turns the KL off)")
        if self.kl_kind not in ("reverse", "forward", "jsd"):
            raise ValueError(f"teacher.kl_kind={self.kl_kind!r}: use reverse, forward or jsd")
        if self.topk < 0:
            raise ValueError(f"teacher.topk={self.topk} must be >= 0 (0 = full vocabulary)")
        if self.kl_span not in ("turn", "to_divergence"):
            raise ValueError(f"teacher.kl_span={self.kl_span!r}: use turn or to_divergence")
        if not self.divergence_nats > 0:
            raise ValueError(
                f"teacher.divergence_nats={self.divergence_nats} must be > 0 (e.g. 1.0)"
            )
        if self.max_batch < 1:
            raise ValueError(f"teacher.max_batch={self.max_batch} must be >= 1")


@dataclass(kw_only=True, slots=True)
class HintedTurn:
    """One hinted assistant turn of one trajectory, with the teacher's ids built for it."""

    row: int
    """Index of the trajectory in the batch."""
    turn: int
    """Index of the turn in ``trajectory.turns``."""
    hint: str
    teacher_ids: list[int]
    """Student ids before the turn + hint message ids + the turn's ids."""
    student_targets: list[int]
    """Indices into the student's ids of the turn's trainable tokens."""
    teacher_targets: list[int]
    """Indices into ``teacher_ids`` of the same tokens."""

    @property
    def num_hint_ids(self) -> int:
        return self.teacher_targets[0] - self.student_targets[0] if self.student_targets else 0


def hint_message_ids(tokenizer: Tokenizer, hint: str) -> list[int]:
    """The hint as a rendered system message; no ids at all for an empty hint."""
    if not hint:
        return []
    ids, _ = encode_message(tokenizer, "system", hint)
    return ids


def splice_hint(
    student_ids: Sequence[int], turn_start: int, turn_end: int, hint_ids: Sequence[int]
) -> list[int]:
    """``student_ids[:turn_start] + hint_ids + student_ids[turn_start:turn_end]``."""
    assert 0 <= turn_start < turn_end <= len(student_ids), (turn_start, turn_end)
    return [*student_ids[:turn_start], *hint_ids, *student_ids[turn_start:turn_end]]


def build_hinted_turns(
    trajectories: Sequence[Trajectory], tokenizer: Tokenizer, *, max_len: int | None = None
) -> list[HintedTurn]:
    """A `HintedTurn` for every turn with feedback, in batch then turn order.

    ``max_len`` (the model's max_seq_len) drops a turn whose teacher sequence would not fit.
    """
    out = []
    for row, trajectory in enumerate(trajectories):
        ids = trajectory.token_ids
        offsets = trajectory.turn_offsets()
        for turn_index, hint in hints_by_turn(trajectory).items():
            turn = trajectory.turns[turn_index]
            assert turn.role == "assistant", (turn_index, turn.role)
            start = offsets[turn_index]
            end = start + len(turn.token_ids)
            local = [k for k, m in enumerate(turn.trainable) if m]
            if not local:
                continue
            hint_ids = hint_message_ids(tokenizer, hint)
            teacher_ids = splice_hint(ids, start, end, hint_ids)
            if max_len is not None and len(teacher_ids) > max_len:
                continue
            student_targets = [start + k for k in local]
            teacher_targets = [start + len(hint_ids) + k for k in local]
            # aligned by construction: the teacher predicts the very ids the student generated
            assert [teacher_ids[t] for t in teacher_targets] == [ids[s] for s in student_targets]
            assert student_targets[0] >= 1
            out.append(
                HintedTurn(
                    row=row,
                    turn=turn_index,
                    hint=hint,
                    teacher_ids=teacher_ids,
                    student_targets=student_targets,
                    teacher_targets=teacher_targets,
                )
            )
    return out


@torch.no_grad()
def teacher_logits(
    model: nn.Module, hinted: Sequence[HintedTurn], *, max_batch: int = 16
) -> list[Tensor | None]:
    """Per hinted turn, the teacher's fp32 logits [N, V] for its targets (None: empty hint).

    A turn with an empty hint has the student's own context: its teacher is the student's
    logits, which the loss takes from the student forward (exact zero KL, no forward here).
    """
    out: list[Tensor | None] = [None] * len(hinted)
    todo = [k for k, h in enumerate(hinted) if h.num_hint_ids > 0]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for chunk_start in range(0, len(todo), max_batch):
            chunk = todo[chunk_start : chunk_start + max_batch]
            length = max(len(hinted[k].teacher_ids) for k in chunk)
            width = max(len(hinted[k].teacher_targets) for k in chunk)
            # right padding: causal attention keeps pads away from every real position
            tokens_BT = torch.zeros(len(chunk), length, dtype=torch.long)
            index_BN = torch.zeros(len(chunk), width, dtype=torch.long)
            for b, k in enumerate(chunk):
                h = hinted[k]
                tokens_BT[b, : len(h.teacher_ids)] = torch.tensor(h.teacher_ids)
                # the logits at index t - 1 give the distribution of the token at index t
                index_BN[b, : len(h.teacher_targets)] = torch.tensor(h.teacher_targets) - 1
            logits_BNV = model(tokens_BT.to(device), logits_index_BN=index_BN.to(device))
            for b, k in enumerate(chunk):
                out[k] = logits_BNV[b, : len(hinted[k].teacher_targets)].float()
    finally:
        model.train(was_training)
    return out


def hinted_kl(
    student_logits_NV: Tensor,
    teacher_logits_NV: Tensor | None,
    *,
    kind: str = "reverse",
    topk: int = 0,
) -> Tensor:
    """Per-token KL [N] of one hinted turn; ``None`` teacher (empty hint) gives exact zeros."""
    teacher = student_logits_NV.detach() if teacher_logits_NV is None else teacher_logits_NV
    return token_kl(student_logits_NV, teacher, kind=kind, topk=topk)


def feedback_kl_loss(
    student_logits_BTV: Tensor,
    hinted: Sequence[HintedTurn],
    teachers: Sequence[Tensor | None],
    rows: Sequence[int],
    *,
    kind: str = "reverse",
    topk: int = 0,
    num_tokens: int | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """KL loss of the hinted turns of one minibatch, and the per-token KL [N] (detached).

    ``rows[k]`` is the minibatch row holding ``hinted[k]``'s trajectory. The student's logits
    for a target at index t are those at t - 1 of its own (unhinted) sequence. Both students'
    and teachers' logits are divided by ``temperature`` (the rollout's: the KL compares the
    distributions the policy samples from). The loss is the sum of the per-token KL over every
    hinted target divided by ``num_tokens`` (the trainer passes the same token count that
    normalizes the PPO term, so ``beta`` weighs a hinted token against a PPO token the same way
    at every step; default: the hinted targets here). No other position enters the loss.
    """
    assert len(hinted) == len(teachers) == len(rows)
    if not hinted:
        zero = student_logits_BTV.sum() * 0.0
        return zero, torch.zeros(0)
    pieces = []
    for h, teacher, b in zip(hinted, teachers, rows):
        index_N = torch.tensor(h.student_targets, device=student_logits_BTV.device) - 1
        student_NV = student_logits_BTV[b].index_select(0, index_N)
        if teacher is not None:
            assert teacher.shape == student_NV.shape, (teacher.shape, student_NV.shape)
            teacher = teacher.to(student_NV.device)
        if temperature != 1.0:
            student_NV = student_NV / temperature
            teacher = None if teacher is None else teacher / temperature
        pieces.append(hinted_kl(student_NV, teacher, kind=kind, topk=topk))
    kl_N = torch.cat(pieces)
    denom = float(max(num_tokens, 1)) if num_tokens is not None else float(max(len(kl_N), 1))
    return kl_N.sum() / denom, kl_N.detach()


def divergence_span(
    teacher_NV: Tensor,
    target_ids_N: Tensor,
    behavior_N: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    margin: float = 1.0,
) -> int:
    """How many of a hinted turn's N targets ``teacher.kl_span = "to_divergence"`` keeps: up to
    and including the first target whose teacher log-probability (under the sampling
    transform) is below the student's behaviour log-probability by more than ``margin`` nats;
    N when there is none. A token outside the teacher's top-k / top-p diverges."""
    logp_NV = sampling_logprobs(teacher_NV.float(), temperature, top_k=top_k, top_p=top_p)
    picked_N = logp_NV.gather(-1, target_ids_N[:, None].to(logp_NV.device))[:, 0].cpu()
    below_N = ~(picked_N >= behavior_N.float().cpu() - margin)  # -inf and NaN diverge too
    hits = below_N.nonzero()
    return int(hits[0, 0]) + 1 if len(hits) else len(target_ids_N)


def cut_at_divergence(
    hinted: Sequence[HintedTurn],
    teachers: Sequence[Tensor | None],
    trajectories: Sequence[Trajectory],
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    margin: float = 1.0,
) -> tuple[list[HintedTurn], list[Tensor | None]]:
    """The hinted turns (and their teacher logits) cut after their divergence token
    (`divergence_span`); an empty hint's turn (teacher None, KL exactly 0) stays whole."""
    out_h, out_t = [], []
    for h, teacher in zip(hinted, teachers):
        if teacher is None:
            out_h.append(h)
            out_t.append(teacher)
            continue
        traj = trajectories[h.row]
        ids = traj.token_ids
        behavior = [x for t in traj.turns for x in t.logprobs]
        n = divergence_span(
            teacher,
            torch.tensor([ids[t] for t in h.student_targets]),
            torch.tensor([behavior[t] for t in h.student_targets]),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            margin=margin,
        )
        out_h.append(
            dataclasses.replace(
                h, student_targets=h.student_targets[:n], teacher_targets=h.teacher_targets[:n]
            )
        )
        out_t.append(teacher[:n])
    return out_h, out_t


# ---------------------------------------------------------------- teacher weights


def _full(t: Tensor) -> Tensor:
    """A DTensor's full value (an all-gather); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def copy_full_weights(src: nn.Module, dst: nn.Module) -> None:
    """Copy every parameter and buffer of ``src`` (sharded or not) into plain module ``dst``.

    Collective when ``src`` holds DTensors: every rank must call it.
    """
    dst_params = dict(dst.named_parameters())
    for name, p in src.named_parameters():
        dst_params[name].copy_(_full(p.detach()))
    dst_buffers = dict(dst.named_buffers())
    for name, b in src.named_buffers():
        dst_buffers[name].copy_(_full(b))


class TeacherWeights:
    """The module whose forward is the teacher (see `TeacherConfig.source`).

    ``rollout``: the engine's module (it holds the weights that generated the batch until the
    trainer syncs after the update). ``frozen``/``ema``: a plain copy made at construction from
    ``initial`` (the engine's module, which has the full weights on every rank); ``update``
    moves an EMA toward the policy after each optimizer step.
    """

    def __init__(self, cfg: TeacherConfig, engine_model: nn.Module) -> None:
        self.cfg = cfg
        self._engine_model = engine_model
        self._copy: nn.Module | None = None
        if cfg.source in ("frozen", "ema"):
            self._copy = copy.deepcopy(engine_model)
            self._copy.requires_grad_(False)
            self._copy.eval()

    @property
    def module(self) -> nn.Module:
        return self._engine_model if self._copy is None else self._copy

    @torch.no_grad()
    def update(self, policy: nn.Module) -> None:
        """After an optimizer step: EMA toward ``policy`` (collective if it is sharded).

        Parameters and the persistent floating-point buffers (the MoE routers' ``expert_bias``)
        are averaged, so the teacher routes tokens as an average policy would; non-persistent
        buffers (load counters) are left alone.
        """
        if self.cfg.source != "ema":
            return
        assert self._copy is not None
        decay = self.cfg.ema_decay
        mine = dict(self._copy.named_parameters())
        for name, p in policy.named_parameters():
            mine[name].lerp_(_full(p.detach()).to(mine[name].dtype), 1.0 - decay)
        persistent = set(self._copy.state_dict())
        my_buffers = dict(self._copy.named_buffers())
        for name, b in policy.named_buffers():
            mine_b = my_buffers.get(name)
            if mine_b is None or name not in persistent:
                continue
            value = _full(b.detach()).to(mine_b.dtype)
            if mine_b.is_floating_point():
                mine_b.lerp_(value, 1.0 - decay)
            else:
                mine_b.copy_(value)

    def state_dict(self) -> dict[str, Tensor]:
        return {} if self.cfg.source != "ema" else self.module.state_dict()

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if self.cfg.source == "ema" and state:
            self.module.load_state_dict(state)
