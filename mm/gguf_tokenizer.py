"""The tokenizer and chat template of a GGUF file, from its metadata.

llama.cpp's converter stores the byte-level BPE vocabulary (`tokenizer.ggml.tokens`, `.merges`,
`.token_type`), the pre-tokenizer by name (`tokenizer.ggml.pre`), the special token ids and
`tokenizer.chat_template`. `gguf_tokenizer` rebuilds a `transformers` fast tokenizer from them with
Qwen3.5's normalizer (NFC), pre-tokenizer and decoder (mm/tokenizer_files.py): the GGUF does not
store those, so only the pre-tokenizers named below are accepted; anything missing is an error
naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, processors
from transformers import PreTrainedTokenizerFast

from lm.gguf_read import GGUFFile
from lm.weights import WeightError

from . import tokenizer_files

PRE_TOKENIZERS = ("qwen35",)  # llama.cpp's name of the Qwen3.5 / Qwen3.6 pre-tokenizer
CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType


def gguf_tokenizer(file: GGUFFile) -> PreTrainedTokenizerFast:
    """A fast tokenizer equal to the checkpoint's `tokenizer.json` the file was converted from."""
    model = _need(file, "tokenizer.ggml.model")
    if model != "gpt2":
        raise WeightError(f"{file.path}: tokenizer.ggml.model {model!r} is not supported (byte-level BPE 'gpt2' is)")
    pre = _need(file, "tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise WeightError(f"{file.path}: pre-tokenizer {pre!r} is not supported; known: {', '.join(PRE_TOKENIZERS)}")
    tokens = list(_need(file, "tokenizer.ggml.tokens"))
    types = list(_need(file, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _need(file, "tokenizer.ggml.merges")]
    added = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)}
    vocab = {tok: i for i, tok in enumerate(tokens)}  # added and unused ([PADn]) ones too: no gaps in the ids
    if len(vocab) != len(tokens):
        raise WeightError(f"{file.path}: tokenizer.ggml.tokens holds a token twice")
    bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = tokenizer_files._pre_tokenizer()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [dict(id=i, content=tokens[i], single_word=False, lstrip=False, rstrip=False,
                                 normalized=False, special=types[i] == CONTROL) for i in sorted(added)]
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    eos = file.value("tokenizer.ggml.eos_token_id")
    pad = file.value("tokenizer.ggml.padding_token_id")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=tokens[int(eos)] if eos is not None else None,
        pad_token=tokens[int(pad)] if pad is not None else None, clean_up_tokenization_spaces=False,
        split_special_tokens=False, model_max_length=262144,
    )


def gguf_chat_template(file: GGUFFile) -> str:
    return str(_need(file, "tokenizer.chat_template"))


def _need(file: GGUFFile, key: str):
    value = file.value(key)
    if value is None:
        raise WeightError(f"{Path(file.path)}: GGUF metadata has no {key!r}: the tokenizer cannot be built")
    return value


def gguf_processor(path: str | Path):
    """The `Processor` of a GGUF file: its tokenizer and chat template, default image / video
    processors (a text-only model never uses them)."""
    import preprocess

    from .processor import Processor

    file = GGUFFile(path, dequantize_unsupported=True, quiet=True)
    return Processor(gguf_tokenizer(file), gguf_chat_template(file), preprocess.ImageProcessor(),
                     preprocess.VideoProcessor())
