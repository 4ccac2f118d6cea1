"""GGUF's K-quants (Q4_K, Q5_K, Q6_K, Q8_K) dequantized in PyTorch, bit for bit as the `gguf`
package's numpy reference (`gguf.quants.dequantize`, itself ggml's dequantize_row_*).

A super-block is 256 consecutive weights of one row (along K), in sub-blocks of 32 (Q4_K, Q5_K) or
16 (Q6_K) weights, each with its own scale; fp16 numbers are little-endian:
    Q4_K  144 bytes: d, dmin (fp16), 12 bytes of eight 6-bit scales sc and mins m, 128 bytes of
          4-bit q (32-byte chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones)
                                 w = (d sc) q - (dmin m)        4.5 bits per weight
    Q5_K  176 bytes: as Q4_K, with 32 bytes of high bits before the nibbles (bit j of byte l: the
          fifth bit of weight l of sub-block j)
                                 w = (d sc) q - (dmin m)        5.5
    Q6_K  210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, sixteen int8 scales, d (fp16)
                                 w = (d sc) (q - 32)            6.5625
    Q8_K  292 bytes: d (float32), 256 int8 q, sixteen int16 sums of 16 q (for ggml's dot products)
                                 w = d q                        9.125
Each product is rounded to float32 in the order written, as the reference computes it (for Q4_K,
Q5_K and Q6_K every product is exact in float32; lm/kernels/formats.h reads the same rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q8_K": 292}
KQUANT_TYPES = tuple(BLOCK_BYTES)
_CHUNK = 1 << 14  # super-blocks dequantized at a time: bounds the temporaries (~16 MB of float32)


def _half(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, as float32 [n, 1]."""
    return raw[:, at : at + 2].contiguous().view(torch.float16).float()


def _scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [n, 12] -> the eight 6-bit scales and mins, float32 [n, 8] each:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 have their
    low 4 bits in bytes 8-11 (scales low nibble, mins high) and their top 2 bits in the top bits of
    bytes 0-3 (scales) and 4-7 (mins)."""
    lo_sc, lo_m, packed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 63, (packed & 15) | ((lo_sc >> 6) << 4)], dim=1)
    m = torch.cat([lo_m & 63, (packed >> 4) | ((lo_m >> 6) << 4)], dim=1)
    return sc.float(), m.float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes [n, 128] -> the 4-bit q of eight sub-blocks of 32, [n, 8, 32]."""
    chunks = qs.view(-1, 4, 1, 32)
    return torch.cat([chunks & 15, chunks >> 4], dim=2).view(-1, 8, 32)


def _affine(raw: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d sc) q - (dmin m) of Q4_K / Q5_K, q [n, 8, 32] -> float32 [n, 256]."""
    sc, m = _scales_mins(raw[:, 4:16])
    scale = (_half(raw, 0) * sc)[..., None]  # [n, 8, 1]
    low = (_half(raw, 2) * m)[..., None]
    return (scale * q.float() - low).view(-1, QK_K)


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    return _affine(raw, _nibbles(raw[:, 16:144]))


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = (raw[:, 16:48].view(-1, 1, 32) >> shifts) & 1  # [n, 8, 32]: bit j -> sub-block j
    return _affine(raw, _nibbles(raw[:, 48:176]) | (high << 4))


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    """Two halves of 128 weights; in half h, weight r has its low nibble in byte 64h + r % 64 (the
    high nibble for r >= 64) and its top 2 bits in byte 32h + r % 32 (bits 2 (r // 32) and up)."""
    ql = raw[:, 0:128].view(-1, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=2).view(-1, QK_K)
    qh = raw[:, 128:192].view(-1, 2, 1, 32)
    high = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3).view(-1, QK_K)
    q = (low | (high << 4)).to(torch.int16) - 32
    scale = _half(raw, 208) * raw[:, 192:208].view(torch.int8).float()  # [n, 16]
    return (scale[..., None] * q.float().view(-1, 16, 16)).view(-1, QK_K)


def _q8_k(raw: torch.Tensor) -> torch.Tensor:
    d = raw[:, 0:4].contiguous().view(torch.float32)  # [n, 1]
    return d * raw[:, 4:260].view(torch.int8).float()


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q8_K": _q8_k}


def dequantize(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF rows of `kind` super-blocks, uint8 [..., K / 256 * bytes] -> float32 [..., K]."""
    if kind not in _DEQUANTIZE:
        raise ValueError(f"{kind} is not a K-quant type ({', '.join(KQUANT_TYPES)})")
    size = BLOCK_BYTES[kind]
    if raw.dtype != torch.uint8 or raw.shape[-1] % size:
        raise ValueError(f"{kind} rows are uint8 of a multiple of {size} bytes, got {raw.dtype} {list(raw.shape)}")
    blocks = raw.reshape(-1, size)
    out = torch.empty(blocks.shape[0], QK_K, dtype=torch.float32)
    for i in range(0, blocks.shape[0], _CHUNK):
        out[i : i + _CHUNK] = _DEQUANTIZE[kind](blocks[i : i + _CHUNK].contiguous())
    return out.view(*raw.shape[:-1], raw.shape[-1] // size * QK_K)
