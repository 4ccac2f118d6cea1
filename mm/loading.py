"""`load_model`: a checkpoint directory -> a ready `VLModel`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lm import CheckpointReader, WeightError, load_lm_weights
from lm.hugepages import advise_huge_pages
from vision import load_vision_weights

from .config import ModelConfig, read_config_json
from .model import VLModel

MTP_PREFIX = "mtp."  # multi-token-prediction head: in real checkpoints, not used here


def default_dtype(device: str | torch.device) -> torch.dtype:
    """float32 on CPU (CPUs without native bf16 run bf16 matmuls ~300x slower), bfloat16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> VLModel:
    """Load `config.json` and the safetensors weights (single file or shards) of a Qwen3.5 checkpoint.

    Tensors are streamed one at a time into a model allocated once on `device`. Every model
    parameter must be in the checkpoint and every checkpoint tensor must be used, except `mtp.*`,
    which is skipped; otherwise a `WeightError` names the tensor.
    """
    path = Path(path)
    config = ModelConfig.from_hf(read_config_json(path))
    dtype = dtype or default_dtype(device)
    reader = CheckpointReader(path)
    with torch.device("meta"):
        model = VLModel(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    advise_huge_pages(model.parameters())  # before the first write: decode streams these pages
    model.lm.init_buffers()
    model.lm.tie_weights()
    used = load_lm_weights(model.lm, reader)
    if model.visual is not None:
        try:
            used |= load_vision_weights(model.visual, reader)
        except ValueError as e:
            raise WeightError(str(e)) from e
    unexpected = sorted(k for k in reader.keys() if k not in used and not k.startswith(MTP_PREFIX))
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" (and {len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        raise WeightError(f"checkpoint has {len(unexpected)} tensor(s) this model does not use: {shown}")
    model.generation_config = _generation_config(path)
    return model.eval().requires_grad_(False)


def _generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
