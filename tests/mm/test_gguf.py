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
from lm.formats import param_format, to_float
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


def rewrite(src: Path, dst: Path, *, arch: str | None = None, change=None, values: dict | None = None,
            drop: tuple[str, ...] = (), extra: dict | None = None, new_keys: dict | None = None,
            split_max_tensors: int = 0) -> Path:
    """A copy of a GGUF file with the gguf package's writer: every metadata key (`values` replace some,
    `drop` leaves keys and tensors out, `new_keys` adds uint32 ones), each tensor as
    `change(name, array, type)` gives it (None: as it is), then the tensors `extra` (float32, or (blocks, type))."""
    reader = gguf.GGUFReader(src)
    arch = arch or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch, split_max_tensors=split_max_tensors)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, (values or {}).get(key, field.contents()), field.types[0], sub_type=sub)
    for key, value in (new_keys or {}).items():
        writer.add_uint32(key, value)
    for name, data in (extra or {}).items():  # an array, or (uint8 blocks, type)
        data, qtype = data if isinstance(data, tuple) else (data, None)
        writer.add_tensor(name, data, raw_dtype=qtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
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
                p.copy_(to_float(params[name], p.shape[-1], param_format(ours.lm, name)).reshape(p.shape))
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
        assert rel_err(to_float(p, r.shape[-1], param_format(model.lm, name)).reshape(r.shape), r) <= bound, name


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_quantized_files_equal_the_model_holding_their_dequantized_weights(kind, outtype, tmp_path):
    import copy

    path = FIXTURES / f"{kind}-q8_0.gguf" if outtype == "q8_0" else q4_0_file(kind, tmp_path / "q4_0.gguf")
    model = mm.load_model(path, compute="fp32")
    blocked = {n for n, p in model.lm.named_parameters() if p.dtype == torch.uint8}
    assert "model.layers.1.self_attn.q_proj.weight" in blocked  # kept as GGUF blocks, not floats
    # out_proj's columns came V-head reordered: whole blocks move back where a head is 32 columns (moe)
    assert ("model.layers.0.linear_attn.out_proj.weight" in blocked) == (kind == "moe")
    check_weights_near(hf_model(kind), model, 1 / 254 + 1 / 2048 if outtype == "q8_0" else 1 / 7)  # d / 2, d in fp16; Q4_0: -max clamps to 7 d
    held = with_dequantized_weights(copy.deepcopy(hf_model(kind)), model)
    x = ids()
    assert rel_err(model(x), held(input_ids=x).logits.detach()) <= 1e-5


def test_a_tied_file_multiplies_its_head_in_the_files_blocks(tmp_path):
    """A file without output.weight ties the head to token_embd: the head keeps the table's Q8_0
    blocks (what decode streams), the table itself, whose rows are gathered, becomes their exact
    float32; the logits equal those of the file loaded all in float32 (one table for both)."""
    path = rewrite(FIXTURES / "dense-q8_0.gguf", tmp_path / "tied.gguf", drop=("output.weight",))
    model = mm.load_model(path, compute="fp32")
    lm = model.lm
    assert lm.config.tie_word_embeddings and param_format(lm, "lm_head.weight").name == "int8"
    assert param_format(lm, "model.embed_tokens.weight").name == "fp32"
    table = lm.model.embed_tokens.weight
    assert torch.equal(to_float(lm.lm_head.weight, table.shape[1], param_format(lm, "lm_head.weight")), table)
    floats = mm.load_model(path, weights="fp32", compute="fp32")
    assert floats.lm.lm_head.weight is floats.lm.model.embed_tokens.weight
    x = ids()
    assert rel_err(model(x), floats(x)) <= 1e-5


def test_q8_0_blocks_are_the_files_bits(tmp_path):
    """int8 weights hold the file's Q8_0 blocks as they are (rows regrouped by 8), no float round trip."""
    from lm.formats import blocks

    from lm.gguf_read import GGUFFile

    model = mm.load_model(FIXTURES / "moe-q8_0.gguf")
    assert isinstance(GGUFFile(FIXTURES / "moe-q8_0.gguf").reader.data, np.memmap)  # mapped, not read into memory
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


def test_the_tokenizer_and_chat_template_come_from_the_metadata():
    from lm.gguf_read import GGUFFile
    from mm.gguf_tokenizer import gguf_chat_template, gguf_tokenizer
    from mm.tokenizer_files import chat_template_text

    reference, specials = gguf_fixtures.fixture_tokenizer()
    file = GGUFFile(FIXTURES / "dense-bf16.gguf")
    ours = gguf_tokenizer(file)
    text = "<|im_start|>user\nWhat is in this video? Ünïcöde e\u0301 123  <think>\n\n</think>\tok!!<|im_end|>\n"
    assert ours(text, add_special_tokens=False)["input_ids"] == reference.encode(text).ids
    assert ours.convert_tokens_to_ids("<|im_end|>") == specials["<|im_end|>"] and ours.eos_token == "<|im_end|>"
    assert ours.decode(reference.encode(text).ids) == reference.decode(reference.encode(text).ids, skip_special_tokens=False)
    assert gguf_chat_template(file) == chat_template_text()


def test_a_file_without_the_tokenizer_is_refused_naming_the_key(tmp_path):
    path = rewrite(FIXTURES / "dense-q8_0.gguf", tmp_path / "no-merges.gguf", drop=("tokenizer.ggml.merges",))
    with pytest.raises(WeightError, match="no 'tokenizer.ggml.merges'"):
        mm.Pipeline.from_pretrained(path)


def test_mtp_layers_are_skipped_and_unknown_or_missing_tensors_named(tmp_path):
    """A file converted with its MTP layer (blk.{n}, nextn_predict_layers) loads without it; a tensor
    we do not know, or one the model lacks, is an error naming it."""
    mtp = {"blk.2.nextn.eh_proj.weight": np.ones((64, 128), np.float32), "blk.2.attn_norm.weight": np.ones(64, np.float32)}
    path = rewrite(FIXTURES / "moe-f32.gguf", tmp_path / "mtp.gguf", extra=mtp,
                   values={"qwen35moe.block_count": 3, "qwen35moe.attention.recurrent_layers": [True, False, False]})
    with pytest.raises(WeightError, match=r"unexpected GGUF tensor 'blk\.2\.nextn\.eh_proj\.weight'"):
        mm.load_model(path)  # without nextn_predict_layers, blk.2 is a third layer
    path = rewrite(path, tmp_path / "mtp2.gguf", new_keys={"qwen35moe.nextn_predict_layers": 1})
    model = mm.load_model(path, compute="fp32")
    assert model.config.text.num_hidden_layers == 2
    assert rel_err(model(ids()), hf_model("moe")(input_ids=ids()).logits.detach()) <= 1e-5
    odd = rewrite(FIXTURES / "moe-f32.gguf", tmp_path / "odd.gguf", extra={"blk.0.ffn_odd.weight": np.ones(4, np.float32)})
    with pytest.raises(WeightError, match=r"unexpected GGUF tensor 'blk\.0\.ffn_odd\.weight'"):
        mm.load_model(odd)
    short = rewrite(FIXTURES / "moe-f32.gguf", tmp_path / "short.gguf", drop=("blk.1.attn_k.weight",))
    with pytest.raises(WeightError, match=r"missing 1 language-model tensor\(s\): model.layers.1.self_attn.k_proj"):
        mm.load_model(short)


def test_the_pipeline_and_vqa_run_a_gguf_file_text_only():
    from app import VQA
    from lm import SamplingParams

    pipe = mm.Pipeline.from_pretrained(FIXTURES / "moe-q8_0.gguf")
    conversation = [{"role": "user", "content": "What is this?"}]
    [out] = pipe.generate([conversation], SamplingParams(max_new_tokens=6, temperature=0))
    x = pipe.processor([conversation]).input_ids
    assert out.prompt_tokens == x.shape[1] and x[0, 0] == pipe.processor.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert out.token_ids[0] == int(pipe.model(x)[0, -1].argmax())  # greedy from the GGUF model's logits
    answer = VQA(str(FIXTURES / "dense-q8_0.gguf")).ask("Hello", max_new_tokens=4, temperature=0)
    assert answer.completion_tokens <= 4 and answer.finish_reason in ("length", "stop")
    image = [{"type": "image", "image": np.zeros((32, 32, 3), np.uint8)}, {"type": "text", "text": "?"}]
    with pytest.raises(ValueError, match="no vision tower"):
        pipe.generate([[{"role": "user", "content": image}]], SamplingParams(max_new_tokens=2))


def test_the_front_ends_take_a_gguf_file_and_the_flag(tmp_path):
    import argparse

    from app.loading import add_model_arguments, check_model

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--model", str(FIXTURES / "moe-bf16.gguf"), "--dequantize-unsupported"])
    assert args.dequantize_unsupported and check_model(args.model) == FIXTURES / "moe-bf16.gguf"
    with pytest.raises(FileNotFoundError, match="GGUF model file not found"):
        check_model(tmp_path / "absent.gguf")
    llama = tmp_path / "llama.gguf"
    llama.write_bytes((FIXTURES / "dense-f32.gguf").read_bytes()[:100])
    with pytest.raises(WeightError, match="truncated"):
        check_model(llama)


@pytest.mark.parametrize("spec", ["int8", "int4,attention=int8", "bf16"])
def test_a_weights_spec_stores_a_float_file_as_the_hf_checkpoint_is_stored(spec, tmp_path):
    from lm.formats import policy

    hf = hf_model("moe")
    hf.save_pretrained(tmp_path)
    ours, theirs = mm.load_model(FIXTURES / "moe-f32.gguf", weights=spec), mm.load_model(tmp_path, weights=spec)
    reference = dict(theirs.lm.named_parameters())
    large = [(n, p) for n, p in ours.lm.named_parameters() if policy.part_of(n) is not None]
    assert any(p.dtype == torch.uint8 for _, p in large) == spec.startswith("int")
    for name, p in large:
        assert p.dtype == reference[name].dtype and torch.equal(p, reference[name]), name
    x = ids()
    assert rel_err(ours(x), theirs(x)) <= 1e-5


def test_experts_fused_by_the_converter_load_as_split_ones(tmp_path):
    """--fuse-gate-up-exps writes ffn_gate_up_exps = cat(gate, up) along the expert's rows."""
    src = FIXTURES / "moe-q8_0.gguf"
    data = {t.name: (np.array(t.data), t.tensor_type) for t in gguf.GGUFReader(src).tensors}
    fused = {f"blk.{i}.ffn_gate_up_exps.weight": (np.concatenate([data[f"blk.{i}.ffn_gate_exps.weight"][0],
                                                                  data[f"blk.{i}.ffn_up_exps.weight"][0]], axis=1),
                                                  data[f"blk.{i}.ffn_gate_exps.weight"][1]) for i in range(2)}
    drop = tuple(f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up"))
    path = rewrite(src, tmp_path / "fused.gguf", drop=drop, extra=fused)
    split, joined = mm.load_model(src), mm.load_model(path)
    for (name, a), (_, b) in zip(split.lm.named_parameters(), joined.lm.named_parameters()):
        assert torch.equal(a, b), name


def test_a_split_model_and_a_directory_holding_one_are_found(tmp_path):
    """llama.cpp's NAME-00001-of-0000N.gguf parts load from the first part's path, from any part's,
    and from their directory (no config.json; an mmproj file beside them is not the model)."""
    rewrite(FIXTURES / "dense-q8_0.gguf", tmp_path / "m.gguf", split_max_tensors=12)
    parts = sorted(tmp_path.glob("m-*.gguf"))
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    (tmp_path / "mmproj-m-f32.gguf").symlink_to(FIXTURES / "mmproj-dense-vl-f32.gguf")
    whole = mm.load_model(FIXTURES / "dense-q8_0.gguf")
    x = ids()
    for path in (parts[0], parts[2], tmp_path):
        model = mm.load_model(path)
        assert torch.equal(model(x), whole(x)), path
        assert (model.visual is not None) == (path == tmp_path)  # the mmproj beside it: found in the directory
    parts[1].unlink()
    with pytest.raises(WeightError, match="parts missing .*m-00002-of-00003.gguf"):
        mm.load_model(parts[0])
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="holds 2 model GGUF files"):
        mm.load_model(tmp_path)


def test_an_mmproj_file_gives_the_vision_tower_of_the_hf_checkpoint(tmp_path):
    """dense-vl-f32.gguf + its mmproj (both from one VL checkpoint, by the converter): logits with an
    image equal transformers'; the directory holding both is found without naming them."""
    hf = gguf_fixtures.fixture_vl_model()
    model = mm.load_model(FIXTURES / "dense-vl-f32.gguf", mmproj=FIXTURES / "mmproj-dense-vl-f32.gguf", compute="fp32")
    c = model.config
    assert model.visual is not None and c.image_token_id == hf.config.image_token_id
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(2))
    grid = torch.tensor([[1, 4, 4]])
    x = torch.tensor([[5, 9, c.vision_start_token_id] + [c.image_token_id] * 4 + [c.vision_end_token_id, 40, 41]])
    types = (x == c.image_token_id).long()  # 1: image tokens (transformers' mm_token_type_ids)
    ref = hf(input_ids=x, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types).logits.detach()
    assert rel_err(model(x, pixel_values=pixels, image_grid_thw=grid), ref) <= 1e-5
    for f in ("dense-vl-f32.gguf", "mmproj-dense-vl-f32.gguf"):
        (tmp_path / f).symlink_to(FIXTURES / f)
    found = mm.load_model(tmp_path, compute="fp32")
    assert found.visual is not None
    assert torch.equal(found(x, pixel_values=pixels, image_grid_thw=grid), model(x, pixel_values=pixels, image_grid_thw=grid))
    with pytest.raises(WeightError, match="architecture 'qwen35' is not supported here"):
        mm.load_model(FIXTURES / "dense-vl-f32.gguf", mmproj=FIXTURES / "dense-f32.gguf")
    with pytest.raises(ValueError, match="goes with a GGUF model file"):
        mm.load_model(tmp_path / "nowhere", mmproj=FIXTURES / "mmproj-dense-vl-f32.gguf")


def test_a_quantized_mmproj_is_dequantized_into_the_tower_and_said(tmp_path, capsys):
    """An mmproj whose projector matrix is Q8_0 (as llama.cpp's quantize can write): the tower holds
    its dequantized values (gguf's reference, bit for bit), and the loader says so once."""
    def change(name, data, qtype):
        if name == "mm.0.weight":
            return gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        return None

    mmproj = rewrite(FIXTURES / "mmproj-dense-vl-f32.gguf", tmp_path / "mmproj-q8.gguf", change=change)
    model = mm.load_model(FIXTURES / "dense-vl-f32.gguf", mmproj=mmproj, compute="fp32")
    assert "mmproj-q8.gguf: its Q8_0 tensors are dequantized into the vision tower" in capsys.readouterr().err
    t = {t.name: t for t in gguf.GGUFReader(mmproj).tensors}["mm.0.weight"]
    expect = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type))
    assert torch.equal(model.visual.merger.linear_fc1.weight.float(), expect)


def test_the_pipeline_answers_about_an_image_from_gguf_files(tmp_path):
    from lm import SamplingParams

    for f in ("dense-vl-f32.gguf", "mmproj-dense-vl-f32.gguf"):
        (tmp_path / f).symlink_to(FIXTURES / f)
    pipe = mm.Pipeline.from_pretrained(tmp_path)
    image = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)
    content = [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]
    inputs = pipe.processor([[{"role": "user", "content": content}]])
    n_image = int((inputs.input_ids == pipe.model.config.image_token_id).sum())
    assert n_image == int(inputs.image_grid_thw.prod()) // 4 > 0
    [out] = pipe.generate([[{"role": "user", "content": content}]], SamplingParams(max_new_tokens=3, temperature=0))
    assert out.prompt_tokens == inputs.input_ids.shape[1] and 1 <= out.completion_tokens <= 3
