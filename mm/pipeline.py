"""`Pipeline`: chat conversations (text, images, videos) in, answers out. All front ends call this.

Every answer goes through one serving engine per pipeline (lm/serving): `generate` and
`stream` may be called from several threads at once; their requests share the engine's batch, its
prefix cache (a chat's later turns reuse the earlier ones) and a cache of vision features.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lm import SamplingParams
from lm.serving import Engine, EngineConfig
from lm.serving.config import MAX_LEN_CAP

from .chat import split_thinking
from .config import ModelConfig
from .constraints import BUDGET_CLOSING, THINK_END, BudgetRule, ConstraintError, Grammars, reasoning_tokens
from .default_model import RANDOM_WEIGHTS_NOTICE, default_model_path
from .engine_requests import VisionCache, engine_prompt
from .gguf_loading import model_gguf
from .gguf_tokenizer import gguf_processor
from .loading import load_model
from .model import VLModel
from .processor import Conversation, ModelInputs, Processor, PromptTooLongError
from .processor import _as_batch as as_batch
from .tokenizer_check import TokenizerMismatchError, check_tokenizer

# Model-card sampling presets of Qwen3.5 / Qwen3.6 (thinking and non-thinking "instruct" mode).
PRESETS = {
    "thinking": dict(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5),
    "instruct": dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=1.5),
    "greedy": dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0),
}
# Unicode normalization (the Qwen tokenizer's NFC) makes a text at most this many times fewer bytes
# (three Hangul jamo of 3 bytes each compose into one syllable of 3).
NORMALIZED_SHRINK = 3


@dataclass
class Output:
    """One conversation's answer. `text` excludes the thinking, which is in `thinking`."""

    text: str
    thinking: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    # seconds: prefill, decode, total; with speculative decoding also draft_acceptance (the share of
    # the MTP layer's drafts accepted) and tokens_per_step (new tokens per verify forward)
    timings: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens taken from the engine's prefix cache
    reasoning_tokens: int = 0  # completion tokens of the thinking, up to and including `</think>`
    # with SamplingParams.logprobs: per token, (id, log-probability, [(id, log-probability)] of the most likely)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


class Pipeline:
    def __init__(self, model: VLModel, processor: Processor, *, max_context: int | None = None,
                 engine_options: dict[str, Any] | None = None):  # fmt: skip
        """TokenizerMismatchError when the processor's tokenizer disagrees with the model (see
        mm.tokenizer_check). `engine_options`: the serving engine's options, an `lm.serving.EngineConfig` or a
        dict of its fields (max_batch, max_len, step_tokens, prefix_cache_bytes, ...)."""
        check_tokenizer(processor.tokenizer, model.config, model.eos_token_ids())
        self.model, self.processor = model, processor
        self.max_context = max_context or model.config.text.max_position_embeddings
        if isinstance(engine_options, EngineConfig):
            engine_options = {f: getattr(engine_options, f) for f in engine_options.__dataclass_fields__}
        self.engine_options = dict(engine_options or {})
        EngineConfig.of(**self.engine_options)  # an unknown or bad option fails here, not at the first request
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self.vision_cache = VisionCache()
        self.assistant_start = processor.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, device: str = "cpu", dtype: torch.dtype | None = None,
                        weights: str = "auto", engine_options: dict[str, Any] | None = None,
                        compute: str = "auto", dequantize_unsupported: bool = False,
                        mmproj: str | Path | None = None, speculative: str | None = None,
                        num_speculative_tokens: int = 1) -> "Pipeline":
        """The pipeline of a checkpoint directory (None: the built-in default model, tiny, with RANDOM
        weights, as the front ends take it; said on stderr); `weights` the storage format of the
        large weights (see `mm.load_model`), `compute` how prefill and the vision tower multiply (the
        same). The config is read first (a ConfigError naming what is wrong in config.json), then the
        processor, so that a checkpoint without its tokenizer files fails before its weights are read.
        A `.gguf` file loads with its `mmproj` file, else text-only (mm.gguf_loading; `dequantize_unsupported`
        and `mmproj` as in `mm.load_model`). `speculative="mtp"` decodes with the checkpoint's MTP
        layer, drafting `num_speculative_tokens` a step (mm.load_model; lm/serving/drafts.py)."""
        if path is None:  # the built-in model, as the front ends take it (mm/default_model.py)
            print(f"WARNING: {RANDOM_WEIGHTS_NOTICE}", file=sys.stderr, flush=True)
            path = default_model_path()
        if (file := model_gguf(path)) is not None:  # a llama.cpp GGUF file: the tokenizer from its metadata
            processor = gguf_processor(file)
        else:
            ModelConfig.from_pretrained(path)
            processor = Processor.from_pretrained(path)
        model = load_model(path, device=device, dtype=dtype, weights=weights, compute=compute,
                           dequantize_unsupported=dequantize_unsupported, mmproj=mmproj, speculative=speculative,
                           num_speculative_tokens=num_speculative_tokens)
        try:
            return cls(model, processor, engine_options=engine_options)
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
            for i, conversation in enumerate(as_batch(conversations)):
                self._check_text_size(conversation, room, i)
            inputs = self.processor(list(conversations), enable_thinking=enable_thinking, max_length=room,
                                    template_kwargs=template_kwargs)  # fmt: skip
        except PromptTooLongError as e:
            raise PromptTooLongError(f"{e}: the model's context is {self.max_context} tokens and "
                                     f"max_new_tokens={params.max_new_tokens} are kept for the answer") from e
        device = self.model.lm.lm_head.weight.device
        return inputs.to(device, self.model.lm.compute_dtype)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured outputs' compiler for this tokenizer (mm/constraints.py)."""
        return Grammars(self.processor.tokenizer, self.model.config.text.vocab_size, self.model.eos_token_ids())

    @functools.cached_property
    def think_end_id(self) -> int | None:
        """The token id of `</think>`, None for a tokenizer without one."""
        ids = self.processor.tokenizer(THINK_END, add_special_tokens=False)["input_ids"]
        return ids[0] if len(ids) == 1 else None

    def constraint_rule(self, params: SamplingParams, in_thinking: bool, rule=None):
        """The rule of one answer: `rule` (e.g. the server's tool_choice) with params' structured
        output and thinking budget (mm/constraints.py); ConstraintError for a bad or clashing one."""
        if params.json_schema is not None or params.regex is not None or params.grammar is not None:
            if rule is not None:
                raise ConstraintError("a structured output (json_schema, regex, grammar) and tool_choice cannot "
                                      "constrain one answer together")  # fmt: skip
            rule = self.grammars.rule(params, in_thinking=in_thinking, think_end=self.think_end_id)
        if params.thinking_budget is not None and in_thinking:
            if self.think_end_id is None:
                raise ConstraintError(f"thinking_budget: this tokenizer has no single {THINK_END} token",
                                      param="thinking_budget")
            closing = self.processor.tokenizer(BUDGET_CLOSING, add_special_tokens=False)["input_ids"]
            rule = BudgetRule(params.thinking_budget, closing, self.think_end_id, rule)
        return rule

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token of the tokenizer stands for (or more: a byte-level symbol
        counts as its character's UTF-8 bytes)."""
        return max(len(token.encode()) for token in self.processor.tokenizer.get_vocab())

    def _check_text_size(self, conversation: Conversation, room: int, index: int) -> None:
        """Refuse, before tokenizing it (a 10 MB message takes seconds), a conversation whose text
        alone is more tokens than `room` at the fewest tokens its bytes can make."""
        size = _text_bytes(conversation)
        if size <= room:  # (a quick way out: such a text is too few tokens whatever the tokenizer)
            return
        least = size // (NORMALIZED_SHRINK * self.max_token_bytes)
        if least > room:
            raise PromptTooLongError(
                f"conversation {index}: the prompt is at least {least} tokens ({size} bytes of text, a token "
                f"stands for at most {self.max_token_bytes}), longer than the {room} allowed")  # fmt: skip

    @property
    def engine(self) -> Engine:
        """The serving engine all generation goes through (made on first use): requests from any
        thread share its batch and its prefix cache (lm/serving)."""
        with self._engine_lock:
            if self._engine is None:
                config = EngineConfig.of(**{"max_len": min(self.max_context, MAX_LEN_CAP), **self.engine_options})
                self._engine = Engine(self.model.lm, eos_token_ids=self.model.eos_token_ids(), config=config)
            return self._engine

    @property
    def engine_error(self) -> BaseException | None:
        """Why the engine thread stopped, if it did (None while it runs or before it is made)."""
        return None if self._engine is None else self._engine.dead

    def submit(self, conversation: Conversation, params: SamplingParams | None = None, *,
               enable_thinking: bool | None = None, template_kwargs: dict[str, Any] | None = None,
               rule=None, answer_rule=None) -> "Answer":  # fmt: skip
        """Start one conversation's answer in the engine; returns at once (see `Answer`). `rule`:
        a constraint on each next token (see `lm.serving.Engine.submit`), joined here with params'
        structured output and thinking budget by `constraint_rule`. `answer_rule`: what that call
        already made for these params and this prompt, used as it is (`rule` is then not read); a
        rule keeps its answer's state, so it serves one answer only."""
        params = params or self.default_params()
        start = time.perf_counter()
        inputs = self.prepare([conversation], params, enable_thinking, template_kwargs)
        return Answer(self, inputs, params, start, rule, answer_rule=answer_rule)

    def generate(self, conversations: Sequence[Conversation], params: SamplingParams | None = None, *,
                 enable_thinking: bool | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> list[Output]:  # fmt: skip
        """Answers for a batch of conversations, generated together in the engine's batch
        (template_kwargs: more chat template variables, e.g. `tools`)."""
        params = params or self.default_params()
        start = time.perf_counter()
        prepared = [self.prepare([c], params, enable_thinking, template_kwargs) for c in conversations]
        answers = [Answer(self, inputs, params, start) for inputs in prepared]
        try:
            return [answer.output() for answer in answers]
        finally:
            for answer in answers:
                answer.cancel()

    def stream(self, conversation: Conversation, params: SamplingParams | None = None, *,
               enable_thinking: bool | None = None,
               template_kwargs: dict[str, Any] | None = None) -> Generator[str, None, Output]:  # fmt: skip
        """Text pieces of one answer as they are generated (thinking, `</think>`, then the answer).

        The pieces join to the whole generated text. The generator's return value (`StopIteration.value`,
        or the value of `yield from`) is the finished answer's `Output`; closing the generator early
        stops the generation and frees its slot."""
        answer = self.submit(conversation, params, enable_thinking=enable_thinking, template_kwargs=template_kwargs)
        try:
            for _ in answer.request:
                piece = answer.new_text()
                if piece:
                    yield piece
            piece = answer.new_text(final=True)
            if piece:
                yield piece
            return answer.output()
        finally:
            answer.cancel()


class Answer:
    """One conversation's answer in the engine: token bookkeeping, stop strings and incremental
    detokenisation. `request` is the engine's handle (iterate it for token ids)."""

    def __init__(self, pipeline: Pipeline, inputs: ModelInputs, params: SamplingParams, start: float, rule=None, *,
                 answer_rule=None):  # fmt: skip
        self.pipeline, self.inputs, self.params, self.start = pipeline, inputs, params, start
        self.emitted = 0  # characters already streamed
        with torch.no_grad():
            prompt = engine_prompt(pipeline.model, inputs, pipeline.vision_cache, pipeline.assistant_start)
        stop = self._hit_stop_string if params.stop else None
        self.in_thinking = _thinking_open(inputs.prompts[0])
        if answer_rule is None:
            answer_rule = pipeline.constraint_rule(params, self.in_thinking, rule)
        if params.thinking_budget is not None and not self.in_thinking:  # no thinking opened: nothing to bound
            params = dataclasses.replace(params, thinking_budget=None)
        self.request = pipeline.engine.submit(prompt, params, stop_when=stop, rule=answer_rule)

    @property
    def tokens(self) -> list[int]:
        return self.request.tokens

    def cancel(self) -> None:
        self.request.cancel()

    def text(self) -> str:
        """Decoded output so far, cut before the first stop string."""
        text = self.pipeline.processor.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]

    def _hit_stop_string(self, tokens: list[int]) -> bool:
        text = self.pipeline.processor.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in self.params.stop)

    def new_text(self, final: bool = False) -> str:
        """Text not yet streamed; holds back a possibly unfinished character or stop string."""
        text = self.text()
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # a multi-byte character split across tokens
                end = len(text.rstrip("\ufffd"))
            hold = max((len(s) - 1 for s in self.params.stop), default=0)
            end = max(self.emitted, end - hold)
        piece = text[self.emitted : end]
        self.emitted = end
        return piece

    def output(self) -> Output:
        """Wait for the end; the finished answer (raises the engine's error if it failed)."""
        self.request.result()
        times = self.request.times
        first, end = times.get("first_token", times["finished"]), times["finished"]
        thinking, answer = split_thinking(self.text(), in_thinking=self.in_thinking)
        timings = dict(prefill=first - self.start, decode=end - first, total=end - self.start)
        if (drafts := self.request.speculative).steps:  # decoded with the MTP layer's drafts
            timings.update(draft_acceptance=drafts.acceptance, tokens_per_step=drafts.tokens_per_step)
        reasoning = reasoning_tokens(self.tokens, self.pipeline.think_end_id, self.in_thinking)
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = [(token, lp, top) for token, (lp, top) in zip(self.tokens, self.request.logprobs)]
        return Output(answer, thinking, list(self.tokens), int(self.inputs.attention_mask[0].sum()), len(self.tokens),
                      self.request.finish_reason or "stop", timings, self.request.cached_tokens, reasoning,
                      logprobs)  # fmt: skip


def _text_bytes(conversation: Conversation) -> int:
    """UTF-8 bytes of a conversation's text: string contents and text parts (no media, no tools)."""
    total = 0
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        for part in [content] if isinstance(content, str) else content if isinstance(content, list) else []:
            text = part.get("text") if isinstance(part, dict) else part
            total += len(text.encode()) if isinstance(text, str) else 0
    return total


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
