"""The small test tokenizer: loads in transformers with the real Qwen3.5 special token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoProcessor, AutoTokenizer, Qwen3VLProcessor

from app.tokenizer_files import MODEL_VOCAB_SIZE, TOKENIZER_SPECIAL_TOKENS, learn_merges, write_tokenizer

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference"  # copies of the real checkpoints' configs
FILES = ["chat_template.jinja", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json",
         "video_preprocessor_config.json"]  # fmt: skip


def test_writes_the_checkpoint_files(tokenizer_checkpoint):
    assert sorted(p.name for p in tokenizer_checkpoint.iterdir()) == FILES


def test_special_tokens_have_their_real_ids(tokenizer):
    for name, idx in TOKENIZER_SPECIAL_TOKENS.items():
        assert tokenizer.convert_tokens_to_ids(name) == idx, name
        assert tokenizer.convert_ids_to_tokens(idx) == name
    assert len(TOKENIZER_SPECIAL_TOKENS) == 33 and max(TOKENIZER_SPECIAL_TOKENS.values()) == 248076
    assert len(tokenizer) == 248077 < MODEL_VOCAB_SIZE
    assert max(tokenizer.get_vocab().values()) < MODEL_VOCAB_SIZE


def test_config_tokens(tokenizer):
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 248046)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 248044)
    assert tokenizer.bos_token is None
    assert tokenizer.model_max_length == 262144
    assert (tokenizer.image_token, tokenizer.video_token) == ("<|image_pad|>", "<|video_pad|>")
    assert (tokenizer.vision_bos_token, tokenizer.vision_eos_token) == ("<|vision_start|>", "<|vision_end|>")


def test_byte_level_round_trip_and_few_tokens_per_word(tokenizer):
    text = "Describe the image in detail.\n\nNaïve café, 北京, emoji 🙂 and tabs\t!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer.tokenize("What is in the picture?")) == 6  # learned merges: corpus words are whole
    assert tokenizer.tokenize("\n\n") == ["ĊĊ"]


def test_special_tokens_split_text_and_think_tags_are_not_special(tokenizer):
    ids = tokenizer("<|im_start|>user\nHi<|im_end|>\n<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert ids[0] == 248045 and 248046 in ids and 248068 in ids and 248069 in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi\n<think>\n\n</think>\n\n"


def test_checkpoint_config_picks_the_qwen3_5_tokenizer_with_the_same_ids(tokenizer_checkpoint, tokenizer, tmp_path):
    for f in FILES:
        (tmp_path / f).write_bytes((tokenizer_checkpoint / f).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    qwen35 = AutoTokenizer.from_pretrained(tmp_path)
    assert type(qwen35).__name__ == "Qwen3_5Tokenizer"
    text = "<|im_start|>user\nWhat is in the picture?<|im_end|>\n"
    assert qwen35(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_transformers_processor_loads(tokenizer_checkpoint):
    processor = AutoProcessor.from_pretrained(tokenizer_checkpoint)
    assert isinstance(processor, Qwen3VLProcessor)
    assert (processor.image_token_id, processor.video_token_id) == (248056, 248057)
    assert (processor.vision_start_token_id, processor.vision_end_token_id) == (248053, 248054)
    assert processor.chat_template == (tokenizer_checkpoint / "chat_template.jinja").read_text()


def test_processor_configs_are_the_reference_files(tokenizer_checkpoint):
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        assert (tokenizer_checkpoint / name).read_bytes() == (REFERENCE / name).read_bytes(), name


@pytest.mark.slow
def test_output_is_deterministic(tokenizer_checkpoint, tmp_path):
    write_tokenizer(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (tokenizer_checkpoint / name).read_bytes(), name


def test_merges_are_learned_most_frequent_first():
    merges = learn_merges("aaab aaab aab", max_merges=10)
    assert merges[0] == ("a", "a")  # 5 occurrences, more than any other pair
    assert len(set(merges)) == len(merges)
