"""Checkpoint layouts (save_pretrained, fused and per-expert experts, shards, tied) and weight errors."""

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import mm
from lm import WeightError
from lm.formats import param_format
from tests import tiny
from tests.conftest import rel_err

TOL = 1e-4
IDS = torch.randint(3, 500, (1, 33), generator=torch.Generator().manual_seed(9))


def _logits_match(hf, path):
    with torch.no_grad():
        ref = hf(input_ids=IDS).logits
    assert rel_err(mm.load_model(path)(IDS), ref) <= TOL


def _copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    save_file(edit(tensors), path / "model.safetensors", metadata={"format": "pt"})


def _fuse_experts(tensors):
    """Rewrite per-expert tensors into the official fused layout [E, 2I, H] / [E, H, I]."""
    out, groups = {}, {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(n)])
    return out


def test_save_pretrained_writes_per_expert_layout_and_it_loads(checkpoints):
    hf, path = checkpoints("moe_vl")
    names = load_file(path / "model.safetensors").keys()
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in names
    _logits_match(hf, path)


@pytest.mark.parametrize("kind", ["moe_vl", "moe_text"])
def test_fused_expert_layout_loads(checkpoints, tmp_path, kind):
    hf, path = checkpoints(kind)
    fused = _copy_ckpt(path, tmp_path / "fused")
    _rewrite(fused, _fuse_experts)
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(fused / "model.safetensors"))
    _logits_match(hf, fused)


def test_sharded_checkpoint_with_index(checkpoints, tmp_path):
    hf, _ = checkpoints("moe_vl")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    _logits_match(hf, tmp_path)


def test_real_single_shard_name_without_index(checkpoints, tmp_path):
    hf, path = checkpoints("dense_vl")
    ckpt = _copy_ckpt(path, tmp_path / "c")
    (ckpt / "model.safetensors").rename(ckpt / "model.safetensors-00001-of-00001.safetensors")
    _logits_match(hf, ckpt)


def test_tied_embeddings_and_bf16_storage(tmp_path):
    hf = tiny.hf_model("dense_vl", tie_word_embeddings=True)
    hf.config.tie_word_embeddings = True
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    _logits_match(hf, tmp_path)
    _rewrite(tmp_path, lambda ts: {k: v.to(torch.bfloat16) for k, v in ts.items()})
    for weights, fmt in (("auto", "bf16"), ("fp32", "fp32")):  # auto keeps a bf16 checkpoint bf16 (rows, or in groups of 8)
        model = mm.load_model(tmp_path, weights=weights)
        assert param_format(model.lm, "lm_head.weight").name == fmt and model.lm.compute_dtype == torch.float32
        assert model.lm.lm_head.weight.data_ptr() == model.lm.model.embed_tokens.weight.data_ptr()


def test_mtp_tensors_are_skipped(checkpoints, tmp_path):
    hf, path = checkpoints("moe_vl")
    ckpt = _copy_ckpt(path, tmp_path / "mtp")
    _rewrite(ckpt, lambda ts: {**ts, "mtp.fc.weight": torch.zeros(64, 128), "mtp.norm.weight": torch.zeros(64)})
    _logits_match(hf, ckpt)


@pytest.mark.parametrize(
    "name",
    [
        "model.language_model.layers.1.linear_attn.A_log",
        "model.language_model.layers.3.self_attn.q_norm.weight",
        "model.language_model.layers.2.mlp.experts.5.up_proj.weight",
        "lm_head.weight",
        "model.visual.blocks.1.attn.qkv.bias",
    ],
)
def test_missing_tensor_is_named(checkpoints, tmp_path, name):
    _, path = checkpoints("moe_vl")
    ckpt = _copy_ckpt(path, tmp_path / "m")
    _rewrite(ckpt, lambda ts: {k: v for k, v in ts.items() if k != name})
    with pytest.raises(WeightError, match=re.escape(name)):
        mm.load_model(ckpt)


def test_unexpected_and_misshaped_tensors_are_named(checkpoints, tmp_path):
    _, path = checkpoints("moe_text")
    extra = _copy_ckpt(path, tmp_path / "extra")
    _rewrite(extra, lambda ts: {**ts, "model.layers.0.linear_attn.bogus": torch.zeros(3)})
    with pytest.raises(WeightError, match="model.layers.0.linear_attn.bogus"):
        mm.load_model(extra)
    stray = _copy_ckpt(path, tmp_path / "stray")
    _rewrite(stray, lambda ts: {**ts, "something.else": torch.zeros(3)})
    with pytest.raises(WeightError, match="something.else"):
        mm.load_model(stray)
    shaped = _copy_ckpt(path, tmp_path / "shape")
    _rewrite(shaped, lambda ts: {**ts, "model.norm.weight": torch.zeros(65)})
    with pytest.raises(WeightError, match=r"model.norm.weight.*\[65\].*\[64\]"):
        mm.load_model(shaped)


def test_wrong_checkpoint_for_config_is_refused(checkpoints, tmp_path):
    """Weights of one model under another model's config.json."""
    _, dense = checkpoints("dense_text")
    _, moe = checkpoints("moe_text")
    ckpt = _copy_ckpt(dense, tmp_path / "mixed")
    shutil.copy(moe / "config.json", ckpt / "config.json")
    with pytest.raises(WeightError, match="mlp"):
        mm.load_model(ckpt)


def test_huge_page_advice_marks_whole_pages_inside_large_tensors():
    from lm.hugepages import HUGE_PAGE, advise_huge_pages

    big, small = torch.empty(3 * HUGE_PAGE // 4 + 1000), torch.empty(1000)
    marked = advise_huge_pages([big, small])
    start, end = big.data_ptr(), big.data_ptr() + big.numel() * 4
    whole_pages = end // HUGE_PAGE - (start + HUGE_PAGE - 1) // HUGE_PAGE
    assert marked == whole_pages * HUGE_PAGE  # only the big tensor, only whole pages inside it


def test_parameters_from_64_kib_up_are_gathered_into_one_huge_page_buffer():
    from lm.hugepages import HUGE_PAGE, gather_into_huge_pages

    tiny, mid, mid2, big = (torch.nn.Parameter(torch.empty(n)) for n in (100, 300_000, 70_000, 3 * HUGE_PAGE // 4))
    storage = tiny.untyped_storage().data_ptr()
    moved = gather_into_huge_pages([tiny, mid, mid2, big])
    assert moved == (300_000 + 70_000) * 4 + 3 * HUGE_PAGE
    assert len({p.untyped_storage().data_ptr() for p in (mid, mid2, big)}) == 1  # one buffer
    assert mid.data_ptr() % HUGE_PAGE == 0 and mid2.data_ptr() % 4096 == 0 and big.data_ptr() % 4096 == 0
    assert mid2.data_ptr() >= mid.data_ptr() + 300_000 * 4 and big.data_ptr() >= mid2.data_ptr() + 70_000 * 4
    assert tiny.untyped_storage().data_ptr() == storage  # below 64 KiB: stays
    upto = [torch.nn.Parameter(torch.empty(n)) for n in (300_000, 3 * HUGE_PAGE // 4)]
    assert gather_into_huge_pages(upto, high=2 * HUGE_PAGE) == 300_000 * 4  # `high`: the big one stays
    assert mid.shape == (300_000,) and mid.dtype == torch.float32
    mid.data.fill_(1.0), mid2.data.fill_(2.0)
    assert float(mid.data.sum()) == 300_000 and float(mid2.data.sum()) == 140_000


def test_a_loaded_model_gathers_its_mid_size_weights_and_computes_the_same(checkpoints, monkeypatch):
    """load_model moves the mid-size LM weights into the shared buffer before filling them (the tiny
    model's weights are all small: the threshold is lowered to 1 KiB here), and the logits stay."""
    import lm.storage
    from lm.hugepages import gather_into_huge_pages

    _, ckpt = checkpoints("moe_text")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        reference = mm.load_model(ckpt, weights="int8").lm(ids)
        monkeypatch.setattr(lm.storage, "gather_into_huge_pages", lambda ps: gather_into_huge_pages(ps, low=1024))
        model = mm.load_model(ckpt, weights="int8")
        mid = [p for p in model.lm.parameters() if 1024 <= p.numel() * p.element_size() < 4 << 20]
        assert len(mid) > 4 and len({p.untyped_storage().data_ptr() for p in mid}) == 1
        out = model.lm(ids)
        assert (out - reference).abs().max() <= 1e-5 * reference.abs().max()  # alignment may change float32 GEMM rounding
