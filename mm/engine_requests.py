"""One conversation's model inputs as a serving-engine request (`lm.serving.Prompt`).

- The prefix-cache key is the token ids with each image's or video's placeholder tokens replaced by
  a hash of its pixels and grid: the same picture gives the same key, a different one never does.
- The embeddings are made lazily, when the engine prefills: a range without placeholders costs only
  the token embeddings, so a prompt whose images lie inside its cached prefix never runs the vision
  tower. When it does run, its features per image or video come from `VisionCache` (by the same
  content hash), so a later chat turn that misses the prefix cache still does not re-encode them.
- mRoPE positions of the whole prompt, and the position of the first generated token.
- Snapshot points at the start of each message (a shared system prompt is reused whatever follows)
  and at the start of the assistant turn (after `<|im_start|>assistant\\n`): the next turn's
  history renders this turn's answer from there without its `<think>` block, so this is where the
  next turn's prompt leaves this one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from lm.serving import Prompt

from .fusion import scatter_vision
from .model import VLModel
from .processor import ModelInputs
from .rope_index import mrope_positions


class VisionCache:
    """Vision-tower features by content hash, least recently used out past `max_bytes`."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def features(self, model: VLModel, digest: bytes, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        if digest in self._items:
            self.hits += 1
            self._items.move_to_end(digest)
            return self._items[digest]
        self.misses += 1
        features = model.visual(pixels, grid)  # the tower takes pixels to its compute dtype
        size = features.numel() * features.element_size()
        if size <= self.max_bytes:
            while self.nbytes + size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.nbytes -= old.numel() * old.element_size()
            self._items[digest] = features
            self.nbytes += size
        return features

    def stats(self) -> dict:
        return dict(items=len(self._items), bytes=self.nbytes, max_bytes=self.max_bytes, hits=self.hits,
                    misses=self.misses)  # fmt: skip


def _items(pixels: torch.Tensor | None, grid: torch.Tensor | None):
    """(digest, pixel rows, grid [1, 3]) per image or video."""
    if pixels is None:
        return []
    out, start = [], 0
    for row in grid:
        n = int(row.prod())
        chunk = pixels[start : start + n]
        h = hashlib.sha256(chunk.detach().cpu().contiguous().numpy().tobytes())
        h.update(row.cpu().numpy().tobytes())
        out.append((h.digest(), chunk, row[None]))
        start += n
    return out


def engine_prompt(model: VLModel, inputs: ModelInputs, vision_cache: VisionCache,
                  assistant_start: list[int] | None = None) -> Prompt:  # fmt: skip
    """The request of a one-conversation `ModelInputs` (no padding). `assistant_start`: the token ids
    of `<|im_start|>assistant\\n`; its first is the message start token."""
    if inputs.input_ids.shape[0] != 1 or not bool(inputs.attention_mask.all()):
        raise ValueError("engine_prompt takes one conversation without padding")
    cfg = model.config
    ids_t = inputs.input_ids
    ids = ids_t[0].tolist()
    merge = cfg.spatial_merge_size**2
    media = [(cfg.image_token_id, _items(inputs.pixel_values, inputs.image_grid_thw), "image"),
             (cfg.video_token_id, _items(inputs.pixel_values_videos, inputs.video_grid_thw), "video")]  # fmt: skip
    key = list(ids)
    for token, items, _ in media:
        where = [i for i, t in enumerate(ids) if t == token]
        at = 0
        for digest, _, grid in items:
            n = int(grid.prod()) // merge
            mark = -(1 + (int.from_bytes(digest[:8], "little") >> 2))  # never a token id
            for i in where[at : at + n]:
                key[i] = mark
            at += n
    has_media = any(items for _, items, _ in media)
    if has_media and model.visual is None:
        raise ValueError(f"this checkpoint ({cfg.model_type}) has no vision tower; it cannot take images or videos")
    full: list[torch.Tensor] = []

    def embed(start: int, end: int) -> torch.Tensor:
        if not full and not any(k < 0 for k in key[start:end]):
            return model.lm.embed(ids_t[:, start:end])
        if not full:  # once: the whole prompt's embeddings with the vision features fused in
            embeds = model.lm.embed(ids_t)
            for token, items, what in media:
                if items:
                    features = torch.cat([vision_cache.features(model, d, p, g) for d, p, g in items])
                    embeds = scatter_vision(embeds, ids_t, token, features, what)
            full.append(embeds)
        return full[0][:, start:end]

    positions = next_position = None
    if has_media:
        pos, _ = mrope_positions(ids_t, inputs.image_grid_thw, inputs.video_grid_thw, None, config=cfg)
        positions, next_position = pos[:, 0], int(pos.max()) + 1
    points = set()
    if assistant_start:
        n = len(assistant_start)
        points = {i for i, t in enumerate(ids) if t == assistant_start[0] and i > 0}  # message starts
        turn = [i for i in points if ids[i : i + n] == assistant_start]
        if turn:
            points.add(max(turn) + n)
    snapshot_at = tuple(sorted(i for i in points if i < len(ids)))
    return Prompt(ids, key=key, embed=embed, positions=positions, next_position=next_position, snapshot_at=snapshot_at)
