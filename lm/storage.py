"""Where the language model's weights live: each large weight's storage format (lm/formats/policy.py),
the model's memory (one huge-page buffer for the streamed weights, glibc's thresholds), and the
disk cache of converted weights (weight_cache.py). mm.load_model calls these for the LM part of a
checkpoint; the vision tower keeps its own storage (vision/)."""

from __future__ import annotations

import torch

from .formats import Format, policy
from .hugepages import advise_huge_pages, gather_into_huge_pages
from .kernels import bf16_groups
from .malloc import release_large_buffers
from .model import CausalLM
from .weights import CheckpointReader, heads_tied, use_formats


def checkpoint_dtype(reader: CheckpointReader) -> torch.dtype:
    """The dtype the checkpoint stores its weights in (that of its embedding table)."""
    embed = next((k for k in reader.keys() if k.endswith("embed_tokens.weight")), None)
    return reader.dtype(embed) if embed else torch.float32


def compact(device, dtype: torch.dtype) -> bool:
    """Whether storage formats apply: CPU with float32 compute."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def plan_formats(lm: CausalLM, reader: CheckpointReader, weights: str, device, dtype: torch.dtype) -> dict[str, Format]:
    """The storage format of each large LM weight under the spec `weights`; compact formats only on
    CPU with float32 compute (elsewhere only "auto" is accepted: the weights keep the model dtype)."""
    if not compact(device, dtype):
        if weights != "auto":
            raise ValueError(f"weights={weights!r} is for CPU with float32 compute; on {device} in {dtype} the "
                             "weights are stored in the model dtype (use weights='auto')")
        return {}
    shapes = {n: tuple(p.shape) for n, p in lm.named_parameters(remove_duplicate=False)}
    return policy.plan(shapes, weights, checkpoint_dtype(reader), groups=bf16_groups())


def allocate_lm(lm: CausalLM, formats: dict[str, Format], device) -> None:
    """A language model built on the meta device, allocated on `device` in place, each parameter named
    in `formats` in the storage of its format, the rest in the model's dtype; unfilled. On CPU the
    streamed weights share one buffer of huge pages (advised before the first write)."""
    use_formats(lm, formats)
    tied = heads_tied(lm)
    lm.to_empty(device=device)
    advise_huge_pages(lm.parameters())
    if torch.device(device).type == "cpu":
        gather_into_huge_pages(lm.parameters())  # all but the tiny ones, into one buffer of them
    lm.init_buffers()
    if tied:
        lm.tie_weights()


def settle_memory(model: torch.nn.Module) -> None:
    """After allocating a model of this size: glibc's mmap threshold fixed where the weights take
    most of the RAM (lm/malloc.py)."""
    release_large_buffers(sum(p.numel() * p.element_size() for p in model.parameters()))
