"""A small but real Qwen3.5 tokenizer for test and built-in checkpoints.

`write_tokenizer(dir)` writes the tokenizer and processor files of a Qwen3.5 / Qwen3.6 checkpoint:
`tokenizer.json` (byte-level BPE, same normalizer / pre-tokenizer / decoder as the real one), a
`tokenizer_config.json`, the real `chat_template.jinja`, and the real image / video preprocessor
configs. Only the vocabulary is small: 256 byte tokens plus merges learned deterministically from a
built-in English text. The special tokens sit at their real ids (248044 ... 248076). `tokenizers`
ignores explicit ids of added tokens that leave a gap after the vocabulary, so the ids between the
merges and 248044 are filled with never-produced `<|filler_N|>` tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .chat import DEFAULT_CHAT_TEMPLATE_PATH

# The checkpoint's LM vocabulary (embedding rows); every tokenizer id is below it.
MODEL_VOCAB_SIZE = 248320
# Same pattern as transformers' Qwen3_5Tokenizer (models/qwen3_5/tokenization_qwen3_5.py).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
MAX_MERGES = 1500

TOKENIZER_SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<|object_ref_start|>": 248047,
    "<|object_ref_end|>": 248048,
    "<|box_start|>": 248049,
    "<|box_end|>": 248050,
    "<|quad_start|>": 248051,
    "<|quad_end|>": 248052,
    "<|vision_start|>": 248053,
    "<|vision_end|>": 248054,
    "<|vision_pad|>": 248055,
    "<|image_pad|>": 248056,
    "<|video_pad|>": 248057,
    "<tool_call>": 248058,
    "</tool_call>": 248059,
    "<|fim_prefix|>": 248060,
    "<|fim_middle|>": 248061,
    "<|fim_suffix|>": 248062,
    "<|fim_pad|>": 248063,
    "<|repo_name|>": 248064,
    "<|file_sep|>": 248065,
    "<tool_response>": 248066,
    "</tool_response>": 248067,
    "<think>": 248068,
    "</think>": 248069,
    "<|audio_start|>": 248070,
    "<|audio_end|>": 248071,
    "<tts_pad>": 248072,
    "<tts_text_bos>": 248073,
    "<tts_text_eod>": 248074,
    "<tts_text_bos_single>": 248075,
    "<|audio_pad|>": 248076,
}
"""Added tokens of the real Qwen3.5 tokenizer, name -> id (as the real checkpoint ships them)."""

# Added tokens that the Qwen tokenizers mark "special": false (kept by skip_special_tokens).
_NOT_SPECIAL = {
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
}  # fmt: skip
FIRST_SPECIAL_ID = min(TOKENIZER_SPECIAL_TOKENS.values())

# Built-in English text the merges are learned from: plain prose about images, videos and answers,
# so that ordinary prompt words become one or a few tokens.
CORPUS = """
system
You are a helpful assistant

user
What is in this image

assistant
<think>

</think>

A cat is sitting on a chair

The user asks a question about an image and the assistant gives a short answer. Describe the image in
detail. What is in the picture? The picture shows a small red house with a white door, two windows and
a green garden in front of it. A black cat is sitting on the steps and a dog is sleeping under the tree.
The sky is blue and there are a few white clouds. In the video, a person walks along the street, opens
the door of a car and drives away. The first frame shows the street at night; the last frame shows the
car at the end of the road. How many people are in the image? There are three people: a man, a woman
and a child. They are standing next to each other and looking at the camera. What color is the car?
The car is red. Where was this photo taken? It was taken in a park in the city, near a lake, in the
morning.

What time is it in the video? The clock on the wall shows ten minutes past seven.
You are a helpful assistant. Please answer the question with one word. Think step by step before you
answer, then give the final answer.

The answer is yes. The answer is no. The number of objects is four.
Read the text in the image and write it down. The sign says: open every day from nine to five.
Summarize the video in one sentence. A boy plays with a ball in the yard while his mother is reading a
book on the chair. The video is about cooking: a woman cuts the vegetables, puts them in a pot with
water and salt, and waits until the soup is ready. At the end she tastes the soup and smiles.

Compare the two images. The first image is brighter than the second one, and the second image has
more people in it. Both images show the same building from different sides. Is there a bird in the
picture? Yes, there is a small bird on the roof of the house. What is the man holding? He is holding a
cup of coffee in his left hand and a phone in his right hand. Count the apples on the table: one, two,
three, four, five, six, seven, eight, nine, ten. The table is made of wood and the chairs are made of
metal. The weather is sunny and warm; later it will rain. The water in the river is clear and cold.
This is a photo of a mountain with snow on the top and a forest at the bottom. The road goes around
the lake and through the village. The children are playing in the school yard after the lesson.

The model looks at every frame of the video, finds the moment when the ball hits the window, and
reports the time in seconds. The event happens at 3.5 seconds and again at 12.0 seconds.

Explain your reasoning. First, I look at the left side of the image, then at the right side. The
object in the center is a bicycle. The bicycle is blue and it has a basket with flowers.
"""
_REFERENCE_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
"""preprocessor_config.json of Qwen3.5-35B-A3B, as the real checkpoint ships it."""
_REFERENCE_VIDEO_PREPROCESSOR_CONFIG = {
    **{k: v for k, v in _REFERENCE_PREPROCESSOR_CONFIG.items() if k != "image_processor_type"},
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "video_processor_type": "Qwen3VLVideoProcessor",
}
"""video_preprocessor_config.json of Qwen3.5-35B-A3B: the image one with its own
pixel budget and processor type, keys in the same order as the published file."""


def _bytes_to_unicode() -> list[tuple[int, str]]:
    """GPT-2's byte -> printable character table, in its id order (printable bytes first)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table = [(b, chr(b)) for b in printable]
    extra = 0
    for b in range(256):
        if b not in printable:
            table.append((b, chr(256 + extra)))
            extra += 1
    return table


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def learn_merges(text: str, max_merges: int = MAX_MERGES) -> list[tuple[str, str]]:
    """Byte-level BPE merges learned from `text`, most frequent pair first.

    Deterministic: ties go to the lexicographically smallest pair; stops when every word of `text`
    is one token or after `max_merges` merges.
    """
    words = Counter(piece for piece, _ in _pre_tokenizer().pre_tokenize_str(text))
    splits = {word: tuple(word) for word in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            symbols = splits[word]
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best_count = max(pairs.values())
        best = min(pair for pair, count in pairs.items() if count == best_count)
        merges.append(best)
        splits = {word: _merge_pair(symbols, best) for word, symbols in splits.items()}
    return merges


def _merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def build_vocab(merges: list[tuple[str, str]]) -> dict[str, int]:
    """256 byte tokens, one token per merge, then fillers up to the first special id."""
    vocab = {char: i for i, (_, char) in enumerate(_bytes_to_unicode())}
    for left, right in merges:
        token = left + right
        if token not in vocab:
            vocab[token] = len(vocab)
    if len(vocab) > FIRST_SPECIAL_ID:
        raise ValueError(f"vocabulary of {len(vocab)} tokens overlaps the special ids from {FIRST_SPECIAL_ID}")
    for i in range(len(vocab), FIRST_SPECIAL_ID):
        filler = f"<|filler_{i}|>"
        if filler in vocab:
            raise ValueError(f"filler token {filler!r} collides with a learned token")
        vocab[filler] = i
    return vocab


def build_tokenizer() -> Tokenizer:
    """The `tokenizers.Tokenizer` that `write_tokenizer` saves as tokenizer.json."""
    merges = learn_merges(CORPUS)
    bpe = models.BPE(
        vocab=build_vocab(merges), merges=merges, dropout=None, unk_token=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
    )  # fmt: skip
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [_added_token(name, idx) for name, idx in TOKENIZER_SPECIAL_TOKENS.items()]
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    for name, idx in TOKENIZER_SPECIAL_TOKENS.items():
        if tokenizer.token_to_id(name) != idx:
            raise ValueError(f"{name} got id {tokenizer.token_to_id(name)}, expected {idx}")
    return tokenizer


def _added_token(name: str, idx: int) -> dict:
    return {
        "id": idx, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": False, "special": name not in _NOT_SPECIAL,
    }  # fmt: skip


def tokenizer_config() -> dict:
    """tokenizer_config.json contents, as the real checkpoint ships it (the chat template: chat_template.jinja)."""
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(idx): {k: v for k, v in _added_token(name, idx).items() if k != "id"}
            for name, idx in TOKENIZER_SPECIAL_TOKENS.items()
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        "tool_parser_type": "qwen3_coder",
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
        "audio_token": "<|audio_pad|>",
    }


def chat_template_text() -> str:
    """The official Qwen3.5 chat template (stored in mm/chat_template.jinja)."""
    return DEFAULT_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def write_tokenizer(dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and the processor configs into `dir`.

    The files load with `transformers.AutoTokenizer` / `AutoProcessor.from_pretrained(dir)`; every
    token id is below the model vocabulary (248320). Output is byte-for-byte deterministic.
    """
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "tokenizer.json").write_text(build_tokenizer().to_str(), encoding="utf-8")
    (dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    (dir / "chat_template.jinja").write_text(chat_template_text(), encoding="utf-8")
    # Same text as the reference files: json indent 2, no trailing newline.
    (dir / "preprocessor_config.json").write_text(json.dumps(_REFERENCE_PREPROCESSOR_CONFIG, indent=2))
    (dir / "video_preprocessor_config.json").write_text(json.dumps(_REFERENCE_VIDEO_PREPROCESSOR_CONFIG, indent=2))
