"""The optional agent deleter against a local OpenAI-compatible endpoint."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from test_tasks_mine import write_mini_repo

from etude.tasks.agent_deleter import AgentDeleterConfig, chat, parse_features, propose_with_agent
from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.mine import Baseline, Miner, detect_layout, index_package, index_test_imports
from etude.tasks.proposal import ProposalConfig

REPLIES = {
    "minipkg.shapes": {
        "features": [
            {"delete": ["area", "_square", "_UNIT"], "why": "circle area"},
            {"delete": ["scale"], "why": "bad: used at import"},
        ]
    },
    "minipkg.words": {"features": [{"delete": ["shout"]}, {"delete": ["nonexistent"]}]},
}


class _Handler(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, dict(self.headers), body))
        prompt = body["messages"][-1]["content"]
        module = prompt.split("`")[1]
        content = "Here you go:\n" + json.dumps(REPLIES.get(module, {"features": []}))
        payload = json.dumps(
            {"choices": [{"message": {"role": "assistant", "content": content}}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    _Handler.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def _miner(root):
    layout = detect_layout(root)
    lines = {
        "minipkg/shapes.py": {n: frozenset({"t::shapes"}) for n in range(1, 60)},
        "minipkg/words.py": {n: frozenset({"t::words"}) for n in range(1, 20)},
    }
    baseline = Baseline(
        passing=("t::shapes", "t::words", "t::other"),
        failing=(),
        flaky=(),
        canonical={},
        line_tests=lines,
        importable=tuple(layout.modules),
    )
    return Miner(layout, index_package(root, layout), baseline, index_test_imports(root, layout))


def test_proposals_go_through_the_same_checks(tmp_path, endpoint, monkeypatch):
    monkeypatch.setenv("ETUDE_TEST_KEY", "sk-test")
    miner = _miner(write_mini_repo(tmp_path))
    cfg = AgentDeleterConfig(
        enabled=True, base_url=endpoint, model="m", api_key_env="ETUDE_TEST_KEY"
    )
    features, rejected = propose_with_agent(
        miner, cfg, ProposalConfig(min_lines=2, max_test_fraction=1.0)
    )
    assert [f.symbols for f in features] == [
        ("minipkg.shapes.area", "minipkg.shapes._square", "minipkg.shapes._UNIT"),
        ("minipkg.words.shout",),
    ]
    assert features[0].kind == "agent" and features[0].interface == ("minipkg.shapes.area",)
    assert (
        rejected["minipkg.shapes:scale"]
        == "agent proposal: scale is needed at import time by DEFAULT_SIDE"
    )
    assert "not a definition" in rejected["minipkg.words:nonexistent"]
    path, headers, body = _Handler.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sk-test"
    assert body["model"] == "m" and "def area(radius):" in body["messages"][1]["content"]


def test_agent_features_become_agent_deletion_tasks(tmp_path, endpoint):
    repo = write_mini_repo(tmp_path / "repo")
    cfg = TaskBuildConfig(
        workers=2,
        min_difficulty=0.0,  # the mini repository's functions are one-liners
        proposals=ProposalConfig(min_lines=2, include=("nothing.from.the.miner",), modules=False),
        agent=AgentDeleterConfig(enabled=True, base_url=endpoint, model="m"),
    )
    with TaskFactory(repo, tmp_path / "out", cfg) as factory:
        records, report = factory.build()
    assert [r.etude.kind for r in records] == ["agent_deletion", "agent_deletion"]
    assert {r.etude.symbols[0] for r in records} == {"minipkg.shapes.area", "minipkg.words.shout"}
    assert report.candidates == 2 and "minipkg.shapes:scale" in report.rejected


def test_replies_and_config_errors(tmp_path):
    assert parse_features(
        'noise {"features": [{"delete": ["a", "a", "B.m"]}, {"delete": []}, 3]} tail'
    ) == [["a", "B.m"]]
    assert parse_features("no json here") == [] and parse_features("{not json}") == []
    with pytest.raises(ValueError, match="agent.model"):
        AgentDeleterConfig(enabled=True)
    with pytest.raises(ValueError, match="base_url"):
        AgentDeleterConfig(base_url="localhost:8000")
    cfg = AgentDeleterConfig(enabled=True, model="m", base_url="http://127.0.0.1:9/v1", timeout_s=2)
    with pytest.raises(RuntimeError, match="request to"):
        chat(cfg, [{"role": "user", "content": "hi"}])


def test_a_scripted_agent_deletes_code_and_files_and_the_result_is_validated(tmp_path):
    """The agent names a function of one module and a whole other file; the factory deletes
    both together and validates the result like any task."""
    seen: list[str] = []

    def scripted_agent(messages):
        prompt = messages[-1]["content"]
        seen.append(prompt)
        if "Module `minipkg.shapes`" in prompt:
            return json.dumps(
                {
                    "features": [
                        {"delete": ["perimeter"], "files": ["minipkg/words.py"], "why": "two"},
                        {"delete": [], "files": ["minipkg/nothere.py"]},
                    ]
                }
            )
        return "no features here"

    repo = write_mini_repo(tmp_path / "repo")
    cfg = TaskBuildConfig(
        workers=1,
        min_difficulty=0.0,
        proposals=ProposalConfig(
            min_lines=2, include=("nothing.from.the.miner",), modules=False, feature_groups=False
        ),
        agent=AgentDeleterConfig(enabled=True, model="scripted"),
    )
    with TaskFactory(repo, tmp_path / "out", cfg, agent_model=scripted_agent) as factory:
        records, report = factory.build()
    assert any("Files of the package: minipkg/__init__.py" in p for p in seen)
    (record,) = records
    assert record.etude.kind == "agent_deletion"
    assert record.etude.deleted_files == ["minipkg/words.py"]
    assert "minipkg.shapes.perimeter" in record.etude.symbols
    assert any(t.startswith("tests/test_words.py") for t in record.FAIL_TO_PASS)
    assert any(t.startswith("tests/test_shapes.py::test_perimeter") for t in record.FAIL_TO_PASS)
    assert "not a module of the package" in report.rejected["minipkg.shapes:minipkg/nothere.py"]
