"""vision: the Qwen3.5 / Qwen3.6 vision tower and its weights (see docs/architecture.md)."""

from .config import VisionConfig
from .model import VisionModel
from .weights import WeightError, load_vision_weights

__all__ = ["VisionConfig", "VisionModel", "WeightError", "load_vision_weights"]
