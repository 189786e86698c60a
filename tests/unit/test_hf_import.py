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


def published_config(**changes):
    """A config.json in the layout the released DeepSeek-V3-architecture checkpoints use
    (legacy ``rope_scaling``, remote-code keys, FP8 quantization_config), Kimi K2's values."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        "aux_loss_alpha": 0.001,
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "initializer_range": 0.02,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 131072,
        "model_type": "kimi_k2",
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 64,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.3",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 163840,
    }
    return {**config, **changes}


def test_published_layout_imports_to_the_presets():
    from etude.config import to_dict
    from etude.model.config import ModelConfig

    ignore = {"init_std", "bias_update_rate"}  # training settings, not in config.json
    for preset, changes in (
        ("kimi-k2", {}),
        (
            "deepseek-v3",
            dict(
                model_type="deepseek_v3",
                num_attention_heads=128,
                num_key_value_heads=128,
                n_routed_experts=256,
                n_group=8,
                topk_group=4,
                first_k_dense_replace=3,
                routed_scaling_factor=2.5,
                vocab_size=129280,
                max_position_embeddings=163840,
                rope_theta=10000.0,
                num_nextn_predict_layers=1,
                rope_scaling={
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "factor": 40,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096,
                    "type": "yarn",
                },
            ),
        ),
    ):
        cfg, family = model_config_from_hf(published_config(**changes))
        want = to_dict(ModelConfig.preset(preset))
        got = to_dict(cfg)
        assert family == "deepseek_v3"
        assert {k: v for k, v in got.items() if k not in ignore} == {
            k: v for k, v in want.items() if k not in ignore
        }, preset
