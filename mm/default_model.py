"""The built-in default model: a tiny Qwen3.5-MoE with RANDOM weights, for demos and tests.

It has the real architecture (Gated DeltaNet and gated attention layers, routed and shared experts,
the vision tower), the real vocabulary size and special token ids, a small real tokenizer and the
real chat template, and the same files as a real checkpoint directory. It is built deterministically
on first use into a cache directory and reused afterwards. Its answers are random text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from .tokenizer_files import MODEL_VOCAB_SIZE, TOKENIZER_SPECIAL_TOKENS, write_tokenizer

VERSION = 2
RANDOM_WEIGHTS_NOTICE = (
    "Using the built-in default model: a tiny Qwen3.5-MoE with RANDOM weights, so answers are "
    "meaningless text. Point at a real checkpoint with --model PATH (or VQA(model=PATH)), e.g. a "
    "download of Qwen/Qwen3.5-35B-A3B or Qwen/Qwen3.6-35B-A3B."
)


def _config() -> dict:
    ids = TOKENIZER_SPECIAL_TOKENS
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    text = dict(
        model_type="qwen3_5_moe_text", vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_hidden_layers=4,
        layer_types=layer_types, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=False, eos_token_id=ids["<|endoftext|>"], attn_output_gate=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[3, 3, 2], mrope_interleaved=True),
    )
    vision = dict(
        model_type="qwen3_5_moe", depth=2, hidden_size=64, hidden_act="gelu_pytorch_tanh", intermediate_size=128,
        num_heads=2, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
        out_hidden_size=64, num_position_embeddings=2304, deepstack_visual_indexes=[],
    )
    return dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )


GENERATION_CONFIG = {
    "bos_token_id": 248044, "do_sample": True, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
    "temperature": 1.0, "top_k": 20, "top_p": 0.95,
}


def cache_root() -> Path:
    """Where built models live: $QWEN35_CACHE, else $XDG_CACHE_HOME/qwen35-vl, else ~/.cache/qwen35-vl."""
    if os.environ.get("QWEN35_CACHE"):
        return Path(os.environ["QWEN35_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "qwen35-vl"


def default_model_path() -> Path:
    """The default model's checkpoint directory, built on first use (safe against concurrent builders)."""
    path = cache_root() / f"default-model-v{VERSION}"
    if (path / "model.safetensors").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    try:
        build(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first
            if not (path / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build(path: Path) -> None:
    """Write the tokenizer, configs and checkpoint (bf16 safetensors, as the real ones) into `path`."""
    import transformers

    write_tokenizer(path)
    config = transformers.AutoConfig.for_model(**_config())
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForConditionalGeneration._from_config(config, dtype=torch.float32)
    _spread(model, _filler_ids(path))
    model.to(torch.bfloat16).save_pretrained(path)
    add_mtp_layer(path)  # as every real checkpoint ships one: --speculative mtp runs on this model too
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))


def _filler_ids(path: Path) -> torch.Tensor:
    """Ids the small tokenizer fills with never-produced placeholder tokens (see tokenizer_files)."""
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    return torch.tensor(sorted(i for token, i in vocab.items() if token.startswith("<|filler_")))


@torch.no_grad()
def _spread(model: torch.nn.Module, filler_ids: torch.Tensor) -> None:
    """Move zero/one-initialised norms and gates off their init so every weight kind is exercised, and
    zero the LM-head rows of placeholder ids so that the random model emits real tokens (words)."""
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        if p.ndim == 1:
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.lm_head.weight[filler_ids] = 0


def add_mtp_layer(path: Path, seed: int = 0, fused_experts: bool = True) -> Path:
    """Add a multi-token-prediction layer (`mtp.*`, the layout of the real checkpoints) to a saved
    tiny checkpoint, every tensor random: `fc` [H, 2H], the three norms, and one full-attention
    decoder layer shaped as the model's own (its experts fused as `experts.gate_up_proj` [E, 2I, H]
    and `experts.down_proj` [E, H, I], or per expert with `fused_experts=False`). Sets
    `mtp_num_hidden_layers` to 1 in config.json."""
    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(path / "model.safetensors"))
    layer = text["layer_types"].index("full_attention")
    prefix = next(f"{p}layers.{layer}." for p in ("model.language_model.", "model.")
                  if f"{p}layers.{layer}.input_layernorm.weight" in tensors)
    g = torch.Generator().manual_seed(seed + 7)
    dtype = tensors[f"{prefix}input_layernorm.weight"].dtype  # as the checkpoint's own (bf16 for the built-in one)

    def noise(shape):
        return (torch.randn(shape, generator=g) * (0.3 if len(shape) == 1 else 0.03)).to(dtype)

    h = text["hidden_size"]
    mtp = {f"mtp.{n}.weight": noise((h,)) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    mtp["mtp.fc.weight"] = noise((h, 2 * h))
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            new = "mtp.layers.0." + name[len(prefix) :]
            mtp[new] = noise(tuple(tensor.shape))
            if fused_experts and (m := re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", new)):
                experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = mtp.pop(new)
    if experts:
        base = next(iter(experts)).rsplit(".", 1)[0]
        count = len(experts[f"{base}.down_proj"])
        gate_up = [torch.cat([experts[f"{base}.gate_proj"][e], experts[f"{base}.up_proj"][e]]) for e in range(count)]
        mtp[f"{base}.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]: gate rows, then up
        mtp[f"{base}.down_proj"] = torch.stack([experts[f"{base}.down_proj"][e] for e in range(count)])  # [E, H, I]
    save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
