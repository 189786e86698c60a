"""Text-feedback detectors: find the assistant turns where a short hint would have helped.

Targeted RL with textual feedback (docs/architecture.md "RL loss"): the final reward says that an episode went wrong, not where. A detector reads a
finished `Trajectory` and names the turns that could have been better, each with a short hint
that describes the better behavior. ``etude.rl.teacher`` then splices that hint in front of the
turn and uses the hinted model as a teacher for that turn only.

A detector is anything with a ``name`` and ``detect(trajectory) -> list[Feedback]`` (the
`Detector` protocol); `register_detector` adds one to the table that `FeedbackConfig.detectors`
picks from. The built-ins (`BUILTIN_DETECTORS`):

- ``unknown_tool``: a call to a tool that does not exist; the hint lists the available tools;
- ``malformed_call``: a call that is not valid JSON, has bad arguments, or a turn without any
  call; the hint quotes the call format and, where the tool is known, its parameter schema;
- ``test_edit``: a write, replace or shell command that changes a test file; the hint says that
  the tests are the specification and the code is what to change (a later ``write_file`` of a
  path flagged before counts as restoring it and is not flagged);
- ``repeated_failure``: the same call repeated after it failed, with no edit in between;
- ``ruff_style``: Python written by ``write_file`` that ``ruff check`` finds fault with; the hint
  quotes ruff's rule codes and messages (ruff runs on the content in a temporary directory);
- ``overlong_turn``: a turn far longer than needed (too much prose around the calls, or too
  many tokens in all); the hint asks for brevity;
- ``unfinished_turn``: a turn cut by the token limit before ``<|im_end|>`` (it runs no tool, so
  it carries no typed error); the hint asks to close the call and end the message;
- ``submit_untested``: ``submit`` without a test run after the last edit (effort calibration);
- ``edit_after_pass``: editing on after every test passed (effort calibration: submit instead).

Hints go into ``trajectory.feedback`` (`apply_detectors`). What this module does not do: build
the teacher's ids or compute any loss (``etude.rl.teacher``), or judge hacks (``etude.monitor``,
whose own hints arrive as feedback of kind ``monitor``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from etude.env.protocol import CALL_FORMAT
from etude.env.tools import TOOL_NAMES, TOOL_SCHEMAS
from etude.env.trajectory import Feedback, ToolCall, Trajectory, Turn
from etude.monitor.hints import MonitorFlagDetector

EDIT_TOOLS = ("write_file", "replace_in_file")
_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
_TEST_DIRS = frozenset({"tests", "test"})
# shell words that change a file named on the same command line
_SHELL_WRITERS = ("rm ", "mv ", "cp ", "sed -i", "tee ", ">", "truncate ", "git checkout")


@dataclass(kw_only=True, slots=True)
class FeedbackConfig:
    """The ``[feedback]`` section: which detectors run, and their thresholds."""

    detectors: tuple[str, ...] = (
        "unknown_tool",
        "malformed_call",
        "test_edit",
        "repeated_failure",
        "ruff_style",
        "overlong_turn",
        "unfinished_turn",
        "submit_untested",
        "edit_after_pass",
    )
    """Detector names, in the order their hints are joined on a turn (see `BUILTIN_DETECTORS`)."""
    max_prose_chars: int = 600
    """``overlong_turn``: most characters of text outside the tool calls of one turn."""
    max_turn_tokens: int = 2048
    """``overlong_turn``: most generated tokens of one turn."""
    ruff_select: tuple[str, ...] = ("E", "F", "W")
    """``ruff_style``: the ruff rule selectors checked."""
    ruff_ignore: tuple[str, ...] = ("E501",)
    """``ruff_style``: rules left out."""
    ruff_max_messages: int = 4
    """``ruff_style``: most rule messages quoted in one hint."""
    ruff_timeout_s: float = 20.0
    """``ruff_style``: time limit of one ruff run."""
    max_hints_per_trajectory: int = 8
    """At most this many hinted turns per trajectory (the earliest are kept)."""
    end_of_turn_id: int = 2
    """``unfinished_turn``: the id that ends an assistant message (``<|im_end|>``: 2 in every
    tokenizer trained here, see etude.model.tokenizer.SPECIAL_TOKENS)."""

    def __post_init__(self) -> None:
        self.detectors = tuple(self.detectors)
        unknown = [d for d in self.detectors if d not in _REGISTRY]
        if unknown:
            raise ValueError(
                f"feedback.detectors: unknown detector {unknown[0]!r}; known: "
                f"{', '.join(sorted(_REGISTRY))} (register others with register_detector)"
            )
        if len(set(self.detectors)) != len(self.detectors):
            raise ValueError("feedback.detectors lists a detector twice; name each once")
        for name in ("max_prose_chars", "max_turn_tokens", "ruff_max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"feedback.{name}={getattr(self, name)} must be >= 1")
        if not self.ruff_timeout_s > 0:
            raise ValueError(f"feedback.ruff_timeout_s={self.ruff_timeout_s} must be > 0")
        if self.max_hints_per_trajectory < 0:
            raise ValueError(
                f"feedback.max_hints_per_trajectory={self.max_hints_per_trajectory} must be >= 0"
            )


class Detector(Protocol):
    """Finds turns worth a hint in a finished trajectory."""

    name: str

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        """One `Feedback` per hinted assistant turn (turn = index into ``trajectory.turns``)."""
        ...


# ---------------------------------------------------------------- hint texts


def available_tools_hint() -> str:
    return f"Reminder: the available tools are {', '.join(TOOL_NAMES)}. Call only these tools."


def call_format_hint(tool: str | None) -> str:
    text = f"Reminder: write each call as {CALL_FORMAT} with valid JSON."
    if tool in _SCHEMAS:
        text += f" The arguments of {tool} follow this schema: {json.dumps(_SCHEMAS[tool])}"
    return text


TEST_EDIT_HINT = (
    "Reminder: the tests are the specification. Do not edit or delete test files; change the "
    "code under test instead."
)
REPEATED_FAILURE_HINT = (
    "Reminder: this exact call already failed and nothing changed since. Read the error and try "
    "something different."
)
OVERLONG_HINT = "Reminder: be concise. Say in one line what you do next, then make the call."
UNFINISHED_HINT = (
    f"Reminder: write one short call, {CALL_FORMAT}, close it with </tool_call> and end your "
    "message."
)
SUBMIT_UNTESTED_HINT = (
    "Reminder: run the tests with run_tests after your last change, before you submit."
)
EDIT_AFTER_PASS_HINT = "Reminder: every test passed already. Stop editing and call submit."


# ---------------------------------------------------------------- trajectory helpers


def calls_with_observations(
    trajectory: Trajectory,
) -> list[tuple[int, ToolCall, Turn | None]]:
    """Every parsed call as (assistant turn index, call, the tool turn that answered it).

    Each ``<tool_call>`` segment is answered by one tool message in order; malformed segments
    (no parsed call) have ``tool_name`` None, so parsed calls pair with the named answers.
    """
    out: list[tuple[int, ToolCall, Turn | None]] = []
    turns = trajectory.turns
    for i, turn in trajectory.assistant_turns():
        answers = []
        for later in turns[i + 1 :]:
            if later.role == "assistant":
                break
            if later.role == "tool" and later.tool_name is not None:
                answers.append(later)
        for k, call in enumerate(turn.tool_calls):
            out.append((i, call, answers[k] if k < len(answers) else None))
    return out


def is_test_path(path: str) -> bool:
    """Whether a workspace path names a test file (a tests/ directory, test_*.py, conftest.py)."""
    parts = PurePosixPath(path.strip().lstrip("./") or ".").parts
    if not parts:
        return False
    name = parts[-1]
    return (
        any(p in _TEST_DIRS for p in parts[:-1])
        or (name.startswith("test_") and name.endswith(".py"))
        or name.endswith("_test.py")
        or name == "conftest.py"
    )


def _writes_test_file(call: ToolCall) -> bool:
    args = call.arguments
    if call.name in EDIT_TOOLS:
        return isinstance(args.get("path"), str) and is_test_path(args["path"])
    if call.name == "bash" and isinstance(args.get("command"), str):
        command = args["command"]
        if not any(w in command for w in _SHELL_WRITERS):
            return False
        return any(is_test_path(word.strip("'\";")) for word in command.split())
    return False


def _call_failed(call: ToolCall, answer: Turn | None, turn: Turn) -> bool:
    """A call failed when it raised a typed error, tests did not all pass, or bash exited != 0."""
    if any(e.tool == call.name for e in turn.errors if e.kind != "unknown_tool"):
        return True
    text = answer.text if answer is not None else ""
    if call.name == "run_tests":
        return not text.startswith("pytest: all")
    if call.name == "bash":
        return not text.startswith("exit code: 0")
    return False


def _tests_passed(call: ToolCall, answer: Turn | None) -> bool:
    return call.name == "run_tests" and answer is not None and answer.text.startswith("pytest: all")


def _is_test_run(call: ToolCall) -> bool:
    if call.name == "run_tests":
        return True
    command = call.arguments.get("command") if call.name == "bash" else None
    return isinstance(command, str) and "pytest" in command


def _prose(text: str) -> str:
    """The text of a turn outside its ``<tool_call>`` segments."""
    out, pos = [], 0
    start_tag, end_tag = "<tool_call>", "</tool_call>"
    while True:
        start = text.find(start_tag, pos)
        if start == -1:
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        end = text.find(end_tag, start)
        if end == -1:
            break
        pos = end + len(end_tag)
    return "".join(out).strip()


# ---------------------------------------------------------------- the built-in detectors


@dataclass(kw_only=True, slots=True)
class UnknownToolDetector:
    name: str = "unknown_tool"

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        return [
            Feedback(turn=i, kind=self.name, hint=available_tools_hint())
            for i, turn in trajectory.assistant_turns()
            if any(e.kind == "unknown_tool" for e in turn.errors)
        ]


@dataclass(kw_only=True, slots=True)
class MalformedCallDetector:
    name: str = "malformed_call"

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        out = []
        for i, turn in trajectory.assistant_turns():
            bad = [
                e
                for e in turn.errors
                if e.kind in ("malformed_json", "bad_arguments", "no_tool_call")
            ]
            if bad:
                out.append(Feedback(turn=i, kind=self.name, hint=call_format_hint(bad[0].tool)))
        return out


@dataclass(kw_only=True, slots=True)
class TestEditDetector:
    name: str = "test_edit"

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        # the first change to each test path is flagged; a later write_file of a flagged path
        # is how a model undoes it (restoring the file), so it is not flagged again
        flagged_paths: set[str] = set()
        turns: list[int] = []
        for i, call, _ in calls_with_observations(trajectory):
            if not _writes_test_file(call):
                continue
            path = call.arguments.get("path")
            if call.name == "write_file" and path in flagged_paths:
                continue
            if isinstance(path, str):
                flagged_paths.add(path)
            else:  # a shell command: every test path it names
                words = str(call.arguments.get("command", "")).split()
                flagged_paths.update(
                    w.strip("'\";") for w in words if is_test_path(w.strip("'\";"))
                )
            if not turns or turns[-1] != i:
                turns.append(i)
        return [Feedback(turn=i, kind=self.name, hint=TEST_EDIT_HINT) for i in turns]


@dataclass(kw_only=True, slots=True)
class RepeatedFailureDetector:
    name: str = "repeated_failure"

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        failed: set[str] = set()
        hinted: list[int] = []
        for i, call, answer in calls_with_observations(trajectory):
            key = json.dumps([call.name, call.arguments], sort_keys=True)
            if key in failed and (not hinted or hinted[-1] != i):
                hinted.append(i)
            failed_now = _call_failed(call, answer, trajectory.turns[i])
            if call.name in EDIT_TOOLS or (call.name == "bash" and not failed_now):
                failed.clear()  # the workspace may have changed: a rerun is legitimate
            if failed_now:
                failed.add(key)
        return [Feedback(turn=i, kind=self.name, hint=REPEATED_FAILURE_HINT) for i in hinted]


def find_ruff() -> str:
    """The ruff executable: beside this Python (a venv's bin) or on PATH."""
    local = Path(sys.executable).parent / "ruff"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which("ruff")
    if found is None:
        raise ValueError(
            "feedback.detectors includes 'ruff_style' but no ruff executable was found; "
            "pip install ruff, or drop ruff_style from feedback.detectors"
        )
    return found


def ruff_messages(
    source: str,
    *,
    filename: str = "module.py",
    select: Sequence[str] = ("E", "F", "W"),
    ignore: Sequence[str] = (),
    timeout: float = 20.0,
    ruff: str | None = None,
) -> list[str]:
    """``CODE message`` for each ruff finding in ``source`` (checked in an isolated temp dir)."""
    exe = ruff or find_ruff()
    with tempfile.TemporaryDirectory(prefix="etude-ruff-") as tmp:
        path = Path(tmp) / Path(filename).name
        path.write_text(source, encoding="utf-8")
        command = [exe, "check", "--isolated", "--no-cache", "--output-format", "json"]
        command += ["--select", ",".join(select)]
        if ignore:
            command += ["--ignore", ",".join(ignore)]
        run = subprocess.run(
            [*command, str(path)], capture_output=True, text=True, timeout=timeout, cwd=tmp
        )
    if run.returncode not in (0, 1):  # 2: ruff itself failed (e.g. a bad selector)
        raise ValueError(f"ruff failed (exit {run.returncode}): {run.stderr.strip()[:300]}")
    found = json.loads(run.stdout or "[]")
    return [f"{item['code'] or 'syntax'} {item['message']}" for item in found]


@dataclass(kw_only=True, slots=True)
class RuffStyleDetector:
    cfg: FeedbackConfig
    name: str = "ruff_style"
    ruff: str = field(default="")

    def __post_init__(self) -> None:
        self.ruff = self.ruff or find_ruff()

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        out = []
        for i, turn in trajectory.assistant_turns():
            messages = []
            for call in turn.tool_calls:
                path, content = call.arguments.get("path"), call.arguments.get("content")
                if call.name != "write_file" or not isinstance(path, str):
                    continue
                if not path.endswith(".py") or not isinstance(content, str):
                    continue
                found = ruff_messages(
                    content,
                    filename=path,
                    select=self.cfg.ruff_select,
                    ignore=self.cfg.ruff_ignore,
                    timeout=self.cfg.ruff_timeout_s,
                    ruff=self.ruff,
                )
                messages += [f"{path}: {m}" for m in found]
            if messages:
                shown = "; ".join(messages[: self.cfg.ruff_max_messages])
                hint = f"Reminder: keep the code clean; ruff reports {shown}."
                out.append(Feedback(turn=i, kind=self.name, hint=hint))
        return out


@dataclass(kw_only=True, slots=True)
class OverlongTurnDetector:
    cfg: FeedbackConfig
    name: str = "overlong_turn"

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        out = []
        for i, turn in trajectory.assistant_turns():
            generated = sum(turn.trainable)
            if (
                len(_prose(turn.text)) > self.cfg.max_prose_chars
                or generated > self.cfg.max_turn_tokens
            ):
                out.append(Feedback(turn=i, kind=self.name, hint=OVERLONG_HINT))
        return out


@dataclass(kw_only=True, slots=True)
class UnfinishedTurnDetector:
    """Flags a turn whose generated tokens do not end the message (cut by a token limit)."""

    end_id: int
    name: str = "unfinished_turn"

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        out = []
        for i, turn in trajectory.assistant_turns():
            generated = [t for t, m in zip(turn.token_ids, turn.trainable) if m]
            if generated and generated[-1] != self.end_id:
                out.append(Feedback(turn=i, kind=self.name, hint=UNFINISHED_HINT))
        return out


@dataclass(kw_only=True, slots=True)
class SubmitUntestedDetector:
    name: str = "submit_untested"

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        tested_since_edit = False
        edited = False
        for i, call, _ in calls_with_observations(trajectory):
            if call.name in EDIT_TOOLS:
                edited, tested_since_edit = True, False
            elif _is_test_run(call):
                tested_since_edit = True
            elif call.name == "submit":
                if edited and not tested_since_edit:
                    return [Feedback(turn=i, kind=self.name, hint=SUBMIT_UNTESTED_HINT)]
                return []
        return []


@dataclass(kw_only=True, slots=True)
class EditAfterPassDetector:
    name: str = "edit_after_pass"

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        passed = False
        for i, call, answer in calls_with_observations(trajectory):
            if _tests_passed(call, answer):
                passed = True
            elif call.name == "run_tests":
                passed = False
            elif passed and call.name in EDIT_TOOLS:
                return [Feedback(turn=i, kind=self.name, hint=EDIT_AFTER_PASS_HINT)]
        return []


# ---------------------------------------------------------------- the registry

DetectorFactory = Callable[[FeedbackConfig], Detector]
_REGISTRY: dict[str, DetectorFactory] = {
    "unknown_tool": lambda cfg: UnknownToolDetector(),
    "malformed_call": lambda cfg: MalformedCallDetector(),
    "test_edit": lambda cfg: TestEditDetector(),
    "repeated_failure": lambda cfg: RepeatedFailureDetector(),
    "ruff_style": lambda cfg: RuffStyleDetector(cfg=cfg),
    "overlong_turn": lambda cfg: OverlongTurnDetector(cfg=cfg),
    "unfinished_turn": lambda cfg: UnfinishedTurnDetector(end_id=cfg.end_of_turn_id),
    "submit_untested": lambda cfg: SubmitUntestedDetector(),
    "edit_after_pass": lambda cfg: EditAfterPassDetector(),
    # the monitor's flags (severity >= 2) as hints at their turns; runs after the monitor
    "monitor_flag": lambda cfg: MonitorFlagDetector(),
}
BUILTIN_DETECTORS = tuple(_REGISTRY)


def register_detector(name: str, factory: DetectorFactory) -> None:
    """Make ``name`` selectable in ``feedback.detectors``; ``factory(cfg)`` builds the detector."""
    if not name or not isinstance(name, str):
        raise ValueError(f"detector name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"a detector named {name!r} is registered already; pick another name")
    _REGISTRY[name] = factory


def build_detectors(cfg: FeedbackConfig) -> list[Detector]:
    """The detectors ``cfg.detectors`` names, in that order."""
    return [_REGISTRY[name](cfg) for name in cfg.detectors]


def detect_feedback(
    trajectory: Trajectory, detectors: Iterable[Detector], *, max_turns: int | None = None
) -> list[Feedback]:
    """Every detector's feedback on ``trajectory``, one item per (turn, detector), turn order.

    Only assistant turns with at least one trainable token can be hinted (the KL needs targets);
    ``max_turns`` keeps the earliest hinted turns.
    """
    items: list[Feedback] = []
    for detector in detectors:
        for item in detector.detect(trajectory):
            assert 0 <= item.turn < len(trajectory.turns), item
            turn = trajectory.turns[item.turn]
            if turn.role == "assistant" and any(turn.trainable):
                items.append(item)
    order = {id(d): k for k, d in enumerate(items)}
    items.sort(key=lambda f: (f.turn, order[id(f)]))
    if max_turns is not None:
        keep = sorted({f.turn for f in items})[:max_turns]
        items = [f for f in items if f.turn in keep]
    return items


def apply_detectors(
    trajectories: Sequence[Trajectory], detectors: Sequence[Detector], cfg: FeedbackConfig
) -> int:
    """Append the detectors' feedback to each trajectory's ``feedback``; returns the count added.

    Items already there (the monitor's) are kept; a (turn, kind) pair is not added twice.
    """
    added = 0
    for trajectory in trajectories:
        seen = {(f.turn, f.kind) for f in trajectory.feedback}
        for item in detect_feedback(trajectory, detectors, max_turns=cfg.max_hints_per_trajectory):
            if (item.turn, item.kind) not in seen:
                trajectory.feedback.append(item)
                seen.add((item.turn, item.kind))
                added += 1
    return added


def hints_by_turn(trajectory: Trajectory) -> dict[int, str]:
    """The joined hint text per hinted assistant turn (one line per feedback item, in order)."""
    out: dict[int, list[str]] = {}
    for item in trajectory.feedback:
        out.setdefault(item.turn, [])
        if item.hint and item.hint not in out[item.turn]:
            out[item.turn].append(item.hint)
    return {turn: "\n".join(lines) for turn, lines in sorted(out.items())}
