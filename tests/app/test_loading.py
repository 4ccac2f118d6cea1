"""The front ends' shared model arguments (app/loading.py): each default is the engine's own."""

import argparse

import pytest

from app.loading import add_model_arguments, engine_options
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
