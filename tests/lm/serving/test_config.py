"""EngineConfig: every engine option with its default written once, checked where it is made."""

import argparse

import pytest

from lm.kernels import compute
from lm.serving import EngineConfig, default_prefix_cache_bytes
from lm.serving.config import MAX_LEN_CAP


def test_options_replace_fields_and_bad_ones_are_named():
    config = EngineConfig.of(max_batch=4, step_tokens=64)
    assert (config.max_batch, config.step_tokens, config.prefill_chunk) == (4, 64, EngineConfig.prefill_chunk)
    assert EngineConfig.of(config, max_batch=2).step_tokens == 64  # on top of another config
    with pytest.raises(TypeError, match="unknown engine option.*max_batches.*known: .*max_batch"):
        EngineConfig.of(max_batches=4)
    with pytest.raises(ValueError, match="step_tokens must be >= 1"):
        EngineConfig(step_tokens=0)
    with pytest.raises(ValueError, match="prefix_cache_bytes must be >= 0"):
        EngineConfig(prefix_cache_bytes=-1)


def test_the_default_prefix_cache_leaves_room_for_activations(monkeypatch, capsys):
    """2 GiB or an eighth of the RAM, or the memory still available less 4 GiB for a long prompt's
    activations: nothing for the 35B-A3B int4 (20.4 GiB resident) on a machine of 23.5 GiB, said
    once by the engine; an explicit budget as given."""
    from lm.serving import config, scheduler

    monkeypatch.setattr(config, "ram_bytes", lambda: 47 << 29)  # 23.5 GiB
    assert default_prefix_cache_bytes(20 << 30) == 2 << 30
    assert default_prefix_cache_bytes(9 << 29) == 1 << 29 and default_prefix_cache_bytes(3 << 30) == 0
    monkeypatch.setattr(config, "available_bytes", lambda: 3 << 30)
    monkeypatch.setattr(scheduler, "available_bytes", lambda: 3 << 30)
    monkeypatch.setattr(scheduler, "ram_bytes", lambda: 47 << 29)
    monkeypatch.setattr(compute, "_said", set())
    assert EngineConfig().cache_bytes() == 0 and EngineConfig(prefix_cache_bytes=5).cache_bytes() == 5
    assert scheduler.prefix_budget(EngineConfig()) == 0 and scheduler.prefix_budget(EngineConfig()) == 0
    assert capsys.readouterr().err.count("the prefix cache gets 0 MiB") == 1
    assert scheduler.prefix_budget(EngineConfig(prefix_cache_bytes=7)) == 7


def test_derived_values_follow_the_defaults():
    assert EngineConfig().cache_bytes() == default_prefix_cache_bytes() and EngineConfig(prefix_cache_bytes=0).cache_bytes() == 0
    assert EngineConfig().slot_length(262144) == MAX_LEN_CAP and EngineConfig().slot_length(4096) == 4096
    assert EngineConfig(max_len=100).slot_length(262144) == 100


def test_the_command_line_takes_its_defaults_from_the_config():
    from app.loading import add_model_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args([])
    assert engine_options(args) == {"max_batch": EngineConfig.max_batch}  # the rest: the config's own defaults
    assert EngineConfig.of(**engine_options(parser.parse_args(["--prefix-cache-mb", "1"]))).cache_bytes() == 2**20


def test_the_pipeline_takes_a_config_or_its_fields_and_names_a_bad_one_at_once():
    from mm import Pipeline, load_model
    from mm.default_model import default_model_path
    from mm.processor import Processor

    path = default_model_path()
    model, processor = load_model(path), Processor.from_pretrained(path)
    with pytest.raises(TypeError, match="unknown engine option.*max_batches"):
        Pipeline(model, processor, engine_options={"max_batches": 2})  # before any request
    pipeline = Pipeline(model, processor, engine_options=EngineConfig(max_batch=3, step_tokens=32))
    assert pipeline.engine.config.max_batch == 3 and pipeline.engine.config.step_tokens == 32
    assert pipeline.engine.max_len == min(model.config.text.max_position_embeddings, MAX_LEN_CAP)
    pipeline.engine.close()
