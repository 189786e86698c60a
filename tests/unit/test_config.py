"""Config machinery: TOML recipes, dotted overrides, and errors that name the key and the fix."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from etude.config import apply_overrides, from_dict, load_config, parse_override, to_dict


@dataclass(kw_only=True, slots=True)
class Inner:
    lr: float = 0.01
    """learning rate"""
    kind: Literal["a", "b"] = "a"
    """which"""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"inner.lr={self.lr} must be > 0")


@dataclass(kw_only=True, slots=True)
class Outer:
    steps: int = 10
    """steps"""
    betas: tuple[float, float] = (0.9, 0.95)
    """betas"""
    inner: Inner = field(default_factory=Inner)
    """nested"""


def test_defaults_and_nested_tables():
    cfg = from_dict(Outer, {"steps": 3, "inner": {"lr": 1, "kind": "b"}})
    assert (
        cfg.steps == 3
        and cfg.inner.lr == 1.0
        and isinstance(cfg.inner.lr, float)
        and cfg.inner.kind == "b"
    )
    assert from_dict(Outer, {"betas": [0.8, 0.9]}).betas == (0.8, 0.9)
    assert to_dict(cfg)["inner"] == {"lr": 1.0, "kind": "b"}


def test_unknown_key_names_it_and_the_valid_keys():
    with pytest.raises(
        ValueError, match=r"unknown config key 'inner.lrr'; valid keys of inner: kind, lr"
    ):
        from_dict(Outer, {"inner": {"lrr": 1}})


def test_wrong_type_and_literal():
    with pytest.raises(ValueError, match=r"config key 'steps' must be int, got 'x'"):
        from_dict(Outer, {"steps": "x"})
    with pytest.raises(
        ValueError, match=r"config key 'inner.kind' must be one of 'a', 'b', got 'c'"
    ):
        from_dict(Outer, {"inner": {"kind": "c"}})
    with pytest.raises(ValueError, match=r"steps' must be int, got True"):
        from_dict(Outer, {"steps": True})


def test_post_init_validation_propagates():
    with pytest.raises(ValueError, match=r"inner.lr=-1.0 must be > 0"):
        from_dict(Outer, {"inner": {"lr": -1.0}})


def test_overrides_parse_as_toml_values():
    assert parse_override("inner.lr=0.5") == (["inner", "lr"], 0.5)
    assert parse_override("a.b=hello") == (["a", "b"], "hello")
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override('a="1"') == (["a"], "1")
    data = apply_overrides({"inner": {"lr": 0.1}}, ["inner.kind=b", "steps=7"])
    assert data == {"inner": {"lr": 0.1, "kind": "b"}, "steps": 7}
    with pytest.raises(ValueError, match="must look like section.key=value"):
        parse_override("steps")
    with pytest.raises(ValueError, match="'steps' is a value, not a table"):
        apply_overrides({"steps": 1}, ["steps.x=1"])


def test_load_config_from_file(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("steps = 5\n[inner]\nlr = 0.2\n")
    cfg = load_config(Outer, path, ["inner.lr=0.3"])
    assert cfg.steps == 5 and cfg.inner.lr == 0.3
    with pytest.raises(ValueError, match="does not exist"):
        load_config(Outer, tmp_path / "missing.toml")
    path.write_text("steps = = 5")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_config(Outer, path)
