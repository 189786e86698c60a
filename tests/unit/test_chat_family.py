"""The chat-format registry: which format a checkpoint directory speaks, the override, the
record ``etude model import`` keeps, and conversations of each format on its own tokenizer."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from test_hf_parity import hf_model  # noqa: E402
from test_kimi_chat import marker_backend  # noqa: E402

from etude.cli import main  # noqa: E402
from etude.model.chat import Conversation  # noqa: E402
from etude.model.chat_family import (  # noqa: E402
    CHAT_FORMATS,
    TOOL_CALL_PARSERS,
    detect_chat_format,
    load_chat_tokenizer,
    new_conversation,
)
from etude.model.deepseek_chat import DEEPSEEK_MARKERS, DeepSeekV3Conversation  # noqa: E402
from etude.model.family_chat import FamilyCall, MarkerTokenizer  # noqa: E402
from etude.model.hf_chat import HermesConversation  # noqa: E402
from etude.model.kimi_chat import KIMI_MARKERS, KimiConversation  # noqa: E402
from etude.model.tokenizer import SPECIAL_TOKENS, Tokenizer  # noqa: E402

TEXTS = ["def add(a, b):\n    return a + b\n", "Run the tests, then fix add."] * 20


def write_dir(path, markers, model_type, template=None):
    path.mkdir(parents=True, exist_ok=True)
    marker_backend(markers, TEXTS, vocab_size=300).save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return path


def test_markers_decide_before_model_type(tmp_path):
    assert detect_chat_format(write_dir(tmp_path / "k", KIMI_MARKERS, "kimi_k2")) == "kimi_k2"
    # Kimi K2 is also published with model_type deepseek_v3: its tokenizer tells
    assert detect_chat_format(write_dir(tmp_path / "k2", KIMI_MARKERS, "deepseek_v3")) == "kimi_k2"
    ds = write_dir(tmp_path / "d", DEEPSEEK_MARKERS, "deepseek_v3")
    assert detect_chat_format(ds) == "deepseek_v3"


def test_chatml_layouts(tmp_path):
    etude_dir = tmp_path / "etude"
    Tokenizer.train(TEXTS, vocab_size=300).save(etude_dir)
    (etude_dir / "config.json").write_text(json.dumps({"model_type": "glm4_moe"}))
    assert detect_chat_format(etude_dir) == "etude"  # etude's markers at ids 0-6
    shifted = ("<|other|>", *SPECIAL_TOKENS)  # a published ChatML tokenizer: other ids
    assert detect_chat_format(write_dir(tmp_path / "q", shifted, "qwen3")) == "hermes"
    template = "{{ '<tool_call>' }}"
    assert detect_chat_format(write_dir(tmp_path / "t", shifted, "llama", template)) == "hermes"
    unknown = write_dir(tmp_path / "u", shifted, "llama")
    with pytest.raises(ValueError, match=r"model_type='llama'.*pass chat_format="):
        detect_chat_format(unknown)
    assert detect_chat_format(unknown, chat_format="hermes") == "hermes"
    with pytest.raises(ValueError, match="chat_format='gemma' is not a chat format"):
        detect_chat_format(unknown, chat_format="gemma")


def test_each_format_builds_its_conversation(tmp_path):
    dirs = {
        "kimi_k2": write_dir(tmp_path / "k", KIMI_MARKERS, "kimi_k2"),
        "deepseek_v3": write_dir(tmp_path / "d", DEEPSEEK_MARKERS, "deepseek_v3"),
    }
    Tokenizer.train(TEXTS, vocab_size=300).save(tmp_path / "e")
    dirs["etude"] = dirs["hermes"] = tmp_path / "e"
    kinds = {
        "etude": Conversation,
        "hermes": HermesConversation,
        "kimi_k2": KimiConversation,
        "deepseek_v3": DeepSeekV3Conversation,
    }
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {}}}]
    for name in CHAT_FORMATS:
        tok = load_chat_tokenizer(dirs[name], name)
        conv = new_conversation(name, tok, system="Fix add.", tools=tools)
        assert isinstance(conv, kinds[name])
        if name in TOOL_CALL_PARSERS:
            assert isinstance(tok, MarkerTokenizer)
            conv.add_user("Run the tests.")
            conv.add_assistant("", [{"function": {"name": "run_tests", "arguments": {}}}])
            body = conv.text.rsplit("Run the tests.", 1)[1]
            assert TOOL_CALL_PARSERS[name](body) == [
                FamilyCall(
                    name="run_tests",
                    arguments={},
                    call_id="functions.run_tests:0" if name == "kimi_k2" else None,
                )
            ]
    with pytest.raises(ValueError, match="is not a chat format"):
        new_conversation("chatml", None)


def test_import_records_the_format_and_the_override(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf_model("qwen3").save_pretrained(hf)
    # ChatML markers after another token: a published tokenizer, not one etude trained
    shifted = marker_backend(("<|other|>", *SPECIAL_TOKENS), TEXTS, vocab_size=300)
    shifted.save(str(hf / "tokenizer.json"))
    assert main(["model", "import", str(hf), "--out", str(tmp_path / "a")]) == 0
    assert "chat format: hermes" in capsys.readouterr().out
    assert json.loads((tmp_path / "a" / "hf_source.json").read_text())["chat_format"] == "hermes"
    assert detect_chat_format(tmp_path / "a") == "hermes"
    assert isinstance(load_chat_tokenizer(tmp_path / "a", "hermes"), Tokenizer)
    argv = ["model", "import", str(hf), "--out", str(tmp_path / "b"), "--chat-format", "gemma"]
    assert main(argv) == 2
    assert "--chat-format='gemma' is not a chat format" in capsys.readouterr().err
    argv[-1] = "etude"
    assert main(argv) == 0
    assert detect_chat_format(tmp_path / "b") == "etude"  # the record wins over detection


def test_a_tokenizer_without_the_family_markers_is_an_error(tmp_path):
    ds = write_dir(tmp_path / "d", DEEPSEEK_MARKERS, "deepseek_v3")
    with pytest.raises(ValueError, match="no id for the marker"):
        load_chat_tokenizer(ds, "kimi_k2")
    with pytest.raises(ValueError, match="needs all of"):
        KimiConversation(Tokenizer.train(TEXTS, vocab_size=300))
