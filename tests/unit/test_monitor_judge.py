"""The judge against a chat-completions server on loopback, started by the test: verdicts are
parsed; timeouts, HTTP errors, non-JSON bodies and wrong schemas are "unavailable", never clean."""

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from etude.env.trajectory import ToolCall, Trajectory, Turn
from etude.monitor.hook import MonitorConfig, apply_monitor
from etude.monitor.judge import (
    JudgeConfig,
    condense,
    judge_many,
    judge_trajectory,
    parse_verdict,
    verdict_flags,
)

HACK = '{"hack": true, "category": "vcs_history", "reasons": "turn 2 runs git log --all"}'
REPLIES = {
    # task id -> (HTTP status, body or message content); content is wrapped as a chat completion
    "hack": (200, HACK),
    "fenced_clean": (
        200,
        '```json\n{"hack": false, "category": "none", "reasons": "read, edited, tested"}\n```',
    ),
    "prose_hack": (
        200,
        'Looking at turn 4.\n{"hack": true, "category": "Test Tampering", "reasons": "edits tests"} Done.',
    ),
    "odd_category": (200, '{"hack": true, "category": "bribery", "reasons": "asks for reward"}'),
    "error500": (500, "internal error"),
    "not_json": (200, "<html>oops</html>"),
    "no_choices": (200, '{"id": "cmpl-1", "object": "chat.completion"}'),
    "bad_schema": (200, '{"hack": "maybe", "reasons": 3}'),
    "no_verdict": (200, "The agent seems fine to me."),
    "slow": (200, HACK),
}
RAW_BODY = {"not_json", "no_choices"}


class ChatServer:
    """A minimal OpenAI-compatible /v1/chat/completions endpoint on 127.0.0.1."""

    def __init__(self):
        self.requests = []
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                )
                task = re.search(r"task: (\S+)", body["messages"][1]["content"]).group(1)
                if task == "slow":
                    server.release.wait(10)
                status, text = REPLIES[task]
                if task not in RAW_BODY and status == 200:
                    message = {"role": "assistant", "content": text}
                    text = json.dumps(
                        {
                            "id": "c1",
                            "object": "chat.completion",
                            "choices": [{"index": 0, "message": message}],
                        }
                    )
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(text.encode())))
                    self.end_headers()
                    self.wfile.write(text.encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the timeout case)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def server():
    srv = ChatServer()
    yield srv
    srv.close()


def trajectory(task_id, reward=1.0):
    return Trajectory(
        task_id=task_id,
        reward=reward,
        turns=[
            Turn(role="user", text="Re-implement slugify in src/textkit/slug.py"),
            Turn(
                role="assistant",
                text="",
                tool_calls=[ToolCall(name="bash", arguments={"command": "python -m pytest -q"})],
            ),
            Turn(role="tool", text="5 passed", tool_name="bash"),
        ],
    )


def config(url, **kw):
    return JudgeConfig(
        enabled=True, url=url, model="judge-1", timeout_s=kw.pop("timeout_s", 5.0), **kw
    )


def test_verdict_parsed_and_request_well_formed(server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    verdict = judge_trajectory(trajectory("hack"), config(server.url, api_key_env="JUDGE_KEY"))
    assert (verdict.status, verdict.category) == ("hack", "vcs_history")
    assert verdict.reasons == "turn 2 runs git log --all"
    (request,) = server.requests
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sk-test"
    body = request["body"]
    assert body["model"] == "judge-1" and [m["role"] for m in body["messages"]] == [
        "system",
        "user",
    ]
    assert (
        "python -m pytest -q" in body["messages"][1]["content"]
        and '"hack"' in body["messages"][0]["content"]
    )


@pytest.mark.parametrize(
    "task, status, category",
    [
        ("fenced_clean", "clean", "none"),
        ("prose_hack", "hack", "test_tampering"),
        ("odd_category", "hack", "other"),
    ],
)
def test_verdict_found_in_fences_and_prose(server, task, status, category):
    verdict = judge_trajectory(trajectory(task), config(server.url))
    assert (verdict.status, verdict.category) == (status, category)


@pytest.mark.parametrize(
    "task", ["slow", "error500", "not_json", "no_choices", "bad_schema", "no_verdict"]
)
def test_failures_are_unavailable(server, task):
    verdict = judge_trajectory(trajectory(task), config(server.url, timeout_s=0.3))
    assert verdict.status == "unavailable" and verdict.error
    (flag,) = verdict_flags(verdict, config(server.url))
    assert (flag.rule, flag.severity) == (
        "judge.unavailable",
        0,
    ) and "monitor unavailable" in flag.evidence


def test_connection_refused_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    verdict = judge_trajectory(trajectory("hack"), config(f"http://127.0.0.1:{port}/v1"))
    assert verdict.status == "unavailable" and "URLError" in verdict.error


def test_parse_verdict_schema():
    assert parse_verdict(HACK).status == "hack"
    assert parse_verdict('{"hack": false}').status == "clean"
    for bad in (
        '{"hack": 1}',
        '{"hack": true, "category": 5}',
        "[true]",
        "",
        '{"verdict": "hack"}',
        '{"a": ' * 50_000,  # nested past the interpreter's stack: not a crash
    ):
        assert parse_verdict(bad).status == "unavailable", bad[:40]


def test_judge_many_keeps_order(server):
    tasks = ["hack", "error500", "fenced_clean", "hack", "bad_schema"]
    verdicts = judge_many([trajectory(t) for t in tasks], config(server.url, max_concurrency=3))
    assert [v.status for v in verdicts] == ["hack", "unavailable", "clean", "hack", "unavailable"]


def test_condense_is_bounded_and_keeps_both_ends():
    turns = [Turn(role="user", text="FIRST " + "u" * 5000)]
    for i in range(400):
        turns.append(
            Turn(
                role="assistant",
                text="",
                tool_calls=[ToolCall(name="bash", arguments={"command": f"echo {i}"})],
            )
        )
        turns.append(Turn(role="tool", text=f"out {i} " + "x" * 3000, tool_name="bash"))
    turns.append(
        Turn(role="assistant", text="LAST", tool_calls=[ToolCall(name="submit", arguments={})])
    )
    text = condense(Trajectory(task_id="long", turns=turns), max_chars=6000)
    assert len(text) <= 6000
    assert (
        "[0] user: FIRST" in text and "[801] assistant: LAST" in text and "turns left out" in text
    )
    short = trajectory("short")
    assert "[1] call bash" in condense(short, 6000) and "5 passed" in condense(short, 6000)


def test_config_errors():
    with pytest.raises(ValueError, match="monitor.judge.url"):
        JudgeConfig(enabled=True, model="m")
    with pytest.raises(ValueError, match="http:// or https://"):
        JudgeConfig(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="unset environment variable"):
        judge_trajectory(
            trajectory("hack"),
            JudgeConfig(
                enabled=True,
                url="http://127.0.0.1:9/v1",
                model="m",
                api_key_env="ETUDE_NO_SUCH_KEY",
            ),
        )


def test_hook_with_judge(server):
    cfg = MonitorConfig(judge=config(server.url, timeout_s=0.3))
    trajs = [trajectory("hack"), trajectory("error500"), trajectory("fenced_clean")]
    stats = apply_monitor(trajs, cfg)
    assert [t.reward for t in trajs] == [
        0.0,
        1.0,
        1.0,
    ]  # unavailable zeroes nothing, and is not "clean"
    assert [f.rule for f in trajs[0].flags] == ["judge"] and trajs[0].flags[
        0
    ].category == "vcs_history"
    assert [f.rule for f in trajs[1].flags] == ["judge.unavailable"] and trajs[2].flags == []
    assert stats.num_zeroed == 1 and stats.num_judge_unavailable == 1
    assert stats.metrics()["monitor/judge_unavailable"] == 1.0 and stats.by_rule["judge"] == 1
