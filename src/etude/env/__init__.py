"""The coding-agent environment: episodes over a task's workspace, tools, protocol and reward.

Modules, bottom up:

- ``trajectory``: the episode record (turns with token ids, masks, logprobs, calls and typed
  errors) that the monitor and the RL trainer read;
- ``tools``: the tool schemas and their execution on a workspace (`Toolbox`);
- ``protocol``: ``<tool_call>`` parsing, running a turn's calls, appending the results;
- ``reward``: the test-based reward with the tests restored (`compute_reward`);
- ``coding``: one episode (`CodingEnv`, `EnvConfig`, `run_episode`);
- ``episode_workspace``: the episode's directory, hidden content, masks and repository facts;
- ``pool``: many episodes on a bounded thread pool (`EnvPool`);
- ``oracle``: a scripted agent that solves tasks from their gold patch (`OracleAgent`).

Importing the package imports none of them (``etude.env.trajectory`` stays light for its
readers); the names below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Trajectory": "trajectory",
    "Turn": "trajectory",
    "ToolCall": "trajectory",
    "ToolError": "trajectory",
    "ERROR_KINDS": "trajectory",
    "TOOL_SCHEMAS": "tools",
    "TOOL_NAMES": "tools",
    "ToolConfig": "tools",
    "Toolbox": "tools",
    "parse_tool_calls": "protocol",
    "run_turn": "protocol",
    "RewardResult": "reward",
    "compute_reward": "reward",
    "CodingEnv": "coding",
    "EnvConfig": "coding",
    "StepResult": "coding",
    "run_episode": "coding",
    "EnvPool": "pool",
    "OracleAgent": "oracle",
    "MISTAKE_KINDS": "oracle",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'etude.env' has no attribute {name!r}")
    return getattr(importlib.import_module(f"etude.env.{module}"), name)
