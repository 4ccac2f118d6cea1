"""Configs of the real checkpoints (copies in tests/data/reference) and refusals of what we cannot run."""

import json
from pathlib import Path

import pytest

from lm import ConfigError, TextConfig
from mm import ModelConfig

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference"


def _load(name):
    return json.loads((REFERENCE / name).read_text())


def test_qwen3_5_35b_a3b():
    cfg = ModelConfig.from_hf(_load("qwen3.5-35b-a3b.config.json"))
    text = cfg.text
    assert text.is_moe and (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (256, 8, 512)
    assert text.full_attention_layers == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    assert text.rotary_dim == 64 and text.mrope_section == (11, 11, 10) and text.rope_theta == 1e7
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (16, 2, 256)
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (16, 32)
    assert not text.tie_word_embeddings and text.vocab_size == 248320
    assert cfg.vision.depth == 27 and cfg.vision.out_hidden_size == 2048
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id) == (248056, 248057, 248053)


def test_qwen3_5_0_8b_dense():
    cfg = ModelConfig.from_hf(_load("qwen3.5-0.8b.config.json"))
    assert not cfg.text.is_moe and cfg.text.intermediate_size == 3584 and cfg.text.tie_word_embeddings
    assert len(cfg.text.full_attention_layers) == 6 and cfg.vision.hidden_size == 768


def test_text_only_form_is_flat():
    text = _load("qwen3.5-35b-a3b.config.json")["text_config"]
    cfg = ModelConfig.from_hf(dict(text, model_type="qwen3_5_moe_text"))
    assert cfg.vision is None and cfg.text.num_hidden_layers == 40


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attn_output_gate=False), "gated attention"),
        (dict(layer_types=["linear_attention"] * 39 + ["sliding_attention"]), "unsupported layer type"),
        (dict(layer_types=["linear_attention"] * 3), "layer_types has 3 entries"),
        (dict(rope_parameters=dict(rope_type="default", mrope_section=[10, 10, 10], partial_rotary_factor=0.25)),
         "mrope_section"),
        (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    ],
)
def test_unsupported_values_are_refused(change, message):
    text = dict(_load("qwen3.5-35b-a3b.config.json")["text_config"], **change)
    with pytest.raises(ConfigError, match=message):
        TextConfig.from_hf(dict(text, model_type="qwen3_5_moe_text"))
