"""Write the GGUF test fixtures (tests/fixtures/gguf/) with llama.cpp's own converter.

    python tools/gguf_fixtures.py LLAMA_CPP_SRC_DIR [OUT_DIR]

LLAMA_CPP_SRC_DIR is a llama.cpp source tree (its `convert_hf_to_gguf.py`, `conversion/` and
`gguf-py/`). The fixtures were made with the one vendored in `llama-cpp-python` 0.3.36 (its sdist,
`pip download --no-binary :all: llama-cpp-python==0.3.36`), torch 2.14.1, transformers 5.23.0.

For each of `dense` (architecture qwen35) and `moe` (qwen35moe) it builds the tiny random checkpoint
`fixture_model(kind)` (tests/tiny.py's, every parameter perturbed; 2 layers, vocab 384; the value
head dim 16 in `dense`, 32 in `moe`: both sides of a Q8_0 block boundary), saves it
with a tiny byte-level BPE tokenizer (fixture_tokenizer; the special tokens right after the merges)
and the project's chat template, and converts it to `{kind}-{f32,bf16,q8_0}.gguf`
(`--outtype`; this converter has no q4_0 outtype, so the tests write Q4_0 files from the F32 ones with
the `gguf` package's reference quantizer; the converter's small pre-tokenizer hash is declared as Qwen3.5's, as
`get_vocab_base_pre` would say for the real tokenizer). The tests rebuild the same checkpoint from
the seed and compare. `dense-vl` is a dense VL checkpoint (`fixture_vl_model`): its LM as
`dense-vl-f32.gguf` and its vision tower as `mmproj-dense-vl-f32.gguf` (`--mmproj`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUTTYPES = ("f32", "bf16", "q8_0")  # the converter writes no Q4_0 (that takes llama-quantize)
KINDS = {"dense": "dense_text", "moe": "moe_text"}
OVERRIDES = dict(vocab_size=384, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                 num_attention_heads=2, num_key_value_heads=1)
MOE_OVERRIDES = dict(num_experts=4, num_experts_per_tok=2, linear_value_head_dim=32)  # out_proj: whole Q8_0 blocks per V head
MERGES = 80


def fixture_model(kind: str):
    """The float32 transformers model a fixture was converted from ("dense" or "moe")."""
    from tests import tiny

    overrides = dict(OVERRIDES, **(MOE_OVERRIDES if kind == "moe" else {}))
    return tiny.hf_model(KINDS[kind], seed=45, **overrides)


def fixture_tokenizer():
    """A byte-level BPE tokenizer with the real pre-tokenizer, MERGES merges and the Qwen3.5 added
    tokens right after them (ids < 384)."""
    from tokenizers import Tokenizer

    from mm import tokenizer_files as tf

    merges = tf.learn_merges(tf.CORPUS, MERGES)
    vocab = {char: i for i, (_, char) in enumerate(tf._bytes_to_unicode())}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    first = len(vocab)
    specials = {name: first + i for i, name in enumerate(tf.TOKENIZER_SPECIAL_TOKENS)}
    tok = json.loads(tf.build_tokenizer().to_str())
    tok["model"]["vocab"], tok["model"]["merges"] = vocab, [[a, b] for a, b in merges]
    tok["added_tokens"] = [tf._added_token(name, idx) for name, idx in specials.items()]
    return Tokenizer.from_str(json.dumps(tok)), specials


def fixture_vl_model():
    """The float32 transformers VL model (dense, with a vision tower) of the `dense-vl` fixtures: the
    vision token ids are the fixture tokenizer's."""
    import torch
    import transformers

    from tests import tiny

    _, specials = fixture_tokenizer()
    cfg = tiny.config_dict("dense_vl", **OVERRIDES)
    cfg.update(image_token_id=specials["<|image_pad|>"], video_token_id=specials["<|video_pad|>"],
               vision_start_token_id=specials["<|vision_start|>"], vision_end_token_id=specials["<|vision_end|>"])
    torch.manual_seed(46)
    model = transformers.Qwen3_5ForConditionalGeneration._from_config(
        transformers.AutoConfig.for_model(**cfg), dtype=torch.float32, attn_implementation="sdpa").eval()
    tiny.perturb(model, 46)
    return model


def write_checkpoint(kind: str, path: Path) -> Path:
    from mm import tokenizer_files as tf

    model = fixture_vl_model() if kind == "dense-vl" else fixture_model(kind)
    model.save_pretrained(path)
    tokenizer, specials = fixture_tokenizer()
    (path / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = tf.tokenizer_config()
    config["added_tokens_decoder"] = {str(i): {k: v for k, v in tf._added_token(n, i).items() if k != "id"}
                                      for n, i in specials.items()}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (path / "chat_template.jinja").write_text(tf.chat_template_text(), encoding="utf-8")
    return path


def convert(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str, *args: str) -> None:
    code = (
        "import runpy, sys; from pathlib import Path; root = Path(sys.argv[1]); "
        "sys.argv = [str(root / 'convert_hf_to_gguf.py')] + sys.argv[2:]; "
        "sys.path.insert(0, str(root)); sys.path.insert(1, str(root / 'gguf-py')); "
        "import conversion.base as base\n"
        "for cls in vars(base).values():\n"
        "    if isinstance(cls, type) and hasattr(cls, 'get_vocab_base_pre'):\n"
        "        cls.get_vocab_base_pre = lambda self, tokenizer: 'qwen35'\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    subprocess.run([sys.executable, "-c", code, str(llama_cpp), str(hf_dir), "--outtype", outtype,
                    "--outfile", str(out), *args], check=True)


def main() -> None:
    llama_cpp = Path(sys.argv[1]).resolve()
    out_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "tests" / "fixtures" / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    from mm import tokenizer_files as tf

    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            hf_dir = write_checkpoint(kind, Path(tmp) / kind)
            for outtype in OUTTYPES:
                convert(llama_cpp, hf_dir, out_dir / f"{kind}-{outtype}.gguf", outtype, "--no-mtp")
        vl_dir = write_checkpoint("dense-vl", Path(tmp) / "dense-vl")
        (vl_dir / "preprocessor_config.json").write_text(json.dumps(tf._REFERENCE_PREPROCESSOR_CONFIG, indent=2))
        convert(llama_cpp, vl_dir, out_dir / "dense-vl-f32.gguf", "f32", "--no-mtp")
        convert(llama_cpp, vl_dir, out_dir / "mmproj-dense-vl-f32.gguf", "f32", "--mmproj")  # (it refuses --no-mtp)
    for f in sorted(out_dir.glob("*.gguf")):
        print(f"{f.name}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
