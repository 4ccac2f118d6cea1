"""A checkpoint's tokenizer must be there and must agree with its model config.

Without `tokenizer.json` (a partial download) transformers' AutoTokenizer still builds a tokenizer,
from the added tokens of tokenizer_config.json alone: 33 tokens, renumbered from 0, which
tokenizes ordinary text to nothing. These checks refuse that, and a tokenizer from another model,
by name, when the checkpoint loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import ModelConfig

PROBE_TEXT = "What is in the picture?"


class TokenizerMismatchError(ValueError):
    """The tokenizer's ids disagree with the model config (a tokenizer from another model?)."""


def check_tokenizer_files(path: str | Path) -> None:
    """FileNotFoundError naming the missing files when `path` lacks its tokenizer: `tokenizer.json`
    (or the slow tokenizer's `vocab.json` and `merges.txt`) and `tokenizer_config.json`."""
    path = Path(path)
    missing = []
    if not (path / "tokenizer.json").is_file() and not all((path / f).is_file() for f in ("vocab.json", "merges.txt")):
        missing.append("tokenizer.json (or vocab.json and merges.txt)")
    if not (path / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json")
    if missing:
        raise FileNotFoundError(f"{path} has no complete tokenizer: {' and '.join(missing)} missing (an interrupted "
                                "download? fetch the checkpoint's tokenizer files again)")  # fmt: skip


def check_tokenizer(tokenizer: Any, config: ModelConfig, eos_token_ids: Sequence[int]) -> None:
    """TokenizerMismatchError listing every disagreement between a transformers tokenizer and the
    model: the image / video / vision start / end token ids (config.json), the vocabulary (at most
    text_config.vocab_size tokens), the end-of-sequence ids generation stops at (each a token of the
    tokenizer, the tokenizer's own EOS among them), and that ordinary text gets tokens at all."""
    problems = []
    special = {"<|image_pad|>": ("image_token_id", config.image_token_id),
               "<|video_pad|>": ("video_token_id", config.video_token_id),
               "<|vision_start|>": ("vision_start_token_id", config.vision_start_token_id),
               "<|vision_end|>": ("vision_end_token_id", config.vision_end_token_id)}  # fmt: skip
    for token, (key, expected) in special.items():
        actual = tokenizer.convert_tokens_to_ids(token)
        if actual != expected:
            problems.append(f"{token} is id {actual} in the tokenizer but {key} is {expected} in config.json")
    size = len(tokenizer)
    if size > config.text.vocab_size:
        problems.append(f"the tokenizer has {size} tokens, more than the model's vocab_size {config.text.vocab_size}")
    outside = [i for i in eos_token_ids if not 0 <= i < size]
    if outside:
        problems.append(f"end-of-sequence id(s) {outside} are not tokens of the tokenizer ({size} tokens)")
    eos = tokenizer.eos_token_id
    if eos is not None and eos not in eos_token_ids:
        problems.append(f"the tokenizer's end token {tokenizer.eos_token} (id {eos}) is not among the ids generation "
                        f"stops at, {list(eos_token_ids)} (eos_token_id of generation_config.json, else of "
                        "config.json)")  # fmt: skip
    if not tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]:
        problems.append(f"the tokenizer turns {PROBE_TEXT!r} into no tokens at all")
    if problems:
        raise TokenizerMismatchError("the tokenizer does not belong to this model: " + "; ".join(problems))
