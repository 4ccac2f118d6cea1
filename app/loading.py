"""Load the `mm.Pipeline` behind every front end: a checkpoint directory, or the built-in default model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lm.formats.policy import CHOICES as WEIGHTS_CHOICES
from mm import Pipeline

from .default_model import RANDOM_WEIGHTS_NOTICE, default_model_path

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_model(model: str | Path | None) -> Path:
    """The checkpoint directory to load: `model`, or the built-in default model (announced on stderr)."""
    if model is None:
        print(f"WARNING: {RANDOM_WEIGHTS_NOTICE}", file=sys.stderr, flush=True)
        return default_model_path()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model checkpoint directory not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory: it has no config.json")
    return path


def load_pipeline(model: str | Path | None, *, device: str = "cpu", dtype: torch.dtype | str | None = None,
                  weights: str = "auto") -> Pipeline:
    """`mm.Pipeline` for a checkpoint directory (None: the built-in random-weights model); `weights`
    the storage format of the large weights (see `mm.load_model`)."""
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    return Pipeline.from_pretrained(resolve_model(model), device=device, dtype=dtype, weights=weights)


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype from its name ("bfloat16", "float16", "float32")."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype and --weights, shared by the command-line front ends."""
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint directory (default: the built-in tiny model with RANDOM weights)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--weights", default="auto", metavar="FORMAT",
                        help=f"storage of the large weights on CPU: {', '.join(WEIGHTS_CHOICES)}, or per part, e.g. "
                             "'int4,attention=int8' (default auto: a bf16 checkpoint stays bf16, computed in float32)")
