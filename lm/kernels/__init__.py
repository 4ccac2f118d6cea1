"""CPU fast paths for decoding: bandwidth-bound products of a few rows with large weights.

One switch, the environment variable `QWEN35_CPU_KERNELS`:
    unset / "auto"  build the C++ kernels on first use (torch caches the build); if that fails
                    (no C++ compiler), say so once on stderr and use `F.linear`
    "1"             the kernels are required: a failed build raises
    "0"             never use them (the reference path, `F.linear`)
The kernels give the same results as `F.linear` up to float32 rounding (summation order).
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # decode batches; larger products go to MKL's GEMM, which is efficient there
MIN_WEIGHT_ELEMENTS = 1 << 16  # smaller weights stay in cache: no bandwidth to win, only call overhead

_lock = threading.Lock()
_state: dict = {}


def mode() -> str:
    value = os.environ.get("QWEN35_CPU_KERNELS", "auto").strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"QWEN35_CPU_KERNELS must be auto, 1 or 0, got {value!r}")
    return value


def _kernels():
    """The compiled module, or None when switched off or unavailable (auto mode)."""
    current = mode()
    if current == "0":
        return None
    with _lock:
        if "module" not in _state:
            try:
                from .build import load_kernels

                _state["module"] = load_kernels()
            except Exception as e:  # noqa: BLE001 - any build failure means "no kernels"
                if current == "1":
                    raise RuntimeError(f"QWEN35_CPU_KERNELS=1 but the CPU kernels did not build: {e}") from e
                print(f"[qwen35] CPU kernels unavailable ({type(e).__name__}: {e}); decoding uses F.linear, "
                      "which is 2-3x slower on CPU. Set QWEN35_CPU_KERNELS=0 to silence this.", file=sys.stderr)
                _state["module"] = None
    return _state["module"]


def _eligible(rows: int, weight: torch.Tensor) -> bool:
    return (
        rows <= MAX_ROWS
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.numel() >= MIN_WEIGHT_ELEMENTS
        and weight.is_contiguous()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the small-batch kernel when it applies."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows == 0 or not _eligible(rows, weight) or x.dtype != torch.float32 or (k := _kernels()) is None:
        return F.linear(x, weight, bias)
    y = k.small_m_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, experts: list[int], sizes: list[int]) -> torch.Tensor | None:
    """Rows of x [R, K] grouped by expert (`sizes` rows for each of `experts`) times their expert's
    weight[e] [N, K] -> [R, N]; None when the kernel does not apply (the caller uses its own path)."""
    if not sizes or max(sizes) > MAX_ROWS or x.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if not weight.is_contiguous() or weight[0].numel() < MIN_WEIGHT_ELEMENTS // 4 or (k := _kernels()) is None:
        return None
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    return k.grouped_linear(x.contiguous(), weight, torch.tensor(experts), offsets)


def gated_delta_step(state, q, k, v, decay, beta) -> torch.Tensor | None:
    """In-place decode step of the gated delta rule (see delta_rule.gated_delta_step) with one pass
    over the state; None when the kernel does not apply. Shapes: state [B, H, Dk, Dv]; q, k
    [B, H, Dk]; v [B, H, Dv]; decay, beta [B, H]."""
    b, h, dk, dv = state.shape
    if state.device.type != "cpu" or state.dtype != torch.float32 or dv % 16 or not state.is_contiguous():
        return None
    if (kernel := _kernels()) is None:
        return None
    flat = (lambda t, *shape: t.reshape(*shape).contiguous())
    out = kernel.gated_delta_step(state.view(b * h, dk, dv), flat(q, b * h, dk), flat(k, b * h, dk),
                                  flat(v, b * h, dv), flat(decay, b * h), flat(beta, b * h))
    return out.view(b, h, dv)
