"""The whole model's typed config: token ids plus the text and (optional) vision configs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lm.config import ConfigError, TextConfig
from vision import VisionConfig

VL_TYPES = {"qwen3_5_moe": "moe", "qwen3_5": "dense"}
TEXT_TYPES = {"qwen3_5_moe_text": "moe", "qwen3_5_text": "dense"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    text: TextConfig
    vision: VisionConfig | None  # None for the text-only (`*ForCausalLM`) checkpoints
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @property
    def spatial_merge_size(self) -> int:
        return self.vision.spatial_merge_size if self.vision else 2

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        model_type = config.get("model_type")
        if model_type not in VL_TYPES and model_type not in TEXT_TYPES:
            known = ", ".join([*VL_TYPES, *TEXT_TYPES])
            raise ConfigError(f"unsupported model_type {model_type!r}: this pipeline runs {known}")
        text = TextConfig.from_hf(config)
        vision = None
        if model_type in VL_TYPES:
            if not isinstance(config.get("vision_config"), dict):
                raise ConfigError(f"a {model_type} config needs a vision_config object")
            try:
                vision = VisionConfig.from_hf(config["vision_config"])
            except ValueError as e:
                raise ConfigError(f"vision_config: {e}") from e
            if vision.out_hidden_size != text.hidden_size:
                raise ConfigError(
                    f"vision_config.out_hidden_size {vision.out_hidden_size} != text hidden_size {text.hidden_size}"
                )
        ids = {k: int(config[k]) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                           "vision_end_token_id") if k in config}
        return cls(model_type=model_type, text=text, vision=vision, **ids)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """The config of a checkpoint directory; ConfigError naming its config.json for any value it
        cannot read (a string where a number belongs, a list where an object does, ...)."""
        config = read_config_json(path)
        try:
            return cls.from_hf(config)
        except ConfigError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"{Path(path) / 'config.json'}: a value of the wrong kind ({type(e).__name__}: {e})") from e


def read_config_json(path: str | Path) -> dict:
    """`config.json` of a checkpoint directory, with errors that say what is wrong."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model directory not found: {path}")
    if not path.is_dir():
        raise NotADirectoryError(f"a model must be a checkpoint directory, got the file {path}")
    file = path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{file} must hold a JSON object")
    return config
