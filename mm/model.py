"""`VLModel`: the vision tower and the hybrid language model, fused early."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from lm import CausalLM, SamplingParams, TokenEvent, stream_generate
from lm.serving import SpeculativeStats
from vision import VisionModel

from .config import ModelConfig
from .fusion import scatter_vision
from .rope_index import mrope_positions


class VLModel(nn.Module):
    """`forward` takes the tensors of transformers' `Qwen3_5MoeForConditionalGeneration.forward`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.visual = VisionModel(config.vision) if config.vision is not None else None
        self.lm = CausalLM(config.text)
        self.generation_config: dict = {}

    def embed(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Input embeddings [B, T, hidden] with vision features fused in, and mRoPE positions
        [3, B, T] (None for text-only prompts, whose positions the LM derives itself)."""
        embeds = self.lm.embed(input_ids)
        cfg = self.config
        for pixels, grid, token, what in (
            (pixel_values, image_grid_thw, cfg.image_token_id, "image"),
            (pixel_values_videos, video_grid_thw, cfg.video_token_id, "video"),
        ):
            if pixels is None:
                continue
            if self.visual is None:
                raise ValueError(f"this checkpoint ({cfg.model_type}) has no vision tower; it cannot take {what}s")
            if grid is None:
                raise ValueError(f"{what} pixels need their grid_thw")
            features = self.visual(pixels, grid)  # the tower takes pixels to its compute dtype
            embeds = scatter_vision(embeds, input_ids, token, features, what)
        if image_grid_thw is None and video_grid_thw is None:
            return embeds, None
        positions, _ = mrope_positions(input_ids, image_grid_thw, video_grid_thw, attention_mask, config=cfg)
        return embeds, positions

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab]. Left padding is marked by zeros in `attention_mask`."""
        embeds, positions = self.embed(
            input_ids, attention_mask, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
        )
        return self.lm(inputs_embeds=embeds, positions=positions, attention_mask=attention_mask)

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: the checkpoint's generation_config.json, else the text config."""
        eos = self.generation_config.get("eos_token_id")
        if eos is None:
            return self.config.text.eos_token_id
        return (eos,) if isinstance(eos, int) else tuple(eos)

    def stream_generate(
        self,
        input_ids: torch.Tensor,
        params: SamplingParams | list[SamplingParams],
        *,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
        stop_when: Callable[[int, list[int]], bool] | None = None,
        stats: SpeculativeStats | None = None,
    ) -> Iterator[TokenEvent]:
        """Generate with the cache for a left-padded batch; yields each token as it is sampled.
        (With the MTP layer loaded, `stats` counts the speculative drafts: lm.serving.speculative.)"""
        with torch.no_grad():
            embeds, positions = self.embed(
                input_ids, attention_mask, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
            )
        eos = self.eos_token_ids() if eos_token_ids is None else eos_token_ids
        yield from stream_generate(
            self.lm, input_ids, params, attention_mask=attention_mask, inputs_embeds=embeds,
            positions=positions, eos_token_ids=eos, stop_when=stop_when, stats=stats,
        )

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 256,
        *,
        params: SamplingParams | list[SamplingParams] | None = None,
        **inputs,
    ) -> list[list[int]]:
        """New tokens per row (greedy unless `params` say otherwise); `inputs` as in `stream_generate`."""
        params = params if params is not None else SamplingParams(max_new_tokens=max_new_tokens)
        outputs: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
        for event in self.stream_generate(input_ids, params, **inputs):
            outputs[event.row].append(event.token)
        return outputs
