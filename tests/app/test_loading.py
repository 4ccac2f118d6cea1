"""The front ends' shared model arguments (app/loading.py): each default is the engine's own."""

import argparse

import pytest

from app.loading import add_model_arguments, engine_options, load_pipeline, pipeline_options
from lm.serving import default_prefix_cache_bytes


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_prefix_cache_default_is_the_engines():
    """Without --prefix-cache-mb the engine takes its own default: 2 GiB, or an eighth of the RAM."""
    assert "prefix_cache_bytes" not in engine_options(_parse())
    assert default_prefix_cache_bytes() <= 2 << 30
    assert engine_options(_parse("--prefix-cache-mb", "64"))["prefix_cache_bytes"] == 64 << 20


def test_compute_is_checked_with_its_choices(capsys):
    assert _parse("--compute", "bf16").compute == "bf16" and _parse().compute == "auto"
    with pytest.raises(SystemExit):
        _parse("--compute", "fp16")
    assert "choose from 'auto', 'fp32', 'bf16', 'int8'" in capsys.readouterr().err


def test_speculative_decoding_is_chosen_on_every_front_end(capsys):
    """--speculative mtp --num-speculative-tokens K load the checkpoint's MTP layer (the built-in
    model ships one); K beyond 1..3 is refused with the choices."""
    args = _parse("--speculative", "mtp", "--num-speculative-tokens", "3")
    options = pipeline_options(args)
    assert options["speculative"] == "mtp" and options["num_speculative_tokens"] == 3
    assert _parse().speculative is None  # off by default
    assert load_pipeline(None, **options).model.lm.num_speculative_tokens == 3
    with pytest.raises(SystemExit):
        _parse("--num-speculative-tokens", "4")
    assert "choose from 1, 2, 3" in capsys.readouterr().err
