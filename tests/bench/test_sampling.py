"""bench/sampling.py runs (a small vocabulary, two rounds) and prints each figure it promises."""

import sys

from bench import sampling


def test_the_sampling_benchmark_prints_draw_top_k_and_sampler_lines(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.sampling", "--vocab", "3000", "--rows", "2", "--rounds", "2"])
    sampling.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("one draw over 3000 tokens: draw ") and "torch.multinomial" in lines[0]
    assert [line.split(":")[0] for line in lines[1:3]] == ["top-20 of 3000 logits", "top-1024 of 3000 logits"]
    assert sum(line.startswith("Sampler, 2 rows, ") for line in lines) == 3
