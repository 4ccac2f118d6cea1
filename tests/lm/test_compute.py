"""Compute formats of prefill products (lm/kernels/compute.py): bf16 and int8 against float32 on
the same weights, per product and end to end, and the fp32 path unchanged.

Bounds, stated here and in the README:
- bf16, per product: |y - y32| <= 2^-7 (|x| |W|^T) elementwise (x and W each rounded to bf16,
  relative 2^-9 each, sums in float32; torch's bf16 GEMM, the path without AMX, also rounds y to
  bf16), for every weight format; the AMX kernel equals its portable twin (the float32 product of
  the same bf16-rounded values) up to float32 summation order.
- end to end (the tiny random models, whose every parameter is perturbed): logits of bf16 / int8
  compute within 3% of their range from fp32 compute on the same weights, MoE and dense, batch 1
  and batch 8 with left padding; vision features within 2% of theirs.
- bf16 attention (bf16_attention.cpp: the vision tower's, and the LM's causal prefill attention
  under bf16 or int8 compute, on CPUs with AVX512-BF16 and no AMX): within 1% of the largest
  output of float32 attention of the same bf16 inputs (the probabilities and the output each
  rounded to bf16: 2^-9 relative each).
"""

import pytest
import torch
import torch.nn.functional as F

import mm
from lm import kernels
from lm.formats import BF16, BF16_G8, FP32, INT4, INT8, Q4_K, Q5_K, Q6_K, Format, to_float
from lm.kernels import compute
from tests.conftest import q8_0_round, rel_err

BF16_BOUND = 2.0**-7


def _weights(n: int, k: int, seed: int) -> dict[str, tuple[torch.Tensor, Format]]:
    """One random weight [n, k] in each format, as (storage, Format) pairs."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return {name: (fmt.quantize(w), fmt) for name, fmt in
            [("fp32", FP32), ("bf16 rows", BF16), ("bf16 groups", BF16_G8), ("int8", INT8), ("int4", INT4)]}


def _float(weight: tuple[torch.Tensor, Format], k: int) -> torch.Tensor:
    return to_float(weight[0], k, weight[1])


def test_unknown_compute_is_refused_with_the_choices(checkpoints):
    with pytest.raises(ValueError, match="choose one of auto, fp32, bf16, int8"):
        compute.check("fp16")
    with pytest.raises(ValueError, match="unknown compute format 'fast'"):
        mm.load_model(checkpoints("moe_text")[1], compute="fast")


@pytest.mark.parametrize("m, n, k", [(9, 40, 64), (77, 96, 160), (300, 264, 1152)])
def test_bf16_products_within_their_bound_for_every_format(m, n, k):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    for name, w in _weights(n, k, seed=n).items():
        w32 = _float(w, k)
        y = kernels.linear(x, w, compute="bf16")
        bound = BF16_BOUND * (x.abs() @ w32.abs().t()) + 1e-6
        assert bool(((y - x @ w32.t()).abs() <= bound).all()), name
        if compute.tiles(kernels.compiled()):
            assert rel_err(y, _twin(x, w32)) < 1e-5, name


def _twin(x: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
    """The portable twin of amx_linear: the float32 product of the bf16-rounded x and W."""
    return F.linear(x.bfloat16().float(), w32.bfloat16().float())


def test_amx_kernel_matches_its_twin_where_the_cpu_has_it():
    k = kernels.compiled()
    if not compute.tiles(k):  # without tiles, auto picks bf16 for bf16 weights only, where AVX512-BF16 is
        native = "avx512_bf16" in compute.cpu_flags()
        assert (compute.pick("auto", BF16, k) == "bf16") == native
        assert (compute.pick("auto", BF16_G8, k) == "bf16") == native
        assert compute.pick("auto", INT4, k) != "bf16"
        return
    x = torch.randn(45, 4304)  # K no multiple of 32 (the vision MLP's), M no multiple of 32
    w = torch.randn(72, 4304)
    assert rel_err(k.amx_linear(x, (w, FP32.code)), _twin(x, w)) < 1e-5
    assert compute.pick("auto", INT8, k) == "bf16" and compute.pick("auto", FP32, k) == "fp32"


def test_bf16_products_of_block_formats_equal_those_of_their_bf16_values():
    """bf16 products decode Q8_0 / Q4_0 blocks to bf16 (on AMX tiles in panels, Q4_0 through a per-row
    table): the product equals, bit for bit, the one of the same weights given as bf16 rows, over
    partial tiles of tokens (M) and weight rows (N, a multiple of 8)."""
    for n, depth in ((40, 96), (136, 512), (8, 32)):
        for name, w in _weights(n, depth, seed=depth).items():
            if name in ("int8", "int4"):
                w16 = _float(w, depth).bfloat16()
                for m in (kernels.MAX_ROWS + 1, 31, 33, 70):  # prefill rows
                    x = torch.randn(m, depth, generator=torch.Generator().manual_seed(m))
                    y = kernels.linear(x, w, compute="bf16")
                    assert torch.equal(y, kernels.linear(x, w16, compute="bf16")), (name, n, depth, m)


@pytest.mark.parametrize("m, n, k", [(9, 40, 64), (77, 264, 1152)])
def test_int8_products_equal_their_twin_for_both_block_formats(m, n, k):
    """int8 compute: x rounded to Q8_0 blocks times the Q8_0 / Q4_0 weights as stored, on AMX tiles
    where the CPU has them, else the int8 dot products; both against their portable twin, the float32
    product of the rounded x and the dequantized weights."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    for name in ("int8", "int4"):
        w = _weights(n, k, seed=n)[name]
        twin = q8_0_round(x) @ _float(w, k).t()
        assert rel_err(kernels.linear(x, w, compute="int8"), twin) < 1e-5, name
        module = kernels.compiled()
        if compute.tiles(module):  # both integer paths, the same sums
            arg = kernels.weight_arg(w)
            assert rel_err(module.amx_int8_linear(x, arg), module.int8_linear(x, arg)) < 1e-5, name


def test_pick_resolves_per_weight_format():
    k = kernels.compiled()
    assert compute.pick("fp32", INT4, k) == "fp32"
    assert compute.pick("bf16", FP32, k) == "bf16"
    legacy = "int8" if k is not None and k.INT8_DOT and k.int8_activations() else "fp32"
    assert compute.pick(None, INT8, k) == legacy  # a layer without a compute setting: as before
    assert compute.pick("int8", BF16, k) == "fp32"  # said once: int8 needs int8 / int4 weights


def _logits(model, ids, mask=None):
    return model(ids, attention_mask=mask)[:, -1]


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("weights, fast", [("int4", "bf16"), ("int8", "int8"), ("bf16", "bf16")])
def test_end_to_end_logits_against_fp32_compute(checkpoints, kind, weights, fast, monkeypatch):
    path = checkpoints(kind)[1]
    exact, quick = mm.load_model(path, weights=weights, compute="fp32"), mm.load_model(path, weights=weights, compute=fast)
    attended = []  # the prefill attention's calls of the bf16 attention kernel, where it runs
    kernel = kernels.bf16_attention_kernel(quick.config.text.head_dim)
    if kernel is not None:
        monkeypatch.setattr(kernels, "bf16_attention_kernel", lambda d: lambda *a: attended.append(1) or kernel(*a))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 400, (1, 48), generator=g)
    assert rel_err(_logits(quick, ids), _logits(exact, ids)) < 0.03
    assert bool(attended) == (kernel is not None)  # the unmasked prefill took it (fp32 compute never does)
    batch = torch.randint(3, 400, (8, 40), generator=g)  # batch 8, left padding
    mask = torch.ones_like(batch)
    for row, pad in enumerate([0, 3, 7, 12, 0, 20, 5, 30]):
        mask[row, :pad] = 0
    assert rel_err(_logits(quick, batch, mask), _logits(exact, batch, mask)) < 0.03


def test_a_later_prompt_chunk_takes_the_bf16_attention_kernel(checkpoints, monkeypatch):
    """A prompt prefilled in two chunks, the second over the first's cache (no padding: no mask,
    lm.attention.attention_mask_for): its attention runs through the bf16 kernel too where that
    runs, and the last logits stay within the end-to-end bound of fp32 compute."""
    path = checkpoints("moe")[1]
    quick = mm.load_model(path, weights="int8", compute="int8")
    exact = mm.load_model(path, weights="int8", compute="fp32")
    kernel = kernels.bf16_attention_kernel(quick.config.text.head_dim)
    queries = []  # the queries of each call of the kernel
    if kernel is not None:
        monkeypatch.setattr(kernels, "bf16_attention_kernel", lambda d: lambda *a: queries.append(a[0].shape[1]) or kernel(*a))
    ids = torch.randint(3, 400, (1, 48), generator=torch.Generator().manual_seed(5))
    cache = quick.lm.make_cache(1, 48)
    quick.lm(ids[:, :30], cache=cache)
    assert rel_err(quick.lm(ids[:, 30:], cache=cache)[:, -1], exact.lm(ids)[:, -1]) < 0.03
    assert (18 in queries) == (kernel is not None) and (30 in queries) == (kernel is not None)


def test_fp32_weights_keep_the_exact_path_under_auto(checkpoints):
    path = checkpoints("moe")[1]
    auto, exact = mm.load_model(path, weights="fp32"), mm.load_model(path, weights="fp32", compute="fp32")
    ids = torch.randint(3, 400, (2, 37), generator=torch.Generator().manual_seed(5))
    assert torch.equal(_logits(auto, ids), _logits(exact, ids))


def test_vision_features_bf16_against_fp32(checkpoints):
    path = checkpoints("moe")[1]
    model = mm.load_model(path, weights="bf16", compute="fp32")
    visual = model.visual
    cfg = visual.config
    grid = torch.tensor([[2, 8, 12]])
    pixels = torch.randn(int(grid.prod()), cfg.patch_dim, generator=torch.Generator().manual_seed(7))
    exact = visual(pixels, grid)
    visual.compute = "bf16"
    quick = visual(pixels, grid)
    assert 0 < rel_err(quick, exact) < 0.02  # bf16 products ran (not equal) within the bound
    bf16 = mm.load_model(path, weights="bf16", compute="bf16").visual
    assert bf16.compute == "bf16" and model.visual.attend is None  # fp32 compute: SDPA
    assert (bf16.attend is None) == (kernels.bf16_attention_kernel(cfg.head_dim) is None)
    if bf16.attend is not None:  # the tower through the bf16 attention kernel, within the same bound
        visual.attend = bf16.attend
        assert 0 < rel_err(visual(pixels, grid), exact) < 0.02


@pytest.mark.parametrize("flags, tower", [(set(), "fp32"), ({"avx512_bf16"}, "bf16"), ({"amx_bf16"}, "bf16")])
def test_int8_compute_leaves_the_vision_tower_in_its_fastest_float_format(checkpoints, monkeypatch, capsys, flags, tower):
    """The tower has no int8 products: under compute='int8' it takes bf16 where the CPU multiplies
    bf16 natively, and float32 elsewhere (emulated bf16 runs slower than float32), and says which once."""
    import mm.loading

    monkeypatch.setattr(mm.loading, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels.compute, "_said", set())
    visual = mm.load_model(checkpoints("moe")[1], weights="bf16", compute="fp32").visual
    mm.loading.set_vision_compute("int8", visual)
    assert visual.compute == tower
    assert f"the vision tower has no int8 products; it computes in {tower}" in capsys.readouterr().err


@pytest.mark.parametrize("length, heads, head_dim", [(37, 3, 72), (64, 2, 64), (5, 1, 16), (130, 2, 40)])
def test_bf16_attention_against_float32_attention(length, heads, head_dim):
    """The bf16 attention kernel, on strided q / k / v as the vision tower passes them (q and k from
    one [N, 2, H, D] buffer, v from [N, 3, H, D]), two segments of `length`, against float32 SDPA of
    the same bf16 values; where it is not built (no AVX512-BF16) or AMX tiles serve bf16, the
    tower keeps SDPA and the kernel says why it cannot run."""
    g = torch.Generator().manual_seed(length)
    n = 2 * length
    qk = (torch.randn(n, 2, heads, head_dim, generator=g) * 2).bfloat16()
    qkv = torch.randn(n, 3, heads, head_dim, generator=g).bfloat16()
    q, k, v = (t.view(2, length, heads, head_dim) for t in (qk[:, 0], qk[:, 1], qkv[:, 2]))
    attend = kernels.bf16_attention_kernel(head_dim)
    built = kernels.compiled() is not None and kernels.compiled().BF16_ATTENTION
    if attend is None:
        assert not built or compute.tiles(kernels.compiled())
        if kernels.compiled() is not None and not built:
            with pytest.raises(RuntimeError, match="built without AVX512-BF16"):
                kernels.compiled().bf16_attention(q, k, v, 0.1)
        return
    out = attend(q, k, v, head_dim**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (2, length, heads, head_dim)
    ref = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert 0 < rel_err(out.float(), ref) < 0.01
    assert kernels.bf16_attention_kernel(258) is None and kernels.bf16_attention_kernel(71) is None


@pytest.mark.parametrize("queries, keys, heads, kv_heads, head_dim", [(50, 50, 4, 2, 256), (19, 40, 2, 1, 72),
                                                                       (33, 33, 3, 3, 128), (1, 9, 2, 2, 96)])
def test_causal_bf16_attention_against_float32_attention(queries, keys, heads, kv_heads, head_dim):
    """The LM's prefill attention through the kernel: causal (the last `queries` of `keys` positions,
    each query seeing itself and the keys before it), grouped key heads, the cache's [B, KV, L, D]
    layout passed transposed, head dims up to 256; against float32 SDPA of the same bf16 values."""
    attend = kernels.bf16_attention_kernel(head_dim)
    if attend is None:  # no kernel here: the layer keeps SDPA (checked in the test above)
        assert kernels.compiled() is None or not kernels.compiled().BF16_ATTENTION or compute.tiles(kernels.compiled())
        return
    g = torch.Generator().manual_seed(queries)
    q = torch.randn(2, heads, queries, head_dim, generator=g).bfloat16()
    k, v = (torch.randn(2, kv_heads, keys, head_dim, generator=g).bfloat16() for _ in range(2))
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), head_dim**-0.5, True)
    assert out.shape == (2, queries, heads, head_dim)
    sees = torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None]  # [T, L]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=sees, enable_gqa=True)
    assert 0 < rel_err(out.float(), ref.transpose(1, 2)) < 0.01


def test_a_failed_start_up_check_keeps_auto_off_the_tiles(monkeypatch, capsys):
    k = kernels.compiled()
    if k is not None and k.amx_ready():
        assert compute._self_check(k) and compute.tiles(k)  # the real check passes on this CPU
    monkeypatch.setattr(compute, "_tiles_checked", {})
    monkeypatch.setattr(compute, "_said", set())
    monkeypatch.setattr(compute, "_self_check", lambda module: False)
    assert not compute.tiles(k)
    assert compute.pick("auto", INT4, k) != "bf16"
    monkeypatch.setattr(compute, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))  # no native bf16 either
    assert compute.pick("auto", BF16, k) != "bf16"
    if k is not None and k.amx_ready():
        assert "failed their start-up check" in capsys.readouterr().err


def test_k_quant_prefill_takes_the_int8_products(monkeypatch, capsys):
    """compute='auto' gives K-quant weights (Q4_K, Q5_K, Q6_K) the int8 products of decode where the
    kernels have them (kquant_dot.h: 2x the float32 conversion and GEMM on AVX-512 and AVX2; bf16 on
    AMX tiles, as for every compact format there), float32 without them, and says nothing."""
    k = kernels.compiled()
    monkeypatch.setattr(compute, "_said", set())
    picked = {compute.pick("auto", fmt, k) for fmt in (Q4_K, Q5_K, Q6_K)}
    int8 = k is not None and bool(k.INT8_DOT) and k.int8_activations()
    assert picked == {"bf16" if compute.tiles(k) else "int8" if int8 else "fp32"}
    assert not compute.int8_on_tiles("int8", k, Q4_K)  # the AMX int8 tiles take Q8_0 / Q4_0 only
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("fmt", [BF16, BF16_G8])
def test_bf16_experts_within_the_bf16_bound(fmt, monkeypatch, capsys):
    """The routed experts' prefill under bf16 compute: AMX tiles, else (a build with AVX512-BF16) each
    expert's weights as bf16 rows through torch's bf16 GEMM, else float32 (said once). Against the
    float32 path on the same weights: within 2% of the largest output (x, W, the activations and
    the GEMM's outputs each rounded to bf16), and not equal to it where bf16 ran."""
    from tests.lm.test_formats import _random_moe

    E, K, H, I, N = 8, 2, 128, 96, 40
    w, router, gate_up, down, _ = _random_moe(fmt, 21, E, H, I, 32)
    x = w(N, H) / 0.2
    top = (x @ router.T).softmax(-1).topk(K, dim=-1)
    chosen = top.values / top.values.sum(-1, keepdim=True)
    order = top.indices.flatten().argsort(stable=True)
    counts = torch.bincount(top.indices.flatten(), minlength=E)
    args = (x, gate_up, down, counts, order // K, chosen.flatten()[order])
    monkeypatch.setattr(compute, "_said", set())
    exact, y = kernels.expert_mlp(*args, compute="fp32"), kernels.expert_mlp(*args, compute="bf16")
    k = kernels.compiled()
    if compute.tiles(k) or k.BF16_ROWS:
        assert 1e-5 < rel_err(y, exact) < 0.02
    else:
        assert torch.equal(y, exact) and "computes in float32" in capsys.readouterr().err
