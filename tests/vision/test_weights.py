"""Loading the tower from a checkpoint written by transformers' save_pretrained."""

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from tests.vision._reference import TINY, patches, rel_err
from vision import VisionConfig, VisionModel, WeightError, load_vision_weights

TEXT = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    layer_types=["linear_attention", "full_attention"],
)


class SafetensorsReader:
    """Test-local reader: every tensor name in one file, one tensor at a time."""

    def __init__(self, path):
        self._file = safe_open(str(path), framework="pt")

    def keys(self):
        return list(self._file.keys())

    def get(self, name):
        return self._file.get_tensor(name)


class EditedReader:
    """Wraps a reader, hiding, adding or replacing tensors."""

    def __init__(self, inner, hide=(), add=None):
        self.inner, self.hide, self.add = inner, set(hide), add or {}

    def keys(self):
        return [k for k in self.inner.keys() if k not in self.hide and k not in self.add] + list(self.add)

    def get(self, name):
        return self.add[name] if name in self.add else self.inner.get(name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen3_5MoeConfig(text_config=TEXT, vision_config={**TINY, "out_hidden_size": 32})
    model = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for param in model.model.visual.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path)
    return path, model


def fresh_model(path):
    import json

    return VisionModel(VisionConfig.from_hf(json.loads((path / "config.json").read_text()))).eval()


def test_loads_every_vision_tensor_and_matches(checkpoint):
    path, hf_model = checkpoint
    reader = SafetensorsReader(path / "model.safetensors")
    model = fresh_model(path)
    consumed = load_vision_weights(model, reader)
    assert consumed == {k for k in reader.keys() if k.startswith("model.visual.")}
    assert len(consumed) == 2 * 12 + 6 + 2 + 1
    x, grid_thw = patches([[1, 8, 12], [2, 4, 6]])
    with torch.inference_mode():
        got = model(x, grid_thw)
        want = hf_model.model.visual(x, grid_thw).pooler_output
    assert rel_err(got, want) < 1e-5


def test_casts_to_model_dtype(checkpoint):
    path, _ = checkpoint
    model = fresh_model(path).to(torch.bfloat16)
    load_vision_weights(model, SafetensorsReader(path / "model.safetensors"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_missing_key_is_named(checkpoint):
    path, _ = checkpoint
    key = "model.visual.blocks.1.attn.qkv.bias"
    reader = EditedReader(SafetensorsReader(path / "model.safetensors"), hide=[key])
    with pytest.raises(WeightError, match="missing.*" + key.replace(".", r"\.")):
        load_vision_weights(fresh_model(path), reader)


def test_unexpected_key_is_named(checkpoint):
    path, _ = checkpoint
    key = "model.visual.blocks.0.attn.extra.weight"
    reader = EditedReader(SafetensorsReader(path / "model.safetensors"), add={key: torch.zeros(2)})
    with pytest.raises(WeightError, match="unexpected.*" + key.replace(".", r"\.")):
        load_vision_weights(fresh_model(path), reader)


def test_shape_mismatch_says_expected_and_got(checkpoint):
    path, _ = checkpoint
    key = "model.visual.merger.linear_fc2.weight"
    reader = EditedReader(SafetensorsReader(path / "model.safetensors"), add={key: torch.zeros(32, 100)})
    with pytest.raises(WeightError, match=r"merger\.linear_fc2\.weight: expected \[32, 256\], got \[32, 100\]"):
        load_vision_weights(fresh_model(path), reader)


def test_patch_embed_conv_layout_and_names():
    """Our parameter names and shapes are exactly the HF ones under model.visual."""
    model = VisionModel(VisionConfig.from_hf(TINY))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["patch_embed.proj.weight"] == (64, 3, 2, 16, 16)
    assert shapes["pos_embed.weight"] == (2304, 64)
    assert shapes["merger.linear_fc1.weight"] == (256, 256)
    assert not dict(model.named_buffers())
