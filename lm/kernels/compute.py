"""The compute format of prefill products: how many-row products multiply, whatever the weights'
storage format (lm/formats). Chosen at load (`mm.load_model(compute=...)`, `--compute` on every
front end), held by each layer (`Linear.compute`, `Experts.compute`) and resolved per product by
`pick`; decode products are not affected (they are bandwidth-bound and keep their own paths).

    fp32   float32 GEMMs; compact weights converted to float32 first (the exact reference path)
    bf16   x and W rounded to bf16, products summed in float32: on AMX tiles (amx_linear.cpp, every
           weight format, converted in L2-sized panels, never whole), else torch's bf16 GEMM
    int8   x rounded to Q8_0 blocks, integer products with Q8_0 / Q4_0 / K-quant weights as they
           lie: Q8_0 / Q4_0 on AMX-INT8 tiles where the CPU has them (amx_linear.cpp), else the
           int8 dot products (int8_dot.h, kquant_dot.h; while kernels.int8_activations is on);
           weights in other formats take float32
    auto   float32 weights: fp32 (exact); other formats: bf16 where the CPU has AMX-BF16 tiles
           (bench/ttft.py measures it against the float32 path), else int8 for Q8_0 / Q4_0 /
           K-quant weights, and for bf16 ones bf16 where the CPU has AVX512-BF16 (torch's bf16 GEMM), else fp32

A gated attention layer's prefill follows its projections: under bf16 or int8 compute, bf16
queries, keys and values with float32 softmax and sums (bf16_attention.cpp on CPUs with AVX512-BF16
and no AMX; torch's SDPA under bf16 compute elsewhere).

Errors against float32 on the same weights: tests/lm/test_compute.py.
"""

from __future__ import annotations

import functools
import sys

import torch

from ..formats import FP32, INT4, KQUANTS, Format

CHOICES = ("auto", "fp32", "bf16", "int8")
_said: set[str] = set()


def check(name: str) -> str:
    """`name` if it is a compute format; a ValueError listing the choices otherwise."""
    if name not in CHOICES:
        raise ValueError(f"unknown compute format {name!r}; choose one of {', '.join(CHOICES)}")
    return name


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


_tiles_checked: dict[int, bool] = {}


def tiles(k) -> bool:
    """Whether the kernels' AMX products (amx_linear.cpp) are used: built with them, the tiles granted
    by the OS, and, once a process, both products equal to their portable twins (the float32
    products of the same bf16-rounded / Q8_0-rounded operands) on a small case; said once if not."""
    if k is None or not k.amx_ready():
        return False
    if id(k) not in _tiles_checked:
        _tiles_checked[id(k)] = ok = _self_check(k)
        if not ok:
            say_once("amx-check", "the AMX products failed their start-up check against their portable twins; "
                     "prefill takes the other kernels")  # fmt: skip
    return _tiles_checked[id(k)]


def _self_check(k) -> bool:
    from ..formats import to_float

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 96, generator=g), torch.randn(40, 96, generator=g)
    bf16 = torch.nn.functional.linear(x.bfloat16().float(), w.bfloat16().float())
    q = INT4.quantize(w)
    blocks = x.view(40, 3, 32)  # x in blocks of 32 with float32 scales, as the int8 products round it
    d = blocks.abs().amax(-1, keepdim=True) / 127
    int8 = (torch.round(blocks / d) * d).view(40, 96) @ to_float(q, 96, INT4).t()
    close = lambda a, b: bool(((a - b).abs().max() <= 1e-4 * b.abs().max()).item())  # noqa: E731
    return close(k.amx_linear(x, (w, FP32.code)), bf16) and close(k.amx_int8_linear(x, (q, INT4.code)), int8)


def pick(requested: str | None, weight: Format, k) -> str:
    """The compute format of one prefill product: `requested` (a layer's `compute`, None = as the
    products ran before the option: int8 for Q8_0 / Q4_0 weights while int8 activations are on,
    float32 otherwise) for a weight stored in format `weight` (lm/formats), `k` the kernels' module
    (or None)."""
    int8_ok = int8_format(weight) and k is not None and bool(k.INT8_DOT) and k.int8_activations()
    if requested is None:
        return "int8" if int8_ok else "fp32"
    if requested == "auto":
        if weight.name == "fp32":
            return "fp32"  # float32 weights ask for the exact path
        if tiles(k):
            return "bf16"
        if int8_ok:
            return "int8"
        return "bf16" if weight.name == "bf16" and "avx512_bf16" in cpu_flags() else "fp32"
    if requested == "int8" and not int8_ok:
        say_once("int8-n/a", "compute='int8' applies to int8 / int4 / K-quant weights with the kernels' int8 dot products "
                  "on; other products compute in float32")  # fmt: skip
        return "fp32"
    if requested == "bf16" and not tiles(k) and "avx512_bf16" not in cpu_flags():
        say_once("bf16-emulated", "compute='bf16' on a CPU without AVX512-BF16 or AMX-BF16: torch emulates bf16 "
                  "products there, slower than float32 (bench/ttft.py measures it); 'auto' does not pick it")  # fmt: skip
    return check(requested)


def int8_format(weight: Format) -> bool:
    """Whether products with weights of this format have an int8 path: Q8_0 / Q4_0 (int8_dot.h) and
    the K-quants (kquant_dot.h)."""
    return weight.name in ("int8", "int4") or weight in KQUANTS.values()


def int8_on_tiles(requested: str | None, k, weight: Format) -> bool:
    """Whether an int8 product takes AMX tiles (amx_linear.cpp) rather than the int8 dot products: for
    Q8_0 / Q4_0 weights when the CPU has them and the layer asked for a compute format (without one,
    prefill keeps the dot products, whose rows equal the decode products' bit for bit). K-quant
    weights always take the dot products."""
    return requested is not None and weight.name in ("int8", "int4") and tiles(k)


def say_once(key: str, text: str) -> None:
    """`text` on stderr, once a process per `key`."""
    if key not in _said:
        _said.add(key)
        print(f"[qwen35] {text}", file=sys.stderr)
