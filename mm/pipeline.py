"""`Pipeline`: chat conversations (text, images, videos) in, answers out. All front ends call this."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lm import SamplingParams

from .chat import split_thinking
from .loading import load_model
from .model import VLModel
from .processor import Conversation, ModelInputs, Processor, PromptTooLongError
from .tokenizer_check import TokenizerMismatchError, check_tokenizer

# Model-card sampling presets of Qwen3.5 / Qwen3.6 (thinking and non-thinking "instruct" mode).
PRESETS = {
    "thinking": dict(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5),
    "instruct": dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=1.5),
    "greedy": dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0),
}


@dataclass
class Output:
    """One conversation's answer. `text` excludes the thinking, which is in `thinking`."""

    text: str
    thinking: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    timings: dict[str, float] = field(default_factory=dict)  # seconds: prefill, decode, total


class Pipeline:
    def __init__(self, model: VLModel, processor: Processor, *, max_context: int | None = None):
        """TokenizerMismatchError when the processor's tokenizer disagrees with the model (see
        mm.tokenizer_check)."""
        check_tokenizer(processor.tokenizer, model.config, model.eos_token_ids())
        self.model, self.processor = model, processor
        self.max_context = max_context or model.config.text.max_position_embeddings

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None,
                        weights: str = "auto") -> "Pipeline":
        """The pipeline of a checkpoint directory; `weights` the storage format of the large weights
        (see `mm.load_model`). The processor loads first, so that a checkpoint without its
        tokenizer files fails before its weights are read."""
        processor = Processor.from_pretrained(path)
        model = load_model(path, device=device, dtype=dtype, weights=weights)
        try:
            return cls(model, processor)
        except TokenizerMismatchError as error:
            raise TokenizerMismatchError(f"{path}: {error}") from None

    def default_params(self, preset: str | None = None, **overrides) -> SamplingParams:
        """Sampling defaults: the checkpoint's generation_config.json, or a named preset
        ("thinking", "instruct", "greedy"); keyword overrides win."""
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown sampling preset {preset!r}; choose one of {sorted(PRESETS)}")
        values = dict(PRESETS[preset]) if preset else _from_generation_config(self.model.generation_config)
        values.update(overrides)
        return SamplingParams(**values)

    def prepare(self, conversations: Sequence[Conversation], params: SamplingParams, enable_thinking: bool | None,
                template_kwargs: dict[str, Any] | None = None) -> ModelInputs:  # fmt: skip
        """Processor inputs for a batch, checked against the model's context length."""
        room = self.max_context - params.max_new_tokens
        if room <= 0:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} leaves no room in the model's context "
                             f"of {self.max_context} tokens")  # fmt: skip
        try:
            inputs = self.processor(list(conversations), enable_thinking=enable_thinking, max_length=room,
                                    template_kwargs=template_kwargs)  # fmt: skip
        except PromptTooLongError as e:
            raise PromptTooLongError(f"{e}: the model's context is {self.max_context} tokens and "
                                     f"max_new_tokens={params.max_new_tokens} are kept for the answer") from e
        device = self.model.lm.lm_head.weight.device
        return inputs.to(device, self.model.lm.compute_dtype)

    def generate(self, conversations: Sequence[Conversation], params: SamplingParams | None = None, *,
                 enable_thinking: bool | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> list[Output]:  # fmt: skip
        """Answers for a batch of conversations, generated together (template_kwargs: more chat template
        variables, e.g. `tools`)."""
        params = params or self.default_params()
        start = time.perf_counter()
        inputs = self.prepare(conversations, params, enable_thinking, template_kwargs)
        run = _Run(self, inputs, params)
        first = None
        for _ in run.events():
            first = first or time.perf_counter()
        return run.outputs(start, first or time.perf_counter(), time.perf_counter())

    def stream(self, conversation: Conversation, params: SamplingParams | None = None, *,
               enable_thinking: bool | None = None,
               template_kwargs: dict[str, Any] | None = None) -> Generator[str, None, Output]:  # fmt: skip
        """Text pieces of one answer as they are generated (thinking, `</think>`, then the answer).

        The pieces join to the whole generated text. The generator's return value (`StopIteration.value`,
        or the value of `yield from`) is the finished answer's `Output`; closing the generator early
        stops the generation."""
        params = params or self.default_params()
        start = time.perf_counter()
        run = _Run(self, self.prepare([conversation], params, enable_thinking, template_kwargs), params)
        first = None
        for _ in run.events():
            first = first or time.perf_counter()
            piece = run.new_text(0)
            if piece:
                yield piece
        piece = run.new_text(0, final=True)
        if piece:
            yield piece
        return run.outputs(start, first or time.perf_counter(), time.perf_counter())[0]


class _Run:
    """One batched generation: token bookkeeping, stop strings and incremental detokenisation."""

    def __init__(self, pipeline: Pipeline, inputs: ModelInputs, params: SamplingParams):
        self.pipeline, self.inputs, self.params = pipeline, inputs, params
        rows = inputs.input_ids.shape[0]
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.reasons: list[str] = ["length"] * rows
        self.emitted = [0] * rows  # characters already streamed per row

    def events(self):
        model = self.pipeline.model
        stop = self._hit_stop_string if self.params.stop else None
        for event in model.stream_generate(
            self.inputs.input_ids, self.params, attention_mask=self.inputs.attention_mask,
            pixel_values=self.inputs.pixel_values, image_grid_thw=self.inputs.image_grid_thw,
            pixel_values_videos=self.inputs.pixel_values_videos, video_grid_thw=self.inputs.video_grid_thw,
            stop_when=stop,
        ):  # fmt: skip
            self.tokens[event.row].append(event.token)
            if event.finish_reason:
                self.reasons[event.row] = event.finish_reason
            yield event

    def text(self, row: int) -> str:
        """Decoded output so far, cut before the first stop string."""
        text = self.pipeline.processor.decode(self.tokens[row], skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]

    def _hit_stop_string(self, row: int, tokens: list[int]) -> bool:
        text = self.pipeline.processor.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in self.params.stop)

    def new_text(self, row: int, final: bool = False) -> str:
        """Text not yet streamed; holds back a possibly unfinished character or stop string."""
        text = self.text(row)
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # a multi-byte character split across tokens
                end = len(text.rstrip("\ufffd"))
            hold = max((len(s) - 1 for s in self.params.stop), default=0)
            end = max(self.emitted[row], end - hold)
        piece = text[self.emitted[row] : end]
        self.emitted[row] = end
        return piece

    def outputs(self, start: float, first: float, end: float) -> list[Output]:
        mask = self.inputs.attention_mask
        results = []
        for row, tokens in enumerate(self.tokens):
            thinking, answer = split_thinking(self.text(row), in_thinking=_thinking_open(self.inputs.prompts[row]))
            timings = dict(prefill=first - start, decode=end - first, total=end - start)
            results.append(Output(answer, thinking, tokens, int(mask[row].sum()), len(tokens), self.reasons[row], timings))
        return results


def _thinking_open(prompt: str) -> bool:
    """The generation prompt opened a `<think>` block that the model is expected to close."""
    tail = prompt.rstrip()
    return tail.endswith("<think>")


def _from_generation_config(config: dict) -> dict:
    """SamplingParams fields from a generation_config.json dict (greedy when do_sample is false/absent)."""
    values = dict(PRESETS["greedy"])
    if config.get("do_sample"):
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty"):
            if config.get(key) is not None:
                values[key] = config[key]
    elif config.get("repetition_penalty") is not None:
        values["repetition_penalty"] = config["repetition_penalty"]
    if config.get("max_new_tokens"):
        values["max_new_tokens"] = int(config["max_new_tokens"])
    return values
