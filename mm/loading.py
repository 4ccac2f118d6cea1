"""`load_model`: a checkpoint directory -> a ready `VLModel`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lm import CheckpointReader, WeightError, load_lm_weights
from lm.formats import policy
from lm.hugepages import advise_huge_pages
from lm.kernels import bf16_attention_kernel, release_openmp_workers
from lm.kernels.compute import check as check_compute
from lm.kernels.compute import cpu_flags, say_once
from lm.linear import Linear
from lm.moe import Experts
from lm.storage import allocate_lm, checkpoint_dtype, compact, plan_formats, settle_memory
from lm.weight_cache import WeightCache
from lm.weights import MTP_PREFIX, read_param_name
from vision import load_vision_weights

from .config import ModelConfig, read_config_json
from .gguf_loading import load_gguf_model, mmproj_beside, model_gguf
from .model import VLModel

SPECULATIVE = (None, "mtp")  # the draft methods of `speculative=`


def default_dtype(device: str | torch.device) -> torch.dtype:
    """float32 on CPU (CPUs without native bf16 run bf16 matmuls ~300x slower), bfloat16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               weights: str = "auto", compute: str = "auto", dequantize_unsupported: bool = False,
               mmproj: str | Path | None = None, speculative: str | None = None,
               num_speculative_tokens: int = 1) -> VLModel:
    """Load `config.json` and the safetensors weights (single file or shards) of a Qwen3.5 checkpoint.

    Tensors are streamed one at a time into a model allocated once on `device`, each converted to
    its storage format as it is read (`weights`, see lm/formats/policy.py: "auto" keeps a bf16
    checkpoint's large weights bf16 on CPU with float32 compute; "fp32", "bf16", "int8" (GGUF Q8_0
    blocks), "int4" (Q4_0), with per-part overrides such as "int4,attention=int8"). Compact formats
    are for CPU. Every model parameter must be in the checkpoint and every checkpoint tensor must
    be used, except `mtp.*`, which is skipped; otherwise a `WeightError` names the tensor. FP8
    checkpoints (Qwen's block-wise e4m3) are dequantized on reading; other quantization methods
    are refused by name. Weights converted to int8 / int4 are cached on disk (lm/weight_cache.py),
    so that the next start of the same checkpoint and spec reads them instead of converting.
    `compute` ("auto", "fp32", "bf16", "int8"; lm/kernels/compute.py) is how prefill products and
    the vision tower multiply: "fp32" is the exact path; "auto" keeps float32 weights exact and
    gives the others bf16 where the CPU has AMX tiles, else int8 (Q8_0 / Q4_0 weights) or bf16 (bf16
    weights, on AVX512-BF16).

    A `.gguf` file (llama.cpp's qwen35 / qwen35moe; or a directory holding one, see
    mm.gguf_loading.model_gguf) loads through mm.gguf_loading, with the vision tower of its `mmproj`
    file (or the one `mmproj*.gguf` beside it in that directory), else text-only; Q4_K / Q5_K / Q6_K
    tensors keep their bits, Q8_K ones are converted at load (lm/gguf_kquants.py), and
    `dequantize_unsupported` lets it dequantize the
    tensor types we neither store nor convert (IQ*, TQ*, ...).

    `speculative="mtp"` also loads the checkpoint's multi-token-prediction layer (`mtp.*`, lm/mtp.py;
    stored in the formats the spec gives its parts) and makes greedy generation draft
    `num_speculative_tokens` (1..3) tokens per step with it (lm/serving/speculative.py); a
    checkpoint without `mtp.*` tensors is refused with their names. Off by default: `mtp.*` is
    then skipped.
    """
    if speculative not in SPECULATIVE:
        raise ValueError(f"speculative={speculative!r}: choose None (off) or 'mtp'")
    if (file := model_gguf(path)) is not None:
        if speculative is not None:
            raise ValueError(f"speculative={speculative!r} reads the mtp.* tensors of a safetensors checkpoint; "
                             f"{file} is a GGUF file")  # fmt: skip
        return load_gguf_model(file, device=device, dtype=dtype, weights=weights, compute=compute,
                               dequantize_unsupported=dequantize_unsupported, mmproj=mmproj or mmproj_beside(path))
    if mmproj is not None:
        raise ValueError(f"mmproj={str(mmproj)!r} goes with a GGUF model file; {path} is a checkpoint directory")
    check_compute(compute)  # a bad value fails before anything is read
    path = Path(path)
    raw = read_config_json(path)
    config = ModelConfig.from_hf(raw)
    dtype = dtype or default_dtype(device)
    policy.parse(weights)  # a bad spec fails before anything is read
    reader = CheckpointReader(path, fp8_block=_fp8_block(raw, path))
    with torch.device("meta"):
        model = VLModel(config)
        if speculative == "mtp":
            model.lm.add_mtp(num_speculative_tokens)
            _check_mtp_tensors(model.lm, reader)
    model = model.to(dtype=dtype)
    formats = plan_formats(model.lm, reader, weights, device, dtype)
    vision = policy.vision_dtype(weights, checkpoint_dtype(reader)) if compact(device, dtype) else None
    model = allocate(model, formats, device, vision)
    spec = weights if speculative is None else f"{weights};mtp"  # the cache entry holds the MTP layer too
    cache = WeightCache(path, spec) if any(f.blocked for f in formats.values()) else None
    if cache is not None and cache.load_into(model.lm):  # converted at an earlier start
        used = {k for k in reader.keys() if read_param_name(k, model.lm) is not None}
    else:
        used = load_lm_weights(model.lm, reader, formats)
        if cache is not None:
            cache.save(model.lm)
    if model.visual is not None:
        try:
            used |= load_vision_weights(model.visual, reader)
        except ValueError as e:
            raise WeightError(str(e)) from e
    unexpected = sorted(k for k in reader.keys() if k not in used and not k.startswith(MTP_PREFIX))
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" (and {len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        raise WeightError(f"checkpoint has {len(unexpected)} tensor(s) this model does not use: {shown}")
    set_compute(compute, model)
    model.generation_config = _generation_config(path)
    release_openmp_workers()  # generation may run on another thread (lm.kernels.release_openmp_workers)
    return model.eval().requires_grad_(False)


def _check_mtp_tensors(lm, reader: CheckpointReader) -> None:
    """Refuse a checkpoint that has no MTP layer, naming the tensors it lacks (partial layers fail
    in load_lm_weights, which names each missing tensor)."""
    if any(k.startswith(MTP_PREFIX) for k in reader.keys()):
        return
    names = [f"mtp.{n}" for n, _ in lm.mtp.named_parameters()]
    shown = ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")
    raise WeightError(f"speculative='mtp' needs the checkpoint's multi-token-prediction layer, but "
                      f"{reader.path} has no mtp.* tensors: missing {shown}")


def set_compute(compute: str, model: VLModel) -> None:
    """Give the model's prefill products and vision tower the compute format `compute` (checked;
    lm/kernels/compute.py): each LM `Linear` and `Experts` holds it, the tower resolves it."""
    check_compute(compute)
    for module in model.lm.modules():
        if isinstance(module, (Linear, Experts)):
            module.compute = compute
    if model.visual is not None:
        set_vision_compute(compute, model.visual)


def set_vision_compute(compute: str, visual) -> None:
    """The tower's compute format (`vision_compute`) and, under bf16 on CPU, its attention kernel
    (lm.kernels.bf16_attention_kernel; None: torch's SDPA)."""
    visual.compute = vision_compute(compute, visual)
    bf16 = visual.compute == "bf16" and visual.pos_embed.weight.device.type == "cpu"
    visual.attend = bf16_attention_kernel(visual.config.head_dim) if bf16 else None


def vision_compute(compute: str, visual) -> str:
    """The vision tower's compute format for the load's `compute`: fp32 or bf16 (torch's bf16 GEMMs).
    "auto": bf16 when the tower's matrices are stored in bf16 and the CPU multiplies bf16 natively
    (AVX512-BF16 or AMX-BF16), else fp32. "int8" (the tower has no int8 products): bf16 where the CPU
    multiplies it natively, else fp32, which is faster there than emulated bf16."""
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    if compute == "auto":
        return "bf16" if native and visual.blocks[0].mlp.linear_fc1.weight.dtype == torch.bfloat16 else "fp32"
    if compute == "int8":
        compute = "bf16" if native else "fp32"
        say_once("vision-int8", f"compute='int8': the vision tower has no int8 products; it computes in {compute}"
                 + ("" if native else " (this CPU has no AVX512-BF16 or AMX-BF16: bf16 would run emulated, slower)"))
    if compute == "bf16" and not native:
        say_once("vision-bf16-emulated", "compute='bf16' on a CPU without AVX512-BF16 or AMX-BF16: the vision "
                 "tower's bf16 products run emulated by torch, slower than float32")  # fmt: skip
    return compute


def allocate(model: VLModel, formats: dict, device: str | torch.device,
             vision_dtype: torch.dtype | None = None) -> VLModel:
    """A model built on the meta device, allocated on `device`: the LM as lm.storage.allocate_lm
    places it (each parameter named in `formats` in its storage format), the vision tower's
    matrices in `vision_dtype` (None: the model's dtype); unfilled."""
    allocate_lm(model.lm, formats, device)
    if model.visual is not None:
        if vision_dtype is not None:
            model.visual.store_matrices_in(vision_dtype)
        model.visual.to_empty(device=device)
        advise_huge_pages(model.visual.parameters())
    if torch.device(device).type == "cpu":
        settle_memory(model)
    return model


def _fp8_block(config: dict, path: Path) -> tuple[int, int] | None:
    """The block size of a Qwen FP8 checkpoint, None for an unquantized one; other quantization
    methods are refused by name."""
    quant = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise WeightError(f"{path}: quantization method {method!r} ({quant.get('fmt', '')}) is not supported; "
                          "this pipeline reads bf16 / fp32 checkpoints and Qwen's block-wise FP8 (e4m3) ones")
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def _generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
