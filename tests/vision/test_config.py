import json
from pathlib import Path

import pytest

from tests.vision._reference import TINY, hf_vision_config
from vision import VisionConfig

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference"  # copies of the real checkpoints' configs


@pytest.mark.parametrize("name, hidden, depth, out", [
    ("qwen3.5-35b-a3b.config.json", 1152, 27, 2048),
    ("qwen3.5-0.8b.config.json", 768, 12, 1024),
])
def test_real_configs(name, hidden, depth, out):
    path = REFERENCE / name
    config = VisionConfig.from_hf(json.loads(path.read_text()))  # the full config: vision_config is unwrapped
    assert (config.hidden_size, config.depth, config.out_hidden_size) == (hidden, depth, out)
    assert config.num_grid_per_side == 48 and config.patch_dim == 1536 and config.merge_unit == 4
    assert config.rope_theta == 10000.0


def test_rope_theta_matches_transformers_default_and_override():
    hf = hf_vision_config()
    assert VisionConfig.from_hf(hf.to_dict()).rope_theta == hf.rope_parameters["rope_theta"] == 10000.0
    custom = hf_vision_config(rope_parameters={"rope_type": "axial", "rope_theta": 500.0})
    assert VisionConfig.from_hf(custom.to_dict()).rope_theta == 500.0
    assert VisionConfig.from_hf({**TINY}).rope_theta == 10000.0


@pytest.mark.parametrize("override, message", [
    ({"deepstack_visual_indexes": [3, 7]}, "deepstack"),
    ({"hidden_act": "quick_gelu"}, "hidden_act"),
    ({"num_position_embeddings": 2300}, "perfect square"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}, "rope_type"),
    ({"model_type": "siglip_vision_model"}, "model_type"),
    ({"num_heads": 3}, "divisible"),
    ({"patch_size": [16, 14]}, "patch_size"),
])
def test_refuses_unsupported(override, message):
    with pytest.raises(ValueError, match=message):
        VisionConfig.from_hf({**TINY, **override})


def test_frozen():
    config = VisionConfig.from_hf(TINY)
    with pytest.raises(AttributeError):
        config.depth = 3  # type: ignore[misc]
