"""llama.cpp's mmproj file of the Qwen3.5 / Qwen3.6 vision tower (architecture `clip`, projector
`qwen3vl_merger`) -> our `VisionModel` (vision/).

The converter (conversion/qwen3vl.py, Qwen3VLVisionModel) renames the tower's tensors and splits the
Conv3D patch embedding into its two temporal slices (`v.patch_embd.weight`, `.weight.1`), stacked
back here; nothing else is transformed. Hyper-parameters come from the `clip.vision.*` metadata.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lm.gguf_read import GGUFFile
from lm.kernels.compute import say_once
from lm.weights import WeightError
from vision import VisionConfig

PROJECTORS = ("qwen3vl_merger",)
_BLOCK = {"attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2",
          "ln1": "norm1", "ln2": "norm2"}
_GLOBAL = {"mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2", "v.post_ln": "merger.norm",
           "v.position_embd": "pos_embed", "v.patch_embd": "patch_embed.proj"}
_NAME = re.compile(r"^(?:v\.blk\.(\d+)\.(\w+)|([\w.]+?))\.(weight|bias)(\.1)?$")


def open_mmproj(path: str | Path, *, dequantize_unsupported: bool = False) -> GGUFFile:
    file = GGUFFile(path, dequantize_unsupported=dequantize_unsupported, architectures=("clip",))
    projector = file.value("clip.projector_type")
    if projector not in PROJECTORS or not file.value("clip.has_vision_encoder"):
        raise WeightError(f"{file.path}: mmproj projector {projector!r} is not the Qwen3.5 vision tower "
                          f"({', '.join(PROJECTORS)} with a vision encoder)")
    return file


def mmproj_config(file: GGUFFile) -> VisionConfig:
    """The tower's config from the `clip.vision.*` metadata."""
    need = lambda k: file.require(f"clip.vision.{k}")  # noqa: E731
    if any(file.value("clip.vision.is_deepstack_layers") or []):
        raise WeightError(f"{file.path}: deepstack layers are not supported")
    patch = int(need("patch_size"))
    return VisionConfig.from_hf(dict(
        depth=int(need("block_count")), hidden_size=int(need("embedding_length")),
        intermediate_size=int(need("feed_forward_length")), num_heads=int(need("attention.head_count")),
        patch_size=patch, spatial_merge_size=int(file.value("clip.vision.spatial_merge_size", 2)),
        temporal_patch_size=2 if "v.patch_embd.weight.1" in file.tensors else 1,
        out_hidden_size=int(need("projection_dim")),
        num_position_embeddings=(int(need("image_size")) // patch) ** 2, deepstack_visual_indexes=[]))


def param_name(gguf_name: str) -> str:
    m = _NAME.match(gguf_name)
    if m and m.group(1) is not None and m.group(2) in _BLOCK:
        return f"blocks.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(4)}"
    if m and m.group(3) in _GLOBAL and (m.group(5) is None or m.group(3) == "v.patch_embd"):
        return f"{_GLOBAL[m.group(3)]}.{m.group(4)}"
    raise WeightError(f"unexpected mmproj tensor {gguf_name!r}: no parameter of the vision tower")


def _say_conversions(file: GGUFFile, params: dict) -> None:
    """One line on stderr for each way the file's tensors change on the way into the tower."""
    blocks = sorted({file.type_of(g) for g in file.tensors} - {"F32", "F16", "BF16"})
    if blocks:
        say_once(f"mmproj-blocks-{'-'.join(blocks)}", f"mmproj {file.path.name}: its {', '.join(blocks)} tensors are "
                 "dequantized into the vision tower's float matrices (the tower has no block-format products)")  # fmt: skip
    to_bf16 = [g for g in file.tensors if file.type_of(g) == "F16" and g != "v.patch_embd.weight.1"
               and params.get(param_name(g), torch.empty(0)).dtype == torch.bfloat16]  # fmt: skip
    if to_bf16:
        say_once("mmproj-f16-bf16", f"mmproj {file.path.name}: {len(to_bf16)} F16 matrices rounded to bf16, the "
                 "vision tower's storage asked for (vision=fp32 in --weights keeps them exact)")  # fmt: skip


def load_mmproj_weights(visual: torch.nn.Module, file: GGUFFile) -> None:
    """Copy every tensor of the mmproj file into the tower (cast to its parameters' dtypes). The
    tower multiplies float matrices only: block-format tensors are dequantized, and F16 ones rounded
    into bf16 matrices; each said once."""
    params = dict(visual.named_parameters())
    pending = set(params)
    _say_conversions(file, params)
    with torch.no_grad():
        for g in file.tensors:
            if g == "v.patch_embd.weight.1":
                continue
            name = param_name(g)
            t = file.float_tensor(g)
            if g == "v.patch_embd.weight" and "v.patch_embd.weight.1" in file.tensors:
                t = torch.stack([t, file.float_tensor("v.patch_embd.weight.1")], dim=2)  # [C, 3, 2, P, P]
            if name not in params or tuple(t.shape) != tuple(params[name].shape):
                expected = list(params[name].shape) if name in params else "no such parameter"
                raise WeightError(f"mmproj tensor {g!r} has shape {list(t.shape)}, expected {expected}")
            params[name].copy_(t)
            pending.discard(name)
    if pending:
        raise WeightError(f"{file.path}: vision tensors missing: {', '.join(sorted(pending)[:8])}")
