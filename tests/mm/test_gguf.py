"""GGUF files (llama.cpp's qwen35 / qwen35moe, made by its own converter: tools/gguf_fixtures.py)
loaded by mm.load_model against the Hugging Face checkpoint they were converted from."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import mm
from lm import WeightError
from lm.formats import to_float
from tests.conftest import rel_err

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gguf"
sys.path.insert(0, str(ROOT / "tools"))
import gguf_fixtures  # noqa: E402

_HF: dict = {}


def hf_model(kind: str):
    if kind not in _HF:
        _HF[kind] = gguf_fixtures.fixture_model(kind)
    return _HF[kind]


def ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, 13), generator=torch.Generator().manual_seed(1))


def rewrite(src: Path, dst: Path, *, arch: str | None = None, change=None) -> Path:
    """A copy of a GGUF file with the gguf package's writer: every metadata key, each tensor as
    `change(name, float32 array, type)` gives it (None: as it is)."""
    reader = gguf.GGUFReader(src)
    arch = arch or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        data, qtype = np.array(t.data), t.tensor_type
        out = change(t.name, data, qtype) if change else None
        if out is None:
            writer.add_tensor(t.name, data, raw_dtype=qtype if qtype.name not in ("F32", "F16") else None)
        else:
            writer.add_tensor(t.name, out[0], raw_dtype=out[1])  # uint8 rows of blocks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def q4_0_file(kind: str, dst: Path) -> Path:
    """The F32 fixture with every 2-D weight of K % 32 == 0 quantized to Q4_0 by gguf's reference."""
    def change(name, data, qtype):
        if data.ndim < 2 or data.shape[-1] % 32 or name.endswith("ssm_conv1d.weight"):
            return None
        q = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
        return q, gguf.GGMLQuantizationType.Q4_0
    return rewrite(FIXTURES / f"{kind}-f32.gguf", dst, change=change)


def with_dequantized_weights(hf, ours):
    """The transformers model holding our loaded model's weights, dequantized to float32."""
    params = dict(ours.lm.named_parameters())
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name == "lm_head.weight" or name.startswith("model."):
                p.copy_(to_float(params[name], p.shape[-1]).reshape(p.shape))
    return hf


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_float_files_give_the_logits_of_the_hf_checkpoint(kind, outtype):
    hf = hf_model(kind)
    model = mm.load_model(FIXTURES / f"{kind}-{outtype}.gguf", compute="fp32")
    assert model.visual is None and model.config.text.num_experts == (4 if kind == "moe" else 0)
    x = ids()
    ref = hf(input_ids=x).logits.detach()
    if outtype == "f32":
        assert rel_err(model(x), ref) <= 1e-5
    else:  # the checkpoint's weights rounded to bf16 by the converter: to compare, give them to transformers
        import copy

        held = with_dequantized_weights(copy.deepcopy(hf), model)
        assert rel_err(model(x), held(input_ids=x).logits.detach()) <= 1e-5
        assert rel_err(model(x), ref) <= 2e-2  # and near the float32 original


def check_weights_near(hf, model, bound: float) -> None:
    """Every parameter, dequantized, within `bound` (relative to its largest) of the HF one: the
    names and the undone transforms are right."""
    ref = dict(hf.named_parameters())
    for name, p in model.lm.named_parameters():
        r = ref[name].detach()
        assert rel_err(to_float(p, r.shape[-1]).reshape(r.shape), r) <= bound, name


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_quantized_files_equal_the_model_holding_their_dequantized_weights(kind, outtype, tmp_path):
    import copy

    path = FIXTURES / f"{kind}-q8_0.gguf" if outtype == "q8_0" else q4_0_file(kind, tmp_path / "q4_0.gguf")
    model = mm.load_model(path, compute="fp32")
    blocked = {n: p.dtype for n, p in model.lm.named_parameters() if p.dtype == torch.uint8}
    assert "model.layers.1.self_attn.q_proj.weight" in blocked  # kept as GGUF blocks, not floats
    check_weights_near(hf_model(kind), model, 1 / 250 if outtype == "q8_0" else 1 / 7)  # Q4_0: -max clamps to 7 d
    held = with_dequantized_weights(copy.deepcopy(hf_model(kind)), model)
    x = ids()
    assert rel_err(model(x), held(input_ids=x).logits.detach()) <= 1e-5


def test_q8_0_blocks_are_the_files_bits(tmp_path):
    """int8 weights hold the file's Q8_0 blocks as they are (rows regrouped by 8), no float round trip."""
    from lm.formats import blocks

    model = mm.load_model(FIXTURES / "moe-q8_0.gguf")
    reader = gguf.GGUFReader(FIXTURES / "moe-q8_0.gguf")
    file = {t.name: np.array(t.data) for t in reader.tensors}
    ours = blocks.deinterleave8(model.lm.model.layers[1].self_attn.k_proj.weight, blocks.Q8_0_BYTES)
    assert torch.equal(ours, torch.from_numpy(file["blk.1.attn_k.weight"]))
    gate = model.lm.model.layers[0].mlp.experts.gate_up_proj[:, :32]
    assert torch.equal(blocks.deinterleave8(gate, blocks.Q8_0_BYTES), torch.from_numpy(file["blk.0.ffn_gate_exps.weight"]))


def test_a_truncated_file_is_refused(tmp_path):
    data = (FIXTURES / "dense-f32.gguf").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError, match="truncated or not a GGUF file"):
        mm.load_model(bad)


def test_a_llama_file_is_refused_naming_the_architecture(tmp_path):
    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightError, match="architecture 'llama' is not supported"):
        mm.load_model(path)


def q5_0_file(dst: Path) -> Path:
    """The dense F32 fixture with blk.1.attn_k.weight in Q5_0 (a type we do not store), valid blocks."""
    rng = np.random.default_rng(0)

    def change(name, data, qtype):
        if name != "blk.1.attn_k.weight":
            return None
        n, k = data.shape
        raw = rng.integers(0, 256, size=(n, k // 32, 22), dtype=np.uint8)
        raw[..., :2] = np.full((n, k // 32), 0.01, dtype=np.float16).view(np.uint8).reshape(n, k // 32, 2)
        return raw.reshape(n, -1), gguf.GGMLQuantizationType.Q5_0
    return rewrite(FIXTURES / "dense-f32.gguf", dst, change=change)


def test_an_unsupported_tensor_type_is_refused_by_name_unless_asked(tmp_path, capsys):
    path = q5_0_file(tmp_path / "q5.gguf")
    with pytest.raises(WeightError, match=r"blk\.1\.attn_k\.weight \(Q5_0\)"):
        mm.load_model(path)
    model = mm.load_model(path, dequantize_unsupported=True)
    assert "dequantizing 1 tensor(s) of type(s) Q5_0" in capsys.readouterr().err
    t = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.1.attn_k.weight"]
    expect = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
    assert torch.equal(model.lm.model.layers[1].self_attn.k_proj.weight, torch.from_numpy(expect))
