"""`load_model` for a llama.cpp GGUF file (`qwen35` / `qwen35moe`): the language model only.

The hyper-parameters come from the GGUF metadata (lm/gguf_read.py), the tensors through its memory
map with the converter's transforms undone (lm/gguf_names.py). A GGUF model file holds no vision
tower: llama.cpp keeps it in a separate mmproj file (mm/gguf_mmproj.py); without one the model is
text-only, said once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lm.config import ConfigError, TextConfig
from lm.formats import policy
from lm.gguf_names import load_gguf_lm_weights, plan, say_kquant_conversion
from lm.gguf_read import SPLIT_NAME, GGUFFile
from lm.kernels import bf16_groups, release_openmp_workers
from lm.kernels.compute import check as check_compute
from lm.kernels.compute import say_once
from lm.storage import compact

from .config import ModelConfig
from .gguf_mmproj import load_mmproj_weights, mmproj_config, open_mmproj
from .model import VLModel


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix)."""
    return Path(path).suffix.lower() == ".gguf"


def model_gguf(path: str | Path) -> Path | None:
    """The GGUF model file a model path names, None for a checkpoint directory: a `.gguf` file (the
    first part of a split one), or a directory without config.json that holds one model GGUF (or
    its split parts; `mmproj*` files aside). FileNotFoundError when it holds several."""
    path = Path(path)
    if is_gguf(path):
        m = SPLIT_NAME.match(path.name)
        return path.with_name(f"{m.group(1)}-00001-of-{m.group(3)}.gguf") if m else path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(p for p in path.glob("*.gguf") if not p.name.lower().startswith("mmproj"))
    firsts = [p for p in files if (m := SPLIT_NAME.match(p.name)) is None or int(m.group(2)) == 1]
    if len(firsts) > 1:
        raise FileNotFoundError(f"{path} holds {len(firsts)} model GGUF files ({', '.join(p.name for p in firsts)}): "
                                "name one with --model FILE")
    return firsts[0] if firsts else None


def mmproj_beside(path: str | Path) -> Path | None:
    """The mmproj file of a model directory (`mmproj*.gguf`), None for a file path or none there;
    FileNotFoundError when the directory holds several."""
    path = Path(path)
    if not path.is_dir():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.name.lower().startswith("mmproj"))
    if len(found) > 1:
        raise FileNotFoundError(f"{path} holds {len(found)} mmproj files ({', '.join(p.name for p in found)}): "
                                "name one with --mmproj FILE")
    return found[0] if found else None


def gguf_config(file: GGUFFile, mmproj: GGUFFile | None = None) -> ModelConfig:
    """The model config of a GGUF file (the vision token ids from its vocabulary), with the vision
    tower of an mmproj file (else text-only)."""
    raw = file.hf_config()
    text = TextConfig.from_hf(raw)
    if mmproj is None:
        return ModelConfig(model_type=raw["model_type"], text=text, vision=None, **_vision_ids(file))
    try:
        vision = mmproj_config(mmproj)
    except ValueError as e:
        raise ConfigError(f"{mmproj.path}: {e}") from e
    if vision.out_hidden_size != text.hidden_size:
        raise ConfigError(f"{mmproj.path}: projection_dim {vision.out_hidden_size} != the model's embedding_length "
                          f"{text.hidden_size}: not this model's mmproj")
    return ModelConfig(model_type=raw["model_type"].removesuffix("_text"), text=text, vision=vision, **_vision_ids(file))


def _vision_ids(file: GGUFFile) -> dict[str, int]:
    """The ids of the vision tokens in the file's vocabulary (a GGUF has no config.json to say them)."""
    tokens = file.value("tokenizer.ggml.tokens") or []
    index = {t: i for i, t in enumerate(tokens)}
    names = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
    return {key: index[token] for key, token in names.items() if token in index}


def load_gguf_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    weights: str = "auto", compute: str = "auto", dequantize_unsupported: bool = False,
                    mmproj: str | Path | None = None) -> VLModel:
    """A `VLModel` from a GGUF file (see `mm.load_model`), with the vision tower of the `mmproj`
    file, else text-only (said once). `weights="auto"` keeps each LM tensor's own format where ours
    can hold it: Q8_0 -> int8, Q4_0 -> int4 (the same bits, rows regrouped), Q4_K / Q5_K / Q6_K as
    they are, BF16 -> bf16, F32 / F16 -> fp32, Q8_K converted at load to int8 (lm.gguf_names.plan,
    lm.gguf_kquants.STORED_AS; said once); the tower's matrices as
    lm.formats.policy.vision_dtype says for a bf16 (BF16 file) or float32 (other types) checkpoint."""
    from .loading import allocate, default_dtype, set_compute

    check_compute(compute)
    file = GGUFFile(path, dequantize_unsupported=dequantize_unsupported)
    clip = open_mmproj(mmproj, dequantize_unsupported=dequantize_unsupported) if mmproj is not None else None
    config = gguf_config(file, clip)
    dtype = dtype or default_dtype(device)
    if clip is None:
        say_once("gguf-text-only", f"{Path(path).name}: no mmproj file given: the model is text-only (no images or videos)")
    with torch.device("meta"):
        model = VLModel(config)
    model = model.to(dtype=dtype)
    if compact(device, dtype):
        formats = plan(model.lm, file, weights, groups=bf16_groups())
    elif weights != "auto":
        raise ValueError(f"weights={weights!r} is for CPU with float32 compute; on {device} in {dtype} use weights='auto'")
    else:
        formats = {}
    vision = None
    if clip is not None and compact(device, dtype):
        bf16 = "mm.0.weight" in clip.tensors and clip.type_of("mm.0.weight") == "BF16"
        vision = policy.vision_dtype(weights, torch.bfloat16 if bf16 else torch.float32)
    say_kquant_conversion(model.lm, file, formats, dtype)
    model = allocate(model, formats, device, vision)
    load_gguf_lm_weights(model.lm, file, formats)
    if clip is not None:
        load_mmproj_weights(model.visual, clip)
    set_compute(compute, model)
    model.generation_config = {}
    release_openmp_workers()
    return model.eval().requires_grad_(False)
