"""Which format each language-model weight is stored in: `weights=` of `mm.load_model`.

A spec is a base format, optionally followed by per-part overrides, comma-separated:

    "auto"                      bf16 where the checkpoint is bf16 (or fp8), else fp32: lossless
    "fp32" | "bf16" | "int8" | "int4"
    "int4,attention=int8"       int4, but the full-attention projections int8
    "experts=int4"              auto, with the routed experts int4

Parts (the large weights, streamed by every decode step):
    experts        the routed experts (mlp.experts.gate_up_proj / down_proj)
    shared_expert  the shared expert's projections
    attention      the full-attention q/k/v/o projections
    deltanet       the Gated DeltaNet in_proj_qkv, in_proj_z and out_proj
    mlp            the dense MLP projections (dense models)
    lm_head        the LM head
    mtp            the MTP layer's fc [H, 2H] (lm/mtp.py; the weights of its decoder layer take the
                   parts above, as the main layers' do)
    embed          the embedding table: fp32 or bf16 only (rows are gathered, not streamed); with an
                   int8/int4 base it stays bf16
    router         the MoE router (mlp.gate): fp32 or bf16 only; "auto" (bf16 for a bf16 checkpoint:
                   lossless) under every base but fp32 and bf16, which store it as they say. Each
                   decode step streams it whole (Qwen3.5-35B-A3B: 2 MiB a layer in float32)
    vision         the vision tower's matrices: fp32 or bf16 only (the tower is compute-bound and
                   always computes in float32; a bf16 matrix is converted where it is used, which
                   costs a few percent of the tower's time and halves its memory). "auto" means bf16
                   where the checkpoint is bf16 (lossless), else fp32; it is the default under a
                   bf16 / int8 / int4 base, while the "auto" and "fp32" bases keep the tower fp32
Everything else (norms, the conv, A_log, dt_bias, the shared-expert gate, DeltaNet's small
in_proj_a/b) stays in the compute dtype, float32 on CPU, converted exactly from bf16.
"""

from __future__ import annotations

import re
import sys

import torch

from . import BF16, BF16_G8, FORMATS, FP32, Format

PARTS = ("experts", "shared_expert", "attention", "deltanet", "mlp", "lm_head", "embed", "vision", "router",
         "mtp")
_FLOAT_ONLY = ("embed", "vision", "router")  # parts that take no block format
CHOICES = ("auto", "fp32", "bf16", "int8", "int4")
_PART_OF = [
    (re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$"), "experts"),
    (re.compile(r"\.mlp\.shared_expert\.(gate|up|down)_proj\.weight$"), "shared_expert"),
    (re.compile(r"\.self_attn\.[qkvo]_proj\.weight$"), "attention"),
    (re.compile(r"\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)\.weight$"), "deltanet"),
    (re.compile(r"\.mlp\.(gate|up|down)_proj\.weight$"), "mlp"),
    (re.compile(r"^lm_head\.weight$"), "lm_head"),
    (re.compile(r"^mtp\.fc\.weight$"), "mtp"),
    (re.compile(r"\.embed_tokens\.weight$"), "embed"),
    (re.compile(r"\.mlp\.gate\.weight$"), "router"),
]


def part_of(name: str) -> str | None:
    """The part of a `CausalLM` parameter name (see PARTS), or None for the small tensors."""
    for pattern, part in _PART_OF:
        if pattern.search(name):
            return part
    return None


def parse(spec: str) -> dict[str, str]:
    """A weights spec -> {part: format name or "auto"} for every part; ValueError names a bad item."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"weights must be one of {', '.join(CHOICES)} (optionally 'part=format,...'), got {spec!r}")
    items = [item.strip() for item in spec.split(",")]
    base = "auto"
    if "=" not in items[0]:
        base = items.pop(0)
    if base not in CHOICES:
        raise ValueError(f"unknown weights format {base!r}: choose one of {', '.join(CHOICES)}")
    parts = {p: base for p in PARTS}
    if base in ("int8", "int4"):
        parts["embed"] = parts["router"] = "auto"
    parts["vision"] = "fp32" if base in ("auto", "fp32") else "auto"
    for item in items:
        part, _, fmt = item.partition("=")
        part, fmt = part.strip(), fmt.strip()
        if part not in PARTS:
            raise ValueError(f"unknown weights part {part!r} in {spec!r}: parts are {', '.join(PARTS)}")
        if fmt not in CHOICES or (part in _FLOAT_ONLY and fmt in ("int8", "int4")):
            allowed = "auto, fp32, bf16" if part in _FLOAT_ONLY else ", ".join(CHOICES)
            raise ValueError(f"weights part {part}={fmt!r}: choose one of {allowed}")
        parts[part] = fmt
    return parts


def lossless_auto(checkpoint_dtype: torch.dtype) -> Format:
    """What "auto" stores: bf16 for a bf16 (or fp8) checkpoint, else fp32."""
    return BF16 if checkpoint_dtype in (torch.bfloat16, torch.float8_e4m3fn) else FP32


def vision_dtype(spec: str, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the vision tower's matrices under `spec` (see the `vision` part)."""
    fmt = parse(spec)["vision"]
    fmt = lossless_auto(checkpoint_dtype) if fmt == "auto" else FORMATS[fmt]
    return torch.bfloat16 if fmt in (BF16, BF16_G8) else torch.float32


def storage(name: str, groups: bool) -> Format:
    """The format a weight of `name` ("fp32", "bf16", "int8", "int4") is stored in where it fits:
    bf16 in groups of 8 rows with `groups` (lm.kernels.bf16_groups()), else FORMATS[name]."""
    return BF16_G8 if name == "bf16" and groups else FORMATS[name]


def plan(shapes: dict[str, tuple[int, ...]], spec: str, checkpoint_dtype: torch.dtype, *,
         groups: bool) -> dict[str, Format]:
    """The storage format of every large LM parameter (name -> Format; the rest stay in the compute
    dtype). `shapes` are the parameters' logical shapes; "auto" means bf16 for a bf16 (or fp8)
    checkpoint, else fp32. A block format that does not fit a weight (K % 32, or its rows % 8)
    leaves it in bf16, said once on stderr with the names. With `groups` (lm.kernels.bf16_groups())
    bf16 is stored with its rows in groups of 8 (BF16_G8) where they fit, in rows (BF16) for the
    router and the matrices that do not fit (both layouts are exact)."""
    parts = parse(spec)
    auto = lossless_auto(checkpoint_dtype)
    formats, unfit = {}, []
    for name, shape in shapes.items():
        part = part_of(name)
        if part is None:
            continue
        fmt = auto if parts[part] == "auto" else FORMATS[parts[part]]
        rows = shape[-2] // 2 if name.endswith("gate_up_proj") else shape[-2]  # filled as gate, then up
        if not fmt.fits(shape[-1], rows):
            unfit.append(name)
            fmt = BF16
        elif fmt is BF16 and groups and BF16_G8.fits(shape[-1], rows):
            fmt = BF16 if part == "router" else BF16_G8  # the table too (gather_rows)
        if fmt is not FP32:
            formats[name] = fmt
    if unfit:
        shown = ", ".join(unfit[:4]) + (f" (and {len(unfit) - 4} more)" if len(unfit) > 4 else "")
        print(f"[qwen35] weights={spec}: {len(unfit)} weight(s) have rows that are no multiple of 32 (or a "
              f"row count that is no multiple of 8) and stay bf16: {shown}", file=sys.stderr)
    return formats
