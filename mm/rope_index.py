"""3-axis mRoPE position ids for prompts with images and videos (transformers' `get_rope_index`)."""

from __future__ import annotations

import itertools

import torch

from .config import ModelConfig

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_types(input_ids: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """0 for text, 1 for image placeholders, 2 for video placeholders (same shape as input_ids)."""
    types = torch.zeros_like(input_ids)
    types[input_ids == config.image_token_id] = IMAGE
    types[input_ids == config.video_token_id] = VIDEO
    return types


def mrope_positions(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    config: ModelConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [3, B, T] (rows t, h, w) and deltas [B, 1] for decoding.

    Text advances all three rows together. A run of placeholders of one image (or one 2-frame group
    of a video: each group is its own grid with t = 1) starting at position p gets t = p and
    h = p + row, w = p + column on its merged (h/2, w/2) grid; the text after it continues at
    p + max(h, w) / 2. Left padding (attention_mask 0) is skipped and gets position 0. The next
    generated token's position is `T_real + delta` = max position + 1.
    """
    merge = config.spatial_merge_size
    grids = {IMAGE: _grid_list(image_grid_thw), VIDEO: _split_video_grids(video_grid_thw)}
    cursor = {IMAGE: 0, VIDEO: 0}
    types = token_types(input_ids, config)
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
    deltas = []
    for b in range(input_ids.shape[0]):
        real = attention_mask[b].bool() if attention_mask is not None else torch.ones_like(types[b], dtype=torch.bool)
        row_types = types[b][real].tolist()
        pos = _row_positions(row_types, grids, cursor, merge)  # [3, T_real]
        positions[:, b, real] = pos.to(positions.device)
        deltas.append(int(pos.max()) + 1 - len(row_types) if row_types else 0)
    for kind, name in ((IMAGE, "image"), (VIDEO, "video frame-group")):
        if cursor[kind] != len(grids[kind]):
            raise ValueError(f"{len(grids[kind])} {name} grids given but the prompt has {cursor[kind]} such runs")
    return positions, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


def _grid_list(grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    return [] if grid_thw is None else [tuple(int(v) for v in g) for g in grid_thw.tolist()]


def _split_video_grids(grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """Each temporal group of a video is its own grid with t = 1 (timestamps separate them in the prompt)."""
    return [(1, h, w) for t, h, w in _grid_list(grid_thw) for _ in range(t)]


def _row_positions(types: list[int], grids: dict, cursor: dict, merge: int) -> torch.Tensor:
    parts, current = [], 0
    for kind, run in itertools.groupby(types):
        length = len(list(run))
        if kind == TEXT:
            parts.append(torch.arange(current, current + length).expand(3, -1))
            current += length
            continue
        if cursor[kind] >= len(grids[kind]):
            raise ValueError(f"the prompt has more {'image' if kind == IMAGE else 'video'} placeholder runs than grids")
        t, h, w = grids[kind][cursor[kind]]
        cursor[kind] += 1
        gh, gw = h // merge, w // merge
        if length != t * gh * gw:
            raise ValueError(f"a placeholder run of {length} tokens does not match its grid {t}x{h}x{w} "
                             f"({t * gh * gw} tokens)")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + current)
        current += max(gh, gw)
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(parts, dim=1)
