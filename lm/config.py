"""Typed language-model config, built from a Hugging Face `config.json` dict."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_text")
LAYER_TYPES = ("linear_attention", "full_attention")


class ConfigError(ValueError):
    """The checkpoint's config asks for something this pipeline cannot run."""


@dataclass(frozen=True)
class TextConfig:
    """The hybrid decoder's hyper-parameters (names follow the HF `text_config`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP: MoE (num_experts > 0) or dense SwiGLU
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_id: tuple[int, ...] = field(default=())
    # multi-token prediction (lm/mtp.py): the checkpoint's `mtp.*` layers
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @classmethod
    def from_hf(cls, config: dict) -> "TextConfig":
        """Build from a full `config.json` dict (nested `text_config`) or a flat text config."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: this pipeline runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        text = config.get("text_config", config)
        if not isinstance(text, dict):
            raise ConfigError("text_config must be a JSON object")
        is_moe = model_type.startswith("qwen3_5_moe")
        tie = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return cls(
            model_type=model_type,
            tie_word_embeddings=tie,
            **_text_fields(text, is_moe),
        )


def _require(text: dict, key: str):
    if key not in text:
        raise ConfigError(f"config is missing {key!r}")
    return text[key]


def _text_fields(text: dict, is_moe: bool) -> dict:
    n_layers = int(_require(text, "num_hidden_layers"))
    rope = _rope_fields(text)
    fields = dict(
        vocab_size=int(_require(text, "vocab_size")),
        hidden_size=int(_require(text, "hidden_size")),
        num_hidden_layers=n_layers,
        layer_types=_layer_types(text, n_layers),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        num_attention_heads=int(_require(text, "num_attention_heads")),
        num_key_value_heads=int(_require(text, "num_key_value_heads")),
        head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
        attention_bias=bool(text.get("attention_bias", False)),
        linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        intermediate_size=int(text.get("intermediate_size", 0) or 0) if not is_moe else 0,
        num_experts=int(_require(text, "num_experts")) if is_moe else 0,
        num_experts_per_tok=int(_require(text, "num_experts_per_tok")) if is_moe else 0,
        moe_intermediate_size=int(_require(text, "moe_intermediate_size")) if is_moe else 0,
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0)) if is_moe else 0,
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        eos_token_id=_ids(text.get("eos_token_id")),
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
        mtp_use_dedicated_embeddings=bool(text.get("mtp_use_dedicated_embeddings", False)),
        **rope,
    )
    _validate(text, fields, is_moe)
    return fields


def _layer_types(text: dict, n_layers: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {n_layers}")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"unsupported layer type(s) {unknown}; known: {LAYER_TYPES}")
    return tuple(types)


def _rope_fields(text: dict) -> dict:
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"unsupported rope_type {rope_type!r}: only 'default' (mRoPE) is implemented")
    if rope.get("mrope_interleaved", True) is not True:
        raise ConfigError("only interleaved mRoPE (mrope_interleaved: true) is supported")
    section = tuple(int(s) for s in rope.get("mrope_section", (11, 11, 10)))
    if len(section) != 3:
        raise ConfigError(f"mrope_section must have 3 entries, got {list(section)}")
    return dict(
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
        mrope_section=section,
    )


def _validate(text: dict, f: dict, is_moe: bool) -> None:
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {text.get('hidden_act')!r}: only 'silu' is implemented")
    if text.get("attn_output_gate", True) is not True:
        raise ConfigError("only gated attention (attn_output_gate: true) is implemented")
    if f["num_attention_heads"] % f["num_key_value_heads"]:
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if f["linear_num_value_heads"] % f["linear_num_key_heads"]:
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    rotary = int(f["head_dim"] * f["partial_rotary_factor"])
    if rotary % 2 or sum(f["mrope_section"]) != rotary // 2:
        raise ConfigError(f"mrope_section {list(f['mrope_section'])} must sum to rotary_dim/2 = {rotary // 2}")
    if is_moe and not 0 < f["num_experts_per_tok"] <= f["num_experts"]:
        raise ConfigError("num_experts_per_tok must be in [1, num_experts]")
    if not is_moe and f["intermediate_size"] <= 0:
        raise ConfigError("a dense model needs intermediate_size > 0")


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
