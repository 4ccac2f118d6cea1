"""Load the `mm.Pipeline` behind every front end: a checkpoint directory, or the built-in default model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lm.formats.policy import CHOICES as WEIGHTS_CHOICES
from lm.kernels.compute import CHOICES as COMPUTE_CHOICES
from lm.kernels.build import prebuild
from lm.serving import EngineConfig
from lm.serving.config import MAX_LEN_CAP
from mm import ModelConfig, Pipeline
from lm.gguf_read import GGUFFile
from mm.gguf_loading import gguf_config, is_gguf, model_gguf
from mm.tokenizer_check import check_tokenizer_files

from mm.default_model import RANDOM_WEIGHTS_NOTICE, default_model_path

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_model(model: str | Path | None) -> Path:
    """The checkpoint directory (or GGUF file) to load: `model`, or the built-in default model (announced on stderr)."""
    if model is None:
        print(f"WARNING: {RANDOM_WEIGHTS_NOTICE}", file=sys.stderr, flush=True)
        return default_model_path()
    path = Path(model).expanduser()
    if (file := model_gguf(path)) is not None:  # a llama.cpp GGUF file, or a directory holding one (text-only)
        if not file.is_file():
            raise FileNotFoundError(f"GGUF model file not found: {file}")
        return file
    if not path.is_dir():
        raise FileNotFoundError(f"model checkpoint directory not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory: it has no config.json")
    return path


def check_model(model: str | Path | None) -> Path:
    """`resolve_model`, then the checks that take a second rather than a weight load: config.json
    names a model type this pipeline runs, and the tokenizer files are there. Front ends call it
    before they touch any input."""
    path = resolve_model(model)
    if is_gguf(path):  # its metadata: the architecture, the config and the tokenizer (types: at load)
        gguf_config(GGUFFile(path, dequantize_unsupported=True, quiet=True))
        return path
    ModelConfig.from_pretrained(path)
    check_tokenizer_files(path)
    return path


def load_pipeline(model: str | Path | None, *, device: str = "cpu", dtype: torch.dtype | str | None = None,
                  weights: str = "auto", engine_options: dict | None = None, compute: str = "auto",
                  dequantize_unsupported: bool = False, mmproj: str | Path | None = None,
                  speculative: str | None = None, num_speculative_tokens: int = 1) -> Pipeline:
    """`mm.Pipeline` for a checkpoint directory (None: the built-in random-weights model); `weights`
    the storage format of the large weights and `compute` how prefill and the vision tower multiply
    (see `mm.load_model`; `dequantize_unsupported` and `mmproj` for a GGUF file); `engine_options` those of its
    serving engine (see `engine_options`); `speculative="mtp"` decodes with the checkpoint's MTP layer
    (`num_speculative_tokens` drafts a step). On CPU the C++ kernels are built (first time, announced)
    or loaded first, so no request waits for a build."""
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    path = resolve_model(model)
    if torch.device(device).type == "cpu":
        prebuild()
    return Pipeline.from_pretrained(path, device=device, dtype=dtype, weights=weights, engine_options=engine_options,
                                    compute=compute, dequantize_unsupported=dequantize_unsupported, mmproj=mmproj,
                                    speculative=speculative, num_speculative_tokens=num_speculative_tokens)


def pipeline_options(args: argparse.Namespace) -> dict:
    """`load_pipeline`'s keyword arguments from those of `add_model_arguments`."""
    return dict(device=args.device, dtype=args.dtype, weights=args.weights, engine_options=engine_options(args),
                compute=args.compute, dequantize_unsupported=args.dequantize_unsupported, mmproj=args.mmproj,
                speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens)


def engine_options(args: argparse.Namespace) -> dict:
    """The serving engine's options from the arguments of `add_model_arguments`."""
    options = dict(max_batch=args.max_batch)
    if args.prefix_cache_mb is not None:  # else the engine's default (lm.serving.default_prefix_cache_bytes)
        options["prefix_cache_bytes"] = int(args.prefix_cache_mb * 2**20)
    if args.max_len is not None:
        options["max_len"] = args.max_len
    return options


def device_problem(device: str) -> str | None:
    """Why `device` cannot run a model here (not a torch device, or a CUDA device this machine lacks), or None."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        return f"--device {device}: not a torch device ({error})"
    if parsed.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0 or (parsed.index is not None and parsed.index >= count):
            return f"--device {device}: this machine has {count} CUDA device(s)"
    return None


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype from its name ("bfloat16", "float16", "float32")."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --weights and the serving engine's sizes, shared by the
    command-line front ends."""
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint directory, or llama.cpp GGUF file (qwen35 / qwen35moe) or a directory holding one (default: "
                             "the built-in tiny model with RANDOM weights)")
    parser.add_argument("--mmproj", default=None, metavar="FILE",
                        help="with a GGUF --model: llama.cpp's mmproj file of the vision tower (default: the one "
                             "mmproj*.gguf beside the model in a --model directory, else text-only)")
    parser.add_argument("--dequantize-unsupported", action="store_true",
                        help="for a GGUF file: dequantize the tensor types not read (Q5_0, IQ*, TQ*, ...) "
                             "to float instead of refusing the file")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--weights", default="auto", metavar="FORMAT",
                        help=f"storage of the large weights on CPU: {', '.join(WEIGHTS_CHOICES)}, or per part, e.g. "
                             "'int4,attention=int8' (default auto: a bf16 checkpoint stays bf16, computed in float32)")
    parser.add_argument("--compute", default="auto", choices=COMPUTE_CHOICES,
                        help="how prompt prefill and the vision tower multiply: fp32 (exact), bf16, int8 (int8 / int4 "
                             "weights), auto (default: fp32 for float32 weights, else bf16 on CPUs with AMX tiles, "
                             "else int8 for int8 / int4 weights)")
    parser.add_argument("--speculative", default=None, choices=["mtp"],
                        help="speculative decoding with the checkpoint's multi-token-prediction layer (mtp.*): "
                             "greedy answers unchanged, sampled ones of the same distribution (default: off)")
    parser.add_argument("--num-speculative-tokens", type=int, default=1, choices=[1, 2, 3], metavar="K",
                        help="with --speculative mtp: tokens drafted a step, 1 to 3 (default: 1)")
    parser.add_argument("--max-batch", type=int, default=EngineConfig.max_batch, metavar="N",
                        help="sequences the engine decodes together (its slots; more requests wait) (default: "
                             f"{EngineConfig.max_batch})")
    parser.add_argument("--max-len", type=int, default=None, metavar="TOKENS",
                        help="the longest sequence (prompt + answer) one slot holds (default: the model's context, "
                             f"at most {MAX_LEN_CAP})")
    parser.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                        help="memory for cached prompt states, reused by later requests and chat turns (default: "
                             "2048, or an eighth of the machine's memory, or the memory available once the model is "
                             "loaded less 4 GiB for activations, whichever is least)")
