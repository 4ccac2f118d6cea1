"""A checkpoint without its tokenizer, or with another model's, is refused when it loads, by name."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from app.default_model import default_model_path
from mm import ModelConfig, Pipeline, Processor, TokenizerMismatchError
from mm.tokenizer_check import check_tokenizer, check_tokenizer_files

EOS_IDS = (248046, 248044)  # the default model's generation_config.json


def copy_checkpoint(target: Path, *, drop: tuple[str, ...] = (), edit: dict[str, dict] | None = None) -> Path:
    """The default model's directory, linked file by file, without `drop` and with JSON files updated."""
    source = default_model_path()
    target.mkdir()
    for file in source.iterdir():
        if file.name in drop:
            continue
        if file.name in (edit or {}):
            data = json.loads(file.read_text())
            data.update(edit[file.name])
            (target / file.name).write_text(json.dumps(data))
        else:
            os.symlink(file, target / file.name)
    return target


def test_a_checkpoint_without_tokenizer_json_is_refused_naming_the_file(tmp_path):
    path = copy_checkpoint(tmp_path / "partial", drop=("tokenizer.json",))
    # what AutoTokenizer makes of it: the 33 added tokens, renumbered, and no tokens for ordinary text
    silent = AutoTokenizer.from_pretrained(path)
    assert len(silent) == 33 and silent("What is in the picture?", add_special_tokens=False)["input_ids"] == []
    for load in (Processor.from_pretrained, Pipeline.from_pretrained):
        with pytest.raises(FileNotFoundError, match=r"tokenizer\.json \(or vocab\.json and merges\.txt\) missing"):
            load(path)
    with pytest.raises(TokenizerMismatchError, match=r"<\|image_pad\|> is id 12 in the tokenizer but image_token_id"):
        check_tokenizer(silent, ModelConfig.from_pretrained(path), EOS_IDS)  # the ids catch it too


def test_missing_tokenizer_config_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json missing"):
        check_tokenizer_files(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    check_tokenizer_files(tmp_path)


def test_token_ids_that_disagree_with_config_json_are_refused_by_name(tmp_path):
    path = copy_checkpoint(tmp_path / "swapped", edit={"config.json": {"image_token_id": 248057,
                                                                      "video_token_id": 248056}})  # fmt: skip
    with pytest.raises(TokenizerMismatchError) as error:
        Pipeline.from_pretrained(path)
    message = str(error.value)
    assert str(path) in message
    assert "<|image_pad|> is id 248056 in the tokenizer but image_token_id is 248057 in config.json" in message
    assert "<|video_pad|> is id 248057 in the tokenizer but video_token_id is 248056" in message
    assert "vision_start" not in message  # only what disagrees


def test_eos_that_does_not_stop_generation_is_refused(tmp_path):
    path = copy_checkpoint(tmp_path / "eos", edit={"generation_config.json": {"eos_token_id": [248044]}})
    with pytest.raises(TokenizerMismatchError, match=r"end token <\|im_end\|> \(id 248046\) is not among the ids "
                                                     r"generation stops at, \[248044\]"):  # fmt: skip
        Pipeline.from_pretrained(path)


def test_vocabulary_and_eos_ids_are_checked_against_the_model():
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = ModelConfig.from_pretrained(path)
    check_tokenizer(tokenizer, config, EOS_IDS)  # the default model's own tokenizer agrees
    small = dataclasses.replace(config, text=dataclasses.replace(config.text, vocab_size=1000))
    with pytest.raises(TokenizerMismatchError, match="has 248077 tokens, more than the model's vocab_size 1000"):
        check_tokenizer(tokenizer, small, EOS_IDS)
    with pytest.raises(TokenizerMismatchError, match=r"end-of-sequence id\(s\) \[300000\] are not tokens"):
        check_tokenizer(tokenizer, config, (248046, 300000))
