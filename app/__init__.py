"""app: the front ends over `mm.Pipeline` (see docs/architecture.md): the `VQA` Python API, the Gradio
demo (`python -m app.demo`), batch video captioning (`python -m app.caption`) and the built-in model.

The names below are imported on first use, so that a module of `app` that needs no model (the
captioner's inputs and outputs, which Ray's write tasks import) loads without torch."""

from __future__ import annotations

from typing import Any

__all__ = ["Answer", "RANDOM_WEIGHTS_NOTICE", "VQA", "default_model_path"]


def __getattr__(name: str) -> Any:
    if name in ("VQA", "Answer"):
        from . import vqa

        return getattr(vqa, name)
    if name in ("RANDOM_WEIGHTS_NOTICE", "default_model_path"):
        from mm import default_model

        return getattr(default_model, name)
    raise AttributeError(f"module 'app' has no attribute {name!r}")
