"""GGUF K-quants: dequantization bit for bit as `gguf.quants.dequantize`, the kernels' products of
Q4_K / Q5_K / Q6_K weights, and files holding Q4_K / Q5_K / Q6_K / Q8_K matrices (as a Q4_K_M file
mixes them) loaded (the first three as they are, Q8_K converted, said so), against the same model
from a float32 file holding the dequantized values."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import mm
from lm import WeightError, kernels
from lm.formats import FP32, INT4, INT8, Q4_K, Q5_K, Q6_K, param_format, stored, to_float
from lm.gguf_kquants import BLOCK_BYTES, QK_K, dequantize
from lm.gguf_names import param_name
from lm.gguf_read import GGUFFile
from mm.gguf_loading import gguf_config
from mm.model import VLModel
from tests.conftest import rel_err
from tests.lm.test_formats import _decode_logits
from tests.mm.test_gguf import FIXTURES, ids, rewrite

Q = gguf.GGMLQuantizationType


def finite_half(rng: np.random.Generator, n: int) -> np.ndarray:
    """n fp16 numbers from random bits (subnormals, zeros and both signs included), made finite by
    clearing the top exponent bit of inf / NaN patterns, as uint8 [n, 2]."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF
    return bits.view(np.uint8).reshape(n, 2)


def random_blocks(kind: str, n: int, rng: np.random.Generator, scale: float | None = None) -> np.ndarray:
    """n random valid `kind` super-blocks, uint8 [n, bytes]: random quants and 6-bit / int8 scales,
    and finite fp16 super-block scales; of any magnitude (None), or with weights within about
    +-`scale`."""
    raw = rng.integers(0, 256, size=(n, BLOCK_BYTES[kind]), dtype=np.uint8)

    def half(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float16).reshape(n, 1).view(np.uint8)

    def u() -> np.ndarray:
        return rng.uniform(0.5, 1.0, n)

    if kind in ("Q4_K", "Q5_K"):  # w = d sc q - dmin m, sc and m in [0, 63]
        qmax = 15 if kind == "Q4_K" else 31
        raw[:, 0:2] = finite_half(rng, n) if scale is None else half(2 * scale / (63 * qmax) * u())
        raw[:, 2:4] = finite_half(rng, n) if scale is None else half(scale / 63 * u())
    elif kind == "Q6_K":  # w = d sc (q - 32), sc int8
        raw[:, 208:210] = finite_half(rng, n) if scale is None else half(scale / (127 * 32) * u())
    else:  # Q8_K: float32 d, int8 q, int16 sums of 16 q
        d = rng.standard_normal(n).astype(np.float32) if scale is None else (scale / 127 * u()).astype(np.float32)
        raw[:, 0:4] = d.reshape(n, 1).view(np.uint8)
        sums = raw[:, 4:260].view(np.int8).reshape(n, 16, 16).sum(-1, dtype=np.int16)
        raw[:, 260:292] = sums.view(np.uint8).reshape(n, 32)
    return raw


def q8_k_reference(raw: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q8_K, one weight at a time (the gguf package has no Q8_K): y = d q."""
    out = np.empty((raw.shape[0], QK_K), np.float32)
    for i, block in enumerate(raw):
        d = block[0:4].view(np.float32)[0]
        for j in range(QK_K):
            out[i, j] = d * np.float32(block[4 + j].view(np.int8))
    return out


def reference(raw: np.ndarray, kind: str) -> np.ndarray:
    return q8_k_reference(raw.reshape(-1, BLOCK_BYTES[kind])).reshape(*raw.shape[:-1], -1) if kind == "Q8_K" \
        else gguf.quants.dequantize(raw, Q[kind])


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_is_gguf_bit_for_bit(kind):
    rng = np.random.default_rng(sum(map(ord, kind)))
    raw = random_blocks(kind, 6 * 1024, rng).reshape(8, 96, 8 * BLOCK_BYTES[kind])  # [E, N, K / 256 * bytes]
    ours = dequantize(torch.from_numpy(raw), kind)
    assert ours.shape == (8, 96, 8 * QK_K) and ours.dtype == torch.float32
    ref = torch.from_numpy(reference(raw, kind))
    assert torch.isfinite(ref).all() and torch.equal(ours, ref)
    assert (ours != 0).float().mean() > 0.9 and ours.abs().max() > 1  # the test exercises large and small scales
    with np.errstate(all="ignore"):  # any bytes, fp16 inf / NaN scales included: the same values, NaN for NaN
        wild = rng.integers(0, 256, size=(512, BLOCK_BYTES[kind]), dtype=np.uint8)
        ref = torch.from_numpy(reference(wild, kind))
    ours = dequantize(torch.from_numpy(wild), kind)
    assert not torch.isfinite(ref).all() and torch.equal(ours.isnan(), ref.isnan())
    assert torch.equal(ours.nan_to_num(), ref.nan_to_num())


def test_q8_k_is_d_times_q():
    raw = random_blocks("Q8_K", 64, np.random.default_rng(8)).reshape(4, 16 * BLOCK_BYTES["Q8_K"])
    assert torch.equal(dequantize(torch.from_numpy(raw), "Q8_K"), torch.from_numpy(reference(raw, "Q8_K")))


def test_dequantize_refuses_other_types_and_partial_blocks():
    with pytest.raises(ValueError, match="not a K-quant"):
        dequantize(torch.zeros(1, 144, dtype=torch.uint8), "Q4_0")
    with pytest.raises(ValueError, match="multiple of 210 bytes"):
        dequantize(torch.zeros(1, 200, dtype=torch.uint8), "Q6_K")


# A Q4_K_M-like mix: Q6_K for attn_v, the down projections and the output; Q5_K for the DeltaNet's
# qkv and the shared expert's down; Q8_K for one matrix; Q4_K for the other matrices (the embedding
# too, and DeltaNet's small in_proj_a / b). The 1-D tensors, the conv and the routers stay F32.
_MIX = [(r"attn_v\.", "Q6_K"), (r"ffn_down_shexp\.", "Q5_K"), (r"ffn_down", "Q6_K"), (r"^output\.", "Q6_K"),
        (r"attn_qkv\.", "Q5_K"), (r"^blk\.1\.attn_k\.", "Q8_K")]
_FLOAT = re.compile(r"norm|ssm_conv1d|ssm_a$|ssm_dt|ffn_gate_inp")
# the fixtures' metadata with every matrix's K a multiple of 256 (hidden, heads x head dim, the
# DeltaNet's value width, the MLP / expert widths)
_DIMS = {"embedding_length": 256, "attention.head_count": 4, "ssm.inner_size": 256, "feed_forward_length": 256,
         "expert_feed_forward_length": 256, "expert_shared_feed_forward_length": 256}


def quant_type(name: str) -> str | None:
    if _FLOAT.search(name):
        return None
    return next((t for pattern, t in _MIX if re.search(pattern, name)), "Q4_K")


def gguf_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape (numpy order) under the file's metadata: our parameter's, with the
    converter's reshapes (the conv squeezed, the experts' gate and up split)."""
    file = GGUFFile(path)
    with torch.device("meta"):
        lm = VLModel(gguf_config(file)).lm
    params = {n: tuple(p.shape) for n, p in lm.named_parameters(remove_duplicate=False)}
    shapes = {}
    for g in file.tensors:
        shape = params[param_name(g, lm.config.num_hidden_layers)]
        if g.endswith("ssm_conv1d.weight"):
            shape = (shape[0], shape[2])
        elif g.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            shape = (shape[0], shape[1] // 2, shape[2])
        shapes[g] = shape
    return shapes


def kquant_files(kind: str, out: Path) -> tuple[Path, Path]:
    """A random `kind` ("dense", "moe") GGUF with the fixture's tensor names and K = 256 matrices in
    the mix of K-quants above, and its twin with those matrices float32, their dequantized values."""
    arch = "qwen35moe" if kind == "moe" else "qwen35"
    dims = {f"{arch}.{k}": v for k, v in _DIMS.items() if k != "feed_forward_length" or kind == "dense"}
    meta = rewrite(FIXTURES / f"{kind}-f32.gguf", out / "meta.gguf", values=dims)  # the tensors: the old shapes
    shapes, rng, floats = gguf_shapes(meta), np.random.default_rng(45), {}

    def quantized(name, data, qtype):
        shape, qt = shapes[name], quant_type(name)
        if qt is None or len(shape) < 2:
            if name.endswith("ssm_a"):
                values = -rng.uniform(0.5, 2.0, shape)  # -exp(A_log)
            elif "norm" in name:
                values = 1 + 0.2 * rng.standard_normal(shape)
            else:
                values = 0.3 * rng.standard_normal(shape)
            floats[name] = values.astype(np.float32)
            return floats[name], None
        assert shape[-1] % QK_K == 0, name
        raw = random_blocks(qt, int(np.prod(shape)) // QK_K, rng, scale=0.5 if "token_embd" in name else 0.1)
        raw = raw.reshape(*shape[:-1], shape[-1] // QK_K * BLOCK_BYTES[qt])
        floats[name] = reference(raw, qt)
        return raw, Q[qt]
    kq = rewrite(meta, out / f"{kind}-kquants.gguf", change=quantized)
    twin = rewrite(meta, out / f"{kind}-dequantized-f32.gguf", change=lambda name, d, t: (floats[name], None))
    return kq, twin


_FILES: dict = {}


def files(kind: str, tmp_path_factory) -> tuple[Path, Path]:
    if kind not in _FILES:
        _FILES[kind] = kquant_files(kind, tmp_path_factory.mktemp(f"kquants-{kind}"))
    return _FILES[kind]


def test_the_fixture_mixes_the_k_quants(tmp_path_factory):
    kq, twin = files("moe", tmp_path_factory)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(kq).tensors}
    assert {"Q4_K", "Q5_K", "Q6_K", "Q8_K", "F32"} == set(types.values())
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K" and types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    assert {t.tensor_type.name for t in gguf.GGUFReader(twin).tensors} == {"F32"}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_k_quant_file_keeps_its_k_quants_and_converts_the_rest_saying_so_once(kind, tmp_path_factory, capsys):
    """Q4_K / Q5_K / Q6_K matrices keep their bits (formats Q4_K / Q5_K / Q6_K, which the kernels read
    in place): they dequantize to the file's values bit for bit, in Python and in C++. Q8_K -> int8,
    and a K-quant out_proj whose super-blocks the V-head reorder would split -> int4 / int8 (our
    quantizer on its values), the embedding and the small matrices fp32, said once. The logits
    equal those of the float32 twin holding the same values: prefill, decode rows, and the decode
    steps of a left-padded batch."""
    kq, twin = files(kind, tmp_path_factory)
    capsys.readouterr()
    model = mm.load_model(kq, compute="fp32")
    err = capsys.readouterr().err
    assert err.count("converted at load") == 1, err
    assert "Q4_K -> fp32 (" in err and "Q8_K -> int8 (1)" in err and "kept as they are" in err
    reference = mm.load_model(twin, compute="fp32")
    floats, params = dict(reference.lm.named_parameters()), dict(model.lm.named_parameters())
    expect = {"model.layers.1.self_attn.q_proj.weight": Q4_K,
              "model.layers.1.self_attn.v_proj.weight": Q6_K, "lm_head.weight": Q6_K,
              "model.layers.1.self_attn.k_proj.weight": INT8,  # Q8_K
              "model.layers.0.linear_attn.in_proj_qkv.weight": Q5_K,
              "model.embed_tokens.weight": FP32,  # Q4_K, rows gathered
              "model.layers.0.linear_attn.in_proj_a.weight": FP32}  # Q4_K, a small matrix (compute dtype)
    for name, fmt in expect.items():
        assert param_format(model.lm, name) is fmt, name
    # the V-head reorder moves out_proj's columns by whole value heads, of fewer than 256 weights here:
    # its super-blocks would split
    assert model.config.text.linear_value_head_dim % 256
    assert param_format(model.lm, "model.layers.0.linear_attn.out_proj.weight") in (INT4, INT8)
    kept = 0
    for name, p in model.lm.named_parameters():
        f, fmt = floats[name], param_format(model.lm, name)
        if fmt is FP32:
            assert torch.equal(p, f), name
        elif fmt in (Q4_K, Q5_K, Q6_K):
            kept += 1
            assert torch.equal(to_float(p, f.shape[-1], fmt), f), name
            assert torch.equal(kernels.to_float((p, fmt), f.shape[-1]), f), name  # formats.h, bit for bit
        else:
            assert torch.equal(p, fmt.quantize(f)), name  # our quantizer on the dequantized values
            bound = 1 / 7 if fmt is INT4 else 1 / 254 + 1 / 2048  # half a step, d in fp16 (int4: -max clamps to 7 d)
            assert rel_err(to_float(p, f.shape[-1], fmt), f) <= bound, name
    assert kept >= 4
    with torch.no_grad():
        for name, p in reference.lm.named_parameters():
            p.copy_(to_float(params[name], p.shape[-1], param_format(model.lm, name)))
    x = ids()
    assert rel_err(model(x), reference(x)) <= 1e-5  # prefill (26 rows)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    kernels.set_int8_activations(False)  # the int8 / int4 weights' decode rows with float32 x (K-quants: always)
    try:
        assert rel_err(model(x[:, :3]), reference(x[:, :3])) <= 1e-5  # decode rows (6): the products' kernels
        steps = x[:, :12]
        assert rel_err(_decode_logits(model, steps, mask, 4), _decode_logits(reference, steps, mask, 4)) <= 1e-5
    finally:
        kernels.set_int8_activations(True)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_k_quant_prefill_in_int8_is_within_the_int8_bound(kind, tmp_path_factory):
    """Under compute='int8' the K-quant matrices' prefill products take the int8 kernels (panels of
    kquant_tiles.h for 8 rows of x and more): the logits within 3% of their range from float32
    compute on the same weights (tests/lm/test_compute.py's bound), and not equal to them."""
    kq, _ = files(kind, tmp_path_factory)
    exact, int8 = mm.load_model(kq, compute="fp32"), mm.load_model(kq, compute="int8")
    head = int8.lm.lm_head
    assert kernels.prefill_compute(head.compute, stored(head), torch.zeros(26, 256)) == "int8"
    x = ids()
    ref = exact(x)
    assert 1e-5 < rel_err(int8(x), ref) < 0.03


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_weights_fp32_loads_a_k_quant_file_exactly(kind, tmp_path_factory, capsys):
    kq, twin = files(kind, tmp_path_factory)
    capsys.readouterr()
    model, reference = mm.load_model(kq, weights="fp32", compute="fp32"), mm.load_model(twin, compute="fp32")
    err = capsys.readouterr().err
    assert err.count("converted at load") == 1 and "Q6_K -> fp32 (" in err and "int4 (" not in err and "int8 (" not in err
    for (name, p), (_, r) in zip(model.lm.named_parameters(), reference.lm.named_parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, r), name
    x = ids()
    assert torch.equal(model(x), reference(x))


def test_a_weights_spec_applies_to_k_quant_tensors(tmp_path_factory, capsys):
    kq, twin = files("dense", tmp_path_factory)
    capsys.readouterr()
    model = mm.load_model(kq, weights="int8,attention=int4")
    err = capsys.readouterr().err
    # the embedding and DeltaNet's small in_proj_a / b in float32, the attention int4, the rest int8
    assert "Q4_K -> fp32 (3), int4 (2), int8 (6); Q5_K -> int8 (1); Q6_K -> int4 (1), int8 (3); Q8_K -> int4 (1)" in err
    reference = dict(mm.load_model(twin, weights="int8,attention=int4").lm.named_parameters())
    for name, p in model.lm.named_parameters():
        assert p.dtype == reference[name].dtype and torch.equal(p, reference[name]), name
    capsys.readouterr()
    mm.load_model(kq, dtype=torch.bfloat16)  # no storage formats off float32 compute: the model dtype
    assert "Q4_K -> bf16 (" in capsys.readouterr().err


def test_types_we_do_not_read_are_still_refused_by_name(tmp_path_factory, tmp_path, capsys):
    """IQ* and TQ* tensors: refused naming tensor and type, unless dequantize_unsupported (said)."""
    kq, _ = files("dense", tmp_path_factory)
    rng = np.random.default_rng(3)

    def other(name, data, qtype):
        kind = {"blk.1.attn_k.weight": Q.TQ2_0, "blk.0.attn_gate.weight": Q.IQ4_NL}.get(name)
        if kind is None:
            return None
        size, nbytes = gguf.constants.GGML_QUANT_SIZES[kind]
        n, k = data.shape[0], data.shape[1] // BLOCK_BYTES[qtype.name] * QK_K
        raw = rng.integers(0, 256, size=(n * k // size, nbytes), dtype=np.uint8)
        at = 0 if kind == Q.IQ4_NL else nbytes - 2  # the fp16 d: first in IQ4_NL, last in TQ2_0
        raw[:, at : at + 2] = np.full((len(raw), 1), 0.01, np.float16).view(np.uint8)
        return raw.reshape(n, -1), kind
    path = rewrite(kq, tmp_path / "iq.gguf", change=other)
    with pytest.raises(WeightError, match=r"blk\.0\.attn_gate\.weight \(IQ4_NL\).*blk\.1\.attn_k\.weight \(TQ2_0\)"):
        mm.load_model(path)
    capsys.readouterr()
    model = mm.load_model(path, dequantize_unsupported=True, weights="fp32")
    err = capsys.readouterr().err
    assert "dequantizing 2 tensor(s) of type(s) IQ4_NL, TQ2_0" in err and "Q4_K / Q5_K / Q6_K tensors" in err
    t = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.1.attn_k.weight"]
    expect = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type))
    assert torch.equal(model.lm.model.layers[1].self_attn.k_proj.weight, expect)


def test_float_tensor_of_a_k_quant_tensor_is_the_references(tmp_path_factory):
    kq, _ = files("moe", tmp_path_factory)
    file = GGUFFile(kq)
    t = file.tensors["blk.1.ffn_down_exps.weight"]
    assert t.tensor_type.name == "Q6_K" and file.shape(t.name) == (4, 256, 256)
    expect = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
    assert torch.equal(file.float_tensor(t.name), torch.from_numpy(expect))
    assert torch.equal(file.float_tensor(t.name, 2), torch.from_numpy(expect[2]))  # one expert
