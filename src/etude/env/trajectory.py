"""The trajectory record: one episode of a policy acting in a task's repository.

This is the contract that the environment writes and the monitor, the RL trainer, the feedback
detectors and the report read (docs/architecture.md, "Trajectory"). It lives in ``etude.env`` because both
``monitor`` and ``rl`` sit above ``env``.

A trajectory is a list of turns in conversation order. Token ids of the whole episode are the
concatenation of the turns' ``token_ids``, built append-only by the chat renderer (never by
re-rendering the conversation: re-tokenization drift would break behavior logprobs).

- ``system``/``user`` turns: the task prompt; ``tool`` turns: one observation per tool call.
- ``assistant`` turns: the model's generated tokens with their behavior logprobs; the parsed
  ``tool_calls``; and typed ``errors`` for calls that went wrong (unknown tool, malformed JSON,
  bad arguments, path escape, ...), which the text-feedback detectors read.

Serialized as one JSON object per line (``write_jsonl``/``read_jsonl``). What it is not: a
replay log of the sandbox (command outputs are kept only as the observation text the model saw).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from etude.tasks.record import write_atomic

Role = Literal["system", "user", "assistant", "tool"]

# Typed tool-call errors recorded on the assistant turn that made the call.
ERROR_KINDS = (
    "no_tool_call",  # an assistant turn with neither a tool call nor a final answer
    "malformed_json",  # <tool_call> body is not a JSON object with name/arguments
    "unknown_tool",  # the named tool does not exist
    "bad_arguments",  # missing, extra or mistyped arguments for the tool's schema
    "path_escape",  # a path outside the workspace (.., absolute, symlink)
    "tool_failed",  # the tool ran and reported a failure (no match, file missing, ...)
)


@dataclass(kw_only=True, slots=True)
class ToolCall:
    """One parsed call: the tool's name and its JSON arguments, as the model wrote them."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class ToolError:
    """A tool call that went wrong, typed so that detectors need not parse observation text."""

    kind: str
    """One of ``ERROR_KINDS``."""
    message: str
    """The text the model saw for it."""
    tool: str | None = None
    """The tool name the model asked for, when one could be parsed."""

    def __post_init__(self) -> None:
        assert self.kind in ERROR_KINDS, self.kind


@dataclass(kw_only=True, slots=True)
class Turn:
    """One message of the episode and the tokens it added to the conversation."""

    role: Role
    text: str
    """The message content (for assistant turns: the decoded generated text)."""
    token_ids: list[int] = field(default_factory=list)
    """The ids this message appended (role header, content, end marker)."""
    trainable: list[int] = field(default_factory=list)
    """Per token of ``token_ids``: 1 where the policy generated the token (loss applies), else 0."""
    logprobs: list[float] = field(default_factory=list)
    """Per token of ``token_ids``: behavior logprob where trainable, 0.0 elsewhere."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolError] = field(default_factory=list)
    tool_name: str | None = None
    """For ``tool`` turns: which tool produced this observation."""
    policy_version: int | None = None
    """For generated ``assistant`` turns: the version of the weights that generated them
    (optimizer steps applied; asynchronous RL bounds the trainer's step minus this)."""
    provenance: dict[str, Any] | None = None
    """For ``tool`` turns of sandboxed tools: what the command touched
    (``etude.sandbox.provenance.Provenance.to_json``); None when not recorded."""

    def __post_init__(self) -> None:
        if self.trainable:
            assert len(self.trainable) == len(self.token_ids), (
                "trainable mask must align with token_ids"
            )
        if self.logprobs:
            assert len(self.logprobs) == len(self.token_ids), "logprobs must align with token_ids"


@dataclass(kw_only=True, slots=True)
class Flag:
    """A monitor finding: which rule fired, how bad it is, and the evidence."""

    rule: str
    category: str
    severity: int
    """0 info, 1 low, 2 medium, 3 high (a hack), 4 certain (a honeypot canary)."""
    turn: int | None
    evidence: str


@dataclass(kw_only=True, slots=True)
class Feedback:
    """A hint for one assistant turn: the text-feedback teacher sees ``hint`` before that turn."""

    turn: int
    kind: str
    hint: str


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One episode. ``reward`` is None until the episode has been scored."""

    task_id: str
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    tests: dict[str, str] = field(default_factory=dict)
    """Per test id of the reward run: ``passed``, ``failed``, ``error`` or ``skipped``."""
    finish_reason: str = ""
    """``submit``, ``max_turns``, ``max_tokens``, ``timeout`` or ``error``."""
    flags: list[Flag] = field(default_factory=list)
    feedback: list[Feedback] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form metadata: group and sample index, policy step, seed, timings."""

    @property
    def token_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]

    def turn_offsets(self) -> list[int]:
        """Start offset of each turn in ``token_ids``."""
        offsets, pos = [], 0
        for turn in self.turns:
            offsets.append(pos)
            pos += len(turn.token_ids)
        return offsets

    def assistant_turns(self) -> Iterator[tuple[int, Turn]]:
        return ((i, t) for i, t in enumerate(self.turns) if t.role == "assistant")

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for turn in data["turns"]:
            if turn["provenance"] is None:
                del turn["provenance"]  # most turns ran no command
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        data = dict(data)
        turns = []
        for t in data.pop("turns", []):
            t = dict(t)
            t["tool_calls"] = [ToolCall(**c) for c in t.get("tool_calls", [])]
            t["errors"] = [ToolError(**e) for e in t.get("errors", [])]
            turns.append(Turn(**t))
        flags = [Flag(**f) for f in data.pop("flags", [])]
        feedback = [Feedback(**f) for f in data.pop("feedback", [])]
        return cls(turns=turns, flags=flags, feedback=feedback, **data)


def is_infra_failure(trajectory: Trajectory) -> bool:
    """Whether the episode ended by an infrastructure failure (a dead worker, a crashed sandbox):
    ``info["infra"]`` names it. Such an episode has no reward; it is masked from group
    statistics and the loss, and counted, never scored 0."""
    return bool(trajectory.info.get("infra"))


def write_jsonl(
    path: str | Path, trajectories: Iterable[Trajectory], *, append: bool = False
) -> None:
    """Write trajectories one per line. A new file is written atomically (temp + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(t.to_json()) + "\n" for t in trajectories)
    if append:
        with open(path, "a") as f:
            f.write(lines)
        return
    write_atomic(path, lines.encode("utf-8"))


def read_jsonl(path: str | Path) -> list[Trajectory]:
    """Read trajectories; a malformed line is a ``ValueError`` naming the file and line."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_json(json.loads(line)))
            # JSON of the wrong shape: not an object, missing or unknown keys, misaligned
            # per-token lists, an unknown error kind (the records' own assertions)
            except (ValueError, TypeError, AttributeError, AssertionError) as e:
                raise ValueError(f"{path}:{lineno}: not a trajectory record ({e})") from None
    return out
