"""Shared fixtures: tiny random reference models (transformers) and their saved checkpoints."""

from __future__ import annotations

import pytest
import torch

from tests import tiny


@pytest.fixture(autouse=True, scope="session")
def _quiet_and_deterministic():
    torch.manual_seed(0)
    import transformers

    transformers.logging.set_verbosity_error()


class _Checkpoints:
    """Builds each kind of tiny checkpoint once per session: `(hf_model, directory)`."""

    def __init__(self, root):
        self.root, self.cache = root, {}

    def __call__(self, kind: str):
        if kind not in self.cache:
            model = tiny.hf_model(kind)
            self.cache[kind] = (model, tiny.save(model, self.root / kind))
        return self.cache[kind]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> _Checkpoints:
    return _Checkpoints(tmp_path_factory.mktemp("checkpoints"))


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def q8_0_round(v: torch.Tensor) -> torch.Tensor:
    """v [..., K] rounded to GGUF Q8_0 blocks of 32 (scale max|v| / 127), back in float32: the
    activations the int8 dot products take (lm/kernels/int8_dot.h)."""
    blocks = v.reshape(*v.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / d) * d).reshape(v.shape)


def count_step_tokens(monkeypatch, module) -> list[bool]:
    """A list that records, for each call of `module.step_tokens` from now on (the generation
    core's, lm/serving/runner.py), whether the CPU plan took the step (lm.decode.step_tokens gave logits)."""
    from lm.decode import step_tokens

    taken = []

    def counting(*args):
        out = step_tokens(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(module, "step_tokens", counting)
    return taken


@pytest.fixture(scope="session")
def tokenizer_checkpoint(tmp_path_factory):
    """A directory with the small real tokenizer, chat template and processor configs (no weights)."""
    from app.tokenizer_files import write_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_checkpoint)
