"""CPU fast paths (float32): what PyTorch's generic operators do slowly at these sizes.

Decode: bandwidth-bound products of a few rows with large weights (small_m_linear.cpp), and whole
decode-time blocks fused into one call each, because at decode sizes the fixed cost of each tensor
operation outweighs its arithmetic: a DeltaNet token step (delta_step.cpp), a MoE block
(moe_decode.cpp), attention over the KV cache (decode_attention.cpp), RMS norms (norms.cpp).
A whole decode step runs them layer after layer in one call (decode_step.cpp, driven by lm/decode.py);
the wrappers below serve the layers.
Prefill: the routed experts one per thread (expert_mlp.cpp) and the chunked delta rule with heads
side by side (chunked_delta_rule.cpp), where many small GEMMs run better single-threaded in parallel;
the DeltaNet causal conv in one pass (causal_conv.cpp).

Weights may be stored in any format of lm/formats (float32, bf16, GGUF Q8_0 / Q4_0 blocks): the
decode products, the MoE blocks and the decode step read them in registers (kernels/formats.h).
A weight argument below is a `(storage, Format)` pair (lm.formats.stored gives a layer's), or a
float32 / bf16 tensor, whose dtype is its format; the C++ kernels get the format's code with it.
Prefill products compute in the format each layer holds (compute.py: fp32, bf16 on AMX tiles
(amx_linear.cpp) or through torch, int8 on AMX tiles or through the int8 dot products of int8_linear
and expert_mlp); a layer without one keeps the int8 dot products for Q8_0 / Q4_0 weights while int8
activations are on (set_int8_activations) and converts other compact weights to float32 once per
call for the GEMMs.

One switch, the environment variable `QWEN35_CPU_KERNELS`:
    unset / "auto"  build the C++ kernels on first use (torch caches the build); if that fails
                    (no C++ compiler), say so once on stderr and use the reference paths
    "1"             the kernels are required: a failed build raises
    "0"             never use them (the reference PyTorch paths in lm/)
The kernels give the same results as the reference paths up to float32 rounding (summation order);
tests/lm/test_kernels.py checks each against its reference.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

import torch
import torch.nn.functional as F

from ..formats import BF16_G8, FP32, Format, float_format, ungroup_rows
from . import tuning
from .compute import int8_on_tiles, pick, say_once, tiles

MAX_ROWS = 8  # decode batches; larger products go to MKL's GEMM, which is efficient there
MIN_WEIGHT_ELEMENTS = 1 << 16  # smaller weights stay in cache: no bandwidth to win, only call overhead
PANEL = 48  # output rows per panel (vec.h)

_lock = threading.Lock()
_state: dict = {}

Weight = torch.Tensor | tuple[torch.Tensor, Format]  # a weight argument (see the top)


def _split(weight) -> tuple[torch.Tensor, Format]:
    """A weight argument -> (storage, Format)."""
    if isinstance(weight, tuple):
        return weight
    return weight, float_format(weight)


def _arg(weight, fmt: Format) -> tuple[torch.Tensor, int]:
    """A weight as the C++ kernels take it: (storage, format code)."""
    return weight, fmt.code


def weight_arg(weight: Weight) -> tuple[torch.Tensor, int]:
    """A weight argument (see the top) as the C++ kernels take it: (storage, format code)."""
    return _arg(*_split(weight))


def mode() -> str:
    value = os.environ.get("QWEN35_CPU_KERNELS", "auto").strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"QWEN35_CPU_KERNELS must be auto, 1 or 0, got {value!r}")
    return value


_UNBUILT = object()


def _kernels():
    """The compiled module, or None when switched off or unavailable (auto mode)."""
    module = _state.get("module", _UNBUILT)
    if module is not _UNBUILT and os.environ.get("QWEN35_CPU_KERNELS", "auto") == "auto":
        return module  # the common case, first and cheap: this runs ~100 times per decode step
    current = mode()
    if current == "0":
        return None
    with _lock:
        if "module" not in _state:
            try:
                from .build import load_kernels

                _state["module"] = load_kernels()
                if not _state["module"].INT8_DOT:  # said once: this build's Q8_0 / Q4_0 products
                    print("[qwen35] the int8 dot products of the CPU kernels need AVX2, which this build lacks: "
                          "int8 / int4 weights decode with float32 activations and prefill through float32 "
                          "copies (slower)", file=sys.stderr)
            except Exception as e:  # noqa: BLE001 - any build failure means "no kernels"
                if current == "1":
                    raise RuntimeError(f"QWEN35_CPU_KERNELS=1 but the CPU kernels did not build: {e}") from e
                print(f"[qwen35] CPU kernels unavailable ({type(e).__name__}: {e}); using the reference "
                      "PyTorch paths, 2-3x slower on CPU. Set QWEN35_CPU_KERNELS=0 to silence this.", file=sys.stderr)
                _state["module"] = None
    return _state["module"]


def compiled():
    """The compiled kernel module (lm/kernels/bindings.cpp names its functions), or None when the
    kernels are switched off or unavailable."""
    return _kernels()


def _fusable(x: torch.Tensor):
    """The kernel module when the activations x are float32 on CPU and the kernels are on, else None.
    (The kernels check their weights themselves and raise a clear error on a mismatch.)"""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return _kernels()


def _eligible(rows: int, weight: torch.Tensor, fmt: Format) -> bool:
    """A product the small-batch kernel serves: few rows, a contiguous float32 weight worth streaming."""
    return (
        rows <= MAX_ROWS
        and fmt is FP32
        and weight.numel() >= MIN_WEIGHT_ELEMENTS
        and weight.is_contiguous()
    )


def panel_rows() -> int:
    """Rows from which decode products stream panel copies of their weights: the tuning profile's
    `panel_rows` where the kernels were built with 16-float vectors (AVX-512), never (MAX_ROWS + 1)
    with 8-float vectors, where the 8-row panel kernel (48 accumulators for 16 registers) spills."""
    module = _kernels()
    return tuning.current().panel_rows if module is not None and module.VECTOR_FLOATS >= 16 else MAX_ROWS + 1


def moe_pieces() -> int:
    """moe_decode's parallel pieces per expert gate/up and per down (the tuning profile)."""
    return tuning.current().moe_pieces


def bf16_groups() -> bool:
    """Whether bf16 matrices are stored with their rows in groups of 8 (BF16_G8) rather than in rows
    (lm/formats/policy.py takes it as `groups`): where the CPU kernels are in use and the tuning
    profile says so (all but AMD Zen 3). A one-row product then reads a group of 8 rows as one stream
    and loads x once for the 8 rows (vec.h, block_bf16_groups). The reference paths keep rows, which
    PyTorch reads as they are; both layouts hold the same bf16 values. One switch, the environment
    variable QWEN35_BF16_GROUPS: "auto" (unset) as above, "1" groups, "0" rows."""
    value = os.environ.get("QWEN35_BF16_GROUPS", "auto").strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"QWEN35_BF16_GROUPS must be auto, 1 or 0, got {value!r}")
    if value != "auto":
        return value == "1"
    return _kernels() is not None and tuning.current().bf16_groups


def to_float(weight: Weight, k: int) -> torch.Tensor:
    """A weight [..., row] (see the top) -> float32 [..., K] (lm/formats.to_float, equal bit for bit),
    in one pass on all threads through the C++ conversion when the kernels are on."""
    w, fmt = _split(weight)
    if fmt is FP32:
        return w
    if w.device.type == "cpu" and (module := _kernels()) is not None:
        return module.dequantize(_arg(w.contiguous(), fmt), k)
    return fmt.dequantize(w, k)


_panels: dict = {}  # id(weight) -> (its version, panel copy); an entry goes when its weight does
_NO_PANELS = torch.empty(0)


def panels(weight: Weight) -> torch.Tensor:
    """The panel copy of a weight [N, K] that decode products of 5-8 rows stream (see vec.h): W's
    rows in panels of 48 (the last one 16 or 32 when N % 48 != 0), each panel stored k-major, so
    that each weight float is loaded once and multiplied by all rows of x. With 5-8 rows the
    row-major products are compute-bound; through the panels they run ~1.6x faster at this
    machine's higher memory bandwidth. The copy costs the weight's memory once more; it is made on
    first use, lives as long as the weight and is remade when the weight is written in place.
    Float32 and bf16 weights (a bf16 copy for a bf16 weight of either layout: vec.h, panel_load) of at least
    MIN_WEIGHT_ELEMENTS, contiguous, [N, K] with N a multiple of 16; else an empty tensor."""
    weight, fmt = _split(weight)
    if (fmt.blocked or weight.numel() < MIN_WEIGHT_ELEMENTS or not weight.is_contiguous() or weight.dim() != 2
            or weight.shape[0] % 16):
        return _NO_PANELS
    cached = _panels.get(id(weight))
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    from ..hugepages import advise_huge_pages

    n, k = weight.shape
    rows = ungroup_rows(weight) if fmt is BF16_G8 else weight  # bf16 rows in groups of 8
    full = n // PANEL * PANEL
    copy = torch.empty(n * k, dtype=rows.dtype)
    advise_huge_pages([copy])  # streamed like the weights: before the first write
    with torch.no_grad():
        copy[: full * k].view(-1, k, PANEL).copy_(rows[:full].view(-1, PANEL, k).transpose(1, 2))
        copy[full * k :].view(k, n - full).copy_(rows[full:].t())
    if id(weight) not in _panels:
        weakref.finalize(weight, _panels.pop, id(weight), None)
    _panels[id(weight)] = (weight._version, copy)
    return copy


def panel_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The panel copy decode products have made of `weight` (see panels), or None when none was made."""
    cached = _panels.get(id(weight))
    return cached[1] if cached is not None else None


def panel_copies() -> list[torch.Tensor]:
    """Every panel copy made so far, of weights still alive."""
    return [copy for _, copy in _panels.values()]


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
           compute: str | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a weight in any format (see the top), through the small-batch
    kernel when it applies; decode rows (one token each, x [B, 1, K]) from `panel_rows()` on
    through the weight's panel copy. More rows (prefill) compute as `compute` picks for this weight
    (lm/kernels/compute.py): bf16 on AMX tiles (amx_linear) or through torch's bf16 GEMM, the int8
    dot products of Q8_0 / Q4_0 weights (int8_linear), or float32, a compact weight converted to
    float32 for this call."""
    weight, fmt = _split(weight)
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    compact = weight.dtype != x.dtype  # a compact format (lm/formats): F.linear cannot read it
    how = prefill_compute(compute, (weight, fmt), x) if rows > MAX_ROWS else "fp32"
    if how == "int8":
        # Q8_0 / Q4_0 / K-quant weights in prefill: integer products, no float32 copy, Q8_0 / Q4_0 on
        # AMX tiles where there are some (amx_linear.cpp), else the int8 dot products (int8_dot.h;
        # K-quants: kquant_tiles.h)
        k = _kernels()
        product = k.amx_int8_linear if int8_on_tiles(compute, k, fmt) else k.int8_linear
        y = product(x.reshape(rows, x.shape[-1]).contiguous(), _arg(weight, fmt))
    elif how == "bf16":
        y = bf16_linear(x.reshape(rows, x.shape[-1]), (weight, fmt))
    else:
        takes_kernel = 0 < rows <= MAX_ROWS if compact else rows > 0 and _eligible(rows, weight, fmt)
        if not takes_kernel or (k := _fusable(x)) is None:
            if compact:
                weight = to_float((weight, fmt), x.shape[-1]).to(x.dtype)
            return F.linear(x, weight, bias)
        decode = x.dim() == 3 and x.shape[1] == 1 and rows >= panel_rows()
        y = k.small_m_linear(x.reshape(rows, x.shape[-1]).contiguous(), _arg(weight, fmt),
                             panels((weight, fmt)) if decode else _NO_PANELS)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def prefill_compute(compute: str | None, weight: Weight, x: torch.Tensor) -> str:
    """The compute format ("fp32", "bf16" or "int8") a layer holding `compute` and `weight` uses in
    prefill for activations x (lm/kernels/compute.py: pick); attention follows its projections."""
    if x.dtype != torch.float32:
        return "fp32"
    return pick(compute, _split(weight)[1], _fusable(x))


def bf16_linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [M, K] float32 times a weight of any format in bf16 with float32 sums -> [M, N] float32: on
    AMX tiles when the kernels have them (the weight converted panel by panel, amx_linear.cpp), else
    torch's bf16 GEMM (a bf16 weight in rows as it is, another converted for this call)."""
    weight, fmt = _split(weight)
    k = _fusable(x)
    if tiles(k):
        return k.amx_linear(x.contiguous(), _arg(weight, fmt))
    if fmt is BF16_G8:  # bf16 in groups of 8 rows: regrouped into rows, no float32 copy
        weight = ungroup_rows(weight)
    elif weight.dtype != torch.bfloat16:
        weight = to_float((weight, fmt), x.shape[-1]).to(torch.bfloat16)
    return F.linear(x.to(torch.bfloat16), weight).float()


def grouped_linear(x: torch.Tensor, weight: Weight, experts: list[int], sizes: list[int]) -> torch.Tensor | None:
    """Rows of x [R, K] grouped by expert (`sizes` rows for each of `experts`) times their expert's
    weight[e] [N, K] -> [R, N]; None when the kernel does not apply (the caller uses its own path)."""
    weight, fmt = _split(weight)
    small = fmt is FP32 and weight[0].numel() < MIN_WEIGHT_ELEMENTS // 4  # compact: always
    if not sizes or max(sizes) > MAX_ROWS or not weight.is_contiguous() or small:
        return None
    if (k := _fusable(x)) is None:
        return None
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    return k.grouped_linear(x.contiguous(), _arg(weight, fmt), torch.tensor(experts), offsets)


def expert_mlp(x: torch.Tensor, gate_up: Weight, down: Weight, counts: torch.Tensor,
               token: torch.Tensor, weight: torch.Tensor, compute: str | None = None) -> torch.Tensor | None:
    """Token rows x [N, H] through their selected experts' SwiGLU (gate_up [E, 2I, H], down [E, H, I]),
    weighted and summed -> [N, H]. The selections come grouped by expert: `counts` [E] of them each,
    `token` [S] the row of each and `weight` [S] its routing weight. Experts spread over threads;
    each computes as `compute` picks for the experts' format (lm/kernels/compute.py). None when n/a."""
    if (k := _fusable(x)) is None:
        return None
    (gate_up, gate_up_fmt), (down, down_fmt) = _split(gate_up), _split(down)
    how = pick(compute, gate_up_fmt, k)
    if how == "bf16" and not tiles(k) and not k.BF16_ROWS:
        say_once("bf16-experts", "compute='bf16': the routed experts' prefill takes bf16 on AMX tiles or, in a "
                 "build with AVX512-BF16, torch's bf16 GEMM; without either it computes in float32")  # fmt: skip
        how = "fp32"
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).long()
    code = {"fp32": 0, "bf16": 1, "int8": 3 if int8_on_tiles(compute, k, gate_up_fmt) else 2}[how]
    return k.expert_mlp(x.contiguous(), _arg(gate_up, gate_up_fmt), _arg(down, down_fmt), offsets, token,
                        weight.float().contiguous(), code)


def chunked_delta_rule(q, k, v, g, beta, state, chunk_size: int):
    """The chunked gated delta rule (lm.delta_rule) with each (row, value head) on one thread at a time,
    on the layer's own layout: q, k [B, T, Hk, Dk] as they leave the conv (not yet unit-norm: the
    kernel does lm.delta_rule._prepare's work per chunk); v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state
    [B, Hv, Dk, Dv] -> (out [B, T, Hv, Dv] float32, new state); None when n/a. Other dtypes on CPU
    are converted to float32 first (the rule computes in float32 either way)."""
    if q.device.type != "cpu" or (kernel := _kernels()) is None:
        return None
    rows = [x.float() if x.stride(-1) == 1 else x.float().contiguous() for x in (q, k, v)]
    return tuple(kernel.chunked_delta_rule(*rows, g.float(), beta.float(), state.float(), chunk_size))


_ALL_KEYS = torch.empty(0, dtype=torch.long)  # decode_attention's lengths: every row attends over all L keys


def decode_attention(q, k, v, mask, scale: float) -> torch.Tensor | None:
    """One query token per row: q [B, H, 1, D] over k, v [B, KV, L, D] (cache views) with `mask`
    [B, 1, 1, L] (True = attend) or None -> [B, H, 1, D], the cache read once; None when n/a."""
    b, h, _, d = q.shape
    rows_contiguous = k.stride(-1) == v.stride(-1) == 1 and k.stride(2) == v.stride(2) == d
    if not rows_contiguous or h % k.shape[1]:
        return None
    if (kernel := _fusable(q)) is None:
        return None
    keep = mask.reshape(b, -1).contiguous() if mask is not None else torch.empty(0, dtype=torch.bool)
    return kernel.decode_attention(q.reshape(b, h, d).contiguous(), k, v, keep, scale, _ALL_KEYS).view(b, h, 1, d)


def gated_delta_step(state, q, k, v, decay, beta) -> torch.Tensor | None:
    """In-place decode step of the gated delta rule (see delta_rule.gated_delta_step) with one pass
    over the state; None when the kernel does not apply. Shapes: state [B, H, Dk, Dv]; q, k
    [B, H, Dk]; v [B, H, Dv]; decay, beta [B, H]."""
    b, h, dk, dv = state.shape
    if dv % 16 or not state.is_contiguous() or (kernel := _fusable(state)) is None:
        return None
    flat = (lambda t, *shape: t.reshape(*shape).contiguous())
    out = kernel.gated_delta_step(state.view(b * h, dk, dv), flat(q, b * h, dk), flat(k, b * h, dk),
                                  flat(v, b * h, dv), flat(decay, b * h), flat(beta, b * h))
    return out.view(b, h, dv)


def multi_linear(x: torch.Tensor, weights: list[Weight]) -> list[torch.Tensor] | None:
    """`[F.linear(x, w) for w in weights]` in one parallel region (decode rows); None when n/a."""
    rows = x.numel() // x.shape[-1]
    if not 0 < rows <= MAX_ROWS or (k := _fusable(x)) is None:
        return None
    ys = k.multi_linear(x.reshape(rows, x.shape[-1]).contiguous(), [_arg(*_split(w)) for w in weights])
    return [y.view(*x.shape[:-1], y.shape[-1]) for y in ys]


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor] | None:
    """Depthwise causal conv + SiLU along time in one pass: x [B, T, C], window [B, K-1, C], weight
    [C, K] -> [out [B, T, C], new window [B, K-1, C]]; None when n/a."""
    if (k := _fusable(x)) is None or window.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    return k.causal_conv(x.contiguous(), window.contiguous(), weight.contiguous())


def bf16_attention_kernel(head_dim: int):
    """`attend(q, k, v, scale, causal=False)` for bf16 q [B, T, H, D], k and v [B, L, KV, D] with
    D = head_dim, no mask or causal (bf16_attention.cpp: vdpbf16ps, float32 softmax), or None where
    torch's SDPA is the choice: head dims above 256 or odd, kernels built without AVX512-BF16, or a
    CPU with AMX tiles (oneDNN's bf16 products there; docs/kernel-decisions.md)."""
    k = _kernels()
    if k is None or not k.BF16_ATTENTION or tiles(k) or head_dim % 2 or head_dim > 256:
        return None
    return k.bf16_attention


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor | None:
    """`x / rms(x) * (offset + weight)` over the last dim in one pass; None when n/a."""
    if x.numel() == 0 or x.stride(-1) != 1 or (k := _fusable(x)) is None:
        return None
    try:
        rows = x.view(-1, x.shape[-1])  # a view: strided rows (e.g. the query half of q_proj) are fine
    except RuntimeError:
        rows = x.reshape(-1, x.shape[-1])
    return k.rms_norm(rows, weight.contiguous(), eps, offset).view(x.shape)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`weight * x / rms(x) * silu(z)` over the last dim in one pass; None when n/a."""
    if x.numel() == 0 or x.stride(-1) != 1 or z.stride(-1) != 1 or (k := _fusable(x)) is None or z.dtype != x.dtype:
        return None
    rows, gates = x.reshape(-1, x.shape[-1]), z.reshape(-1, z.shape[-1])
    return k.gated_rms_norm(rows, gates, weight.float().contiguous(), eps).view(x.shape)


def release_openmp_workers() -> None:
    """End the calling thread's OpenMP worker threads (libgomp's omp_pause_resource_all; its next
    parallel region starts new ones). A thread calls this when it is done with parallel work that
    another thread's decoding follows: the model loader, a generation's end, a request's
    preprocessing before the serving engine's thread takes over. Each thread that runs a parallel
    region keeps a pool of workers, and once the pools' threads outnumber the cores, libgomp stops
    spinning between regions: every one of a decode step's ~80 regions then waits for its workers
    to be woken. Measured on 2 cores (bench checkpoint, int4, batch 1): a generation in a second
    thread took 14.5-15.7 ms a token while the loading thread's pool lived, 10.5-11.4 after it ended
    (10.8-12.8 in the loading thread itself). A no-op without the kernels."""
    if (k := _kernels()) is not None:
        k.release_openmp_workers()


def set_int8_activations(on: bool) -> None:
    """Q8_0 / Q4_0 / K-quant products with the activations rounded to Q8_0 blocks and integer dot
    products (on, the default; kernels/int8_dot.h states the error; K-quants: kquant_dot.h,
    kquant_tiles.h), or with float32 activations (off: equal to dequantize-then-matmul up to float32
    rounding). Decode: ~2x faster on AVX2. Prefill
    (`linear` of more than MAX_ROWS rows, the routed experts of expert_mlp): the weights are read
    as they are instead of converted to float32 for MKL's SGEMM, 1.7-2.5x faster on the GEMMs."""
    if (k := _kernels()) is not None:
        k.set_int8_activations(on)


def int8_activations(x: torch.Tensor | None = None) -> bool:
    """Whether Q8_0 / Q4_0 products round their activations to Q8_0 (set_int8_activations): on
    where the kernels have the int8 dot products (AVX2 builds on), unless switched off; with x, and
    the kernels take x (float32 on CPU)."""
    k = _kernels() if x is None else _fusable(x)
    return k is not None and bool(k.INT8_DOT) and k.int8_activations()


def moe_decode(x, router, gate_up, down, top_k, shared_gate, shared_up, shared_down, shared_expert_gate):
    """A sparse MoE block on a few rows x [N, H] in one call (router, top-k, experts, gated shared
    expert; see moe_decode.cpp). Weights as in `lm.moe` (see the top; the shared-expert gate float32).
    None when the kernel does not apply."""
    if x.shape[0] > MAX_ROWS or (k := _fusable(x)) is None:
        return None
    router, gate_up, down, shared_gate, shared_up, shared_down = (
        _arg(*_split(w)) for w in (router, gate_up, down, shared_gate, shared_up, shared_down))
    return k.moe_decode(x.contiguous(), router, gate_up, down, top_k, shared_gate, shared_up, shared_down,
                        shared_expert_gate, moe_pieces())
