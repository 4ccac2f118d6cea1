"""GGUF's K-quants (Q4_K, Q5_K, Q6_K, Q8_K) in GGUF files. Q4_K, Q5_K and Q6_K tensors keep their
bits: they are formats of ours (lm/formats: Q4_K, Q5_K, Q6_K, read in place by the kernels;
lm/formats/kquants.py states the layouts). The others are dequantized (bit for bit as the `gguf`
package's numpy reference) and converted at load (`STORED_AS`), said once: Q8_K, and a K-quant
tensor whose super-blocks a transform of the converter splits (lm/gguf_names.py, `plan`).
"""

from __future__ import annotations

from .formats import KQUANTS
from .formats.kquants import BLOCK_BYTES, KQUANT_TYPES, QK_K, dequantize  # noqa: F401 - this module's names too

KEPT = tuple(KQUANTS)  # the K-quant types stored as they are
STORED_AS = {"Q4_K": "int4", "Q5_K": "int8", "Q6_K": "int8", "Q8_K": "int8"}
"""The storage format of a K-quant weight that is converted under weights="auto": the smallest of
ours (int4 = Q4_0, 4.5 bits per weight; int8 = Q8_0, 8.5) with no fewer bits per weight than the
file's type, int8 at most. Q4_K -> int4 keeps the size a Q4_K_M file was chosen for; the second
rounding, to Q4_0's 16 symmetric levels, adds half an int4 step at most (the largest |w| of 32
weights / 16; / 8 for a weight Q4_0 clamps), about Q4_K's own error. Q5_K, Q6_K -> int8 keep what
the file holds (int8 adds at most the largest |w| of 32 / 254); Q8_K (9.1 bits) -> int8 too, our
widest block format. weights="fp32" keeps their values exactly (K-quant values are float32
products, not bf16)."""
