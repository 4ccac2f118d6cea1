"""Weight storage formats (lm/formats): the quantizers against gguf's reference, the kernels against
dequantize-then-matmul, and whole models against float32 on the same weights."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mm
from lm import kernels
from lm.kernels import tuning
from lm.formats import (BF16, BF16_G8, FP32, INT4, INT8, Q4_K, Q5_K, Q6_K, blocks, format_of, gather_rows, group_rows,
                        param_format, policy, tag, to_float)
from tests.conftest import q8_0_round, rel_err


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    monkeypatch.setattr(kernels, "MIN_WEIGHT_ELEMENTS", 0)
    yield
    kernels.set_int8_activations(True)


@pytest.fixture
def int8_on(kernels_on):
    """The kernels with int8 activations on (skipped where the build lacks the int8 dot products)."""
    if not kernels.compiled().INT8_DOT:
        pytest.skip("the int8 dot products are built for AVX2 only")
    kernels.set_int8_activations(True)


def _weights(n=48, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :32] = 0  # an all-zero block: d = 0
    w[1, 40] = -w[1, 32:64].abs().max() * 1.5  # the block's largest magnitude is negative
    w[2, 64:96] = 0.25  # ties everywhere
    return w


@pytest.mark.parametrize("fmt,qtype", [(INT8, "Q8_0"), (INT4, "Q4_0")])
def test_quantizer_is_bit_exact_with_gguf(fmt, qtype):
    from gguf import GGMLQuantizationType, quants

    w = _weights()
    ours = fmt.quantize(w)
    ref = quants.quantize(w.numpy(), getattr(GGMLQuantizationType, qtype))
    gguf_rows = blocks.deinterleave8(ours, fmt.block_bytes)  # GGUF's blocks, kept in groups of 8 rows
    assert ours.dtype == torch.uint8 and np.array_equal(gguf_rows.numpy(), ref)
    deq = quants.dequantize(ref, getattr(GGMLQuantizationType, qtype))
    assert np.array_equal(fmt.dequantize(ours, w.shape[1]).numpy(), deq)
    assert format_of(ours, w.shape[1]) is fmt
    assert abs(fmt.bits_per_weight - (8.5 if fmt is INT8 else 4.5)) < 1e-9


@pytest.mark.parametrize("fmt,blocks_fn", [(INT8, "_q8_0_blocks"), (INT4, "_q4_0_blocks")])
def test_block_format_rows_are_grouped_by_eight(fmt, blocks_fn):
    """blocks.py's layout: block b of a group holds the 8 rows' scales, then chunk c = quant bytes
    4c..4c+3 of rows 0..7 (8 chunks for Q8_0, 4 for Q4_0); the kernels read it as it is."""
    w = _weights(n=16, k=64)
    bb, chunks = fmt.block_bytes, (fmt.block_bytes - 2) // 4
    gguf_rows = blocks._quantize(w, bb, getattr(blocks, blocks_fn))
    group = fmt.quantize(w)[8:16].reshape(-1)  # the second group's bytes, in order
    for r, b, c in [(0, 0, 0), (5, 1, 2), (7, 1, chunks - 1)]:
        block = group[b * 8 * bb : (b + 1) * 8 * bb]
        assert torch.equal(block[2 * r : 2 * r + 2], gguf_rows[8 + r, b * bb : b * bb + 2])
        assert torch.equal(block[16 + 32 * c + 4 * r : 20 + 32 * c + 4 * r], gguf_rows[8 + r, b * bb + 2 + 4 * c : b * bb + 6 + 4 * c])
    assert torch.equal(blocks.interleave8(blocks.deinterleave8(fmt.quantize(w), bb), bb), fmt.quantize(w))
    with pytest.raises(ValueError, match="groups of 8 rows"):
        fmt.quantize(torch.randn(12, 64))
    assert not fmt.fits(64, 12) and fmt.fits(64, 16) and BF16.fits(64, 12)


def test_format_of_refuses_unknown_storage():
    with pytest.raises(ValueError, match="no known format"):
        format_of(torch.zeros(4, 30, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="cannot take"):
        format_of(torch.zeros(4, 30), 64)


@pytest.mark.parametrize("fmt", [BF16, BF16_G8, INT8, INT4])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_products_with_float_activations_equal_dequantized_matmul(kernels_on, fmt, rows, monkeypatch):
    kernels.set_int8_activations(False)
    monkeypatch.setattr(kernels, "MIN_WEIGHT_ELEMENTS", 0)  # decode rows from panel_rows() on: the panels
    w, g = _weights(), torch.Generator().manual_seed(rows)
    q = fmt.quantize(w)
    x, b = torch.randn(rows, 256, generator=g), torch.randn(48, generator=g)
    ref = F.linear(x, fmt.dequantize(q, 256), b)
    assert rel_err(kernels.linear(x, (q, fmt), b), ref) < 1e-5
    assert rel_err(kernels.linear(x[None], (q, fmt), b)[0], ref) < 1e-5  # [B, T, K] inputs
    assert rel_err(kernels.linear(x[:, None], (q, fmt), b)[:, 0], ref) < 1e-5  # decode rows [B, 1, K]
    assert torch.equal(kernels.to_float((q, fmt), 256), fmt.dequantize(q, 256))  # the C++ conversion, bit for bit


def test_bf16_rows_in_groups_of_8():
    """BF16_G8 holds a bf16 weight's own values (exact), block b of each group of 8 rows being row 0's
    weights 32b..32b+31, then row 1's, ... (the layout lm/kernels/formats.h reads); the policy stores
    bf16 so where it fits (the embedding table and a head tied to it too), in rows for the router and the rest."""
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    q = group_rows(w)
    assert q.dtype == torch.uint16 and q.shape == w.shape and format_of(q, 96) is BF16_G8
    assert torch.equal(BF16_G8.dequantize(q, 96), w.bfloat16().float())
    flat = q.view(torch.bfloat16).reshape(-1)
    for group, r, b in [(0, 0, 0), (0, 5, 2), (1, 7, 1)]:
        at = (group * 3 + b) * 8 * 32 + r * 32
        assert torch.equal(flat[at : at + 32], w[group * 8 + r, 32 * b : 32 * b + 32].bfloat16())
    with pytest.raises(ValueError, match="groups of 8 rows"):
        group_rows(torch.randn(12, 64))
    assert not BF16_G8.fits(64, 12) and not BF16_G8.fits(48, 16) and BF16_G8.fits(64, 16)
    shapes = {"model.embed_tokens.weight": (512, 64), "lm_head.weight": (512, 64),
              "model.layers.0.mlp.gate.weight": (8, 64), "model.layers.0.mlp.experts.gate_up_proj": (8, 32, 64),
              "model.layers.0.linear_attn.in_proj_qkv.weight": (96, 64),
              "model.layers.0.linear_attn.out_proj.weight": (64, 36)}
    plan = policy.plan(shapes, "auto", torch.bfloat16, groups=True)
    assert plan["lm_head.weight"] is plan["model.embed_tokens.weight"] is BF16_G8  # a tied head stays the table
    assert plan["model.layers.0.mlp.gate.weight"] is BF16
    assert plan["model.layers.0.mlp.experts.gate_up_proj"] is BF16_G8
    assert plan["model.layers.0.linear_attn.in_proj_qkv.weight"] is BF16_G8
    assert plan["model.layers.0.linear_attn.out_proj.weight"] is BF16  # K = 36: no whole blocks of 32
    assert policy.plan(shapes, "int4,deltanet=bf16", torch.bfloat16, groups=True)[
        "model.layers.0.linear_attn.in_proj_qkv.weight"] is BF16_G8  # a bf16 part under another base
    assert set(policy.plan(shapes, "auto", torch.bfloat16, groups=False).values()) == {BF16}
    table = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 7, 8], [23, 15, 9]])
    assert torch.equal(gather_rows(group_rows(table), ids, BF16_G8), table.bfloat16()[ids])  # the table's rows


def test_bf16_groups_follow_the_kernels_the_profile_and_the_switch(monkeypatch):
    """Groups of 8 rows where the CPU kernels are in use and the tuning profile says so (all but AMD
    Zen 3); rows on the reference paths; QWEN35_BF16_GROUPS forces either, and a bad value is an
    error that names the variable."""
    monkeypatch.delenv("QWEN35_BF16_GROUPS", raising=False)
    for module, profiled, grouped in [(None, True, False), (object(), True, True), (object(), False, False)]:
        monkeypatch.setattr(kernels, "_kernels", lambda module=module: module)
        with tuning.override(bf16_groups=profiled):
            assert kernels.bf16_groups() is grouped
        assert policy.storage("bf16", grouped) is (BF16_G8 if grouped else BF16)
        assert policy.storage("int4", grouped) is INT4
    for value, grouped in [("1", True), ("0", False)]:
        monkeypatch.setenv("QWEN35_BF16_GROUPS", value)
        assert kernels.bf16_groups() is grouped
    monkeypatch.setenv("QWEN35_BF16_GROUPS", "yes")
    with pytest.raises(ValueError, match="QWEN35_BF16_GROUPS"):
        kernels.bf16_groups()


@pytest.mark.parametrize("k", [200, 1056])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 8])
def test_bf16_products_of_any_width(kernels_on, k, rows):
    """bf16 products through the kernels: a K % 32 tail (200), and K beyond one chunk of x (1056); an odd
    number of weight rows (7: the one-row kernel of Zen 3 builds takes rows in twos, block_pairs)."""
    g = torch.Generator().manual_seed(k + rows)
    w = (torch.randn(40, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=g)
    ref = F.linear(x, w.float())
    assert rel_err(kernels.linear(x, w), ref) < 1e-5
    parts = [w, w[:16], w[:7]]
    assert all(rel_err(y, x @ v.float().T) < 1e-5 for y, v in zip(kernels.multi_linear(x, parts), parts))


@pytest.mark.parametrize("fmt", [INT8, INT4])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_products_with_int8_activations(int8_on, fmt, rows):
    """Activations rounded to Q8_0 blocks (float32 scales): the kernel equals the float64 product
    with those activations; against float32 x, the error is at most sum_k |w_k| dx_k / 2."""
    w, g = _weights(seed=1), torch.Generator().manual_seed(rows)
    q, wf = fmt.quantize(w), fmt.dequantize(fmt.quantize(w), 256).double()
    x = torch.randn(rows, 256, generator=g)
    blocks = x.view(rows, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(blocks / d) * d).view(rows, 256).double()
    y = kernels.linear(x, (q, fmt)).double()
    assert rel_err(y, xq @ wf.T) < 1e-5
    bound = (wf.abs() @ (d / 2).expand(-1, -1, 32).reshape(rows, 256).double().T).T  # [rows, N]
    assert ((y - x.double() @ wf.T).abs() <= bound * 1.001 + 1e-6).all()
    assert rel_err(y, x.double() @ wf.T) > 1e-6  # the activations were really rounded


@pytest.mark.parametrize("fmt", [INT8, INT4])
def test_int8_dot_products_of_one_row_equal_those_of_more_rows_bit_for_bit(int8_on, fmt):
    """One row takes its own group kernel (on Zen 4's AVX-512 build, 512-bit registers: int8_dot.h,
    dot_group_q4_0_zmm); its integer dot products and float scaling are those of the kernel of 2-4
    rows, so each row's y is the same bit for bit."""
    q = fmt.quantize(_weights(seed=2))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    both = kernels.linear(x, (q, fmt))
    for r in range(3):
        assert torch.equal(kernels.linear(x[r : r + 1], (q, fmt)), both[r : r + 1])


@pytest.mark.parametrize("fmt", [BF16, BF16_G8, INT8, INT4])
def test_grouped_and_moe_decode_kernels_with_compact_experts(kernels_on, fmt):
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(6, 64, 96, generator=g) * 0.1, torch.randn(6, 96, 32, generator=g) * 0.1
    gq, dq = fmt.quantize(gate_up), fmt.quantize(down)
    experts, sizes = [0, 3, 5], [2, 1, 4]
    x = torch.randn(7, 96, generator=g)
    kernels.set_int8_activations(False)
    gf = fmt.dequantize(gq, 96)
    ref = torch.cat([x[0:2] @ gf[0].T, x[2:3] @ gf[3].T, x[3:7] @ gf[5].T])
    assert rel_err(kernels.grouped_linear(x, (gq, fmt), experts, sizes), ref) < 1e-5

    from lm.config import TextConfig
    from lm.moe import SparseMoeBlock
    from tests import tiny

    cfg = TextConfig.from_hf(tiny.text_config(True, hidden_size=96, num_experts=6, num_experts_per_tok=2,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=64))
    block = SparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        block.experts.gate_up_proj.copy_(gate_up[:, :64])
    reference = {n: p.clone() for n, p in block.named_parameters()}
    for name in ("experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj.weight",
                 "shared_expert.up_proj.weight", "shared_expert.down_proj.weight"):
        module, attr = name.rsplit(".", 1)
        p = block.get_submodule(module)._parameters[attr]
        q = fmt.quantize(p.data)
        reference[name] = fmt.dequantize(q, p.shape[-1])
        block.get_submodule(module)._parameters[attr] = torch.nn.Parameter(q, requires_grad=False)
        tag(block.get_submodule(module), attr, fmt)
    x = torch.randn(5, 96, generator=g)
    dense = SparseMoeBlock(cfg).eval()
    dense.load_state_dict(reference)
    prefill = torch.randn(80, 96, generator=g)  # more rows than decode: expert_mlp converts per expert
    with torch.no_grad():
        assert rel_err(block(x), dense(x)) < 1e-5  # moe_decode reading the compact experts
        assert rel_err(block(prefill), dense(prefill)) < 1e-5
        if fmt.name != "bf16" and kernels.compiled().INT8_DOT:  # x and each expert's act rounded to Q8_0
            kernels.set_int8_activations(True)
            assert 1e-6 < rel_err(block(x), dense(x)) < 2e-2  # ~1.0% for both formats here


def _random_moe(fmt, seed, E, H, I, Is):
    """Random MoE weights in `fmt`: (w, a maker of more random tensors; router; gate_up; down; the
    shared expert's three), each weight in `fmt` a (storage, fmt) pair."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    def q(*shape):
        return fmt.quantize(w(*shape)), fmt

    return w, w(E, H), q(E, 2 * I, H), q(E, H, I), [q(Is, H), q(Is, H), q(H, Is)]


@pytest.mark.parametrize("fmt", [INT8, INT4])
def test_moe_decode_rows_together_equal_each_row_alone_with_int8_activations(int8_on, fmt):
    """moe_decode quantizes x to Q8_0 once: an expert one token chose reads that token's row in place,
    an expert several tokens chose reads copies of their rows side by side. Each row of a batch must
    equal the same row alone (the same integer dots; only the order of the float sums over the
    experts differs), for both kinds of expert, and for an expert of 5 rows (its fifth row takes
    the one-row kernel)."""
    E, K, H, I, Is, N = 6, 2, 96, 32, 64, 8
    w, router, gate_up, down, shared = _random_moe(fmt, 10, E, H, I, Is)
    shared_gate, x = w(H), w(N, H) / 0.2
    counts = torch.bincount((x @ router.T).topk(K, dim=-1).indices.flatten(), minlength=E)
    assert (counts == 1).any() and (counts >= 5).any()  # both kinds of expert, one of 5 rows

    def moe(rows):
        return kernels.moe_decode(rows, router, gate_up, down, K, *shared, shared_gate)

    together = moe(x)
    for n in range(N):
        assert rel_err(together[n : n + 1], moe(x[n : n + 1])) < 1e-6


@pytest.mark.parametrize("rows", [3 * kernels.MAX_ROWS + 5, 261])  # AVX2 builds: Q8_0 tiles from 256 rows
@pytest.mark.parametrize("fmt", [INT8, INT4])
def test_prefill_products_with_int8_activations(int8_on, fmt, rows):
    """More rows than a decode batch (prefill) take int8_linear: x rounded to Q8_0 blocks, equal to
    the float64 product with those activations, and each row the same bits as that row alone in a
    decode product (the same integer dots and scaling), so prefill and decode agree."""
    w, g = _weights(n=56, seed=4), torch.Generator().manual_seed(5)
    q, wf = fmt.quantize(w), fmt.dequantize(fmt.quantize(w), 256).double()
    x = torch.randn(rows, 256, generator=g)
    xq = q8_0_round(x).double()
    y = kernels.linear(x.view(1, rows, 256), (q, fmt))[0]
    assert rel_err(y.double(), xq @ wf.T) < 1e-5
    assert 1e-4 < rel_err(y.double(), x.double() @ wf.T) < 2e-2  # the rounding is real
    for r in range(rows):  # rows in whole prefill tiles and the rows left over alike
        assert torch.equal(y[r : r + 1], kernels.linear(x[r : r + 1], (q, fmt)))
    kernels.set_int8_activations(False)  # off: the weight converted to float32, then the GEMM
    assert rel_err(kernels.linear(x, (q, fmt)).double(), x.double() @ wf.T) < 1e-5


@pytest.mark.parametrize("fmt", [INT8, INT4])
def test_prefill_experts_equal_decode_experts_with_int8_activations(int8_on, fmt):
    """expert_mlp (prefill) and moe_decode round x and each expert's activations to Q8_0 the same
    way and take the same integer dots: each token's experts agree up to the order of the float sums
    (the shared expert is zeroed here: prefill runs it through the layers' own products)."""
    E, K, H, I, Is, N = 8, 2, 96, 64, 32, 24
    w, router, gate_up, down, shared = _random_moe(fmt, 11, E, H, I, Is)
    shared[2] = fmt.quantize(torch.zeros(H, Is)), fmt
    x = w(N, H) / 0.2
    probs = (x @ router.T).softmax(-1)
    top = probs.topk(K, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    order = top.indices.flatten().argsort(stable=True)
    counts = torch.bincount(top.indices.flatten(), minlength=E)
    prefill = kernels.expert_mlp(x, gate_up, down, counts, order // K, weights.flatten()[order])
    decode = torch.cat([kernels.moe_decode(x[n : n + 1], router, gate_up, down, K, *shared, w(H)) for n in range(N)])
    assert rel_err(prefill, decode) < 1e-5


def test_weights_specs():
    assert policy.parse("int4")["embed"] == "auto" and policy.parse("int4")["experts"] == "int4"
    parts = policy.parse("int4,attention=int8,embed=fp32")
    assert parts["attention"] == "int8" and parts["deltanet"] == "int4" and parts["embed"] == "fp32"
    assert policy.parse("experts=int4")["lm_head"] == "auto"
    assert policy.parse("int4")["router"] == "auto" and policy.parse("fp32")["router"] == "fp32"
    assert policy.parse("bf16")["router"] == "bf16" and policy.part_of("model.layers.0.mlp.gate.weight") == "router"
    assert policy.part_of("model.layers.0.mlp.gate_proj.weight") == "mlp"  # a dense MLP's gate is no router
    assert policy.parse("auto")["vision"] == "fp32" and policy.parse("fp32")["vision"] == "fp32"
    assert policy.parse("int4")["vision"] == "auto" and policy.parse("bf16,vision=fp32")["vision"] == "fp32"
    assert policy.vision_dtype("int4", torch.bfloat16) == torch.bfloat16  # lossless on a bf16 checkpoint
    assert policy.vision_dtype("int4", torch.float32) == torch.float32
    assert policy.vision_dtype("vision=bf16", torch.float32) == torch.bfloat16
    for bad, match in [("int3", "unknown weights format"), ("int4,heads=int8", "unknown weights part"),
                       ("int8,embed=int4", "embed"), ("int8,vision=int8", "vision"), ("int4,router=int4", "router"),
                       ("", "weights must be")]:
        with pytest.raises(ValueError, match=match):
            policy.parse(bad)


def _bf16_checkpoint(tmp_path, kind, **overrides):
    from tests import tiny

    model = tiny.hf_model(kind, **overrides).to(torch.bfloat16)
    model.save_pretrained(tmp_path / kind)
    return tmp_path / kind


def _decode_logits(model, ids, mask, steps):
    """A left-padded prefill of ids[:, :-steps] then one token per row per step: logits [B, T, V]."""
    cache = model.lm.make_cache(ids.shape[0], ids.shape[1])
    prompt = ids.shape[1] - steps
    with torch.no_grad():
        out = [model.lm(ids[:, :prompt], attention_mask=mask, cache=cache)]
        positions = mask.sum(-1)
        for i in range(prompt, ids.shape[1]):
            pos = (positions + i - prompt)[None, :, None].expand(3, -1, 1)
            out.append(model.lm(ids[:, i : i + 1], positions=pos, cache=cache))
    return torch.cat(out, 1)


def _batch(b, seed=0):
    ids = torch.randint(3, 500, (b, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(b, 8, dtype=torch.long)
    mask[b - 1, :3] = 0  # the last row left-padded
    return ids, mask


@pytest.mark.parametrize("groups", ["1", "0"])  # bf16 rows in groups of 8 (the default with the kernels), rows
@pytest.mark.parametrize("kind", ["moe_text", "dense_vl", "dense_tied"])
def test_bf16_storage_equals_fp32_on_a_bf16_checkpoint(tmp_path, kind, groups, monkeypatch):
    monkeypatch.setenv("QWEN35_BF16_GROUPS", groups)
    extra = {"moe_text": dict(shared_expert_intermediate_size=64), "dense_tied": dict(tie_word_embeddings=True)}
    path = _bf16_checkpoint(tmp_path, kind.replace("_tied", "_text"), **extra.get(kind, {}))
    monkeypatch.setattr(kernels, "MIN_WEIGHT_ELEMENTS", 0)
    fp32, auto = mm.load_model(path, weights="fp32"), mm.load_model(path, compute="fp32")  # storage alone
    # bf16 in rows, or in rows grouped by 8 (uint16), the embedding table (gathered in prefill and in the
    # decode step) and a head tied to it included
    groups = groups == "1"
    assert auto.lm.lm_head.weight.dtype == auto.lm.model.embed_tokens.weight.dtype == (torch.uint16 if groups else torch.bfloat16)
    assert fp32.lm.lm_head.weight.dtype == torch.float32
    assert (auto.lm.lm_head.weight is auto.lm.model.embed_tokens.weight) == auto.lm.config.tie_word_embeddings
    grouped = [p for n, p in auto.lm.named_parameters() if p.dtype == torch.uint16]
    assert len(grouped) >= 2 * len(auto.lm.model.layers) if groups else not grouped  # every layer's large matrices
    if kind.startswith("moe"):  # the router too: decode (moe_decode) and prefill read it in bf16
        routers = [(a.mlp.gate.weight, f.mlp.gate.weight) for a, f in zip(auto.lm.model.layers, fp32.lm.model.layers)]
        assert all(a.dtype == torch.bfloat16 and f.dtype == torch.float32 and torch.equal(a.float(), f) for a, f in routers)
    ids, mask = _batch(3)
    assert rel_err(auto(ids), fp32(ids)) <= 1e-5
    assert rel_err(_decode_logits(auto, ids, mask, 4), _decode_logits(fp32, ids, mask, 4)) <= 1e-5


@pytest.mark.parametrize("fast", [True, False])
def test_vision_tower_in_bf16_storage_equals_fp32_on_a_bf16_checkpoint(tmp_path, fast):
    """Under a compact base the tower's matrices stay bf16 and are converted where used: the features
    equal those of the float32 tower bit for bit (bf16 -> fp32 is exact; the same products run)."""
    path = _bf16_checkpoint(tmp_path, "dense_vl")
    compact = mm.load_model(path, weights="int8", compute="fp32")  # storage alone: float32 products
    wide = mm.load_model(path, weights="int8,vision=fp32", compute="fp32")
    assert compact.visual.blocks[0].mlp.linear_fc1.weight.dtype == torch.bfloat16
    assert compact.visual.merger.linear_fc1.weight.dtype == torch.bfloat16
    assert compact.visual.patch_embed.proj.weight.dtype == torch.bfloat16
    assert compact.visual.blocks[0].norm1.weight.dtype == torch.float32 == compact.visual.dtype
    assert wide.visual.blocks[0].mlp.linear_fc1.weight.dtype == torch.float32
    config = compact.visual.config
    grid = torch.tensor([[2, 4, 4]])
    pixels = torch.randn(32, config.patch_dim, generator=torch.Generator().manual_seed(0))
    compact.visual.fast = wide.visual.fast = fast
    assert torch.equal(compact.visual(pixels, grid), wide.visual(pixels, grid))


def _dequantized_fp32(model, path):
    """The fp32 model of `path` with the compact model's weights, dequantized, in its parameters."""
    ref = mm.load_model(path, weights="fp32")
    params = dict(ref.lm.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, p in model.lm.named_parameters(remove_duplicate=False):
            params[name].copy_(to_float(p, params[name].shape[-1], param_format(model.lm, name)))
    return ref


@pytest.mark.parametrize("kind", ["moe_text", "dense_vl"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("batch", [1, 8])
def test_compact_model_equals_its_dequantized_weights_in_fp32(tmp_path, monkeypatch, kind, weights, batch):
    """int8 / int4 storage through the kernels against the same weights dequantized to float32 through
    the reference path (no kernels): float32 activations to float32 rounding; int8 activations
    within 10% of the logits' range on these tiny random models, whose 4 random layers amplify
    it (bench/formats.py gives the figures of a real-proportioned model)."""
    extra = dict(shared_expert_intermediate_size=64) if kind.startswith("moe") else {}
    path = _bf16_checkpoint(tmp_path, kind, **extra)
    monkeypatch.setattr(kernels, "MIN_WEIGHT_ELEMENTS", 0)
    model = mm.load_model(path, weights=weights, compute="int8")  # int8 products (float32 with them off)
    formats = {name: param_format(model.lm, name) for name in ("lm_head.weight", "model.embed_tokens.weight")}
    assert formats["lm_head.weight"].name == weights  # the table: bf16 rows, or in groups of 8 with the kernels
    assert formats["model.embed_tokens.weight"].name == "bf16"
    reference = _dequantized_fp32(model, path)
    ids, mask = _batch(batch, seed=batch)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    ref = _decode_logits(reference, ids, mask, 4)
    unkerneled = _decode_logits(model, ids, mask, 4)  # the compact model's own reference path
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    kernels.set_int8_activations(False)
    try:
        exact = _decode_logits(model, ids, mask, 4)
    finally:
        kernels.set_int8_activations(True)
    fast = _decode_logits(model, ids, mask, 4)
    assert rel_err(unkerneled, ref) < 1e-5
    assert rel_err(exact, ref) < 1e-5
    assert 1e-6 < rel_err(fast, ref) < 1e-1


def test_tied_head_in_another_format_gets_its_own_table(tmp_path, monkeypatch):
    path = _bf16_checkpoint(tmp_path, "dense_text", tie_word_embeddings=True)
    model = mm.load_model(path, weights="int8")
    head, table = model.lm.lm_head.weight, model.lm.model.embed_tokens.weight
    k, table_fmt = table.shape[1], param_format(model.lm, "model.embed_tokens.weight")
    assert param_format(model.lm, "lm_head.weight") is INT8 and table_fmt.name == "bf16"  # rows, or groups of 8
    assert torch.equal(to_float(head, k, INT8), INT8.dequantize(INT8.quantize(to_float(table, k, table_fmt)), k))
    auto = mm.load_model(path)
    assert auto.lm.lm_head.weight is auto.lm.model.embed_tokens.weight  # one format: still one tensor


def test_unknown_weights_and_quantization_methods_are_refused(tmp_path):
    import json

    path = _bf16_checkpoint(tmp_path, "dense_text")
    with pytest.raises(ValueError, match="unknown weights format 'q5'"):
        mm.load_model(path, weights="q5")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization method 'gptq'"):
        mm.load_model(path)


def test_fp8_checkpoint_loads_block_dequantized(tmp_path):
    """Qwen's FP8 layout: 2-D weights in F8_E4M3 with one `weight_scale_inv` per 128x128 block."""
    import json

    from safetensors.torch import load_file, save_file

    path = _bf16_checkpoint(tmp_path, "moe_text", hidden_size=160)  # 160: a ragged last block of 32
    tensors = load_file(path / "model.safetensors")
    expected, fp8 = {}, {}
    g = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if t.dim() == 2 and "embed" not in name and "norm" not in name and "gate.weight" not in name:
            r, c = t.shape
            scale = torch.rand(-(-r // 128), -(-c // 128), generator=g) * 0.01 + 0.001
            full = scale.repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]
            q = (t.float() / full).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            expected[name] = q.float() * full
        else:
            fp8[name] = t
    save_file(fp8, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))
    model = mm.load_model(path, weights="fp32")
    params = dict(model.lm.named_parameters())
    for name, value in expected.items():
        if ".experts." in name:  # per-expert tensors: slices of the fused parameters
            prefix, e, kind, _ = name.rsplit(".", 3)
            fused = params[f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"][int(e)]
            inter = fused.shape[0] // 2
            param = {"gate_proj": fused[:inter], "up_proj": fused[inter:], "down_proj": fused}[kind]
        else:
            param = params[name]
        assert torch.equal(param, value), name
    auto = mm.load_model(path).lm  # auto: an fp8 checkpoint is bf16-class (rows grouped by 8)
    assert param_format(auto, "lm_head.weight").name == "bf16"


@pytest.fixture(autouse=True)
def _private_weight_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN35_CACHE", str(tmp_path / "cache"))  # converted weights stay in the test's folder


def test_converted_weights_are_cached_and_rebuilt_when_stale_or_damaged(tmp_path, monkeypatch):
    from lm.formats import blocks
    from lm.weight_cache import WeightCache

    path = _bf16_checkpoint(tmp_path, "moe_text", shared_expert_intermediate_size=64)
    first = mm.load_model(path, weights="int4")
    entry = WeightCache(path, "int4")
    assert entry.file.exists()
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0))
    calls = []
    real = blocks._q4_0_blocks
    monkeypatch.setattr(blocks, "_q4_0_blocks", lambda b: calls.append(1) or real(b))
    same = (lambda model: rel_err(model(ids), first(ids)) < 1e-6)  # the MoE kernel's thread sums vary in order
    cached = mm.load_model(path, weights="int4")
    assert not calls and all(torch.equal(p, q) for p, q in zip(cached.parameters(), first.parameters()))
    entry = WeightCache(path, "int4")
    with open(entry.file, "r+b") as f:  # damaged: the data cut short
        f.truncate(entry.file.stat().st_size - 100)
    assert same(mm.load_model(path, weights="int4")) and calls  # detected, rebuilt
    calls.clear()
    entry.file.write_bytes(b"not a safetensors file")
    assert same(mm.load_model(path, weights="int4")) and calls
    calls.clear()
    (path / "config.json").touch()  # the checkpoint changed: a new key, the old entry goes
    mm.load_model(path, weights="int4")
    assert calls and WeightCache(path, "int4").file.exists() and not entry.dir.exists()
    calls.clear()
    mm.load_model(path, weights="int4,attention=int8")  # another spec: converted, kept beside the first
    assert calls and WeightCache(path, "int4,attention=int8").file.exists()
    assert WeightCache(path, "int4").file.exists()
    calls.clear()
    mm.load_model(path, weights="int4")  # switching back converts nothing
    mm.load_model(path, weights="int4,attention=int8")
    assert not calls
    stale = WeightCache(path, "int4,attention=int8").dir
    (path / "config.json").touch()  # changed again: each spec's stale entry goes when it is rewritten
    mm.load_model(path, weights="int4")
    assert calls and stale.exists() and len(list(stale.parent.glob("*"))) == 2
    mm.load_model(path, weights="int4,attention=int8")
    assert not stale.exists() and len(list(stale.parent.glob("*"))) == 2


@pytest.mark.subprocess
def test_loading_streams_within_the_final_size_plus_the_largest_tensor(tmp_path):
    """A compact load never holds the float32 model: the peak growth of anonymous memory (sampled;
    the checkpoint's mmap'd pages belong to the page cache) <= final size + the largest checkpoint
    tensor (x3: read, in float32 chunks, converted) + a fixed margin (128 MiB: freed temporaries the
    allocator keeps, lazy imports)."""
    import json
    import subprocess
    import sys

    from tests import tiny

    overrides = dict(hidden_size=512, vocab_size=16384, num_experts=16, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, linear_num_value_heads=8, linear_num_key_heads=4,
                     linear_key_head_dim=64, linear_value_head_dim=64)
    path = _bf16_checkpoint(tmp_path, "moe_text", **overrides)
    script = f"""
import json, math, torch, mm
from safetensors import safe_open
with safe_open({str(path / 'model.safetensors')!r}, 'pt') as f:  # bf16: 2 bytes a weight
    largest = max(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * 2
import threading, time
def rss():  # anonymous memory: the checkpoint's mmap'd pages are the page cache's, not the model's
    return int(open('/proc/self/status').read().split('RssAnon:')[1].split()[0]) * 1024
base, peak, done = rss(), [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
thread = threading.Thread(target=sample)
thread.start()
model = mm.load_model({str(path)!r}, weights='int4')
done.append(1)
thread.join()
final = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps(dict(base=base, peak=peak[0], final=final, largest=largest)))
"""
    env = dict(__import__("os").environ, QWEN35_CACHE=str(tmp_path / "cache"), QWEN35_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["peak"] - r["base"] <= r["final"] + 3 * r["largest"] + 128 * 2**20, r  # margin: allocator, imports
    assert r["peak"] - r["base"] < 8 * r["final"], r  # the float32 model would add ~7x the int4 one


@pytest.mark.parametrize("fmt", [Q4_K, Q5_K, Q6_K])
def test_k_quant_products_equal_dequantized_matmul(kernels_on, fmt):
    """GGUF's K-quants through the kernels' traits (formats.h), rows as in the file: the C++
    conversion equals the Python dequantization (itself gguf's, tests/mm/test_gguf_kquants.py) bit
    for bit; with float32 activations, decode products of 1-8 rows, several weights in one call,
    grouped experts and the MoE decode block equal dequantize-then-matmul; prefill (more rows)
    converts and multiplies in float32. With int8 activations (kquant_dot.h), decode products equal
    their twin, x rounded to Q8_0 blocks times the dequantized weights; so do prefill products (more
    rows: int8_linear, in panels of 16 weight rows on AVX-512 VNNI builds, kquant_tiles.h) and the
    routed experts' prefill (expert_mlp: x's rows and the activations rounded to Q8_0)."""
    from tests.mm.test_gguf_kquants import random_blocks

    rng, g = np.random.default_rng(fmt.code), torch.Generator().manual_seed(fmt.code)
    name = fmt.name.upper()

    def weight(*shape):  # rows of K = shape[-1] weights, random super-blocks of weights within ~0.1
        n = int(np.prod(shape)) // 256
        raw = torch.from_numpy(random_blocks(name, n, rng, scale=0.1)).reshape(*shape[:-1], -1)
        return raw, fmt

    kernels.set_int8_activations(False)
    w = weight(40, 512)
    wf = fmt.dequantize(w[0], 512)
    assert torch.equal(kernels.to_float(w, 512), wf) and wf.abs().max() > 0
    for rows in (1, 2, 3, 5, 8, 3 * kernels.MAX_ROWS):
        x = torch.randn(rows, 512, generator=g)
        assert rel_err(kernels.linear(x, w), x @ wf.T) < 1e-5, rows
    x = torch.randn(3, 512, generator=g)
    v = weight(16, 512)
    ys = kernels.multi_linear(x, [w, v])
    assert rel_err(ys[0], x @ wf.T) < 1e-5 and rel_err(ys[1], x @ fmt.dequantize(v[0], 512).T) < 1e-5
    experts = weight(4, 24, 256)
    ef = fmt.dequantize(experts[0], 256)
    xs = torch.randn(5, 256, generator=g)
    ref = torch.cat([xs[0:2] @ ef[1].T, xs[2:5] @ ef[3].T])
    assert rel_err(kernels.grouped_linear(xs, experts, [1, 3], [2, 3]), ref) < 1e-5
    E, K, H, I, Is = 4, 2, 256, 256, 256
    router = torch.randn(E, H, generator=g) * 0.2
    gate_up, down, shared = weight(E, 2 * I, H), weight(E, H, I), [weight(Is, H), weight(Is, H), weight(H, Is)]
    gate = torch.randn(H, generator=g) * 0.2
    x = torch.randn(3, H, generator=g)
    floats = [(fmt.dequantize(t, t.shape[-1] // fmt.block_bytes * 256), FP32) for t, _ in (gate_up, down, *shared)]
    ours = kernels.moe_decode(x, router, gate_up, down, K, *shared, gate)
    twin = kernels.moe_decode(x, router, floats[0], floats[1], K, *floats[2:], gate)
    assert rel_err(ours, twin) < 1e-5
    if not kernels.compiled().INT8_DOT:
        return
    kernels.set_int8_activations(True)
    for rows in (1, 2, 3, 5, 8):
        x = torch.randn(rows, 512, generator=g)
        y = kernels.linear(x, w)
        assert rel_err(y, q8_0_round(x) @ wf.T) < 1e-5, rows
        assert 1e-4 < rel_err(y, x @ wf.T) < 2e-2, rows  # the rounding is real
    x = torch.randn(3, H, generator=g)
    ours = kernels.moe_decode(x, router, gate_up, down, K, *shared, gate)
    assert 1e-5 < rel_err(ours, kernels.moe_decode(x, router, floats[0], floats[1], K, *floats[2:], gate)) < 2e-2
    rows = 3 * kernels.MAX_ROWS + 5
    x = torch.randn(rows, 512, generator=g)
    y = kernels.linear(x.view(1, rows, 512), w, compute="auto")[0]
    assert kernels.prefill_compute("auto", w, x) == "int8"
    assert rel_err(y, q8_0_round(x) @ wf.T) < 1e-5 and 1e-4 < rel_err(y, x @ wf.T) < 2e-2
    for r in (0, 7, rows - 1):  # panels of 16 rows (kquant_tiles.h) sum in another order than decode
        assert rel_err(y[r : r + 1], kernels.linear(x[r : r + 1], w)) < 1e-6
    x = torch.randn(40, H, generator=g)  # 20 rows an expert: the panels; fewer than 8: kquant_dot.h
    top = (x @ router.T).softmax(-1).topk(K, dim=-1)
    chosen = top.values / top.values.sum(-1, keepdim=True)
    order = top.indices.flatten().argsort(stable=True)
    counts = torch.bincount(top.indices.flatten(), minlength=E)
    y = kernels.expert_mlp(x, gate_up, down, counts, order // K, chosen.flatten()[order], compute="int8")
    gu, dn = floats[0][0].view(E, 2 * I, H), floats[1][0].view(E, H, I)
    twin = torch.zeros_like(x)
    for n in range(40):
        for e, c in zip(top.indices[n].tolist(), chosen[n].tolist()):
            h = q8_0_round(x[n]) @ gu[e].T
            twin[n] += c * (q8_0_round(F.silu(h[:I]) * h[I:]) @ dn[e].T)
    # the activations' Q8_0 rounding may differ by one step where the twin's float32 h differs from
    # the kernel's in its last bits (~1/127 of a block's largest activation, times one weight)
    assert rel_err(y, twin) < 1e-3
