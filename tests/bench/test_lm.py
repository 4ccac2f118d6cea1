"""bench/lm.py's FLOP counts, which every prefill share of bench/ttft.py divides by."""

import mm
from bench.lm import prefill_flops, weights_per_token


def test_flops_count_weights_by_shape_whatever_their_storage(checkpoints):
    """int8 / int4 storage holds bytes ([N, K / 32 blocks x 34 or 18]), not weights: a product's
    FLOPs are the same for every weight format of one checkpoint."""
    path = checkpoints("moe_text")[1]
    counted = {}
    for weights in ("fp32", "int8", "int4"):
        model = mm.load_model(path, weights=weights)
        if weights != "fp32":  # the test means something only if some matrices are stored compact
            assert any(m.fmt.name == weights for m in model.lm.modules() if hasattr(m, "fmt"))
        counted[weights] = (weights_per_token(model), prefill_flops(model, 100))
    assert counted["int8"] == counted["fp32"] and counted["int4"] == counted["fp32"]
