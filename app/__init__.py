"""app: the front ends over `mm.Pipeline` (see docs/architecture.md): the `VQA` Python API, the Gradio
demo (`python -m app.demo`), batch video captioning (`python -m app.caption`) and the built-in model."""

from mm.default_model import RANDOM_WEIGHTS_NOTICE, default_model_path
from .vqa import VQA, Answer

__all__ = ["Answer", "RANDOM_WEIGHTS_NOTICE", "VQA", "default_model_path"]
