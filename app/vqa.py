"""`VQA`: ask questions about images and videos from Python, through `mm.Pipeline`.

    from app import VQA
    vqa = VQA("/models/Qwen3.5-35B-A3B", device="cuda")
    answer = vqa.ask("What is in the picture?", image="cat.jpg", max_new_tokens=128)
    print(answer.text)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm import SamplingParams
from mm import Output, Pipeline

from .loading import load_pipeline

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
ITEM_KEYS = frozenset({"question", "image", "images", "video", "videos", "fps", "max_frames", "max_pixels"})


@dataclass(frozen=True)
class Answer:
    """One answer. `text` excludes the thinking, which is in `thinking` ("" when there was none).

    finish_reason: "stop" (end of turn, stop token or stop string) or "length" (max_new_tokens hit).
    seconds: wall time of the call that produced it (for `ask_many`, the whole batch's).
    """

    text: str
    thinking: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    seconds: float

    @classmethod
    def from_output(cls, output: Output, seconds: float) -> "Answer":
        return cls(output.text, output.thinking, output.prompt_tokens, output.completion_tokens,
                   output.finish_reason, seconds)  # fmt: skip


class VQA:
    """Visual question answering on a Qwen3.5 / Qwen3.6 checkpoint.

    model: a checkpoint directory, or None for the built-in tiny model with RANDOM weights (a notice
    is printed). preset: the sampling defaults ("thinking", "instruct", "greedy"; None: the
    checkpoint's generation_config.json). Every call may override SamplingParams fields by keyword
    (max_new_tokens=..., temperature=..., seed=..., stop=[...]).
    """

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", dtype: torch.dtype | None = None,
                 preset: str | None = None, weights: str = "auto", compute: str = "auto",
                 dequantize_unsupported: bool = False, mmproj: str | Path | None = None,
                 speculative: str | None = None, num_speculative_tokens: int = 1):  # fmt: skip
        self.pipeline = load_pipeline(model, device=device, dtype=dtype, weights=weights, compute=compute,
                                      dequantize_unsupported=dequantize_unsupported, mmproj=mmproj,
                                      speculative=speculative, num_speculative_tokens=num_speculative_tokens)
        self.preset = preset
        self.pipeline.default_params(preset)  # refuse an unknown preset now

    @classmethod
    def from_pipeline(cls, pipeline: Pipeline, *, preset: str | None = None) -> "VQA":
        """A VQA over an already loaded pipeline (e.g. shared with the demo)."""
        vqa = cls.__new__(cls)
        vqa.pipeline, vqa.preset = pipeline, preset
        pipeline.default_params(preset)
        return vqa

    def params(self, **sampling: Any) -> SamplingParams:
        """The sampling parameters of a call: the preset's (or checkpoint's) defaults, then `sampling`."""
        unknown = sorted(set(sampling) - SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"unknown sampling option(s) {unknown}; "
                            f"SamplingParams fields are {sorted(SAMPLING_FIELDS)}")
        return self.pipeline.default_params(self.preset, **sampling)

    def ask(self, question: str, image: Any = None, images: Sequence[Any] | None = None, video: Any = None, *,
            videos: Sequence[Any] | None = None, fps: float | None = None, max_frames: int | None = None,
            max_pixels: int | None = None, enable_thinking: bool | None = None, **sampling: Any) -> Answer:  # fmt: skip
        """Answer one question about optional images and videos (paths, PIL images, arrays; videos also
        frame lists or `preprocess.VideoClip`). fps / max_frames: how to sample video files.
        max_pixels: the pixel budget of each image file and of each video file's frames (None: the
        default of `preprocess.load_image` / `sample_video`). enable_thinking: None follows the chat
        template (Qwen3.5: thinking on)."""
        conversation = build_conversation(question, image=image, images=images, video=video, videos=videos, fps=fps,
                                          max_frames=max_frames, max_pixels=max_pixels)  # fmt: skip
        start = time.perf_counter()
        [output] = self.pipeline.generate([conversation], self.params(**sampling), enable_thinking=enable_thinking)
        return Answer.from_output(output, time.perf_counter() - start)

    def stream(self, question: str, image: Any = None, images: Sequence[Any] | None = None, video: Any = None, *,
               videos: Sequence[Any] | None = None, fps: float | None = None, max_frames: int | None = None,
               max_pixels: int | None = None, enable_thinking: bool | None = None,
               **sampling: Any) -> Iterator[str]:  # fmt: skip
        """Text pieces of the answer as they are generated: in thinking mode the thinking comes first,
        then `</think>`, then the answer (split them with `mm.split_thinking`). Arguments as in `ask`."""
        conversation = build_conversation(question, image=image, images=images, video=video, videos=videos, fps=fps,
                                          max_frames=max_frames, max_pixels=max_pixels)  # fmt: skip
        yield from self.pipeline.stream(conversation, self.params(**sampling), enable_thinking=enable_thinking)

    def ask_many(self, items: Sequence[str | Mapping[str, Any]], *, fps: float | None = None,
                 max_frames: int | None = None, max_pixels: int | None = None, enable_thinking: bool | None = None,
                 **sampling: Any) -> list[Answer]:  # fmt: skip
        """Answer several questions, in order. All go to the serving engine at once: it decodes as
        many together as it has slots and starts the next as soon as one ends.

        Each item is a question string, or a dict with "question" and optionally "image", "images",
        "video", "videos", "fps", "max_frames", "max_pixels" (as the arguments of `ask`; an item's
        win over the call's). Sampling options and enable_thinking apply to every item.
        """
        if isinstance(items, (str, Mapping)) or not items:
            raise ValueError("ask_many takes a non-empty list of questions (strings or dicts)")
        conversations = [_item_conversation(item, i, fps, max_frames, max_pixels) for i, item in enumerate(items)]
        start = time.perf_counter()
        outputs = self.pipeline.generate(conversations, self.params(**sampling), enable_thinking=enable_thinking)
        seconds = time.perf_counter() - start
        return [Answer.from_output(output, seconds) for output in outputs]


def build_conversation(question: str, *, image: Any = None, images: Sequence[Any] | None = None, video: Any = None,
                       videos: Sequence[Any] | None = None, fps: float | None = None,
                       max_frames: int | None = None,
                       max_pixels: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """A one-message conversation: the images, then the videos, then the question."""
    if not isinstance(question, str):
        raise TypeError(f"the question must be a string, got {type(question).__name__}")
    pictures = _media_list(image, images, "image")
    clips = _media_list(video, videos, "video")
    budget = {} if max_pixels is None else {"max_pixels": max_pixels}
    parts: list[dict[str, Any]] = [{"type": "image", "image": picture, **budget} for picture in pictures]
    options = {key: value for key, value in (("fps", fps), ("max_frames", max_frames)) if value is not None}
    options.update(budget)
    parts += [{"type": "video", "video": clip, **options} for clip in clips]
    parts.append({"type": "text", "text": question})
    return [{"role": "user", "content": parts}]


def _media_list(one: Any, many: Sequence[Any] | None, name: str) -> list[Any]:
    if many is not None and (isinstance(many, (str, bytes, Path)) or not isinstance(many, Sequence)):
        raise TypeError(f"{name}s= takes a list; for a single {name} use {name}=")
    return ([] if one is None else [one]) + list(many or [])


def _item_conversation(item: str | Mapping[str, Any], index: int, fps: float | None, max_frames: int | None,
                       max_pixels: int | None) -> list[dict[str, Any]]:  # fmt: skip
    if isinstance(item, str):
        return build_conversation(item)
    if not isinstance(item, Mapping) or "question" not in item:
        raise ValueError(f"item {index}: expected a question string or a dict with a 'question' key")
    unknown = sorted(set(item) - ITEM_KEYS)
    if unknown:
        raise ValueError(f"item {index}: unknown key(s) {unknown}; allowed: {sorted(ITEM_KEYS)}")
    options = {"fps": item.get("fps", fps), "max_frames": item.get("max_frames", max_frames),
               "max_pixels": item.get("max_pixels", max_pixels)}
    return build_conversation(item["question"], image=item.get("image"), images=item.get("images"),
                              video=item.get("video"), videos=item.get("videos"), **options)  # fmt: skip
