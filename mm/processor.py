"""Chat messages to model inputs: chat template, image / video preprocessing, placeholder expansion.

Equal, token for token, to transformers' `Qwen3VLProcessor` (5.23) for the same rendered text and
the same pixels: every `<|image_pad|>` becomes `t*h*w/4` pads; every `<|video_pad|>` becomes, per
2-frame group, `<{t:.1f} seconds><|vision_start|>` + `h*w/4` pads + `<|vision_end|>`, where `t` is the
mean timestamp of the group's first and last frame. Like transformers 5.x, only the pad token is
replaced, so the template's own `<|vision_start|>` / `<|vision_end|>` stay around a video's groups.

Images are loaded with `preprocess.load_image` (with the part's "max_pixels"). Videos given as a path,
bytes or frames in memory go through `preprocess.sample_video` with the part's options (for frames in
memory, "fps" is their frame rate); a `preprocess.VideoClip` is used as given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoTokenizer

import preprocess
from mm.chat import Conversation, MediaItem, collect_media, load_chat_template, render, split_thinking
from mm.tokenizer_check import check_tokenizer_files

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
_PLACEHOLDER = re.compile(re.escape(IMAGE_TOKEN) + "|" + re.escape(VIDEO_TOKEN))


class PromptTooLongError(ValueError):
    """A prompt has more tokens than allowed."""


@dataclass(frozen=True)
class VideoInfo:
    """What was made of one video: the frames used, their timestamps and the per-group prompt times."""

    source: str  # file name, or where the video sat in the conversation
    timestamps: list[float]  # seconds, one per frame fed to the vision tower
    group_timestamps: list[float]  # seconds, one per 2-frame group (the "<t seconds>" values)
    frame_indices: list[int]  # position of each frame used among the source's frames
    source_fps: float
    duration: float  # seconds, the source's length
    total_frames: int  # frames in the source

    @property
    def num_frames(self) -> int:
        """Frames fed to the vision tower."""
        return len(self.timestamps)


@dataclass
class ModelInputs:
    """Batched model inputs, with the same tensors and meaning as transformers' processor output.

    input_ids / attention_mask: int64 [B, T], left-padded with the pad token (mask 0 on pads).
    pixel_values [N, 1536] / image_grid_thw [n, 3]: every image of the batch, conversation by
    conversation, in prompt order (None without images); pixel_values_videos / video_grid_thw: the
    same for videos. videos: one VideoInfo per video, same order. prompts: the rendered chat text of
    each conversation, before placeholder expansion.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    videos: list[VideoInfo] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)

    def mm_token_types(self, image_token_id: int, video_token_id: int) -> torch.Tensor:
        """[B, T]: 1 on image pads, 2 on video pads, 0 elsewhere (transformers' `mm_token_type_ids`)."""
        types = torch.zeros_like(self.input_ids)
        types[self.input_ids == image_token_id] = 1
        types[self.input_ids == video_token_id] = 2
        return types

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> "ModelInputs":
        """A copy with every tensor on `device`; pixel tensors also cast to `dtype` when given."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                cast = dtype if dtype is not None and value.is_floating_point() else None
                moved[f.name] = value.to(device=device, dtype=cast)
        return replace(self, **moved)


class Processor:
    """Turns conversations into `ModelInputs` for a Qwen3.5 / Qwen3.6 checkpoint."""

    def __init__(self, tokenizer: Any, chat_template: str, image_processor: preprocess.ImageProcessor,
                 video_processor: preprocess.VideoProcessor):  # fmt: skip
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.pad_token_id = _token_id(tokenizer, tokenizer.pad_token, "pad token")
        self.image_token_id = _token_id(tokenizer, IMAGE_TOKEN, "image token")
        self.video_token_id = _token_id(tokenizer, VIDEO_TOKEN, "video token")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Processor":
        """Tokenizer (transformers AutoTokenizer), chat template and image / video processors of a checkpoint dir.
        FileNotFoundError naming the files when the tokenizer's are missing (see mm.tokenizer_check)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {path}")
        check_tokenizer_files(path)
        return cls(AutoTokenizer.from_pretrained(str(path)), load_chat_template(path),
                   preprocess.ImageProcessor.from_pretrained(path), preprocess.VideoProcessor.from_pretrained(path))  # fmt: skip

    def __call__(self, conversations: Conversation | Sequence[Conversation], *, enable_thinking: bool | None = None,
                 add_generation_prompt: bool = True, max_length: int | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> ModelInputs:  # fmt: skip
        """Render, preprocess and tokenize one conversation or a batch of them.

        enable_thinking: passed to the chat template (None: the template's default; for Qwen3.5,
        thinking). max_length: refuse prompts longer than this many tokens. template_kwargs: more
        template variables, e.g. `tools` (OpenAI function schemas) or `preserve_thinking`.
        """
        batch = _as_batch(conversations)
        prompts, media = [], []
        for i, conversation in enumerate(batch):
            messages, items = collect_media(conversation, i)
            prompts.append(render(self.tokenizer, self.chat_template, messages, i, enable_thinking=enable_thinking,
                                  add_generation_prompt=add_generation_prompt,
                                  template_kwargs=template_kwargs))  # fmt: skip
            media.append(items)
        images = self._images([item for items in media for item in items if item.kind == "image"])
        videos, infos = self._videos([item for items in media for item in items if item.kind == "video"])
        image_pads = self._image_replacements(images)
        video_pads = self._video_replacements(videos, infos)
        texts = []
        for i, (prompt, items) in enumerate(zip(prompts, media)):
            n_images = sum(item.kind == "image" for item in items)
            n_videos = len(items) - n_images
            texts.append(_expand(prompt, image_pads[:n_images], video_pads[:n_videos], i))
            image_pads, video_pads = image_pads[n_images:], video_pads[n_videos:]
        input_ids, attention_mask = self._tokenize(texts, max_length)
        return ModelInputs(
            input_ids=input_ids, attention_mask=attention_mask,
            pixel_values=None if images is None else images.pixel_values,
            image_grid_thw=None if images is None else images.grid_thw,
            pixel_values_videos=None if videos is None else videos.pixel_values,
            video_grid_thw=None if videos is None else videos.grid_thw, videos=infos, prompts=prompts,
        )  # fmt: skip

    def decode(self, token_ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Token ids (a list or a 1-D tensor) to text; `<think>`/`</think>` are not special and stay."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 1:
                raise ValueError(f"decode takes one sequence (1-D), got shape {tuple(token_ids.shape)}")
            token_ids = token_ids.tolist()
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    split_thinking = staticmethod(split_thinking)

    def _images(self, items: list[MediaItem]) -> preprocess.VisualInputs | None:
        if not items:
            return None
        images = []
        for item in items:
            try:
                images.append(preprocess.load_image(item.source, **item.options))
                self.image_processor.target_size(images[-1].height, images[-1].width)  # e.g. an extreme aspect ratio
            except preprocess.ImageError as error:
                raise preprocess.ImageError(f"{item.where}: {error}") from error
            except ValueError as error:
                raise ValueError(f"{item.where}: {error}") from error
        return self.image_processor(images)

    def _videos(self, items: list[MediaItem]) -> tuple[preprocess.VisualInputs | None, list[VideoInfo]]:
        if not items:
            return None, []
        clips = [_sample(item) for item in items]
        infos = [_video_info(clip, item.where) for clip, item in zip(clips, items)]
        return self.video_processor(clips), infos

    def _image_replacements(self, images: preprocess.VisualInputs | None) -> list[str]:
        if images is None:
            return []
        merge = self.image_processor.config.merge_size**2
        return [IMAGE_TOKEN * (int(grid.prod()) // merge) for grid in images.grid_thw]

    def _video_replacements(self, videos: preprocess.VisualInputs | None, infos: list[VideoInfo]) -> list[str]:
        if videos is None:
            return []
        merge = self.video_processor.config.merge_size**2
        out = []
        for grid, info in zip(videos.grid_thw, infos):
            t, h, w = (int(v) for v in grid)
            if len(info.group_timestamps) != t:
                raise ValueError(f"video {info.source}: {len(info.group_timestamps)} frame groups timestamped "
                                 f"but the video processor made {t}")  # fmt: skip
            group = VISION_START + VIDEO_TOKEN * (h * w // merge) + VISION_END
            out.append("".join(f"<{time:.1f} seconds>" + group for time in info.group_timestamps))
        return out

    def _tokenize(self, texts: list[str], max_length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        for i, row in enumerate(ids):
            if max_length is not None and len(row) > max_length:
                raise PromptTooLongError(f"conversation {i}: the prompt is {len(row)} tokens, longer than the "
                                         f"{max_length} allowed")  # fmt: skip
        longest = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), longest), dtype=torch.long)
        for i, row in enumerate(ids):
            if row:
                input_ids[i, longest - len(row) :] = torch.tensor(row, dtype=torch.long)
                attention_mask[i, longest - len(row) :] = 1
        return input_ids, attention_mask


def _as_batch(conversations: Any) -> list[Conversation]:
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise ValueError("expected a conversation (a non-empty list of messages) or a non-empty list of them")
    if all(isinstance(message, dict) for message in conversations):
        return [list(conversations)]
    if all(isinstance(conversation, (list, tuple)) for conversation in conversations):
        return [list(conversation) for conversation in conversations]
    raise ValueError("expected a conversation (a list of message dicts) or a list of conversations, not a mix")


def _token_id(tokenizer: Any, token: str | None, what: str) -> int:
    idx = tokenizer.convert_tokens_to_ids(token) if token is not None else None
    if idx is None or (idx == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"the tokenizer has no {what} ({token!r})")
    return int(idx)


def _expand(prompt: str, image_pads: list[str], video_pads: list[str], index: int) -> str:
    """Replace the i-th image / video placeholder of `prompt` by the i-th expansion."""
    found = [m.group() for m in _PLACEHOLDER.finditer(prompt)]
    if found.count(IMAGE_TOKEN) != len(image_pads) or found.count(VIDEO_TOKEN) != len(video_pads):
        raise ValueError(f"conversation {index}: the prompt has {found.count(IMAGE_TOKEN)} {IMAGE_TOKEN} and "
                         f"{found.count(VIDEO_TOKEN)} {VIDEO_TOKEN} but the messages hold {len(image_pads)} images "
                         f"and {len(video_pads)} videos (literal placeholder tokens in the text?)")  # fmt: skip
    images, videos = iter(image_pads), iter(video_pads)
    return _PLACEHOLDER.sub(lambda m: next(images) if m.group() == IMAGE_TOKEN else next(videos), prompt)


def _sample(item: MediaItem) -> preprocess.VideoClip:
    """The frames of one video part: a VideoClip as given, anything else through `preprocess.sample_video`."""
    if isinstance(item.source, preprocess.VideoClip):
        if item.options:
            raise ValueError(f"{item.where}: video options {sorted(item.options)} do not apply to a VideoClip")
        return item.source
    try:
        return preprocess.sample_video(item.source, **item.options)
    except preprocess.VideoError as error:
        raise preprocess.VideoError(f"{item.where}: {error}") from error
    except ValueError as error:  # invalid options or frames
        raise ValueError(f"{item.where}: {error}") from error


def _video_info(clip: preprocess.VideoClip, where: str) -> VideoInfo:
    """Group times as transformers computes them: frames padded to pairs, mean of each pair's ends."""
    stamps = [float(t) for t in clip.timestamps]
    if len(stamps) != len(clip) or not stamps:
        raise ValueError(f"{where}: the video clip has {len(clip)} frames but {len(stamps)} timestamps")
    padded = stamps + stamps[-1:] * (len(stamps) % 2)
    groups = [(padded[i] + padded[i + 1]) / 2 for i in range(0, len(padded), 2)]
    return VideoInfo(clip.source or where, stamps, groups, list(clip.frame_indices), clip.source_fps, clip.duration,
                     clip.total_frames)  # fmt: skip
