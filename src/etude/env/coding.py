"""One coding-agent episode: a task's workspace, the tools, the token bookkeeping, the reward.

``CodingEnv(task, cfg, tokenizer=..., base_dir=...)`` turns a task record into an episode:

- ``reset()`` copies the task's broken workspace into a fresh episode directory (a temp dir:
  ``EPISODE/workspace``, plus ``EPISODE/original`` when the workspace is an archive), renders the
  system prompt (the instructions and the tool schemas, ``chat.tools_system_prompt``) and the
  user prompt (the problem statement), and opens the first assistant turn
  (``<|im_start|>assistant\\n``). ``env.prompt_ids`` is then exactly what the engine continues.
- ``step(text)`` (a scripted agent) or ``step(token_ids=..., logprobs=...)`` (the engine's output,
  ending with ``<|im_end|>``) appends the assistant turn, runs its tool calls
  (``etude.env.protocol``), appends one ``tool`` message per call, and, unless the episode is
  over, opens the next assistant turn. Text is encoded as the chat template encodes an assistant
  message (tool-call markers as their special ids, then ``<|im_end|>``), so a text step and an
  ids step with those ids leave identical ids and masks. Everything is appended; no id is ever
  re-rendered.
- The episode ends on ``submit``; after ``max_turns`` assistant turns; when the conversation
  reaches ``max_tokens`` (an assistant turn that ends at or past the budget, or that was cut
  before ``<|im_end|>``, runs no tools); or after ``wall_clock_s`` seconds from ``reset`` (no
  further tool call starts, and each call's timeout is capped by the time left). The last
  turn's observations may take the conversation past ``max_tokens``; they are never trained on.
- ``finish()`` grades the final workspace (``etude.env.reward`` through ``etude.sandbox.grader``:
  the agent's changes to package source on a pristine copy, a fresh sandbox) whatever ended the
  episode, records the grade (status, reason) in ``info['grade']`` (reward None when the grader
  could not grade: an ``infra`` outcome is not a score), and returns the `Trajectory`: every message as a `Turn` with its
  ids, trainable mask (1 on the assistant's generated ids and ``<|im_end|>`` only), behavior
  logprobs (0.0 where not given or not trainable), parsed calls and typed errors.
- ``close()`` removes the episode directory (the env is a context manager).

The conversation is in the policy's chat format (``chat_format``: etude's ChatML by default, an
imported family's own template and tool-call syntax otherwise; ``etude.env.episode_chat``): the
``<|im_end|>``, ChatML headers and ``<tool_call>`` above are the ``etude`` format's.

The episode directory's naming and cleanup, hidden content, masks and the repository facts are
``etude.env.episode_workspace``'s.

What this module does not do: generate (``etude.engine``), batch episodes (``etude.env.pool``),
detect hacks (``etude.monitor``) or decide which turns get hints (``etude.rl.feedback``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from etude.env.episode_chat import EpisodeChat
from etude.env.episode_workspace import (
    EPISODE_PREFIX,
    remove_stale_dirs,
    replace_masks,
    repo_facts,
    strip_hidden,
)
from etude.env.protocol import TOOL_DECLARATIONS, append_results, run_turn, turn_record
from etude.env.reward import (
    RewardResult,
    compute_reward,
    copy_workspace,
    remove_tree,
    task_grading,
)
from etude.env.tools import Toolbox, ToolConfig, tool_schemas
from etude.env.trajectory import ToolCall, ToolError, Trajectory
from etude.model.chat import Span
from etude.sandbox import SandboxConfig, make_sandbox
from etude.sandbox.masking import find_package_copies, foreign_package_dirs, visible_roots
from etude.tasks.record import TaskRecord, is_archive, resolve_workspace

DEFAULT_INSTRUCTIONS = (
    "You are a coding agent working in a Python repository; its root is your working directory. "
    "You act only through tool calls. Read the code and the tests, make the change the task asks "
    "for, run the tests, and call submit when you are done. The tests are the specification: do "
    "not edit them, change the code."
)
FINISH_REASONS = ("submit", "max_turns", "max_tokens", "timeout")


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    """Limits and setup of coding episodes (TOML section ``[env]``)."""

    max_turns: int = 30
    """Assistant turns per episode."""
    max_tokens: int = 16_384
    """Tokens per episode, prompts included; the engine should generate at most ``tokens_left``."""
    wall_clock_s: float = 1800.0
    """Seconds from reset after which no tool call starts and the episode ends."""
    reward_timeout_s: float = 300.0
    """Wall-clock limit of the reward's test run."""
    instructions: str = DEFAULT_INSTRUCTIONS
    """Text that opens the system prompt, before the tool declarations."""
    tool_declarations: str = "json"
    """How the system prompt declares the tools: ``json`` (OpenAI schemas) or ``compact`` (one
    signature line per tool, ``etude.env.protocol.compact_tool_lines``: ~6x fewer tokens)."""
    work_dir: str = ""
    """Directory for episode and scoring directories (empty: the system temp directory)."""
    tools: ToolConfig = field(default_factory=ToolConfig)
    """Output caps and timeouts of the tools."""
    mask_package_copies: bool = True
    """Search what the sandbox shows for copies of the task's package and mask them: the whole
    view when the record does not list them (``etude.masked_paths``, recorded at build time),
    else only ``sandbox.extra_ro_paths``; a search runs once per process."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Backend and limits of every command; the task's hidden paths are added per episode."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns={self.max_turns} must be >= 1")
        if self.max_tokens < 64:
            raise ValueError(
                f"env.max_tokens={self.max_tokens} leaves no room for a prompt; use at least 64 "
                "(thousands in practice)"
            )
        if not self.wall_clock_s > 0:
            raise ValueError(f"env.wall_clock_s={self.wall_clock_s} must be > 0 seconds")
        if self.tool_declarations not in TOOL_DECLARATIONS:
            raise ValueError(
                f"env.tool_declarations={self.tool_declarations!r}: use json or compact"
            )
        if not self.reward_timeout_s > 0:
            raise ValueError(f"env.reward_timeout_s={self.reward_timeout_s} must be > 0 seconds")
        if self.work_dir and not os.path.isdir(self.work_dir):
            raise ValueError(
                f"env.work_dir={self.work_dir!r} is not a directory; create it or leave it empty "
                "for the system temp directory"
            )


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What one assistant turn led to."""

    observations: list[str]
    """Texts of the messages appended after the turn (tool results, or the protocol reminder)."""
    done: bool
    finish_reason: str
    """One of `FINISH_REASONS` when done, else empty."""
    tool_calls: list[ToolCall]
    errors: list[ToolError]
    num_tokens: int
    """Length of the conversation now."""

    @property
    def observation(self) -> str:
        return "\n\n".join(self.observations)


class Agent(Protocol):
    """A scripted policy: the next assistant text from the last step's result."""

    def act(self, last: StepResult | None) -> str:
        """The next assistant message; ``last`` is None for the first turn."""
        ...

    def episode_info(self) -> dict[str, Any]:
        """Metadata merged into the trajectory's ``info`` when the episode is scored."""
        ...


_cleaned: set[str] = set()


def _dir_prefix() -> str:
    return f"{EPISODE_PREFIX}{os.getpid()}-"


def _holding_busy(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` holding the env's ``busy`` lock (the pool closes an abandoned env only
    once its stuck call has released it)."""

    @functools.wraps(method)
    def wrapper(self: CodingEnv, *args: Any, **kwargs: Any) -> Any:
        with self.busy:
            return method(self, *args, **kwargs)

    return wrapper


class CodingEnv:
    """One episode of a task at a time (see the module docstring).

    ``base_dir`` is the directory the record's relative ``etude.workspace`` is resolved against
    (the directory of its tasks.jsonl). ``clock`` is the time source of the wall-clock limit.
    ``chat_format`` is the policy's chat format (``etude.model.chat_family``: ``etude`` for
    etude's own models, the family's for an imported checkpoint) and ``tokenizer`` the one it
    needs (``load_chat_tokenizer``); episodes are rendered and parsed in it
    (``etude.env.episode_chat``).
    """

    def __init__(
        self,
        task: TaskRecord,
        cfg: EnvConfig | None = None,
        *,
        tokenizer: Any,
        base_dir: str | os.PathLike[str] = ".",
        clock: Callable[[], float] = time.monotonic,
        chat_format: str = "etude",
    ) -> None:
        if task.etude is None:
            raise ValueError(
                f"task {task.instance_id!r} has no etude.workspace; CodingEnv needs a record "
                "whose workspace is a directory or archive on disk"
            )
        if not task.FAIL_TO_PASS and not task.PASS_TO_PASS:
            raise ValueError(f"task {task.instance_id!r} has no tests to reward with")
        self.task = task
        self.cfg = cfg if cfg is not None else EnvConfig()
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.base_dir = Path(base_dir)
        self._clock = clock
        # checks the format and the declarations before any episode (a ValueError names them)
        self._header_len = self._new_chat().max_prompt_len
        self._episode_dir: Path | None = None
        self._original: Path | None = None
        self._masked: tuple[str, ...] = ()
        self._toolbox: Toolbox | None = None
        self._repo: dict[str, Any] = {}
        self._chat: EpisodeChat | None = None
        self._trajectory: Trajectory | None = None
        self._header_start = 0
        self._started = 0.0
        self._num_assistant_turns = 0
        self._finish_reason = ""
        self._scored = False
        self.busy = threading.RLock()
        """Held while reset, step or finish runs."""

    # ------------------------------------------------------------ state

    @property
    def chat(self) -> EpisodeChat:
        """The episode's conversation in the policy's chat format."""
        if self._chat is None:
            raise ValueError("no episode: call reset() first")
        return self._chat

    @property
    def conversation(self) -> Any:
        """The format's own builder (``etude.model.chat.Conversation`` for ``etude``)."""
        return self.chat.conversation

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids at which generation of an assistant turn stops (the format's end of turn)."""
        return (self._new_chat().end_id,) if self._chat is None else (self._chat.end_id,)

    @property
    def trajectory(self) -> Trajectory:
        """The episode so far (scored by `finish`)."""
        if self._trajectory is None:
            raise ValueError("no episode: call reset() first")
        return self._trajectory

    @property
    def prompt_ids(self) -> list[int]:
        """The ids to continue: the whole conversation, ending with an open assistant header."""
        return self.chat.ids

    @property
    def tokens_left(self) -> int:
        """How many ids the next assistant turn may have before the episode hits max_tokens."""
        return max(self.cfg.max_tokens - len(self.chat), 0)

    @property
    def done(self) -> bool:
        return bool(self._finish_reason)

    @property
    def finish_reason(self) -> str:
        return self._finish_reason

    @property
    def workspace(self) -> Path:
        """The episode's workspace directory (what the agent changes)."""
        if self._episode_dir is None:
            raise ValueError("no episode: call reset() first")
        return self._episode_dir / "workspace"

    @property
    def episode_dir(self) -> Path | None:
        return self._episode_dir

    # ------------------------------------------------------------ lifecycle

    @_holding_busy
    def reset(self) -> Any:
        """Start a new episode (removing the previous one's directory); returns the conversation."""
        self.close()
        etude = self.task.etude
        assert etude is not None
        work_dir = self.cfg.work_dir or tempfile.gettempdir()
        if work_dir not in _cleaned:  # once per process and directory
            _cleaned.add(work_dir)
            remove_stale_dirs(work_dir)
        episode_dir = Path(tempfile.mkdtemp(prefix=_dir_prefix(), dir=work_dir))
        self._episode_dir = episode_dir
        try:
            source = Path(etude.workspace)
            if is_archive(source):
                self._original = resolve_workspace(
                    self.task, self.base_dir, dest=episode_dir / "original"
                )
            else:
                self._original = resolve_workspace(self.task, self.base_dir)
            copy_workspace(self._original, episode_dir / "workspace")
            self._repo = repo_facts(self.task, episode_dir / "workspace")
            hidden = tuple(dict.fromkeys([*self.cfg.sandbox.hidden_paths, *etude.hidden_paths]))
            # hidden content never enters the episode's tree (the sandbox masks and the tools'
            # checks go by name, and a rename would carry it out from under them); the grader
            # takes it from the pristine tree
            strip_hidden(episode_dir / "workspace", hidden)
            spec = task_grading(self.task, self._original)
            sandbox = make_sandbox(None, dataclasses.replace(self.cfg.sandbox, hidden_paths=hidden))
            self._masked = self._package_copies(sandbox, spec.allowed)
            if self._masked:
                sandbox = make_sandbox(sandbox.name, replace_masks(sandbox.config, self._masked))  # type: ignore[arg-type]
            self._toolbox = Toolbox(
                episode_dir / "workspace",
                sandbox=sandbox,
                cfg=self.cfg.tools,
                test_ids=spec.test_ids,
                hidden_paths=hidden,
                pristine=self._original,
                allowed=spec.allowed,
                test_env=spec.test_env,
                pytest_args=spec.pytest_args,
                work_dir=self.cfg.work_dir or None,
            )
            self._start_conversation()
        except BaseException:
            self.close()
            raise
        return self.conversation

    def _package_copies(self, sandbox: Any, allowed: Sequence[str]) -> tuple[str, ...]:
        """Host paths holding a copy of the task's package that the sandbox would show: the
        record's ``etude.masked_paths`` (found when the task was built) plus a search of this
        env's ``extra_ro_paths``, which the build did not see; a record without the list (built
        before it was recorded) gets a search of the whole view (``etude.sandbox.masking``,
        once per process). Searches run only with ``env.mask_package_copies``."""
        assert self.task.etude is not None and self._original is not None
        recorded = self.task.etude.extra.get("masked_paths")
        found = [str(p) for p in recorded] if recorded is not None else []
        if self.cfg.mask_package_copies and sandbox.name == "bwrap":
            extra = self.cfg.sandbox.extra_ro_paths
            roots = list(extra) if recorded is not None else visible_roots(extra)
            if roots:
                skip = foreign_package_dirs(extra)
                found += find_package_copies(self._original, allowed, roots, skip)
        return tuple(dict.fromkeys(found))

    def _new_chat(self) -> EpisodeChat:
        return EpisodeChat(
            self.chat_format,
            self.tokenizer,
            instructions=self.cfg.instructions,
            tools=tool_schemas(),
            declarations=self.cfg.tool_declarations,
        )

    def _start_conversation(self) -> None:
        chat = self._new_chat()
        trajectory = Trajectory(task_id=self.task.instance_id, info={"repo": self._repo})
        trajectory.info["chat_format"] = self.chat_format
        system = turn_record(chat, chat.system_span, "system", chat.system_text)
        trajectory.turns.append(system)
        user = self.task.problem_statement
        trajectory.turns.append(turn_record(chat, chat.add_user(user), "user", user))
        prompt_len = len(chat) + self._header_len
        if prompt_len >= self.cfg.max_tokens:
            raise ValueError(
                f"the prompt of task {self.task.instance_id!r} is {prompt_len} tokens, not below "
                f"env.max_tokens={self.cfg.max_tokens}; raise env.max_tokens"
            )
        self._chat = chat
        self._trajectory = trajectory
        self._header_start = chat.add_generation_prompt().start
        self._num_assistant_turns = 0
        self._finish_reason = ""
        self._scored = False
        self._started = self._clock()

    @_holding_busy
    def step(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        logprobs: Sequence[float] | None = None,
        policy_version: int | None = None,
    ) -> StepResult:
        """Append one assistant turn, run its tool calls, append their results.

        Give either ``text`` (encoded like an assistant message, the format's end id added) or the
        generated ``token_ids`` (ending with the end id unless the generation was cut) with
        their behavior ``logprobs`` (one per id; default 0.0), and the ``policy_version`` of
        the weights that generated them (recorded on the turn).
        """
        chat = self.chat
        if self.done:
            raise ValueError(
                f"the episode is over ({self._finish_reason}); call finish() or reset()"
            )
        if (text is None) == (token_ids is None):
            raise ValueError("pass exactly one of text or token_ids to step()")
        if text is not None:
            if logprobs is not None:
                raise ValueError("logprobs go with token_ids, not with text")
            ids = chat.encode_assistant(text)
            behavior = [0.0] * len(ids)
        else:
            ids = [int(i) for i in token_ids]
            behavior = [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
            if len(behavior) != len(ids):
                raise ValueError(
                    f"logprobs has {len(behavior)} entries for {len(ids)} token ids; give one per id"
                )
        gen_span = chat.add_generated(ids)
        start = self._header_start
        # the turn spans header, generated ids and (when closed) the separator
        turn = turn_record(chat, Span(start, len(chat)), "assistant", chat.generated_text())
        offset = gen_span.start - start
        turn.logprobs[offset : offset + len(behavior)] = behavior
        turn.policy_version = policy_version
        self.trajectory.turns.append(turn)
        self._num_assistant_turns += 1

        observations: list[str] = []
        if chat.turn_open or len(chat) >= self.cfg.max_tokens:
            reason = "max_tokens"
        else:
            result = run_turn(
                turn.text,
                self._toolbox_or_fail(),
                deadline=self._started + self.cfg.wall_clock_s,
                clock=self._clock,
                parse=chat.parse_calls,
                reminder=chat.reminder,
            )
            turn.tool_calls = list(result.calls)
            turn.errors = list(result.errors)
            for record in append_results(chat, result):
                self.trajectory.turns.append(record)
                observations.append(record.text)
            if result.submitted:
                reason = "submit"
            elif result.timed_out or self._clock() >= self._started + self.cfg.wall_clock_s:
                reason = "timeout"
            elif len(chat) + self._header_len >= self.cfg.max_tokens:
                reason = "max_tokens"
            elif self._num_assistant_turns >= self.cfg.max_turns:
                reason = "max_turns"
            else:
                reason = ""
        self._finish_reason = reason
        if not reason:
            self._header_start = chat.add_generation_prompt().start
        return StepResult(
            observations=observations,
            done=bool(reason),
            finish_reason=reason,
            tool_calls=list(turn.tool_calls),
            errors=list(turn.errors),
            num_tokens=len(chat),
        )

    def _toolbox_or_fail(self) -> Toolbox:
        if self._toolbox is None:
            raise ValueError("the episode directory was closed; call reset() for a new episode")
        return self._toolbox

    @_holding_busy
    def finish(self) -> Trajectory:
        """Score the final workspace and return the finished trajectory (idempotent)."""
        trajectory = self.trajectory
        if not self.done:
            raise ValueError(
                "the episode is not over: step() until StepResult.done before finish()"
            )
        if self._scored:
            return trajectory
        if self._episode_dir is None or self._original is None:
            raise ValueError("the episode directory was closed before finish(); nothing to score")
        try:
            result = compute_reward(
                self.task,
                self.workspace,
                original=self._original,
                sandbox=replace_masks(self.cfg.sandbox, self._masked),
                timeout=self.cfg.reward_timeout_s,
                work_dir=self.cfg.work_dir or None,
            )
        except OSError as e:  # the host failed (disk full, a copy refused): not a score
            reason = f"grading failed on the host: {e}"
            result = RewardResult(reward=None, status="infra", reason=reason)
            result.grade = {"status": "infra", "reason": reason}
        errors = Counter(e.kind for _, t in trajectory.assistant_turns() for e in t.errors)
        trajectory.reward = result.reward  # None when the grader could not grade (infra)
        trajectory.tests = dict(result.tests)
        trajectory.finish_reason = self._finish_reason
        trajectory.info.update(
            num_assistant_turns=self._num_assistant_turns,
            num_tool_calls=sum(len(t.tool_calls) for _, t in trajectory.assistant_turns()),
            num_tokens=len(self.chat),
            error_counts=dict(sorted(errors.items())),
            episode_seconds=round(self._clock() - self._started, 3),
            reward_seconds=round(result.duration, 3),
            collection_error=result.collection_error,
            reward_timed_out=result.timed_out,
            grade=dict(result.grade),
            masked_paths=list(self._masked),
        )
        if result.status == "infra":  # masked by the trainer (``etude.env.ray_pool`` agrees)
            trajectory.info["infra"] = result.reason or "the grader could not grade"
        self._scored = True
        return trajectory

    def close(self) -> None:
        """Remove the episode directory (the trajectory stays readable) and stop the episode's
        provenance tracer, if its sandbox ran one."""
        episode_dir, self._episode_dir = self._episode_dir, None
        if self._toolbox is not None:
            close_sandbox = getattr(self._toolbox.sandbox, "close", None)
            if close_sandbox is not None:
                close_sandbox()
        self._toolbox = None
        self._original = None
        if episode_dir is not None:
            remove_tree(episode_dir)

    def __enter__(self) -> CodingEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_episode(env: CodingEnv, agent: Agent) -> Trajectory:
    """Reset ``env``, let ``agent`` act until the episode ends, and return the scored trajectory.

    The episode directory is left to the caller (``env.close()``, or the pool).
    """
    env.reset()
    last: StepResult | None = None
    while not env.done:
        last = env.step(agent.act(last))
    trajectory = env.finish()
    trajectory.info.update(agent.episode_info())
    return trajectory
