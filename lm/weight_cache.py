"""An on-disk cache of a checkpoint's language-model weights in a compact storage format.

Quantizing a 35B checkpoint to int4 reads and converts ~70 GB of bf16 tensors; the result is ~19 GB.
`load_model` keeps that result in `$QWEN35_CACHE/weights/<key>/lm.safetensors` (default
`~/.cache/qwen35-vl`), one safetensors file of our parameter names in their storage dtypes, so the
next start reads the converted tensors instead of converting again. The key hashes the checkpoint's
weight files (names, sizes, modification times), its config.json, the weights spec, the layout of
its bf16 parts (rows, or rows in groups of 8 with the CPU kernels: lm.kernels.bf16_groups) and
FORMAT_VERSION, so a changed checkpoint or spec gets a new entry. A checkpoint keeps one entry per
spec (switching between int8 and int4 converts each once): when an entry is written, the same
checkpoint's entries of that spec with another key (stale: the checkpoint or FORMAT_VERSION
changed) and any without a readable record go. A cache file is trusted only when its
header parses and it holds exactly the model's parameters with their shapes and dtypes, its size
equals the size recorded beside it, and its marker file says it was written completely; otherwise
it is rebuilt (said on stderr).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .kernels import bf16_groups
from .weights import SAFETENSORS_DTYPES

FORMAT_VERSION = 5  # bump when a format's layout or the conversion changes (2: int4 rows in groups of 8, 3: int8's too, 4: the router in bf16, 5: bf16 rows in groups of 8)
FILE, META = "lm.safetensors", "meta.json"


def cache_root() -> Path:
    return Path(os.environ.get("QWEN35_CACHE") or Path.home() / ".cache" / "qwen35-vl") / "weights"


class WeightCache:
    """The cache entry of one (checkpoint, weights spec)."""

    def __init__(self, checkpoint: Path, weights: str):
        self.checkpoint = checkpoint.resolve()
        files = sorted(p for p in self.checkpoint.iterdir() if p.name.endswith((".safetensors", ".json")))
        described = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
        layout = ["bf16 rows in groups of 8"] if bf16_groups() else []  # the layout of the bf16 parts
        text = "\n".join([str(self.checkpoint), weights, str(FORMAT_VERSION), *layout, *described])
        self.key = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.origin = hashlib.sha256(str(self.checkpoint).encode()).hexdigest()[:8]  # same checkpoint, any key
        self.dir = cache_root() / f"{self.origin}-{self.key}"
        self.weights = weights

    @property
    def file(self) -> Path:
        return self.dir / FILE

    def load_into(self, lm: nn.Module) -> bool:
        """Copy the cached tensors into `lm`'s (allocated) parameters; False when there is no
        complete, matching entry (a damaged one is reported and removed)."""
        if not (self.dir / META).exists():
            return False
        params = dict(lm.named_parameters())
        try:
            meta = json.loads((self.dir / META).read_text())
            if meta.get("size") != self.file.stat().st_size or meta.get("key") != self.key:
                raise ValueError("its size or key differs from the record beside it")
            with safe_open(str(self.file), framework="pt") as f:
                if set(f.keys()) != set(params):
                    raise ValueError("it holds other tensors than this model's")
                for name, param in params.items():
                    t = f.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(t.get_dtype())
                    if tuple(t.get_shape()) != tuple(param.shape) or dtype != param.dtype:
                        raise ValueError(f"tensor {name} has another shape or dtype")
                with torch.no_grad():
                    for name, param in params.items():
                        param.copy_(f.get_tensor(name))
        except (OSError, ValueError, SafetensorError) as error:
            print(f"[qwen35] the converted-weights cache {self.dir} is unusable ({error}); converting again",
                  file=sys.stderr)
            shutil.rmtree(self.dir, ignore_errors=True)
            return False
        return True

    def save(self, lm: nn.Module) -> None:
        """Write `lm`'s parameters as this entry (atomically: a marker is written last) and drop
        the same checkpoint's stale entries of this spec. A failure to write is said, not raised."""
        tmp = self.dir.with_name(self.dir.name + ".tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write_safetensors(tmp / FILE, {n: p.data for n, p in lm.named_parameters()})
            size = (tmp / FILE).stat().st_size
            for old in cache_root().glob(f"{self.origin}-*"):
                if old != tmp and _spec_of(old) in (self.weights, None):
                    shutil.rmtree(old, ignore_errors=True)
            tmp.rename(self.dir)
            (self.dir / META).write_text(json.dumps(dict(key=self.key, size=size, checkpoint=str(self.checkpoint),
                                                         weights=self.weights, version=FORMAT_VERSION)))
            print(f"[qwen35] converted weights cached in {self.dir} ({size / 2**30:.2f} GiB)", file=sys.stderr)
        except OSError as error:
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"[qwen35] could not cache the converted weights in {self.dir}: {error}", file=sys.stderr)


def _spec_of(entry: Path) -> str | None:
    """The weights spec an entry was written for (its record), None when it has no readable record."""
    try:
        return json.loads((entry / META).read_text())["weights"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file written one tensor at a time from the tensors' own memory (the library's
    save_file first makes a bytes copy of every tensor: twice the model in memory)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = dict(dtype=_CODES[t.dtype], shape=list(t.shape), data_offsets=[offset, offset + size])
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(memoryview(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())
