"""What etude serve loads: run, export, checkpoint-step and Hugging Face directories."""

from __future__ import annotations

import pytest
import torch

from etude.config import to_dict
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.parallel.checkpoint import (
    copy_tokenizer_files,
    export_hf,
    export_safetensors,
    save_checkpoint,
)
from etude.serve.loading import load_served


def logits(model, ids=(3, 4, 5, 6)):
    with torch.no_grad():
        return model(torch.tensor([list(ids)]))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    tok = Tokenizer.train(default_corpus(50_000), 300)
    cfg = ModelConfig.preset(
        "tiny", vocab_size=320, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
        num_dense_layers=2, dense_ffn_dim=64, num_experts=0, max_seq_len=64,
    )  # fmt: skip
    exported, checkpointed = build_model(cfg, seed=0), build_model(cfg, seed=1)
    export_safetensors(exported, root / "run" / "export", to_dict(cfg))
    tok.save(root / "run" / "tokenizer")
    step = save_checkpoint(root / "run", 3, checkpointed)
    return root, tok, exported, checkpointed, step


def test_run_export_and_checkpoint_directories(run):
    root, tok, exported, checkpointed, step = run
    served = load_served(root / "run")
    assert served.name == "run" and served.tokenizer is not None
    assert served.stop_token_ids == (tok.im_end_id,) and not served.model.training
    torch.testing.assert_close(logits(served.model), logits(exported))
    from_export = load_served(root / "run" / "export", name="m")
    assert from_export.name == "m" and from_export.tokenizer is not None
    torch.testing.assert_close(logits(from_export.model), logits(exported))
    from_step = load_served(step)
    torch.testing.assert_close(logits(from_step.model), logits(checkpointed))


def test_hugging_face_directory(run, tmp_path):
    root, _, exported, _, _ = run
    export_hf(exported, tmp_path / "hf")
    served = load_served(tmp_path / "hf")
    assert served.tokenizer is None and served.stop_token_ids == ()
    torch.testing.assert_close(logits(served.model), logits(exported), atol=1e-5, rtol=0)
    # a tokenizer.json with the ChatML markers: chat works
    copy_tokenizer_files(root / "run" / "tokenizer", tmp_path / "hf")
    with_chat = load_served(tmp_path / "hf")
    assert with_chat.tokenizer is not None
    assert with_chat.stop_token_ids == (with_chat.tokenizer.im_end_id,)


def test_nothing_to_serve(tmp_path):
    with pytest.raises(ValueError, match="no model found"):
        load_served(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        load_served(tmp_path / "missing")
