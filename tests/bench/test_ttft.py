"""bench/ttft.py's speedups: the median of the rounds' paired ratios (fp32 time / this format's time
in the same round), with their range."""

from bench.ttft import paired


def test_speedup_is_the_median_of_the_rounds_paired_ratios():
    # round 2 ran on a slow machine for both formats: its ratio is still 1.5
    assert paired([2.0, 4.0, 2.0], [3.0, 6.0, 3.3]) == "1.50x fp32 compute, rounds 1.50-1.65"
    # one round disturbed for one format only moves the range, not the median
    assert paired([2.0, 2.0, 2.0, 2.0, 4.0], [3.2, 3.0, 3.4, 3.0, 3.0]) == "1.50x fp32 compute, rounds 0.75-1.70"
