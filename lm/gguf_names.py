"""llama.cpp's `qwen35` / `qwen35moe` tensor names -> ours, with the converter's transforms undone.

llama.cpp's convert_hf_to_gguf.py (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase)
writes, from the Hugging Face tensors:
    *norm.weight (all but linear_attn.norm)   stored + 1             -> w = stored - 1 (exact in float32)
    linear_attn.A_log                         ssm_a = -exp(A_log)    -> A_log = log(-ssm_a)
    linear_attn.dt_bias                       ssm_dt.bias
    linear_attn.conv1d.weight [C, 1, K]       squeezed to [C, K]
    DeltaNet value heads (num_v > num_k)      grouped by key head [k, v/k, d] reordered to tiled
                                              [v/k, k, d]: the V rows of in_proj_qkv and of the conv,
                                              the rows of in_proj_z / a / b, A_log, dt_bias, and the
                                              columns of out_proj -> reordered back
    experts.gate_up_proj [E, 2I, H]           split into ffn_gate_exps / ffn_up_exps (or kept fused,
                                              ffn_gate_up_exps, with --fuse-gate-up-exps)
    per-expert tensors                        stacked into [E, ...]
Blocks of Q8_0 / Q4_0 keep their bits where our storage is the same format (rows regrouped by 8,
lm/formats/blocks.py), as do Q4_K / Q5_K / Q6_K super-blocks (rows as in the file); a reorder of
out_proj's columns moves whole blocks when the value head dim is a multiple of the block (32; 256
for the K-quants), else the weight is planned in float32, or for a K-quant converted (`plan`). Q8_K
tensors, and the K-quant tensors not kept, are dequantized (lm/gguf_kquants.py) and converted at
load into the planned format (gguf_kquants.STORED_AS under "auto"), said once.
"""

from __future__ import annotations

import re
import sys

import torch
from torch import nn

from .config import TextConfig
from .formats import BF16, BF16_G8, FORMATS, FP32, INT4, INT8, KQUANTS, Format, blocks, policy
from .gguf_kquants import KQUANT_TYPES, QK_K, STORED_AS
from .gguf_read import BLOCK_TYPES, GGUFFile
from .weights import WeightError, heads_tied

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj", "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}  # fmt: skip
_PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_AUTO = {"Q8_0": INT8, "Q4_0": INT4, "BF16": BF16, **{k: FORMATS[f] for k, f in STORED_AS.items()}, **KQUANTS}
_RAW = {"Q8_0": INT8, "Q4_0": INT4, **KQUANTS}  # GGUF types whose bits our storage keeps


def param_name(gguf_name: str, n_layers: int) -> str | None:
    """Our `CausalLM` parameter for a GGUF tensor; None for the MTP layers (blk.{n_layers}+, skipped)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLK.match(gguf_name)
    if m and m.group(2) in _LAYER:
        return None if int(m.group(1)) >= n_layers else f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    if m and int(m.group(1)) >= n_layers:
        return None
    raise WeightError(f"unexpected GGUF tensor {gguf_name!r}: no parameter of this model")


def _untile(t: torch.Tensor, dim: int, k_heads: int, v_per_k: int, d: int) -> torch.Tensor:
    """Undo the converter's V-head reorder along `dim`: tiled [v/k, k, d] -> grouped [k, v/k, d]."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], v_per_k, k_heads, d, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _v_heads(c: TextConfig) -> tuple[int, int, bool]:
    k, v = c.linear_num_key_heads, c.linear_num_value_heads
    return k, v // k, v != k


def undo_float(kind: str, t: torch.Tensor, c: TextConfig) -> torch.Tensor:
    """The Hugging Face tensor of a float32 GGUF tensor of layer kind `kind` (e.g. "ssm_a")."""
    k, r, reordered = _v_heads(c)
    qk = 2 * k * c.linear_key_head_dim
    if kind in _PLUS_ONE or kind == "output_norm.weight":
        return t - 1
    if kind == "ssm_a":
        t = -t
        return (_untile(t[:, None], 0, k, r, 1)[:, 0] if reordered else t).log()
    if kind == "ssm_dt.bias":
        return _untile(t[:, None], 0, k, r, 1)[:, 0] if reordered else t
    if kind == "ssm_conv1d.weight":
        if reordered:
            t = torch.cat([t[:qk], _untile(t[qk:], 0, k, r, c.linear_value_head_dim)])
        return t[:, None, :]
    if kind == "ssm_out.weight" and reordered:
        return _untile(t, 1, k, r, c.linear_value_head_dim)  # its columns
    return undo_rows(kind, t, c)


def undo_rows(kind: str, t: torch.Tensor, c: TextConfig) -> torch.Tensor:
    """Undo the row reorders of in_proj_qkv / z / a / b on rows of any storage (float or blocks)."""
    k, r, reordered = _v_heads(c)
    if not reordered:
        return t
    if kind == "attn_qkv.weight":
        qk = 2 * k * c.linear_key_head_dim
        return torch.cat([t[:qk], _untile(t[qk:], 0, k, r, c.linear_value_head_dim)])
    if kind == "attn_gate.weight":
        return _untile(t, 0, k, r, c.linear_value_head_dim)
    if kind in ("ssm_beta.weight", "ssm_alpha.weight"):
        return _untile(t, 0, k, r, 1)
    return t


def undo_blocks(kind: str, q: torch.Tensor, c: TextConfig, block: int = blocks.QK) -> torch.Tensor | None:
    """The HF rows of a tensor of GGUF blocks of `block` weights (32: Q8_0 / Q4_0; 256: the
    K-quants), still blocks; None where a reorder splits blocks."""
    k, r, reordered = _v_heads(c)
    if kind == "ssm_out.weight" and reordered:
        d = c.linear_value_head_dim
        if d % block:
            return None
        per = q.shape[-1] // (c.linear_num_value_heads * d // block)  # bytes per block
        heads = q.reshape(q.shape[0], r, k, d // block * per)
        return heads.transpose(1, 2).reshape(q.shape)
    return undo_rows(kind, q, c)


def kind_of(gguf_name: str) -> str:
    m = _BLK.match(gguf_name)
    return m.group(2) if m else gguf_name


def plan(lm: nn.Module, file: GGUFFile, weights: str, groups: bool) -> dict[str, Format]:
    """The storage format of each large LM parameter for a GGUF file: the spec's where it names one
    (lm/formats/policy.py), else ("auto") the tensor's own: Q8_0 -> int8, Q4_0 -> int4, Q4_K / Q5_K /
    Q6_K as they are, BF16 -> bf16, F32 / F16 -> fp32 (F16 exactly), Q8_K -> int8, any other type
    -> fp32. A K-quant tensor whose super-blocks the V-head reorder splits is converted as
    gguf_kquants.STORED_AS says (Q4_K -> int4, Q5_K / Q6_K -> int8). A block tensor that does not fit
    our storage (rows % 8, K % 32; K % 256 for the K-quants) or whose columns the V-head reorder
    splits is kept in float32 (bf16 where the spec named the format, as policy.plan does), said once.
    A tied head (no output.weight) takes token_embd's format as the head's own (two copies: the
    table's rows are gathered, so it is converted, while the head streams the file's blocks)."""
    parts = policy.parse(weights)
    n = lm.config.num_hidden_layers
    source = {}
    for g in file.tensors:
        name = param_name(g, n)
        if name is not None:
            source[name] = g
    if lm.config.tie_word_embeddings and "model.embed_tokens.weight" in source:
        # the head multiplies the table's blocks as the file holds them; the table itself, whose rows
        # are gathered, is converted (two copies, as a tied checkpoint under weights=int4)
        source["lm_head.weight"] = source["model.embed_tokens.weight"]
    formats, floats = {}, []
    for name, p in lm.named_parameters(remove_duplicate=False):
        part = policy.part_of(name)
        if part is None or name not in source:
            continue
        rows = p.shape[-2] // 2 if name.endswith("gate_up_proj") else p.shape[-2]
        kind = file.type_of(source[name])
        if parts[part] != "auto":
            fmt = policy.storage(parts[part], groups)
        else:
            fmt = _AUTO.get(kind, FP32)
            if fmt.blocked and part in ("embed", "router"):
                fmt = FP32  # rows gathered / float only: the exact float32
            c = lm.config
            if kind in KQUANTS and fmt.blocked and kind_of(source[name]) == "ssm_out.weight" \
                    and c.linear_value_head_dim % QK_K and c.linear_num_value_heads != c.linear_num_key_heads:
                fmt = FORMATS[STORED_AS[kind]]  # the reorder splits super-blocks: dequantized, converted
            if kind in BLOCK_TYPES and kind_of(source[name]) == "ssm_out.weight" and c.linear_value_head_dim % 32 \
                    and c.linear_num_value_heads != c.linear_num_key_heads:
                fmt = FP32
                floats.append(name)
        if not fmt.fits(p.shape[-1], rows):  # as policy.plan: a named format falls back to bf16, "auto" to fp32
            floats.append(name)
            fmt = BF16 if parts[part] != "auto" else FP32
        elif fmt is BF16 and groups and BF16_G8.fits(p.shape[-1], rows) and part != "router":
            fmt = BF16_G8
        if fmt is not FP32:
            formats[name] = fmt
    if floats:
        print(f"[qwen35] {file.path.name}: {len(floats)} weight(s) kept in float (bf16 for a format named in "
              f"weights=, else float32) as their rows do not fit a block layout or the V-head reorder splits their "
              f"blocks: {', '.join(floats[:4])}", file=sys.stderr)
    return formats


def say_kquant_conversion(lm: nn.Module, file: GGUFFile, formats: dict[str, Format], dtype: torch.dtype) -> None:
    """Say once on stderr, for a file with K-quant LM tensors, what each K-quant type is converted to
    at load (the formats of `plan`, else the model dtype), with the count of tensors each way."""
    done: dict[str, dict[str, int]] = {}
    floats = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    for g in file.tensors:
        kind, name = file.type_of(g), param_name(g, lm.config.num_hidden_layers)
        if kind in KQUANT_TYPES and name is not None and formats.get(name) is not KQUANTS.get(kind):
            to = formats[name].name if name in formats else floats.get(dtype, str(dtype))
            done.setdefault(kind, {}).setdefault(to, 0)
            done[kind][to] += 1
    if not done:
        return
    kinds = sorted(done)
    ways = "; ".join(f"{k} -> " + ", ".join(f"{to} ({n})" for to, n in sorted(done[k].items())) for k in kinds)
    lossy = any(to in ("int8", "int4") for ways_k in done.values() for to in ways_k)
    print(f"[qwen35] {file.path.name}: {' / '.join(kinds)} tensors converted at load (Q4_K / Q5_K / Q6_K are "
          f"kept as they are where weights= and their shapes allow; weights=int4 converts them to Q4_0, whose "
          f"decode products run faster): {ways} tensor(s)"
          + ("; weights=fp32 keeps their values exactly" if lossy else ""), file=sys.stderr)


def load_gguf_lm_weights(lm: nn.Module, file: GGUFFile, formats: dict[str, Format]) -> None:
    """Copy every LM tensor of the GGUF file into `lm` (allocated with `formats`), undoing the
    converter's transforms; WeightError names a missing, unexpected or mis-shaped tensor."""
    c: TextConfig = lm.config
    params = dict(lm.named_parameters(remove_duplicate=False))
    pending = {n for n in params if not (c.tie_word_embeddings and n == "lm_head.weight")}
    for g in file.tensors:
        name = param_name(g, c.num_hidden_layers)
        if name is None:
            continue
        if name not in params:
            raise WeightError(f"unexpected GGUF tensor {g!r}: the model has no parameter {name!r}")
        kind = kind_of(g)
        param, fmt = params[name], formats.get(name)
        if kind in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            half = param.shape[1] // 2
            param = param[:, :half] if kind == "ffn_gate_exps.weight" else param[:, half:]
        _fill(param, file, g, kind, fmt, c)
        if name == "model.embed_tokens.weight" and c.tie_word_embeddings and not heads_tied(lm):
            _fill(params["lm_head.weight"], file, g, kind, formats.get("lm_head.weight"), c)
        pending.discard(name)
    if pending:
        shown = ", ".join(sorted(pending)[:8])
        raise WeightError(f"{file.path}: missing {len(pending)} language-model tensor(s): {shown}")


def _fill(param: torch.Tensor, file: GGUFFile, g: str, kind: str, fmt: Format | None, c: TextConfig) -> None:
    gtype = file.type_of(g)
    same = fmt is not None and fmt is _RAW.get(gtype)
    q = undo_blocks(kind, file.blocks(g), c, fmt.block) if same else None
    if q is not None:
        if tuple(q.shape) != tuple(param.shape):
            raise WeightError(f"GGUF tensor {g!r} has blocks {list(q.shape)}, expected {list(param.shape)}")
        with torch.no_grad():
            param.copy_(q if fmt.rows == 1 else blocks.interleave8(q, fmt.block_bytes))  # K-quants: rows as they are
        return
    expected = tuple(param.shape) if fmt is None else (*param.shape[:-1], fmt.inputs(param.shape[-1]))
    if kind.endswith("_exps.weight") and file.shape(g) == expected:  # no transform: one expert at a time
        for e in range(expected[0]):  # (bounds the float32 copy: a 35B-A3B layer's gate is 1 GiB)
            t = file.float_tensor(g, e)
            with torch.no_grad():
                param[e].copy_(t if fmt is None else fmt.quantize(t))
        return
    t = undo_float(kind, file.float_tensor(g), c)
    if kind == "ffn_gate_inp_shexp.weight" and t.dim() == 1:
        t = t[None]
    if tuple(t.shape) != expected:
        raise WeightError(f"GGUF tensor {g!r} has shape {list(t.shape)}, expected {list(expected)}")
    with torch.no_grad():
        param.copy_(t if fmt is None else fmt.quantize(t))

