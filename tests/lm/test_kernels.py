"""The CPU decode kernels against `F.linear` (the reference), and the model with them on and off."""

import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import mm
from lm import kernels
from lm.formats import FP32, INT4, INT8
from tests.conftest import q8_0_round, rel_err


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    monkeypatch.setattr(kernels, "MIN_WEIGHT_ELEMENTS", 0)  # tiny test weights take the kernel too


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])  # AVX2: 2-6 rows of x in one pass, 7-8 in two (vec.h)
@pytest.mark.parametrize("shape", [(96, 64), (33, 70), (512, 1024), (34, 2100)])  # K % 8 != 0; odd N; K > 1024 + tail
def test_small_m_linear_equals_f_linear(kernels_on, rows, shape):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, shape[1], generator=g), torch.randn(*shape, generator=g), torch.randn(shape[0])
    assert rel_err(kernels.linear(x, w, b), F.linear(x, w, b)) < 1e-5
    x3 = torch.randn(1, rows, shape[1], generator=g)  # [B, T, K] inputs keep their leading shape
    assert kernels.linear(x3, w).shape == (1, rows, shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # a bf16 weight's copy is bf16
@pytest.mark.parametrize("rows", [4, 5, 8])  # from kernels.panel_rows() on, decode rows take the panel copy
@pytest.mark.parametrize("n", [96, 112, 80])  # whole panels of 48; a last panel of 16; of 32
def test_decode_products_through_panel_copies_equal_f_linear(kernels_on, monkeypatch, rows, n, dtype):
    monkeypatch.setattr(kernels, "panel_rows", lambda: 5)  # on whatever this CPU's default (never on AVX2)
    g = torch.Generator().manual_seed(n)
    x, w, b = torch.randn(rows, 1, 70, generator=g), torch.randn(n, 70, generator=g).to(dtype), torch.randn(n, generator=g)
    assert rel_err(kernels.linear(x, w, b), F.linear(x, w.float(), b)) < 1e-5
    assert (kernels.panel_copy(w) is not None) == (rows >= 5)
    if rows < 5:
        return
    assert kernels.panel_copy(w).dtype == dtype
    kernels.panel_copy(w).zero_()  # the copy, not the weight, is what the product reads
    assert kernels.linear(x, w).abs().max() == 0
    with torch.no_grad():
        w.mul_(2)  # written in place: the copy is stale and is made again
    assert rel_err(kernels.linear(x, w, b), F.linear(x, w.float(), b)) < 1e-5
    key = id(w)
    del w
    assert key not in kernels._panels  # a copy goes with its weight


def test_grouped_linear_equals_per_expert_products(kernels_on):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, 48, generator=g)
    experts, sizes = [0, 3, 5], [2, 1, 4]
    x = torch.randn(sum(sizes), 48, generator=g)
    out = kernels.grouped_linear(x, w, experts, sizes)
    ref = torch.cat([x[0:2] @ w[0].T, x[2:3] @ w[3].T, x[3:7] @ w[5].T])
    assert rel_err(out, ref) < 1e-5


def test_kernels_are_skipped_when_switched_off_or_not_applicable(monkeypatch):
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    assert kernels.grouped_linear(torch.randn(2, 8), torch.randn(3, 4, 8), [0], [2]) is None
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "maybe")
    with pytest.raises(ValueError, match="QWEN35_CPU_KERNELS"):
        kernels.mode()


def test_decoding_with_kernels_equals_reference(checkpoints, monkeypatch):
    _, path = checkpoints("moe_vl")
    model = mm.load_model(path)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(5))

    def decode():
        cache = model.lm.make_cache(2, 20)
        with torch.no_grad():
            return torch.cat([model.lm(ids[:, :8], cache=cache)] + [model.lm(ids[:, i : i + 1], cache=cache)
                                                                  for i in range(8, 12)], 1)

    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    reference = decode()
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    monkeypatch.setattr(kernels, "MIN_WEIGHT_ELEMENTS", 0)
    assert rel_err(decode(), reference) < 1e-5


@pytest.mark.parametrize("value_dim", [48, 32])  # column strips, row-major head
def test_fused_delta_step_equals_reference(monkeypatch, value_dim):
    from lm.delta_rule import gated_delta_step, recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(3, 1, 2, 32, generator=g), torch.randn(3, 1, 2, 32, generator=g)
    v = torch.randn(3, 1, 4, value_dim, generator=g)
    decay, beta = -torch.rand(3, 1, 4, generator=g), torch.rand(3, 1, 4, generator=g)
    state = torch.randn(3, 4, 32, value_dim, generator=g)
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    live = state.clone()
    out, new = gated_delta_step(q, k, v, decay, beta, live)
    assert new is live
    assert rel_err(out, ref_out) < 1e-5 and rel_err(live, ref_state) < 1e-5


# ---------------------------------------------------------------- fused decode blocks against the reference path


def _perturbed(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def _both_paths(monkeypatch, run):
    """run() with the kernels switched off (reference), then on; the kernels must really be used."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    reference = run()
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    return run(), reference


@pytest.mark.parametrize("rows,pieces", [(1, 1), (3, 1), (3, 3), (8, 2), (20, 1), (100, 1)])  # decode; prefill
def test_fused_moe_block_equals_reference(monkeypatch, rows, pieces):
    from lm.config import TextConfig
    from lm.moe import SparseMoeBlock
    from tests import tiny

    config = TextConfig.from_hf(tiny.text_config(True, num_experts=16, num_experts_per_tok=4))
    block = _perturbed(SparseMoeBlock(config), rows)
    x = torch.randn(rows, 1, config.hidden_size, generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    monkeypatch.setattr(kernels, "moe_pieces", lambda: pieces)  # experts cut into pieces (uneven: 3 into 32 and 48)
    if rows <= kernels.MAX_ROWS:
        assert kernels.moe_decode(x[:, 0], block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj,
                                  4, block.shared_expert.gate_proj.weight, block.shared_expert.up_proj.weight,
                                  block.shared_expert.down_proj.weight, block.shared_expert_gate.weight) is not None
    else:
        counts = torch.tensor([rows] + [0] * 15)
        token, weight = torch.arange(rows), torch.ones(rows)
        assert kernels.expert_mlp(x[:, 0], block.experts.gate_up_proj, block.experts.down_proj, counts, token,
                                  weight) is not None
    with torch.no_grad():
        ours, reference = _both_paths(monkeypatch, lambda: block(x))
    assert ours.shape == x.shape and rel_err(ours, reference) < 1e-5


@pytest.mark.parametrize("rows,pieces", [(1, 1), (5, 1), (8, 3)])
def test_moe_decode_gives_the_same_bits_on_every_call(monkeypatch, rows, pieces):
    """moe_decode deals its down pieces to the threads in a fixed way: each output's additions come in
    one order, and the same input gives the same bits on every call, with 1, 2 or 3 threads (with the
    down pieces taken from the queue, most repeated calls differed in their last bits, and greedy
    near-ties with them); every thread count equals the reference."""
    from lm.config import TextConfig
    from lm.moe import SparseMoeBlock
    from tests import tiny

    config = TextConfig.from_hf(tiny.text_config(True, num_experts=16, num_experts_per_tok=4))
    block = _perturbed(SparseMoeBlock(config), rows)
    x = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(2))
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    with torch.no_grad():
        reference = block(x[:, None])[:, 0]
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    k, s, before = kernels.compiled(), block.shared_expert, torch.get_num_threads()

    def call():
        w = kernels.weight_arg  # float32 weights: (weight, FP32.code)
        return k.moe_decode(x, w(block.gate.weight), w(block.experts.gate_up_proj), w(block.experts.down_proj), 4,
                            w(s.gate_proj.weight), w(s.up_proj.weight), w(s.down_proj.weight),
                            block.shared_expert_gate.weight, pieces)

    try:
        for threads in (2, 1, 3):
            torch.set_num_threads(threads)
            first = call()
            assert all(torch.equal(call(), first) for _ in range(40)), threads
            assert rel_err(first, reference) < 1e-5
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt,int8", [("fp32", False), ("int4", False), ("int4", True), ("int8", True)])
def test_prefill_experts_give_the_same_bits_on_every_call_and_thread_count(monkeypatch, fmt, int8):
    """expert_mlp (prefill) keeps each expert's outputs and adds them into the tokens' rows in one
    order (the columns split among the threads): the same bits on every call and with 1, 2 or 3
    threads (adding into per-thread rows, whichever thread took an expert, made most prefills differ
    in their last bits), equal to the experts applied one selection at a time. With int8 activations
    (Q8_0 / Q4_0 experts), x and each expert's activations are rounded to Q8_0 blocks first."""
    from lm.formats import FORMATS

    if int8 and not kernels.compiled().INT8_DOT:
        pytest.skip("the int8 dot products are built for AVX2 only")

    g = torch.Generator().manual_seed(3)
    E, N, K, H, I = 16, 40, 4, 64, 32
    x = torch.randn(N, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    gate_up = FORMATS[fmt].quantize(gate_up.reshape(E * 2 * I, H)).view(E, 2 * I, -1), FORMATS[fmt]
    down = FORMATS[fmt].quantize(down.reshape(E * H, I)).view(E, H, -1), FORMATS[fmt]
    chosen = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])  # [N, K]
    weights = torch.rand(N, K, generator=g)
    order = chosen.flatten().argsort(stable=True)
    token, weight = (order // K), weights.flatten()[order]
    counts = torch.bincount(chosen.flatten(), minlength=E)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    before = torch.get_num_threads()
    kernels.set_int8_activations(int8)
    try:
        torch.set_num_threads(2)
        first = kernels.expert_mlp(x, gate_up, down, counts, token, weight)
        for threads in (2, 1, 3):
            torch.set_num_threads(threads)
            assert all(torch.equal(kernels.expert_mlp(x, gate_up, down, counts, token, weight), first)
                       for _ in range(10)), threads
    finally:
        torch.set_num_threads(before)
        kernels.set_int8_activations(True)
    wg, wd = kernels.to_float(gate_up, H), kernels.to_float(down, I)
    rounded = q8_0_round if int8 else (lambda v: v)
    reference, exact = torch.zeros(N, H), torch.zeros(N, H)
    for n in range(N):
        for k in range(K):
            h, hx = wg[chosen[n, k]] @ rounded(x[n]), wg[chosen[n, k]] @ x[n]
            reference[n] += weights[n, k] * (wd[chosen[n, k]] @ rounded(F.silu(h[:I]) * h[I:]))
            exact[n] += weights[n, k] * (wd[chosen[n, k]] @ (F.silu(hx[:I]) * hx[I:]))
    if not int8:
        assert rel_err(first, reference) < 1e-5
        return
    # Rounded as the kernel rounds, up to the activations' roundings that the last bits of their
    # float32 sums flip (~1e-3 here); the error of the rounding itself is ten times that. (Against
    # the decode kernel, which rounds the same sums: tests/lm/test_formats.py.)
    assert rel_err(first, reference) < 3e-3
    assert 5e-3 < rel_err(first, exact) < 3e-2


@pytest.mark.parametrize("rows,value_dim,scale,key_dim,conv_size", [
    (1, 32, 1, 16, 4), (4, 32, 1, 16, 4), (2, 128, 1, 16, 4), (2, 48, 1, 16, 4), (2, 32, 60, 16, 4),
    (2, 32, 1, 20, 4), (2, 32, 1, 16, 3)])
def test_fused_deltanet_decode_equals_reference(monkeypatch, rows, value_dim, scale, key_dim, conv_size):
    """48: the column-strip path; scale 60: inputs that drive the SiLUs (the kernels' own vectorised
    exp, vec.h) far into both tails, where its clamping matters; key heads of 20: the conv's vector
    loop and its scalar tail; a conv of 3 taps: the scalar loop alone (the vector one takes 4)."""
    from lm.cache import LinearSlot
    from lm.config import TextConfig
    from lm.gated_deltanet import GatedDeltaNet
    from tests import tiny

    config = TextConfig.from_hf(tiny.text_config(True, linear_value_head_dim=value_dim, linear_key_head_dim=key_dim,
                                                 linear_conv_kernel_dim=conv_size))
    layer = _perturbed(GatedDeltaNet(config), rows)
    g = torch.Generator().manual_seed(2)
    conv_dim = 2 * layer.key_dim + layer.value_dim
    window = torch.randn(rows, config.linear_conv_kernel_dim - 1, conv_dim, generator=g)
    state = torch.randn(rows, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, generator=g)
    tokens = torch.randn(3, rows, config.hidden_size, generator=g) * scale

    def run(step):  # three decode tokens: the window shift and state update carry over
        slot = LinearSlot(window.clone(), state.clone())
        with torch.no_grad():
            outs = torch.stack([step(x, slot) for x in tokens], 1)
        return outs, slot.conv, slot.recurrent

    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    reference = run(lambda x, slot: layer(x[:, None], slot, None)[:, 0])  # the module, reference maths
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    k = kernels.compiled()

    def fused(x, slot):  # as decode_step.cpp runs a DeltaNet layer: projections, token step, out_proj
        w = kernels.weight_arg  # float32 weights: (weight, FP32.code)
        qkv, z, b, a = k.multi_linear(x, [w(layer.in_proj_qkv.weight), w(layer.in_proj_z.weight),
                                          w(layer.in_proj_b.weight), w(layer.in_proj_a.weight)])
        conv = layer.conv1d.weight.view(conv_dim, -1)
        out = k.gdn_decode(qkv, z, b, a, slot.conv, conv, layer.A_log, layer.dt_bias, slot.recurrent,
                           layer.norm.weight, layer.norm.eps, layer.num_k_heads)
        return k.small_m_linear(out, w(layer.out_proj.weight), torch.empty(0))

    ours = run(fused)
    for a, b in zip(ours, reference):
        assert rel_err(a, b) < 1e-5


def test_fused_gated_rms_norm_equals_reference(monkeypatch):
    from lm.norm import GatedRMSNorm

    norm = GatedRMSNorm(128)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 70, 4, 128) * 3  # prefill: [B, T, heads, head_dim]
    z = torch.randn(2, 70, 4, 256)[..., 128:]  # strided rows, as a view into a wider projection
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    assert kernels.gated_rms_norm(x, z, norm.weight, norm.eps) is not None
    with torch.no_grad():
        ours, reference = _both_paths(monkeypatch, lambda: norm(x, z))
    assert rel_err(ours, reference) < 1e-6


def test_fused_rms_norm_and_multi_linear_equal_reference(monkeypatch):
    from lm.norm import RMSNorm

    norm = _perturbed(RMSNorm(64), 0)
    x = torch.randn(2, 3, 4, 128)[..., :64]  # strided rows, as the query half of q_proj
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    assert kernels.rms_norm(x, norm.weight, norm.eps, 1.0) is not None
    with torch.no_grad():
        ours, reference = _both_paths(monkeypatch, lambda: norm(x))
    assert rel_err(ours, reference) < 1e-6
    ws = [torch.randn(n, 64) for n in (40, 3, 17)]
    xs = torch.randn(3, 64)
    for y, w in zip(kernels.multi_linear(xs, ws), ws):
        assert rel_err(y, F.linear(xs, w)) < 1e-5


@pytest.mark.parametrize("t, strength", [(5, 1.0), (32, 1.0), (77, 1.0), (77, 12.0)])
def test_chunked_delta_rule_kernel_equals_reference(monkeypatch, t, strength):
    """strength 12: decays that reach below the smallest normal float within a chunk (the kernel
    flushes such denormals to zero, lm/kernels/chunked_delta_rule.cpp). The kernel reads q, k, v
    where they lie (strided rows) and does lm.delta_rule._prepare's work itself."""
    from lm.delta_rule import chunked_gated_delta_rule

    g = torch.Generator().manual_seed(t)
    mixed = torch.randn(2, t, 2 * 16 + 2 * 16 + 4 * 24, generator=g)  # q, k, v: strided rows, as the conv leaves them
    q, k, v = (x.unflatten(-1, (-1, d)) for x, d in zip(mixed.split([32, 32, 96], -1), (16, 16, 24)))
    decay, beta = -strength * F.softplus(torch.randn(2, t, 4, generator=g)), torch.rand(2, t, 4, generator=g)
    state = torch.randn(2, 4, 16, 24, generator=g)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    assert kernels.chunked_delta_rule(q, k, v, decay, beta, state, 32) is not None
    ours, reference = _both_paths(monkeypatch, lambda: chunked_gated_delta_rule(q, k, v, decay, beta, state))
    for a, b in zip(ours, reference):
        assert rel_err(a, b) < 1e-5
    # bf16 activations take the kernel too, in float32 (as the reference's _prepare converts them)
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ours = kernels.chunked_delta_rule(q16, k16, v16, decay, beta, state, 32)
    reference = chunked_gated_delta_rule(q16.float(), k16.float(), v16.float(), decay, beta, state)
    assert rel_err(ours[0], reference[0]) < 1e-5 and rel_err(ours[1], reference[1]) < 1e-5


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("keys", [13, 300])  # 300: several value tiles of 128 keys, and a ragged end
# over 2 KV heads: 2-16 query heads each (the kernel's head groups: 8 per score pass, 4 per value
# pass, and their remainders); 72: value columns not a multiple of the block
@pytest.mark.parametrize("heads,dim", [(4, 64), (8, 72), (6, 64), (10, 64), (16, 64), (24, 32), (32, 64)])
def test_decode_attention_kernel_equals_reference(monkeypatch, masked, keys, heads, dim):
    from lm.attention import decode_attention

    g = torch.Generator().manual_seed(heads)
    # large scores too (x 6 where there are many keys), so that most of exp's range is used and
    # some numerators underflow to 0
    q = torch.randn(2, heads, 1, dim, generator=g) * (6 if keys > 100 else 1)
    cache_k, cache_v = torch.randn(2, 2, keys + 7, dim, generator=g), torch.randn(2, 2, keys + 7, dim, generator=g)
    k, v = cache_k[:, :, :keys], cache_v[:, :, :keys]  # views into a longer cache, as in decoding
    mask = torch.rand(2, 1, 1, keys, generator=g) > 0.3 if masked else None
    if masked:
        mask[..., -1] = True  # a query always sees itself
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    assert kernels.decode_attention(q, k, v, mask, dim**-0.5) is not None
    ours, reference = _both_paths(monkeypatch, lambda: decode_attention(q, k, v, mask, dim**-0.5))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim**-0.5, enable_gqa=True)
    assert rel_err(ours, reference) < 1e-5 and rel_err(ours, sdpa) < 1e-5


def test_decode_attention_kernel_with_per_row_lengths(monkeypatch):
    """The serving engine's ragged rows: row b attends over its first lengths[b] keys only."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 6, 64, generator=g)  # 6 query heads over 2 KV heads
    k, v = torch.randn(3, 2, 20, 64, generator=g), torch.randn(3, 2, 20, 64, generator=g)
    k[1, :, 9:] = v[1, :, 9:] = float("nan")  # beyond row 1's length: never read
    lengths = torch.tensor([20, 9, 1])
    ours = kernels.compiled().decode_attention(q, k, v, torch.empty(0, dtype=torch.bool), 0.125, lengths)
    for b, n in enumerate(lengths.tolist()):
        ref = F.scaled_dot_product_attention(q[b : b + 1, :, None], k[b : b + 1, :, :n], v[b : b + 1, :, :n],
                                             scale=0.125, enable_gqa=True)[:, :, 0]  # fmt: skip
        assert rel_err(ours[b : b + 1], ref) < 1e-5


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_decode_attention_splits_keys_between_threads(monkeypatch, threads):
    """Fewer (row, KV head) pairs than threads: each KV head's keys are split into parts of at least
    512 keys, attended separately and combined (every part's max, sum and weighted values); masked
    keys, ragged lengths (a row shorter than one part) and parts with every key masked included."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 64, generator=g) * 4  # 8 query heads over 1 KV head
    k, v = torch.randn(2, 1, 2000, 64, generator=g), torch.randn(2, 1, 2000, 64, generator=g)
    keep = torch.rand(2, 2000, generator=g) > 0.3
    keep[0, :1100] = False  # row 0's first part(s): all masked
    lengths = torch.tensor([2000, 300])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = kernels.compiled().decode_attention(q, k, v, keep, 0.125, lengths)
    finally:
        torch.set_num_threads(before)
    for b, n in enumerate(lengths.tolist()):
        ref = F.scaled_dot_product_attention(q[b : b + 1, :, None], k[b : b + 1, :, :n], v[b : b + 1, :, :n],
                                             attn_mask=keep[b, None, None, :n], scale=0.125, enable_gqa=True)[:, :, 0]  # fmt: skip
        assert rel_err(ours[b : b + 1], ref) < 1e-5


def test_kernels_reject_mismatched_weights_with_a_clear_error(monkeypatch):
    """A weight reaches the kernels with its format (lm/formats: the layer's tag, Format.code); they
    check the storage against it and never infer a format: storage that does not match its tag, and
    compact storage with no tag, are clear errors."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="torch.float16 storage needs its format named"):
        kernels.multi_linear(x, [torch.randn(8, 64, dtype=torch.float16)])
    with pytest.raises(ValueError, match="torch.uint8 storage needs its format named"):
        kernels.multi_linear(x, [INT8.quantize(torch.randn(8, 64))])
    with pytest.raises(RuntimeError, match="float32 weights are stored as Float, got Half"):
        kernels.multi_linear(x, [(torch.randn(8, 64, dtype=torch.float16), FP32)])
    with pytest.raises(RuntimeError, match="a Q8_0 row of K = 64 inputs holds 68 elements, got 36"):
        kernels.multi_linear(x, [(INT4.quantize(torch.randn(8, 64)), INT8)])  # the tag, not the bytes, decides
    with pytest.raises(RuntimeError, match="a bf16 row of K = 64 inputs holds 64 elements, got 32"):
        kernels.multi_linear(x, [torch.zeros(8, 32, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match="unknown weight format code 9"):
        kernels.compiled().small_m_linear(x, (torch.randn(8, 64), 9), torch.empty(0))
    with pytest.raises(RuntimeError, match="must be a contiguous"):
        kernels.multi_linear(x, [torch.randn(64, 8).T])
    q = INT4.quantize(torch.randn(8, 64))  # a well-formed one: x rounded to Q8_0 blocks times W
    d = x.view(2, 2, 32).abs().amax(-1, keepdim=True) / 127  # (test_formats.py: int8 activations)
    x8 = (torch.round(x.view(2, 2, 32) / d) * d).view(2, 64)
    assert rel_err(kernels.multi_linear(x, [(q, INT4)])[0], x8 @ INT4.dequantize(q, 64).T) < 1e-5


@pytest.mark.parametrize("tokens", [1, 2, 5, 40])  # fewer tokens than the window: it keeps old rows
def test_fused_causal_conv_equals_reference(monkeypatch, tokens):
    from lm.gated_deltanet import causal_conv

    g = torch.Generator().manual_seed(4)
    x, window = torch.randn(2, tokens, 48, generator=g), torch.randn(2, 3, 48, generator=g)
    weight = torch.randn(48, 4, generator=g)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    assert kernels.causal_conv(x, window, weight) is not None
    ours, reference = _both_paths(monkeypatch, lambda: causal_conv(x, window, weight))
    for a, b in zip(ours, reference):
        assert a.shape == b.shape and rel_err(a, b) < 1e-6


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_argmax_kernel_follows_numpy_across_threads_ties_and_nan(monkeypatch, threads):
    """Greedy sampling's argmax (argmax.cpp): numpy's first largest, or its first NaN, for vectors
    short (one thread, tails) and long (parts per thread; ties and NaNs across the parts' bounds)."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    k, before = kernels.compiled(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for n in (1, 7, 8, 9, 17, 1000, 1 << 15, 248_320):
            x = torch.randint(-3, 3, (n,), generator=g).float()  # many ties
            cases = [x, torch.randn(n, generator=g), torch.full((n,), float("-inf")), torch.zeros(n)]
            for at in ({n - 1}, {0, n - 1}, {n // 2, n - 1}, {n // 3, n // 2}):
                for value in (float("inf"), float("nan"), 3.0):
                    y = x.clone()
                    y[sorted(at)] = value
                    cases.append(y)
            z = torch.zeros(n)
            z[n // 2:] = -0.0  # equal to 0.0: the first index wins
            cases.append(z)
            for y in cases:
                assert k.argmax(y) == int(y.numpy().argmax()), (n, y[:4])
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="non-empty contiguous float32"):
        k.argmax(torch.zeros(0))


def test_argmax_rows_equals_argmax_of_each_row(monkeypatch):
    """argmax_rows (the greedy sampler's one call for a batch): each row's argmax, rows of ties,
    NaNs and infinities included, strided rows too; anything but a float32 matrix is refused."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    k, g = kernels.compiled(), torch.Generator().manual_seed(2)
    for n in (1, 9, 1 << 15, 248_320):
        x = torch.randint(-3, 3, (5, n), generator=g).float()
        x[1] = torch.randn(n, generator=g)
        x[2, n // 2] = float("nan")
        x[3] = float("-inf")
        x[4, -1] = float("inf")
        assert k.argmax_rows(x) == [int(row.numpy().argmax()) for row in x], n
    strided = torch.randn(3, 2 * n, generator=g)[:, ::2]
    assert k.argmax_rows(strided) == [int(row.numpy().argmax()) for row in strided]
    for bad in (torch.zeros(4), torch.zeros(2, 0), torch.zeros(2, 3, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="float32 CPU"):
            k.argmax_rows(bad)



def test_instruction_peak_runs_each_kind_and_names_a_bad_one(monkeypatch):
    """instruction_peak (bench/ttft.py's int8 limit on AVX2 builds): a finite, positive rate for each
    kind this build has, and a clear error for any other kind or a step count below one."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    k = kernels.compiled()
    for kind in ("fp32", "int8") if k.INT8_DOT else ("fp32",):
        rate = k.instruction_peak(kind, 100_000)
        assert 0 < rate < float("inf"), kind
    with pytest.raises(RuntimeError, match="kind must be 'fp32' or 'int8', not 'bf16'"):
        k.instruction_peak("bf16")
    with pytest.raises(RuntimeError, match="steps must be positive"):
        k.instruction_peak("fp32", 0)

def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_at(count: int, seconds: float = 10.0) -> bool:
    """Whether the process's thread count comes to `count` (released workers end asynchronously)."""
    deadline = time.time() + seconds
    while _threads() != count and time.time() < deadline:
        time.sleep(0.01)
    return _threads() == count


def _make_workers(k) -> None:
    """A parallel region on this thread (argmax takes both threads from 32k values on)."""
    assert k.argmax(torch.arange(1 << 16, dtype=torch.float32)) == (1 << 16) - 1


def test_release_openmp_workers_ends_this_threads_pool(monkeypatch):
    """release_openmp_workers: the calling thread's OpenMP workers end, and its next parallel region
    starts new ones. (With two threads' pools alive on a 2-core machine, libgomp stops spinning
    between regions: a generation in the serving engine's thread ran ~1.3x slower.)"""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    k, before = kernels.compiled(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kernels.release_openmp_workers()
        time.sleep(0.2)
        base = _threads()
        for _ in range(2):
            _make_workers(k)
            assert _threads() == base + 1  # one worker beside this thread
            kernels.release_openmp_workers()
            assert _settles_at(base)
    finally:
        torch.set_num_threads(before)


def test_generation_and_engine_submissions_release_their_threads_workers(checkpoints, monkeypatch):
    """stream_generate ends its thread's OpenMP workers when it ends; Engine.submit ends the
    submitting thread's (the engine's thread decodes); load_model ends the loading thread's."""
    import lm.serving
    import mm.loading
    from lm import SamplingParams, generate

    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    k, before = kernels.compiled(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = mm.load_model(checkpoints("moe_text")[1])
        kernels.release_openmp_workers()
        time.sleep(0.2)
        base = _threads()
        _make_workers(k)
        generate(model.lm, torch.tensor([[5, 6, 7]]), SamplingParams(max_new_tokens=3))
        assert _settles_at(base)
        released = []
        monkeypatch.setattr(kernels, "release_openmp_workers", lambda: released.append(threading.current_thread()))
        engine = lm.serving.Engine(model.lm)
        try:
            assert len(engine.submit([5, 6, 7], SamplingParams(max_new_tokens=2)).result()) == 2
        finally:
            engine.close()
        assert released == [threading.current_thread()]
        monkeypatch.setattr(mm.loading, "release_openmp_workers", lambda: released.append("load"))
        mm.load_model(checkpoints("moe_text")[1])
        assert released[-1] == "load"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind, weights", [("moe", "fp32"), ("moe", "int8"), ("dense", "bf16")])
def test_inference_mode_runs_the_kernels_as_no_grad_does(checkpoints, kind, weights):
    """The kernels' worker threads take the caller's inference mode: under torch.inference_mode() the
    in-place ops of the chunked delta rule and the expert MLP on its tensors must not fail there."""
    model = mm.load_model(checkpoints(kind)[1], weights=weights).lm
    ids = torch.randint(3, 400, (2, 150), generator=torch.Generator().manual_seed(9))  # > 2 delta-rule chunks
    with torch.no_grad():
        expected = model(ids)
    with torch.inference_mode():
        got = model(ids)
    assert torch.equal(got, expected)
