"""mm: the multimodal model (vision tower + LM), checkpoint loading, the processor, fusion, mRoPE
positions and the `Pipeline` that turns conversations into answers."""

from .chat import load_chat_template, split_thinking
from .config import ModelConfig
from .fusion import PlaceholderMismatchError
from .loading import load_model
from .model import VLModel
from .pipeline import PRESETS, Output, Pipeline
from .processor import ModelInputs, Processor, VideoInfo
from .rope_index import mrope_positions, token_types
from .tokenizer_check import TokenizerMismatchError

__all__ = [
    "ModelConfig", "ModelInputs", "Output", "PRESETS", "Pipeline", "PlaceholderMismatchError", "Processor",
    "TokenizerMismatchError", "VLModel", "VideoInfo", "load_chat_template", "load_model", "mrope_positions",
    "split_thinking", "token_types",
]
