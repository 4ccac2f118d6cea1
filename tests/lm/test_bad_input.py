"""Bad checkpoints and inputs give errors that say what is wrong (no deep torch tracebacks)."""

import json
import shutil

import pytest

import mm
from lm import ConfigError, WeightError


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        mm.load_model(tmp_path / "nope")


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        mm.load_model(tmp_path)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        mm.load_model(tmp_path)


def _with_config_change(checkpoints, tmp_path, change):
    """A copy of the dense text checkpoint whose config.json is edited by `change(cfg)`."""
    _, path = checkpoints("dense_text")
    ckpt = shutil.copytree(path, tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    change(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


def test_unsupported_model_type(checkpoints, tmp_path):
    ckpt = _with_config_change(checkpoints, tmp_path, lambda cfg: cfg.update(model_type="llama"))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        mm.load_model(ckpt)


def test_unsupported_rope_type(checkpoints, tmp_path):
    ckpt = _with_config_change(checkpoints, tmp_path, lambda cfg: cfg["rope_parameters"].update(rope_type="yarn"))
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        mm.load_model(ckpt)


def test_no_weight_files(checkpoints, tmp_path):
    _, path = checkpoints("dense_text")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightError, match="no safetensors weights"):
        mm.load_model(tmp_path)


def test_truncated_safetensors(checkpoints, tmp_path):
    _, path = checkpoints("dense_text")
    ckpt = shutil.copytree(path, tmp_path / "c")
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError, match="model.safetensors"):
        mm.load_model(ckpt)


def test_index_names_a_missing_shard(checkpoints, tmp_path):
    hf, _ = checkpoints("dense_text")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    next(tmp_path.glob("model-*.safetensors")).unlink()
    with pytest.raises(WeightError, match="missing"):
        mm.load_model(tmp_path)
