"""``etude model import|export|info`` and ``init = "hf:PATH"`` on a tiny local checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_parity import hf_model  # noqa: E402

from etude.cli import main  # noqa: E402
from etude.model.hf_tokenizer import load_hf_tokenizer  # noqa: E402
from etude.model.tokenizer import SPECIAL_TOKENS, TOOL_CALL_START, Tokenizer  # noqa: E402
from etude.rl.sft import load_policy  # noqa: E402
from etude.rl.trainer import TrainConfig  # noqa: E402

TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 20


def qwen_style_tokenizer(directory):
    """A tokenizer.json laid out as Qwen ships it: tool markers are added, not special."""
    Tokenizer.train(TEXTS, vocab_size=300).save(directory)
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text())
    for token in data["added_tokens"]:
        if token["content"].startswith(("<tool", "</tool")):
            token["special"] = False
    path.write_text(json.dumps(data))


@pytest.fixture
def hf_dir(tmp_path):
    model = hf_model("qwen3")
    model.save_pretrained(tmp_path / "hf")
    qwen_style_tokenizer(tmp_path / "hf")
    return tmp_path / "hf", model


def test_import_info_export_round_trip(hf_dir, tmp_path, capsys):
    path, ref = hf_dir
    assert main(["model", "import", str(path), "--out", str(tmp_path / "imp")]) == 0
    assert (tmp_path / "imp" / "export" / "model.safetensors").is_file()
    assert (tmp_path / "imp" / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "imp" / "hf_source.json").read_text())["family"] == "qwen3"
    assert main(["model", "info", "--config", str(path)]) == 0
    assert "attention GQA 4 q / 2 kv heads x 16" in capsys.readouterr().out
    out = tmp_path / "back"
    assert (
        main(["model", "export", str(tmp_path / "imp"), "--format", "hf", "--out", str(out)]) == 0
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.config.architectures == ["Qwen3ForCausalLM"]
    tokens = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back(tokens).logits - ref(tokens).logits).abs().max() <= 1e-5
    assert (out / "tokenizer.json").is_file()


def test_import_errors_exit_2(tmp_path, capsys):
    assert main(["model", "import", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_hf_init_loads_policy_and_tokenizer(hf_dir, tmp_path):
    path, ref = hf_dir
    model, tok, cfg = load_policy(
        f"hf:{path}", {}, tmp_path / "run", device=torch.device("cpu"), seed=0
    )
    assert cfg.qk_norm and cfg.num_experts == 0
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(tokens) - ref(tokens).logits).abs().max() <= 1e-4
    assert set(tok.special_ids) == set(SPECIAL_TOKENS)
    # the tool markers became special without changing their ids, and text cannot forge them
    raw = load_hf_tokenizer(path)
    assert raw.special_ids[TOOL_CALL_START] == tok.special_ids[TOOL_CALL_START]
    assert tok.special_ids[TOOL_CALL_START] not in tok.encode("<tool_call>")
    with pytest.raises(ValueError, match="has no config.json"):
        TrainConfig(init=f"hf:{tmp_path / 'missing'}")
