"""A llama.cpp GGUF file of a Qwen3.5 / Qwen3.6 language model (`qwen35`, `qwen35moe`), read through
the `gguf` package's memory map (the file is never copied whole; each tensor is read as it is used).

`GGUFFile(path)` checks the architecture, gives the hyper-parameters as a Hugging Face text config
dict (`hf_config`), and each tensor as float32 (`float_tensor`) or, for Q8_0 / Q4_0 / Q4_K / Q5_K /
Q6_K, as its GGUF blocks (`blocks`, uint8 [..., N, bytes of a row], rows as in the file). Q8_K is
read too (lm/gguf_kquants.py: dequantized, converted at load by the caller).
Other tensor types (Q5_0, IQ*, TQ*, ...) are refused by name unless `dequantize_unsupported`. A model split
in parts (`NAME-00001-of-0000N.gguf`, llama.cpp's `split.count`) is read from its first part's path.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import torch

from . import gguf_kquants
from .weights import WeightError

ARCHITECTURES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}
SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = ("Q8_0", "Q4_0")  # our int8 / int4 storage (lm/formats/blocks.py)
READ_TYPES = FLOAT_TYPES + BLOCK_TYPES + gguf_kquants.KQUANT_TYPES


class GGUFFile:
    """Name -> tensor access over one GGUF file (module docstring)."""

    def __init__(self, path: str | Path, *, dequantize_unsupported: bool = False, quiet: bool = False,
                 architectures: tuple[str, ...] = tuple(ARCHITECTURES)):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the package raises ValueError, IndexError, ... on a damaged file
            raise WeightError(f"cannot read {self.path}: truncated or not a GGUF file ({type(e).__name__}: {e})") from e
        self.arch = self.value("general.architecture")
        if self.arch not in architectures:
            raise WeightError(f"{self.path}: GGUF architecture {self.arch!r} is not supported here; this pipeline reads "
                              f"{', '.join(architectures)} (llama.cpp's Qwen3.5 / Qwen3.6 files)")
        self.tensors = {t.name: t for t in self.reader.tensors}
        for part in self._other_parts():
            try:
                self.tensors.update({t.name: t for t in gguf.GGUFReader(part, "r").tensors})
            except Exception as e:
                raise WeightError(f"cannot read {part}: truncated or not a GGUF file ({type(e).__name__}: {e})") from e
        self._check_types(dequantize_unsupported, quiet)

    def _other_parts(self) -> list[Path]:
        """The files after the first of a split model (`NAME-00001-of-0000N.gguf`, `split.count`)."""
        count = int(self.value("split.count", 1) or 1)
        if count == 1:
            return []
        m = SPLIT_NAME.match(self.path.name)
        if m is None or int(m.group(2)) != 1 or int(m.group(3)) != count:
            raise WeightError(f"{self.path}: part of a model split in {count} files: give its first part, "
                              "NAME-00001-of-" f"{count:05d}.gguf")
        parts = [self.path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)]
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise WeightError(f"{self.path}: split model parts missing from {self.path.parent}: {', '.join(missing)}")
        return parts

    def _check_types(self, dequantize_unsupported: bool, quiet: bool) -> None:
        other = {n: t.tensor_type.name for n, t in self.tensors.items()
                 if t.tensor_type.name not in READ_TYPES}
        if other and not dequantize_unsupported:
            shown = ", ".join(f"{n} ({t})" for n, t in list(other.items())[:8])
            raise WeightError(f"{self.path}: {len(other)} tensor(s) in a type this pipeline does not read: {shown}; "
                              f"it reads {', '.join(READ_TYPES)} (pass dequantize_unsupported=True / "
                              "--dequantize-unsupported to dequantize the others to float)")
        if other and not quiet:
            print(f"[qwen35] {self.path.name}: dequantizing {len(other)} tensor(s) of type(s) "
                  f"{', '.join(sorted(set(other.values())))} to float (dequantize_unsupported)", file=sys.stderr)

    def value(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str):
        value = self.value(key)
        if value is None:
            raise WeightError(f"{self.path}: GGUF metadata has no {key!r}")
        return value

    def type_of(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape in PyTorch order ([..., N, K])."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def float_tensor(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor in float32, [..., N, K] (F16 / BF16 / Q8_0 / Q4_0 exactly, the K-quants as
        `gguf.quants.dequantize` does; other types through it); with `index`, only its slice
        `index` along the first dimension (one expert of [E, N, K])."""
        import gguf

        t = self.tensors[name]
        kind, data, shape = t.tensor_type.name, t.data, self.shape(name)
        if index is not None:
            data, shape = data[index], shape[1:]
        if kind in ("F32", "F16"):
            out = np.array(data, dtype=np.float32)
        elif kind == "BF16":
            raw = torch.from_numpy(np.array(data).view(np.uint16).astype(np.int16))
            return raw.view(torch.bfloat16).float().reshape(shape)
        elif kind in gguf_kquants.KQUANT_TYPES:
            return gguf_kquants.dequantize(torch.from_numpy(np.array(data, dtype=np.uint8)), kind).reshape(shape)
        else:
            out = gguf.quants.dequantize(np.asarray(data), t.tensor_type).astype(np.float32)
        return torch.from_numpy(out).reshape(shape)

    def blocks(self, name: str) -> torch.Tensor:
        """A Q8_0 / Q4_0 tensor's GGUF blocks, or a Q4_K / Q5_K / Q6_K tensor's super-blocks, uint8
        [..., N, bytes of a row], rows as in the file."""
        t = self.tensors[name]
        if t.tensor_type.name not in BLOCK_TYPES + gguf_kquants.KEPT:
            raise ValueError(f"{name} is {t.tensor_type.name}, not a block type")
        shape = self.shape(name)
        return torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(*shape[:-1], -1)

    def hf_config(self) -> dict:
        """The hyper-parameters as a Hugging Face text config (`lm.config.TextConfig.from_hf`)."""
        a = self.arch
        get, need = (lambda k, d=None: self.value(f"{a}.{k}", d)), (lambda k: self.require(f"{a}.{k}"))
        n_layers = int(need("block_count")) - int(get("nextn_predict_layers", 0) or 0)
        recurrent = get("attention.recurrent_layers")
        if recurrent is not None:
            types = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:n_layers]]
        else:
            interval = int(get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        head_dim = int(need("attention.key_length"))
        k_heads, v_heads = int(need("ssm.group_count")), int(need("ssm.time_step_rank"))
        section = [int(s) for s in need("rope.dimension_sections")]
        config = dict(
            model_type=ARCHITECTURES[a],
            vocab_size=self._vocab_size(),
            hidden_size=int(need("embedding_length")),
            num_hidden_layers=n_layers,
            layer_types=types,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            num_attention_heads=int(need("attention.head_count")),
            num_key_value_heads=int(need("attention.head_count_kv")),
            head_dim=head_dim,
            linear_num_key_heads=k_heads,
            linear_num_value_heads=v_heads,
            linear_key_head_dim=int(need("ssm.state_size")),
            linear_value_head_dim=int(need("ssm.inner_size")) // v_heads,
            linear_conv_kernel_dim=int(need("ssm.conv_kernel")),
            max_position_embeddings=int(get("context_length", 262144)),
            tie_word_embeddings="output.weight" not in self.tensors,
            rope_parameters=dict(rope_type="default", rope_theta=float(need("rope.freq_base")),
                                 partial_rotary_factor=int(need("rope.dimension_count")) / head_dim,
                                 mrope_section=section[:3], mrope_interleaved=True),
        )
        eos = self.value("tokenizer.ggml.eos_token_id")
        if eos is not None:
            config["eos_token_id"] = int(eos)
        if a == "qwen35moe":
            config.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                          moe_intermediate_size=int(need("expert_feed_forward_length")),
                          shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)))
        else:
            config["intermediate_size"] = int(need("feed_forward_length"))
        return config

    def _vocab_size(self) -> int:
        if "token_embd.weight" not in self.tensors:
            raise WeightError(f"{self.path}: no token_embd.weight tensor")
        return self.shape("token_embd.weight")[0]
