"""Weight storage formats on CPU: one table of traits per format, read by every product.

Compute is float32 on CPU; a format is how a large weight is stored and streamed. A weight in any
format is a plain tensor whose last dimension holds one row of K inputs (lm/kernels/formats.h reads
the same tensors, in registers):

    name   storage                              bits per weight   to float32
    fp32   float32 [..., N, K]                  32                as is
    bf16   uint16 [..., N, K], rows in groups   16                exact
           bfloat16 [..., N, K] (BF16, rows)    16                exact
    int8   uint8 [..., N, K/32*34], GGUF Q8_0    8.5              w = d q, fp16 d per 32 weights
    int4   uint8 [..., N, K/32*18], GGUF Q4_0    4.5              w = d (q - 8)
    q4_k   uint8 [..., N, K/256*144], GGUF Q4_K  4.5              kquants.py (also q5_k: 5.5,
                                                                  q6_k: 6.5625); from GGUF files

int8 and int4 keep GGUF's blocks with the rows regrouped by 8 (blocks.py), so their weights need a
multiple of 8 rows; the policy (policy.py) keeps any other weight in bf16 and says so. Where the CPU
kernels are in use, but on AMD Zen 3 (lm.kernels.bf16_groups), bf16 matrices are stored the same way, 8
rows' blocks of 32 weights interleaved (`group_rows`), as uint16 so that the kernels can tell them
from bf16 rows: a one-row product then reads one stream and loads x once for 8 rows
(lm/kernels/vec.h, block_bf16_groups); the embedding table's rows are gathered from their groups
(`gather_rows`; each of a row's blocks of 32 is one cache line, as in rows). The router, the vision
tower and matrices whose rows are no multiple of 8 (or K of 32) keep bf16 rows (BF16), as does every
bf16 matrix on the reference paths.

A weight's format is a tag its layer holds (`tag`, given at load by lm.weights.use_formats; read
with `format_in`; an untagged weight is float32 or bf16 rows, as its dtype says), and every product
hands it to the C++ kernels with the weight (`Format.code`): they check the storage against it and
never infer a format from bytes. `to_float(w, k, fmt)` gives the float32 matrix (reference paths).
GGUF's blocks were chosen so the quantizers can be checked bit for bit against the `gguf` package
(tests/lm/test_formats.py) and the error compared with llama.cpp's at the same width
(bench/formats.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import blocks, kquants


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype  # of the storage
    block: int  # weights per block along K (1: not blocked)
    block_bytes: int  # storage elements per block
    quantize: Callable[[torch.Tensor], torch.Tensor]  # float [..., K] -> storage [..., row]
    dequantize: Callable[[torch.Tensor, int], torch.Tensor]  # storage [..., row], K -> float32 [..., K]
    code: int  # the format's tag as the C++ kernels take it with each weight (formats.h: Fmt)
    rows: int = 1  # rows stored together: a weight's rows must be a multiple (int8, int4: 8, blocks.py)
    k_multiple: int = 1  # K must be a multiple of this (besides of `block`)

    @property
    def blocked(self) -> bool:
        return self.block > 1

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes * torch.empty(0, dtype=self.dtype).element_size() / self.block

    def fits(self, k: int, n: int = 0) -> bool:
        """Whether n rows of k inputs can be stored in this format."""
        return k % self.block == 0 and k % self.k_multiple == 0 and n % self.rows == 0

    def row_size(self, k: int) -> int:
        return k // self.block * self.block_bytes

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], self.row_size(shape[-1]))

    def inputs(self, row: int) -> int:
        """K of a stored row of `row` elements."""
        return row // self.block_bytes * self.block


FP32 = Format("fp32", torch.float32, 1, 1, lambda w: w.float(), lambda w, k: w, 0)
BF16 = Format("bf16", torch.bfloat16, 1, 1, lambda w: w.to(torch.bfloat16), lambda w, k: w.float(), 1)


def group_rows(w: torch.Tensor) -> torch.Tensor:
    """bf16 weights [..., N, K] (N % 8 == 0, K % 32 == 0) -> the same elements with each 8 rows'
    blocks of 32 interleaved: block b of a group holds row 0's weights 32b..32b+31, then row 1's, ...
    (as blocks.py groups int8 / int4 rows), viewed as uint16."""
    *lead, n, k = w.shape
    if n % blocks.ROW_GROUP or k % blocks.QK:
        raise ValueError(f"bf16 rows in groups need rows in groups of 8 rows and K % 32 == 0, got {list(w.shape)}")
    g = w.to(torch.bfloat16).reshape(*lead, n // 8, 8, k // blocks.QK, blocks.QK).transpose(-3, -2)
    return g.contiguous().view(torch.uint16).reshape(w.shape)


def ungroup_rows(w: torch.Tensor) -> torch.Tensor:
    """`group_rows`' storage -> the bf16 weights [..., N, K] in rows."""
    *lead, n, k = w.shape
    g = w.contiguous().view(torch.bfloat16).reshape(*lead, n // 8, k // blocks.QK, 8, blocks.QK).transpose(-3, -2)
    return g.reshape(w.shape)


BF16_G8 = Format("bf16", torch.uint16, 1, 1, group_rows, lambda w, k: ungroup_rows(w).float(), 4, blocks.ROW_GROUP,
                 blocks.QK)
INT8 = Format("int8", torch.uint8, blocks.QK, blocks.Q8_0_BYTES, blocks.quantize_q8_0, blocks.dequantize_q8_0, 2,
              blocks.ROW_GROUP)
INT4 = Format("int4", torch.uint8, blocks.QK, blocks.Q4_0_BYTES, blocks.quantize_q4_0, blocks.dequantize_q4_0, 3,
              blocks.ROW_GROUP)
FORMATS: dict[str, Format] = {f.name: f for f in (FP32, BF16, INT8, INT4)}  # "bf16": rows (BF16_G8: policy.plan)


def _from_gguf(w: torch.Tensor) -> torch.Tensor:
    raise ValueError("K-quant weights come from GGUF files as they are; there is no K-quant quantizer here")


def _kquant(name: str, code: int) -> Format:
    """GGUF's K-quant `name` (kquants.py): rows as in the file, super-blocks of 256 weights."""
    return Format(name.lower(), torch.uint8, kquants.QK_K, kquants.BLOCK_BYTES[name], _from_gguf,
                  lambda w, k: kquants.dequantize(w, name), code)


Q4_K, Q5_K, Q6_K = _kquant("Q4_K", 5), _kquant("Q5_K", 6), _kquant("Q6_K", 7)
KQUANTS: dict[str, Format] = {"Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}  # GGUF type -> format (GGUF files only)


def tag(module, name: str, fmt: Format) -> None:
    """Record that `module`'s parameter `name` is stored in `fmt`: the tag its products hand the
    kernels with the weight (lm.weights.use_formats tags each weight it gives compact storage)."""
    module.weight_formats = {**getattr(module, "weight_formats", {}), name: fmt}


def format_in(module, name: str = "weight") -> Format:
    """The storage format of `module`'s parameter `name`: its tag (see `tag`), or for an untagged
    weight the float format its dtype is (`float_format`)."""
    fmt = getattr(module, "weight_formats", {}).get(name)
    return fmt if fmt is not None else float_format(getattr(module, name), f"{type(module).__name__}.{name}")


def param_format(model, name: str) -> Format:
    """The format of `model`'s parameter `name` (dotted, as named_parameters gives it): its module's
    tag (`format_in`)."""
    module, _, attr = name.rpartition(".")
    return format_in(model.get_submodule(module), attr)


def stored(module, name: str = "weight") -> tuple[torch.Tensor, Format]:
    """`module`'s parameter `name` with its format (`format_in`): a weight as the kernels take it."""
    return getattr(module, name), format_in(module, name)


def float_format(w: torch.Tensor, what: str = "weight") -> Format:
    """FP32 for a float32 weight, BF16 (rows) for a bfloat16 one: a float weight's dtype is its
    format. Other storage (uint8 blocks, uint16 bf16 groups) must be named: ValueError."""
    if w.dtype == torch.float32:
        return FP32
    if w.dtype == torch.bfloat16:
        return BF16
    raise ValueError(f"{what}: {w.dtype} storage needs its format named (an lm.formats Format such as INT8, INT4 "
                     "or BF16_G8; a model's layers hold theirs: lm.formats.format_in)")


def gather_rows(w: torch.Tensor, ids: torch.Tensor, fmt: Format | None = None) -> torch.Tensor:
    """Rows `ids` of a float32 or bf16 weight [N, K] (the embedding table) of format `fmt` (None: the
    float format of its dtype), in rows or in groups of 8 rows (BF16_G8) -> [*ids.shape, K] in
    float32, or bf16 for either bf16 layout (exact)."""
    fmt = fmt or float_format(w, "embedding table")
    if fmt is not BF16_G8:
        return F.embedding(ids, w)
    n, k = w.shape
    groups = w.view(torch.bfloat16).view(n // blocks.ROW_GROUP, k // blocks.QK, blocks.ROW_GROUP, blocks.QK)
    return groups[ids // blocks.ROW_GROUP, :, ids % blocks.ROW_GROUP].reshape(*ids.shape, k)


def format_of(w: torch.Tensor, k: int) -> Format:
    """The format weight storage `w` [..., row] whose rows hold k inputs can only be among fp32, bf16
    (rows or groups), int8 and int4 (a check for tests and tools). K-quant storage is not told apart
    (Q4_K rows are as long as int4's): the model's layers hold their weights' formats (`format_in`)."""
    if w.dtype == torch.float32 or w.dtype == torch.bfloat16:
        if w.shape[-1] != k:
            raise ValueError(f"a {w.dtype} weight with rows of {w.shape[-1]} cannot take {k} inputs")
        return FP32 if w.dtype == torch.float32 else BF16
    if w.dtype == torch.uint16 and w.shape[-1] == k and BF16_G8.fits(k, w.shape[-2] if w.dim() > 1 else 1):
        return BF16_G8
    if w.dtype == torch.uint8 and k % blocks.QK == 0:
        for f in (INT8, INT4):
            if w.shape[-1] == f.row_size(k):
                return f
    raise ValueError(f"weight storage {w.dtype} {list(w.shape)} is no known format for rows of {k} inputs")


def to_float(w: torch.Tensor, k: int, fmt: Format | None = None) -> torch.Tensor:
    """Weight storage [..., row] of format `fmt` (None: as `format_of` finds it) -> float32 [..., K];
    a float32 weight is returned as it is. (lm.kernels.to_float gives the same through the C++
    conversion, in one pass on all threads.)"""
    if w.dtype == torch.float32:
        return w
    return (fmt or format_of(w, k)).dequantize(w, k)
