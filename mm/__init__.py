"""mm: the multimodal model (vision tower + LM), checkpoint loading, fusion, mRoPE positions."""

from .config import ModelConfig
from .fusion import PlaceholderMismatchError
from .loading import load_model
from .model import VLModel
from .rope_index import mrope_positions, token_types

__all__ = ["ModelConfig", "PlaceholderMismatchError", "VLModel", "load_model", "mrope_positions", "token_types"]
