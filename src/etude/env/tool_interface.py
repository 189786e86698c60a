"""The interface of the agent's tools: their OpenAI function schemas, the check of a call's
arguments against them, their limits (`ToolConfig`) and what a call gives back (`ToolOutcome`, or
the `ToolFailure` a tool raises).

``TOOL_SCHEMAS`` declares the tools (``list_files``, ``read_file``, ``write_file``,
``replace_in_file``, ``search``, ``run_tests``, ``bash``, ``submit``; what each does is in
``etude.env.tools``). ``check_arguments(name, arguments)`` returns the arguments checked against
the tool's schema (an integral float made an int) or raises `ToolFailure` of kind
``bad_arguments`` that lists every problem (missing, unexpected, wrongly typed, out of range) and
quotes the schema, so that a model can correct the call in one go. `ToolFailure` is the error
every tool raises for the model (kinds in ``etude.env.trajectory.ERROR_KINDS``).

What this module does not do: run a tool (``etude.env.tools.Toolbox``) or parse a call out of
model text (``etude.env.protocol``). The checks cover the JSON Schema keywords the schemas use
(``type``, ``minLength``, ``minimum``, ``maximum``, ``items``), not JSON Schema as a whole.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from etude.env.trajectory import ToolError


def _function(
    name: str, description: str, properties: dict[str, Any], required: list[str]
) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


_PATH = {"type": "string", "description": "Path relative to the repository root."}

TOOL_SCHEMAS: tuple[dict[str, Any], ...] = (
    _function(
        "list_files",
        "List files and directories under a path (directories end with '/').",
        {
            "path": {**_PATH, "description": "Directory relative to the repository root."},
            "max_depth": {
                "type": "integer",
                "minimum": 1,
                "maximum": 8,
                "description": "How many directory levels to descend (default 2).",
            },
        },
        [],
    ),
    _function(
        "read_file",
        "Read a text file with line numbers, optionally only lines start_line..end_line.",
        {
            "path": _PATH,
            "start_line": {"type": "integer", "minimum": 1, "description": "First line (1-based)."},
            "end_line": {"type": "integer", "minimum": 1, "description": "Last line (inclusive)."},
        },
        ["path"],
    ),
    _function(
        "write_file",
        "Create or overwrite a file with the given content.",
        {"path": _PATH, "content": {"type": "string", "description": "The whole new content."}},
        ["path", "content"],
    ),
    _function(
        "replace_in_file",
        "Replace the single exact occurrence of `old` in a file by `new`.",
        {
            "path": _PATH,
            "old": {
                "type": "string",
                "minLength": 1,
                "description": "Exact text to replace, whitespace included; must occur exactly once.",
            },
            "new": {"type": "string", "description": "Replacement text."},
        },
        ["path", "old", "new"],
    ),
    _function(
        "search",
        "Search text files for a Python regular expression; prints path:line: text.",
        {
            "pattern": {
                "type": "string",
                "minLength": 1,
                "description": "Python regex (escape special characters such as ( with \\).",
            },
            "path": {**_PATH, "description": "File or directory to search (default: all)."},
        },
        ["pattern"],
    ),
    _function(
        "run_tests",
        "Run pytest on test ids (default: the task's tests) and report which did not pass.",
        {
            "tests": {
                "type": ["array", "null"],
                "items": {"type": "string", "minLength": 1},
                "description": "pytest node ids such as tests/test_x.py::test_y, or files.",
            }
        },
        [],
    ),
    _function(
        "bash",
        "Run a shell command in the repository root (sandboxed, no network, time-limited).",
        {"command": {"type": "string", "minLength": 1, "description": "The bash command line."}},
        ["command"],
    ),
    _function("submit", "Submit the current state of the repository as your solution.", {}, []),
)
TOOL_NAMES: tuple[str, ...] = tuple(t["function"]["name"] for t in TOOL_SCHEMAS)
SCHEMA_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}


def tool_schemas() -> list[dict[str, Any]]:
    """The tool declarations (a deep copy, safe to change) for ``tools_system_prompt``."""
    return copy.deepcopy(list(TOOL_SCHEMAS))


@dataclass(kw_only=True, slots=True)
class ToolConfig:
    """Output caps and time limits of the tools (TOML section ``[env.tools]``)."""

    read_max_lines: int = 250
    """Most lines one read_file call shows."""
    read_max_chars: int = 20_000
    """Most characters of file content one read_file call shows."""
    read_max_file_bytes: int = 16 << 20
    """Largest file read_file and replace_in_file open (larger ones: use bash)."""
    write_max_bytes: int = 1 << 20
    """Largest content write_file and replace_in_file write."""
    list_max_entries: int = 200
    """Most entries one list_files call shows."""
    search_max_results: int = 50
    """Most matching lines one search call shows."""
    search_max_file_bytes: int = 1 << 20
    """Files larger than this are skipped by search."""
    line_max_chars: int = 300
    """A search result line longer than this is cut."""
    search_timeout_s: float = 20.0
    """Wall-clock limit of one search (it runs in the sandbox)."""
    bash_timeout_s: float = 30.0
    """Wall-clock limit of one bash command."""
    test_timeout_s: float = 120.0
    """Wall-clock limit of one run_tests call."""
    test_output_chars: int = 3000
    """Characters of pytest's output tail shown when tests did not all pass."""
    max_observation_chars: int = 12_000
    """Any observation longer than this keeps its head and tail with a marker between."""

    def __post_init__(self) -> None:
        for name in (
            "read_max_lines",
            "read_max_chars",
            "read_max_file_bytes",
            "write_max_bytes",
            "list_max_entries",
            "search_max_results",
            "search_max_file_bytes",
            "line_max_chars",
            "test_output_chars",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"env.tools.{name}={getattr(self, name)} must be >= 1")
        for name in ("search_timeout_s", "bash_timeout_s", "test_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"env.tools.{name}={getattr(self, name)} must be > 0 seconds")
        if self.max_observation_chars < 200:
            raise ValueError(
                f"env.tools.max_observation_chars={self.max_observation_chars} is too small to "
                "hold an error message; use at least 200"
            )


@dataclass(kw_only=True, slots=True)
class ToolOutcome:
    """What one tool call gave back."""

    observation: str
    """The text the model sees (already capped)."""
    error: ToolError | None = None
    """Set when the call went wrong (bad arguments, path escape, the tool failed)."""
    submitted: bool = False
    """The call was ``submit``: the episode ends."""
    provenance: dict[str, Any] | None = None
    """What a ``bash`` command touched (``sandbox.provenance``), as JSON; None when not recorded."""


class ToolFailure(Exception):
    """A tool call that went wrong; ``Toolbox.call`` turns it into an observation and a ToolError."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def json_type_name(value: Any) -> str:
    """The JSON Schema type name of a decoded JSON value (``integer``, ``array``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _fits_type(value: Any, expected: str) -> bool:
    actual = json_type_name(value)
    if expected == "integer":
        # JSON has one number type: 3.0 is an integer value (JSON Schema agrees)
        return actual == "integer" or (
            actual == "number" and math.isfinite(value) and value == int(value)
        )
    if expected == "number":
        return actual in ("integer", "number")
    return actual == expected


def _check_value(value: Any, schema: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    """The value with integral floats made ints; problems appended for what does not fit."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if types and not any(_fits_type(value, t) for t in types):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        problems.append(
            f"{where} must be {' or '.join(types)}, got {json_type_name(value)} {shown}"
        )
        return value
    if json_type_name(value) == "number" and "integer" in types:
        value = int(value)
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        problems.append(f"{where} must not be empty")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{where} must be >= {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{where} must be <= {schema['maximum']}, got {value}")
    if isinstance(value, list) and "items" in schema:
        value = [
            _check_value(item, schema["items"], f"{where}[{i}]", problems)
            for i, item in enumerate(value)
        ]
    return value


def check_arguments(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments checked against tool ``name``'s schema; ``ToolFailure(bad_arguments)`` lists
    every problem (missing, unexpected, wrongly typed) and quotes the schema."""
    schema = SCHEMA_BY_NAME[name]
    properties = schema["properties"]
    problems = [
        f"missing required argument '{k}'" for k in schema["required"] if k not in arguments
    ]
    problems += [f"unexpected argument '{k}'" for k in arguments if k not in properties]
    checked = {
        key: _check_value(value, properties[key], f"argument '{key}'", problems)
        for key, value in arguments.items()
        if key in properties
    }
    if problems:
        raise ToolFailure(
            "bad_arguments",
            f"Bad arguments for {name}: {'; '.join(problems)}. "
            f"Parameters schema: {json.dumps(schema)}",
        )
    return checked
