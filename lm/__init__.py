"""lm: the Qwen3.5 hybrid (Gated DeltaNet + gated attention, MoE or dense) language model."""

from .cache import Cache, CacheOverflowError
from .config import ConfigError, TextConfig
from .model import CausalLM
from .weights import CheckpointReader, WeightError, load_lm_weights

__all__ = [
    "Cache", "CacheOverflowError", "CausalLM", "CheckpointReader", "ConfigError", "TextConfig",
    "WeightError", "load_lm_weights",
]
from .serving import TokenEvent, generate, stream_generate  # noqa: E402
from .sampling import Sampler, SamplingParams  # noqa: E402

__all__ += ["Sampler", "SamplingParams", "TokenEvent", "generate", "stream_generate"]
