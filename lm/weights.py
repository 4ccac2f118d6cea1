"""Checkpoint files and the language model's weight names.

`CheckpointReader` streams tensors from `model.safetensors` or from shards (with or without
`model.safetensors.index.json`). `load_lm_weights` maps the two HF name families onto `CausalLM`:

    model.language_model.X  (VL checkpoints)      -> model.X
    model.X                 (CausalLM checkpoints) -> model.X
    lm_head.weight                                  -> lm_head.weight (absent when embeddings are tied)
    ...experts.{e}.{gate,up,down}_proj.weight       -> stacked into experts.gate_up_proj / down_proj
    mtp.*                                           -> mtp.* (the MTP layer, lm/mtp.py), read only when
                                                       the model has one (`CausalLM.add_mtp`), else skipped

Large weights may be stored in a compact format (lm/formats): `use_formats` gives their parameters
the storage of their format before the model is allocated, and each tensor is converted as it is
read, so the float32 model never exists. FP8 checkpoints (block-wise e4m3 with `*_scale_inv`) are
dequantized by the reader, tensor by tensor.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .formats import Format, tag

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype codes of the tensors this project reads and writes
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "U16": torch.uint16}  # U16: bf16 rows in groups of 8 (weight cache)
_EXPERT = re.compile(
    r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
MTP_PREFIX = "mtp."  # the multi-token-prediction layer's tensors (lm/mtp.py)


class WeightError(ValueError):
    """A checkpoint's tensors do not fit the model (missing, unexpected, mis-shaped or unreadable)."""


class CheckpointReader:
    """Name -> tensor access over a checkpoint directory's safetensors files, one tensor at a time.

    With `fp8_block` (the [rows, cols] of Qwen's FP8 checkpoints' `weight_block_size`), F8_E4M3
    tensors come back dequantized to float32 with their `<name>_scale_inv` (one scale per block),
    and the scale tensors are not listed as tensors of their own."""

    SCALE_SUFFIX = "_scale_inv"

    def __init__(self, path: str | Path, *, fp8_block: tuple[int, int] | None = None):
        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        self._file_of = self._index()
        self.fp8_block = fp8_block
        self._scales = {n for n in self._file_of if n.endswith(self.SCALE_SUFFIX)} if fp8_block else set()

    def _index(self) -> dict[str, Path]:
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise WeightError(f"{index} is not a valid safetensors index: {e}") from e
            files = {name: self.path / f for name, f in weight_map.items()}
            for f in sorted(set(files.values())):
                if not f.exists():
                    raise WeightError(f"{index} names shard {f.name}, which is missing from {self.path}")
            return files
        shards = sorted(p for p in self.path.iterdir() if ".safetensors" in p.name and p.name != INDEX_FILE)
        if not shards:
            raise WeightError(f"no safetensors weights (model.safetensors or model-*.safetensors) in {self.path}")
        files: dict[str, Path] = {}
        for shard in shards:
            for name in self._open(shard).keys():
                files[name] = shard
        return files

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise WeightError(f"cannot read {file}: truncated or not a safetensors file ({e})") from e
        return self._handles[file]

    def keys(self) -> list[str]:
        return [n for n in self._file_of if n not in self._scales]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._file_of[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of a tensor, without reading it."""
        code = self._open(self._file_of[name]).get_slice(name).get_dtype()
        return SAFETENSORS_DTYPES.get(code, torch.float32)

    def get(self, name: str) -> torch.Tensor:
        tensor = self._read(name)
        if tensor.dtype == torch.float8_e4m3fn and self.fp8_block:
            scale = name + self.SCALE_SUFFIX
            if scale not in self._file_of:
                raise WeightError(f"FP8 tensor {name!r} has no {scale!r} in {self.path}")
            return _dequantize_fp8(tensor, self._read(scale), self.fp8_block, name)
        return tensor

    def _read(self, name: str) -> torch.Tensor:
        file = self._file_of[name]
        try:
            return self._open(file).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise WeightError(f"cannot read tensor {name!r} from {file}: {e}") from e


def _dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """e4m3 weight [..., R, C] times its scale per [block] tile (`scale_inv` [..., ceil(R/br), ceil(C/bc)])
    -> float32, as Qwen's FP8 checkpoints are meant to be read (w = q * scale_inv)."""
    (br, bc), (r, c) = block, w.shape[-2:]
    expect = (*w.shape[:-2], -(-r // br), -(-c // bc))
    if tuple(scale_inv.shape) != expect:
        raise WeightError(f"FP8 scales of {name!r} have shape {list(scale_inv.shape)}, expected {list(expect)}")
    full = scale_inv.float().repeat_interleave(br, -2)[..., :r, :].repeat_interleave(bc, -1)[..., :c]
    return w.float() * full


def lm_param_name(ckpt_name: str) -> str | None:
    """Our `CausalLM` parameter name for a checkpoint tensor name, or None if it is not the LM's."""
    if ckpt_name.startswith("model.language_model."):
        return "model." + ckpt_name[len("model.language_model.") :]
    if ckpt_name.startswith("model.visual."):
        return None
    if ckpt_name.startswith(("model.", MTP_PREFIX)) or ckpt_name == "lm_head.weight":
        return ckpt_name
    return None


def read_param_name(ckpt_name: str, lm: nn.Module) -> str | None:
    """`lm_param_name` for the tensors `lm` reads: None also for the MTP layer's when `lm` has none."""
    name = lm_param_name(ckpt_name)
    return None if name is not None and name.startswith(MTP_PREFIX) and lm.mtp is None else name


def use_formats(lm: nn.Module, formats: dict[str, Format]) -> None:
    """Give each parameter named in `formats` the storage of its format (lm/formats), before the
    model is allocated (on the meta device): a weight [..., N, K] becomes [..., N, row], and its
    module holds the format as its tag (lm.formats.tag). With tied embeddings, an LM head in another
    format than the embedding table gets a table of its own."""
    params = dict(lm.named_parameters(remove_duplicate=False))
    head, table = "lm_head.weight", "model.embed_tokens.weight"
    one_table = heads_tied(lm) and formats.get(head) == formats.get(table)
    for name, fmt in formats.items():
        module_name, attr = name.rsplit(".", 1)
        tag(lm.get_submodule(module_name), attr, fmt)
        if one_table and name == head:
            continue  # the embedding table's new storage, tied again below
        old = params[name]
        storage = torch.empty(fmt.storage_shape(tuple(old.shape)), dtype=fmt.dtype, device=old.device)
        setattr(lm.get_submodule(module_name), attr, nn.Parameter(storage, requires_grad=False))
    if one_table:
        lm.tie_weights()


def heads_tied(lm: nn.Module) -> bool:
    """Whether the LM head is the embedding table itself (tied and in one format)."""
    return lm.lm_head.weight is lm.model.embed_tokens.weight


def load_lm_weights(lm: nn.Module, reader: CheckpointReader, formats: dict[str, Format] | None = None) -> set[str]:
    """Copy every LM tensor of the checkpoint into `lm`, converted to the storage format of its
    parameter (`formats`, as given to `use_formats`; the others cast to the parameter's dtype);
    return the names used.

    Raises `WeightError` naming the tensor for a missing, unexpected or mis-shaped tensor.
    """
    formats = formats or {}
    params = dict(lm.named_parameters(remove_duplicate=False))
    tied = lm.config.tie_word_embeddings
    own_head = tied and not heads_tied(lm)  # tied in the checkpoint, stored twice (two formats)
    pending = {n for n in params if not (tied and n == "lm_head.weight")}
    per_expert: dict[str, set[int]] = defaultdict(set)  # "<prefix>.gate_proj" -> experts loaded
    used: set[str] = set()
    vl_family = False
    for ckpt_name in reader.keys():
        name = read_param_name(ckpt_name, lm)
        if name is None:
            continue  # not the LM's, or the MTP layer of a model loaded without it
        used.add(ckpt_name)
        vl_family |= ckpt_name.startswith("model.language_model.")
        if tied and name == "lm_head.weight":
            continue  # same tensor as embed_tokens; some re-saves write it anyway
        expert = _EXPERT.match(name)
        if expert:
            prefix, e, kind = expert.group(1), int(expert.group(2)), expert.group(3)
            fused = _fused_name(prefix, kind)
            _copy(_expert_slice(params, prefix, e, kind, ckpt_name), reader.get(ckpt_name), ckpt_name,
                  formats.get(fused))
            per_expert[f"{prefix}.{kind}"].add(e)
        elif name in params:
            tensor = reader.get(ckpt_name)
            _copy(params[name], tensor, ckpt_name, formats.get(name))
            if own_head and name == "model.embed_tokens.weight":
                _copy(params["lm_head.weight"], tensor, ckpt_name, formats.get("lm_head.weight"))
            pending.discard(name)
        else:
            raise WeightError(f"unexpected tensor {ckpt_name!r}: the language model has no parameter {name!r}")
    missing = sorted(pending - _complete_fused(params, per_expert))
    if missing:
        _raise_missing(missing, params, per_expert, vl_family)
    return used


def _copy(param: torch.Tensor, tensor: torch.Tensor, ckpt_name: str, fmt: Format | None) -> None:
    """param <- tensor, converted to `fmt` (None: cast to param's dtype)."""
    expected = tuple(param.shape) if fmt is None else (*param.shape[:-1], fmt.inputs(param.shape[-1]))
    if tuple(tensor.shape) != expected:
        raise WeightError(f"tensor {ckpt_name!r} has shape {list(tensor.shape)}, expected {list(expected)}")
    with torch.no_grad():
        param.copy_(tensor if fmt is None else fmt.quantize(tensor))


def _fused_name(prefix: str, kind: str) -> str:
    return f"{prefix}.down_proj" if kind == "down_proj" else f"{prefix}.gate_up_proj"


def _expert_slice(params: dict, prefix: str, e: int, kind: str, ckpt_name: str) -> torch.Tensor:
    """The part of a fused expert parameter that one per-expert tensor fills."""
    fused = params.get(_fused_name(prefix, kind))
    if fused is None or e >= fused.shape[0]:
        raise WeightError(f"unexpected tensor {ckpt_name!r}: the model has no such expert")
    inter = fused.shape[1] // 2  # rows: the same in every storage format
    return {"gate_proj": fused[e, :inter], "up_proj": fused[e, inter:], "down_proj": fused[e]}[kind]


def _complete_fused(params: dict, per_expert: dict[str, set[int]]) -> set[str]:
    """Fused expert parameters fully assembled from per-expert tensors."""
    done = set()
    for key in per_expert:
        prefix = key.rsplit(".", 1)[0]
        for fused_kind, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            name = f"{prefix}.{fused_kind}"
            if all(len(per_expert.get(f"{prefix}.{p}", ())) == params[name].shape[0] for p in parts):
                done.add(name)
    return done


def _raise_missing(missing: list[str], params: dict, per_expert: dict[str, set[int]], vl_family: bool) -> None:
    names = []
    for name in missing:
        prefix, kind = name.rsplit(".", 1)
        if kind in ("gate_up_proj", "down_proj") and any(k.startswith(prefix + ".") for k in per_expert):
            parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            for part in parts:
                absent = sorted(set(range(params[name].shape[0])) - per_expert.get(f"{prefix}.{part}", set()))
                names += [f"{prefix}.{e}.{part}.weight" for e in absent]
        else:
            names.append(name)
    if vl_family:
        names = ["model.language_model." + n[len("model.") :] if n.startswith("model.") else n for n in names]
    shown = ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")
    raise WeightError(f"checkpoint is missing {len(names)} language-model tensor(s): {shown}")
