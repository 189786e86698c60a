"""Hugging Face import details: FP8 block-quantized weights, sharded indexes, config checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from test_hf_parity import hf_model  # noqa: E402

from etude.model.hf_adapter import dequantize_fp8_blocks, quantize_fp8_blocks  # noqa: E402
from etude.model.hf_config import hf_config_from_model, model_config_from_hf  # noqa: E402
from etude.model.transformer import Transformer  # noqa: E402
from etude.parallel.checkpoint import load_hf_checkpoint, read_hf_config  # noqa: E402

BLOCK = 16


def etude_from(path):
    cfg, _ = model_config_from_hf(read_hf_config(path))
    with torch.device("meta"):
        model = Transformer(cfg)
    load_hf_checkpoint(model, path)
    return model


def write_fp8_copy(src, dst):
    """DeepSeek-V3's FP8 layout: 2-D projection/expert weights as e4m3 + weight_scale_inv."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, value in tensors.items():
        quantize = value.dim() == 2 and name.endswith("proj.weight") or "_proj.weight" in name
        if quantize and "embed" not in name and "lm_head" not in name:
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(value, BLOCK)
        else:
            out[name] = value
    names = sorted(out)
    half = len(names) // 2  # two shards, so a weight and its scale may live in different files
    files = {"model-00001-of-00002.safetensors": names[:half]}
    files["model-00002-of-00002.safetensors"] = names[half:]
    for file_name, keys in files.items():
        save_file({k: out[k] for k in keys}, str(dst / file_name))
    weight_map = {k: f for f, keys in files.items() for k in keys}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return sum(1 for k in out if k.endswith("_scale_inv"))


def test_fp8_block_checkpoint_loads_to_the_bf16_weights(tmp_path):
    ref = hf_model("deepseek_v3_q_lora").to(torch.bfloat16)
    ref.save_pretrained(tmp_path / "bf16")
    num_quantized = write_fp8_copy(tmp_path / "bf16", tmp_path / "fp8")
    assert num_quantized > 20
    exact = dict(etude_from(tmp_path / "bf16").state_dict())
    approx = dict(etude_from(tmp_path / "fp8").state_dict())
    assert exact.keys() == approx.keys()
    changed = 0
    for name, want in exact.items():
        got = approx[name]
        if torch.equal(got, want):
            continue
        changed += 1
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, plus the block's
        # subnormal floor (amax / 448 * 2^-9) for tiny values
        err = (got.float() - want.float()).abs()
        bound = want.float().abs() / 16 + want.float().abs().max() / 448 * 2**-6
        assert bool((err <= bound).all()), (name, (err - bound).max())
    assert changed >= 10  # the quantized projections and experts differ, within the bound


def test_fp8_dequantize_handles_partial_blocks():
    weight = torch.randn(40, 24)
    quant, scale_inv = quantize_fp8_blocks(weight, BLOCK)
    assert quant.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    back = dequantize_fp8_blocks(quant, scale_inv, torch.float32, (BLOCK, BLOCK))
    assert back.shape == weight.shape
    assert (back - weight).abs().max() <= weight.abs().max() / 16
    with pytest.raises(ValueError, match="does not tile"):
        dequantize_fp8_blocks(quant, torch.ones(7, 2), torch.float32, (BLOCK, BLOCK))


def deepseek_json():
    saved = json.loads(hf_model("deepseek_v3_q_lora").config.to_json_string(use_diff=True))
    cfg, _ = model_config_from_hf(saved)
    return hf_config_from_model(cfg)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"some_new_field": 3}, "unknown or unsupported key 'some_new_field'"),
        ({"model_type": "mixtral"}, "model_type='mixtral' is not supported"),
        ({"architectures": ["LlamaForCausalLM"]}, "does not match model_type"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "default or yarn"),
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"num_key_value_heads": 1}, "MLA has one key per head"),
    ],
)
def test_unsupported_config_fields_are_named(change, message):
    config = {**deepseek_json(), **change}
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(config)


def test_legacy_rope_scaling_layout_is_read():
    config = deepseek_json()
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "yarn"}
    config["model_type"] = "kimi_k2"
    cfg, family = model_config_from_hf(config)
    assert family == "deepseek_v3" and cfg.rope_scaling == "yarn" and cfg.yarn_factor == 4.0


def test_mismatched_checkpoint_is_a_clear_error(tmp_path):
    hf_model("qwen3").save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["intermediate_size"] = 100
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has shape .* but layers\.0\.ffn\.w[123]\.weight needs"):
        etude_from(tmp_path / "hf")
