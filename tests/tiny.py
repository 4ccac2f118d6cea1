"""Tiny random Qwen3.5 checkpoints with the real layout, built with transformers (the reference)."""

from __future__ import annotations

from pathlib import Path

import torch

KINDS = ("moe_vl", "dense_vl", "moe_text", "dense_text")


def text_config(moe: bool = True, **overrides) -> dict:
    cfg = dict(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # rotary dim 16 -> 8 frequencies, split t/h/w by mrope_section [3, 3, 2]
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
            mrope_section=[3, 3, 2], mrope_interleaved=True,
        ),
        eos_token_id=2,
    )
    if moe:
        cfg.update(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    else:
        cfg.update(intermediate_size=96)
    cfg.update(overrides)
    return cfg


def vision_config(out_hidden_size: int = 64, **overrides) -> dict:
    cfg = dict(
        depth=2, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2,
        in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
        out_hidden_size=out_hidden_size, num_position_embeddings=64, deepstack_visual_indexes=[],
    )
    cfg.update(overrides)
    return cfg


def config_dict(kind: str, **text_overrides) -> dict:
    """A `config.json` dict of the given kind (VL nested or text-only flat)."""
    moe = kind.startswith("moe")
    text = text_config(moe, **text_overrides)
    if kind.endswith("_text"):
        arch = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
        return dict(text, architectures=[arch])
    return dict(
        architectures=["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5_moe" if moe else "qwen3_5",
        text_config=text,
        vision_config=dict(vision_config(text["hidden_size"]), model_type="qwen3_5_moe" if moe else "qwen3_5"),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
        tie_word_embeddings=text["tie_word_embeddings"],
    )


def hf_model(kind: str, seed: int = 0, **text_overrides):
    """A float32 transformers model of `kind` with every parameter moved away from its init."""
    import transformers

    cfg = config_dict(kind, **text_overrides)
    config = transformers.AutoConfig.for_model(**cfg)
    cls = getattr(transformers, cfg["architectures"][0])
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    perturb(model, seed)
    return model


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Zero-initialised norms, unit gates and biases all get noise, so that every parameter matters."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        scale = 0.3 if p.ndim == 1 else 0.02
        p.add_(torch.randn(p.shape, generator=g) * scale)


def save(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def add_mtp(path: Path, seed: int = 0, fused_experts: bool = True) -> Path:
    """Add a random multi-token-prediction layer (`mtp.*`, the real checkpoints' layout) to a saved
    tiny checkpoint: mm.default_model.add_mtp_layer, which the built-in model is made with."""
    from mm.default_model import add_mtp_layer

    return add_mtp_layer(path, seed=seed, fused_experts=fused_experts)