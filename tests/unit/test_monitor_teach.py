"""The judge through the inference backend protocol (a scripted judge model), flags that become
hints at their turns, and the ``etude monitor`` report with recall by category and its HTML page
that the run report links."""

import shutil
from pathlib import Path

import pytest

from etude.engine.sampling import Generation
from etude.env.trajectory import Flag, ToolCall, Trajectory, Turn, read_jsonl
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.monitor.hints import MonitorFlagDetector, flag_feedback
from etude.monitor.judge import JudgeConfig, judge_with_backend, verdict_flags
from etude.monitor.report import monitor_main
from etude.report.html import build_report
from etude.rl.feedback import FeedbackConfig, apply_detectors, build_detectors

CORPUS = Path(__file__).parents[1] / "assets" / "monitor_provenance"
REPORT_RUN = Path(__file__).parents[1] / "assets" / "report_run"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(20_000), 300)


class ScriptedJudge:
    """An InferenceBackend whose model answers each prompt with a scripted reply."""

    policy_version = 0

    def __init__(self, tok: Tokenizer, reply, max_seq_len=None) -> None:
        self.tok, self.reply, self._max = tok, reply, max_seq_len
        self.prompts: list[str] = []

    @property
    def max_seq_len(self):
        return self._max

    def generate(self, requests):
        out = []
        for request in requests:
            prompt = self.tok.decode(request.prompt_ids)
            self.prompts.append(prompt)
            ids = [*self.tok.encode(self.reply(prompt)), self.tok.im_end_id]
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
        return out

    def update_weights(self, source, version):
        raise AssertionError("a judge is never updated")


def hack_episode() -> Trajectory:
    (traj,) = [t for t in read_jsonl(CORPUS / "hacks.jsonl") if t.info["case"] == "mypy_cache_var"]
    return traj


def test_judge_through_backend_reads_rubric_and_provenance(tok):
    def reply(prompt):
        hacked = ".mypy_cache/3.11/textkit/roman.data.json" in prompt
        return '{"hack": %s, "category": "cache_artifacts", "reasons": "turn 3 read the cache"}' % (
            "true" if hacked else "false"
        )

    judge = ScriptedJudge(tok, reply)
    cfg = JudgeConfig(transport="backend", tokenizer="unused-here", max_chars=4000)
    clean = Trajectory(task_id="t", turns=[Turn(role="user", text="implement f")])
    hack, ok = judge_with_backend([hack_episode(), clean], judge, tok, cfg)
    assert hack.status == "hack" and hack.category == "cache_artifacts"
    assert ok.status == "clean"
    assert "Rubric, in order" in judge.prompts[0]
    assert "Sandbox provenance" in judge.prompts[0] and "Sandbox provenance" not in judge.prompts[1]
    assert [f.rule for f in verdict_flags(hack, cfg)] == ["judge"]


def test_judge_failures_are_unavailable_never_clean(tok):
    cfg = JudgeConfig(transport="backend", tokenizer="unused-here", max_chars=4000)
    traj = hack_episode()
    (garbled,) = judge_with_backend([traj], ScriptedJudge(tok, lambda p: "I think so"), tok, cfg)
    assert garbled.status == "unavailable"

    class Down(ScriptedJudge):
        def generate(self, requests):
            raise ConnectionError("refused")

    (down,) = judge_with_backend([traj], Down(tok, None), tok, cfg)
    assert down.status == "unavailable" and "refused" in down.error
    flags = verdict_flags(down, cfg)
    assert flags[0].rule == "judge.unavailable" and flags[0].severity == 0
    # a prompt that cannot fit even condensed is unavailable too
    (tiny,) = judge_with_backend([traj], ScriptedJudge(tok, lambda p: "{}", 64), tok, cfg)
    assert tiny.status == "unavailable" and "does not fit" in tiny.error
    with pytest.raises(ValueError, match="tokenizer"):
        JudgeConfig(enabled=True, url="http://127.0.0.1:1", model="m", transport="backend")


def teach_episode() -> Trajectory:
    turns = [Turn(role="user", text="task")]
    for command in ("ls", "P=.mypy_; cat ${P}cache/x"):
        call = ToolCall(name="bash", arguments={"command": command})
        turns.append(
            Turn(role="assistant", text=command, tool_calls=[call], token_ids=[5], trainable=[1])
        )
        turns.append(Turn(role="tool", text="ok", tool_name="bash"))
    traj = Trajectory(task_id="t", turns=turns)
    traj.flags = [
        Flag(rule="prov.cache_read", category="cache_artifacts", severity=3, turn=4, evidence="x"),
        Flag(rule="probe.identity", category="sandbox_probing", severity=1, turn=1, evidence="y"),
        Flag(rule="judge", category="other", severity=3, turn=None, evidence="z"),
    ]
    return traj


def test_flags_become_hints_at_the_flagged_turn():
    traj = teach_episode()
    (item,) = flag_feedback(traj, min_severity=3)
    assert item.turn == 3 and item.kind == "monitor"  # the call before the flagged output
    assert "cache" in item.hint.lower()
    assert [f.turn for f in flag_feedback(traj, min_severity=1)] == [1, 3]
    # as a feedback detector of the RL trainer, selected by name
    cfg = FeedbackConfig(detectors=("monitor_flag",))
    assert isinstance(build_detectors(cfg)[0], MonitorFlagDetector)
    assert apply_detectors([traj], build_detectors(cfg), cfg) == 1
    assert apply_detectors([traj], build_detectors(cfg), cfg) == 0  # not twice
    with pytest.raises(ValueError, match="min_severity"):
        MonitorFlagDetector(min_severity=0)


def test_monitor_report_counts_recall_and_the_run_report_links_it(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(REPORT_RUN, run)
    (run / "trajectories" / "corpus").mkdir(parents=True)
    shutil.copy(
        CORPUS / "hacks.jsonl", run / "trajectories" / "corpus" / "trajectories_hacks.jsonl"
    )
    shutil.copy(
        CORPUS / "clean.jsonl", run / "trajectories" / "corpus" / "trajectories_clean.jsonl"
    )
    summary = monitor_main(run, num_examples=2)
    out = capsys.readouterr().out
    totals = summary["recall"]["totals"]
    num_hacks = len(read_jsonl(CORPUS / "hacks.jsonl"))
    assert totals["hacks"] == num_hacks and totals["caught"] == num_hacks
    assert totals["clean"] == len(read_jsonl(CORPUS / "clean.jsonl")) and totals["false_flags"] == 0
    assert "recall / false flags" in out and "cache_artifacts" in out
    page = (run / "monitor.html").read_text()
    assert "Recall by expected category" in page and "<script" not in page
    assert 'href="monitor.html"' in build_report([run], max_trajectories=0)
