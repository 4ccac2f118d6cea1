"""GGUF's Q8_0 and Q4_0 block formats in PyTorch: quantize and dequantize, bit for bit as the `gguf`
package's numpy reference (`gguf.quants`, itself bit-exact with ggml-quants.c).

A block is 32 consecutive weights of one row (along K, the input dimension), stored as its fp16
scale d (2 bytes, little-endian) followed by the quants:
    Q8_0  32 int8 q              w = d * q          34 bytes per 32 weights (8.5 bits per weight)
    Q4_0  16 bytes: q[j] in the low nibble of byte j, q[j + 16] in its high nibble, q in [0, 15]
                                 w = d * (q - 8)    18 bytes per 32 weights (4.5 bits per weight)
d * q is exact in float32 (11 + 8 significant bits), so dequantizing loses nothing further.

Q8_0 and Q4_0 rows are stored in groups of 8 (`ROW_GROUP`; the rows of a weight must be a multiple
of 8): block b of a group is the 8 rows' fp16 scales (16 bytes), then chunks of 32 bytes, chunk c
holding quant bytes 4c..4c+3 of row 0, then of row 1, ... row 7 (8 chunks for Q8_0, 4 for Q4_0:
272 / 144 bytes, as 8 rows' blocks take). The bytes are GGUF's, regrouped (`interleave8` /
`deinterleave8`), the layout llama.cpp repacks Q4_0 into for AVX2: a decode product takes one
block of 8 rows with its x block in a few instructions, with no sum across a register per row
(bench/q4_layout.cpp measured the gain for Q4_0: one AVX2 core 13-17 -> 31-38 G weights/s; for
Q8_0, one core in cache 23 -> 39).
"""

from __future__ import annotations

import torch

QK = 32  # weights per block
Q8_0_BYTES = 2 + QK
Q4_0_BYTES = 2 + QK // 2
ROW_GROUP = 8  # rows of a block format stored together
_CHUNK = 1 << 22  # weights quantized at a time: bounds the float32 temporaries (~16 MB each)


def _roundf(n: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as gguf's np_roundf computes it."""
    a = n.abs()
    floored = a.floor()
    return n.sign() * (floored + (2 * (a - floored)).floor())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _q8_0_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32] -> uint8 [n, 34]."""
    d = blocks.abs().amax(-1, keepdim=True) / 127
    qs = _roundf(blocks * _inverse(d)).to(torch.int8)
    return torch.cat([d.half().view(torch.uint8), qs.view(torch.uint8)], dim=-1)


def _q4_0_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32] -> uint8 [n, 18]: d = (the weight of largest magnitude) / -8."""
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = largest / -8
    q = torch.trunc(blocks * _inverse(d) + 8.5).to(torch.uint8).clamp_(0, 15)
    packed = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
    return torch.cat([d.half().view(torch.uint8), packed], dim=-1)


def _quantize(w: torch.Tensor, block_bytes: int, blocks_fn) -> torch.Tensor:
    k = w.shape[-1]
    if k % QK:
        raise ValueError(f"block formats need rows of a multiple of {QK} weights, got {k}")
    flat = w.reshape(-1, QK)
    out = torch.empty(flat.shape[0], block_bytes, dtype=torch.uint8)
    step = _CHUNK // QK
    for i in range(0, flat.shape[0], step):
        out[i : i + step] = blocks_fn(flat[i : i + step].float())
    return out.view(*w.shape[:-1], k // QK * block_bytes)


def _check_groups(shape, name: str) -> None:
    if len(shape) < 2 or shape[-2] % ROW_GROUP:
        raise ValueError(f"{name} weights are stored in groups of {ROW_GROUP} rows, got shape {list(shape)}")


def interleave8(q: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """GGUF rows of `block_bytes` blocks, uint8 [..., N, K / 32 * block_bytes] (N % 8 == 0) -> the
    same rows in groups of 8 (the module docstring's layout)."""
    *lead, n, row = q.shape
    _check_groups(q.shape, "Q8_0 / Q4_0")
    nb, chunks = row // block_bytes, (block_bytes - 2) // 4
    g = q.reshape(*lead, n // ROW_GROUP, ROW_GROUP, nb, block_bytes).movedim(-3, -2)  # [.., G, nb, 8, bytes]
    scales = g[..., :2].flatten(-2)  # [.., G, nb, 16]
    quants = g[..., 2:].unflatten(-1, (chunks, 4)).transpose(-3, -2).flatten(-3)  # [.., G, nb, chunks x 8 rows x 4]
    return torch.cat([scales, quants], -1).reshape(*lead, n, row)


def deinterleave8(q: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """Rows in groups of 8 -> GGUF's row-major rows (the inverse of `interleave8`)."""
    *lead, n, row = q.shape
    nb, chunks = row // block_bytes, (block_bytes - 2) // 4
    g = q.reshape(*lead, n // ROW_GROUP, nb, ROW_GROUP * block_bytes)
    scales = g[..., :16].unflatten(-1, (ROW_GROUP, 2))  # [.., G, nb, 8, 2]
    quants = g[..., 16:].unflatten(-1, (chunks, ROW_GROUP, 4)).transpose(-3, -2).flatten(-2)  # [.., G, nb, 8, bytes - 2]
    blocks = torch.cat([scales, quants], -1).movedim(-2, -3)  # [.., G, 8, nb, bytes]
    return blocks.reshape(*lead, n, row)


def _quantize_grouped(w: torch.Tensor, block_bytes: int, blocks_fn, name: str) -> torch.Tensor:
    """Weights [..., N, K] -> GGUF blocks of `blocks_fn` in groups of 8 rows, quantized a chunk of
    whole groups at a time (bounded temporaries)."""
    _check_groups(w.shape, name)
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    out = torch.empty(rows.shape[0], k // QK * block_bytes, dtype=torch.uint8)
    step = max(ROW_GROUP, _CHUNK // max(k, 1) // ROW_GROUP * ROW_GROUP)
    for i in range(0, rows.shape[0], step):
        out[i : i + step] = interleave8(_quantize(rows[i : i + step], block_bytes, blocks_fn), block_bytes)
    return out.view(*w.shape[:-1], out.shape[-1])


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Weights [..., N, K] (any float dtype; N % 8 == 0, K % 32 == 0) -> Q8_0 rows uint8
    [..., N, K / 32 * 34] in groups of 8 rows (GGUF's blocks, regrouped)."""
    return _quantize_grouped(w, Q8_0_BYTES, _q8_0_blocks, "int8 (Q8_0)")


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """Weights [..., N, K] (any float dtype; N % 8 == 0, K % 32 == 0) -> Q4_0 rows uint8
    [..., N, K / 32 * 18] in groups of 8 rows (GGUF's blocks, regrouped)."""
    return _quantize_grouped(w, Q4_0_BYTES, _q4_0_blocks, "int4 (Q4_0)")


def _scales(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, :2].contiguous().view(torch.float16).float()  # [n, 1]


def dequantize_q8_0(q: torch.Tensor, k: int) -> torch.Tensor:
    """Q8_0 rows uint8 [..., N, K / 32 * 34] in groups of 8 -> float32 [..., N, K]."""
    blocks = deinterleave8(q, Q8_0_BYTES).reshape(-1, Q8_0_BYTES)
    w = _scales(blocks) * blocks[:, 2:].contiguous().view(torch.int8).float()
    return w.view(*q.shape[:-1], k)


def dequantize_q4_0(q: torch.Tensor, k: int) -> torch.Tensor:
    """Q4_0 rows uint8 [..., N, K / 32 * 18] in groups of 8 -> float32 [..., N, K]."""
    blocks = deinterleave8(q, Q4_0_BYTES).reshape(-1, Q4_0_BYTES)
    packed = blocks[:, 2:]
    values = torch.cat([packed & 15, packed >> 4], dim=-1).float() - 8  # [n, 32]: q[0..15], q[16..31]
    return (_scales(blocks) * values).view(*q.shape[:-1], k)
