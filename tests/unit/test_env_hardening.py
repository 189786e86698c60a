"""Attacks on the episode machinery around the grader: a FIFO in a tool write's place, a rename
that carries hidden files out from under their mask, a tool call that overruns the pool's wait,
leftovers of killed runs, and episode directory names that would tell the task."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

from etude.engine.sampling import Generation
from etude.env.coding import CodingEnv, EnvConfig
from etude.env.episode_workspace import remove_stale_dirs
from etude.env.pool import EnvPool
from etude.env.tools import Toolbox
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START, Tokenizer, default_corpus
from etude.sandbox import SandboxConfig, grade, make_sandbox
from etude.sandbox.bwrap import bwrap_unavailable_reason
from etude.sandbox.masking import find_package_copies
from etude.tasks.record import load_tasks

BASE = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "handwritten"
SLUGIFY = {t.instance_id: t for t in load_tasks(BASE / "tasks.jsonl")}["textkit__case.slugify"]
needs_bwrap = pytest.mark.skipif(
    bwrap_unavailable_reason() is not None, reason=f"bwrap: {bwrap_unavailable_reason()}"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


def call(name: str, **arguments) -> str:
    import json

    return f"{TOOL_CALL_START}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_END}"


def finishes_within(seconds: float, function, *args):
    """``function(*args)``'s result, or fail when it has not returned within ``seconds``."""
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(result=function(*args)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still blocked after {seconds} s"
    return box["result"]


def test_write_onto_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    tools = Toolbox(ws, sandbox=make_sandbox())
    made = tools.call("bash", {"command": "mkfifo pipe && mkfifo pkg_mod.py"})
    assert made.observation.startswith("exit code: 0")
    for name in ("write_file", "replace_in_file", "read_file"):
        arguments = {"path": "pipe"}
        if name == "write_file":
            arguments["content"] = "x"
        elif name == "replace_in_file":
            arguments.update(old="a", new="b")
        outcome = finishes_within(10, tools.call, name, arguments)
        assert outcome.error is not None and outcome.error.kind == "tool_failed"
        assert "not a regular file" in outcome.observation
    assert (ws / "pipe").is_fifo()


@needs_bwrap
def test_a_rename_does_not_carry_hidden_files_out_of_their_mask(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "tests" / "hidden").mkdir(parents=True)
    (ws / "tests" / "hidden" / "answers.txt").write_text("the answer is 42\n")
    (ws / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    hidden = ("tests/hidden",)
    tools = Toolbox(
        ws, sandbox=make_sandbox("bwrap", SandboxConfig(hidden_paths=hidden)), hidden_paths=hidden
    )
    assert "42" not in tools.call("bash", {"command": "cat tests/hidden/answers.txt"}).observation
    moved = tools.call("bash", {"command": "mv tests tests_moved && echo moved"})
    assert "moved" in moved.observation
    shown = tools.call("bash", {"command": "cat tests_moved/hidden/answers.txt; ls -R"})
    assert "42" not in shown.observation
    read = tools.call("read_file", {"path": "tests_moved/hidden/answers.txt"})
    assert read.error is not None and read.error.kind == "path_escape"
    found = tools.call("search", {"pattern": "answer is"})
    assert "42" not in found.observation


def test_an_episode_never_holds_hidden_content(tok: Tokenizer, tmp_path: Path) -> None:
    """The hidden paths of a task are left out of the episode's tree: no rename can reach them."""
    from dataclasses import replace

    task = replace(SLUGIFY, etude=replace(SLUGIFY.etude, hidden_paths=["tests/test_case.py"]))
    with CodingEnv(task, EnvConfig(work_dir=str(tmp_path)), tokenizer=tok, base_dir=BASE) as env:
        env.reset()
        assert not (env.workspace / "tests" / "test_case.py").exists()
        result = env.step(call("bash", command="mv tests t2 && cat t2/test_case.py | head -3"))
        assert "def test_" not in result.observation


def test_a_tool_call_that_overruns_the_pool_is_infra_not_zero(tok: Tokenizer, tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    cfg = EnvConfig(work_dir=str(work))
    with EnvPool(cfg, tokenizer=tok, base_dir=BASE, max_workers=2, step_timeout_s=1.0) as pool:
        slow, quick = pool.make_env(SLUGIFY), pool.make_env(SLUGIFY)
        pool.reset_many([slow, quick])
        start = time.monotonic()
        results = pool.step_many([(slow, call("bash", command="sleep 4")), (quick, call("submit"))])
        assert time.monotonic() - start < 3.5  # the pool did not wait for the stuck call
        assert results[0].done and results[0].finish_reason == "timeout"
        assert results[1].finish_reason == "submit"
        assert pool.is_abandoned(slow) and not pool.is_abandoned(quick)
        stuck, scored = pool.finish_many([slow, quick])
        assert stuck.reward is None and stuck.info["grade"]["status"] == "infra"
        assert "did not finish within 1 s" in stuck.info["grade"]["reason"]
        assert scored.reward == 0.0 and scored.info["grade"]["status"] == "failed"
        deadline = time.monotonic() + 30
        while slow.episode_dir is not None and time.monotonic() < deadline:
            time.sleep(0.2)  # the reaper closes the abandoned env once its call returns
        assert slow.episode_dir is None


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_an_abandoned_episode_is_forgotten_when_released(tok: Tokenizer, tmp_path: Path):
    """Released, an abandoned env leaves the pool's books: the pool keeps no reference to it
    (so no later env, whatever address Python gives it, can be taken for abandoned and scored
    infra for nothing), and a new env is not abandoned.

    Checked by a weak reference that dies once the env is released, not by waiting for Python
    to reuse its address (whether the allocator does is not up to the pool)."""
    with EnvPool(EnvConfig(work_dir=str(tmp_path)), tokenizer=tok, base_dir=BASE) as pool:
        lost = pool.make_env(SLUGIFY)
        pool.abandon(lost, "the inference server did not answer")
        assert pool.is_abandoned(lost)
        ref = weakref.ref(lost)
        pool.release([lost])
        assert not pool.is_abandoned(lost)
        del lost
        gc.collect()
        assert ref() is None, "the pool still holds the released env"
        fresh = pool.make_env(SLUGIFY)
        assert not pool.is_abandoned(fresh)


class StuckOrSubmit:
    """An `InferenceBackend` whose model runs a 4 s command in sample 0 and submits in the
    others; records the requests of each episode (session id)."""

    policy_version = 0
    max_seq_len = None

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.sessions: list[str] = []

    def generate(self, requests):
        out = []
        for request in requests:
            self.sessions.append(request.session_id)
            stuck = request.session_id.endswith("sample0")
            text = call("bash", command="sleep 4") if stuck else call("submit")
            ids = self.tok.encode(text) + [self.tok.im_end_id]
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
        return out


def test_a_rollout_takes_no_turn_of_an_episode_whose_call_overran(tok: Tokenizer, tmp_path: Path):
    """The rollout loop leaves an abandoned episode alone (it used to generate and step it again
    every round, each turn waiting out the stuck call) and it ends as infra, never 0."""
    from etude.rl.rollout import RolloutConfig, collect_rollouts

    work = tmp_path / "work"
    work.mkdir()
    cfg = EnvConfig(work_dir=str(work), max_turns=4)
    backend = StuckOrSubmit(tok)
    rollout_cfg = RolloutConfig(tasks_per_step=1, group_size=2, max_new_tokens=64)
    with EnvPool(cfg, tokenizer=tok, base_dir=BASE, max_workers=2, step_timeout_s=1.0) as pool:
        trajectories, _ = collect_rollouts(backend, pool, [SLUGIFY], rollout_cfg, seed=0, step=0)
    stuck, submitted = trajectories
    assert backend.sessions.count("step0-group0-sample0") == 1
    assert stuck.reward is None and stuck.info["grade"]["status"] == "infra"
    assert "did not finish within 1 s" in stuck.info["infra"]
    assert submitted.reward == 0.0 and submitted.info["grade"]["status"] == "failed"


def test_stale_directories_of_killed_runs_are_removed(tok: Tokenizer, tmp_path: Path) -> None:
    dead = _dead_pid()
    stale = [tmp_path / f"etude-ep-{dead}-abc", tmp_path / f"etude-grade-{dead}-def"]
    live = [tmp_path / f"etude-ep-{os.getppid()}-ghi", tmp_path / "etude-episode-recent"]
    old = tmp_path / "etude-reward-old"
    for path in [*stale, *live, old]:
        (path / "ws").mkdir(parents=True)
        (path / "ws" / "f.py").write_text("x = 1\n")
    os.chmod(stale[0] / "ws", 0)  # a run may leave unreadable directories behind
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (day_ago, day_ago))
    with CodingEnv(SLUGIFY, EnvConfig(work_dir=str(tmp_path)), tokenizer=tok, base_dir=BASE) as env:
        env.reset()
        for path in [*stale, old]:
            assert not path.exists()
        for path in live:
            assert path.exists()
        # the episode's own directory names no task, symbol or file of it
        name = env.episode_dir.name
        assert name.startswith(f"etude-ep-{os.getpid()}-")
        for word in ("slugify", "case", "textkit"):
            assert word not in name
    assert remove_stale_dirs(tmp_path) == []


@needs_bwrap
def test_copies_of_the_package_in_the_sandbox_view_are_found_and_masked(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))
    import grading_corpus as corpus

    pristine, record = corpus.make_task(tmp_path / "task")
    vendor = tmp_path / "vendor" / "third_party"
    corpus.write_files(vendor, {"calc/__init__.py": "", "calc/ops.py": corpus.OPS_GOLD})
    view = (str(tmp_path / "vendor"),)
    found = find_package_copies(pristine, ["calc/"], roots=view)
    assert found == [str(vendor / "calc")]
    # an agent's solution that imports the vendored copy: it passes only while the copy shows
    agent = tmp_path / "agent"
    shutil.copytree(pristine, agent)
    (agent / "calc" / "ops.py").write_text(
        corpus.OPS_BROKEN + f"\nimport sys\nsys.path.insert(0, {str(vendor)!r})\n"
        "from importlib import util as _u\n"
        f"_s = _u.spec_from_file_location('v', {str(vendor / 'calc' / 'ops.py')!r})\n"
        "_m = _u.module_from_spec(_s)\n_s.loader.exec_module(_m)\nmul = _m.mul\n"
    )
    ids = [*corpus.FAIL_TO_PASS, *corpus.PASS_TO_PASS]
    shown = SandboxConfig(backend="bwrap", extra_ro_paths=view)
    assert grade(pristine, agent, ["calc/"], ids, sandbox=shown).status == "passed"
    masked = SandboxConfig(backend="bwrap", extra_ro_paths=view, masked_paths=tuple(found))
    outcome = grade(pristine, agent, ["calc/"], ids, sandbox=masked)
    assert outcome.status in ("failed", "error")
    box = make_sandbox("bwrap", masked)
    seen = box.run(f"cat {vendor}/calc/ops.py; ls {vendor}/calc", str(agent))
    assert "def mul" not in seen.stdout and seen.stdout.strip() == ""


@needs_bwrap
def test_recorded_package_copies_are_masked_without_a_search(tok: Tokenizer, tmp_path: Path):
    """A record's ``etude.masked_paths`` (found when the task was built) are masked in the
    episode's sandbox, and the env does not walk the sandbox's view again (seconds per process);
    it searches only its own ``extra_ro_paths``, which the build did not see."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))
    import grading_corpus as corpus

    from etude.sandbox import masking
    from etude.tasks.record import TaskRecord

    _, record = corpus.make_task(tmp_path / "task")
    vendor = tmp_path / "vendor" / "third_party"
    corpus.write_files(vendor, {"calc/__init__.py": "", "calc/ops.py": corpus.OPS_GOLD})
    read = f"cat {vendor}/calc/ops.py; ls {vendor}/calc"
    shown = SandboxConfig(backend="bwrap", extra_ro_paths=(str(tmp_path / "vendor"),))
    (tmp_path / "work").mkdir()
    searches = masking._search.cache_info()
    for recorded, search in (([str(vendor / "calc")], False), ([], True)):
        record["etude"]["masked_paths"] = recorded
        task = TaskRecord.from_dict(record)
        cfg = EnvConfig(work_dir=str(tmp_path / "work"), mask_package_copies=search, sandbox=shown)
        with CodingEnv(task, cfg, tokenizer=tok, base_dir=tmp_path / "task") as env:
            env.reset()
            seen = env.step(call("bash", command=read))
            assert "def mul" not in seen.observation, seen.observation
            assert "No such file or directory" in seen.observation, seen.observation
    after = masking._search.cache_info()
    # the one search: the second episode's, of the extra_ro_paths alone (not of /usr)
    assert after.hits + after.misses == searches.hits + searches.misses + 1


@needs_bwrap
def test_the_agent_cannot_read_packages_its_interpreter_does_not_import(tmp_path: Path) -> None:
    """The sandbox shows the interpreter, its standard library and the environment's packages:
    the other package directories the host has under /usr or the base Python (six, jmespath in
    the base site-packages of a venv; the system Python's dist-packages) are empty there."""
    from etude.sandbox.masking import foreign_package_dirs

    foreign = foreign_package_dirs()
    packages = [
        os.path.join(d, name, "__init__.py")
        for d in foreign
        for name in sorted(os.listdir(d))
        if os.path.isfile(os.path.join(d, name, "__init__.py"))
    ]
    if not packages:
        pytest.skip(f"this host has no package outside the interpreter's sys.path ({foreign})")
    target = packages[0]
    assert os.path.getsize(target) >= 0 and os.access(target, os.R_OK)  # the host can read it
    ws = tmp_path / "ws"
    ws.mkdir()
    tools = Toolbox(ws, sandbox=make_sandbox("bwrap", SandboxConfig(backend="bwrap")))
    directory = os.path.dirname(target)
    seen = tools.call("bash", {"command": f"cat {target}; ls -A {directory} {foreign[0]} | wc -l"})
    assert "No such file or directory" in seen.observation
    imported = tools.call("bash", {"command": "python -c 'import pytest; print(pytest.__file__)'"})
    assert imported.observation.startswith("exit code: 0")  # the environment's packages show
