"""Layer maths against transformers' reference functions and against each other."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as ref

from lm.config import TextConfig
from lm.delta_rule import chunked_gated_delta_rule, gated_delta_step, recurrent_gated_delta_rule
from lm.moe import SparseMoeBlock
from lm.rotary import MRotaryEmbedding, mrope_axis_of_frequency
from tests import tiny
from tests.conftest import rel_err


def _delta_inputs(b=2, t=150, hk=2, hv=4, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, hk, dk, generator=g), torch.randn(b, t, hk, dk, generator=g)
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(b, t, hv, generator=g))
    beta = torch.rand(b, t, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("t", [1, 7, 64, 150])
def test_chunked_equals_recurrent_and_reference(t):
    q, k, v, g, beta, state = _delta_inputs(t=t)
    out_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta, state)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert rel_err(out_c, out_r) < 1e-5 and rel_err(s_c, s_r) < 1e-5
    out_ref, s_ref = ref.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert rel_err(out_r, out_ref) < 1e-5 and rel_err(s_r, s_ref) < 1e-5


def test_decode_step_updates_state_in_place_and_equals_recurrent():
    q, k, v, g, beta, state = _delta_inputs(t=1)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    live = state.clone()
    out, s = gated_delta_step(q, k, v, g, beta, live)
    assert s is live
    assert rel_err(out, out_r) < 1e-5 and rel_err(live, s_r) < 1e-5


def test_chunked_split_anywhere_equals_one_pass():
    q, k, v, g, beta, state = _delta_inputs(t=100)
    whole, s_whole = chunked_gated_delta_rule(q, k, v, g, beta, state)
    first, s1 = chunked_gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state)
    second, s2 = chunked_gated_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], s1)
    assert rel_err(torch.cat([first, second], 1), whole) < 1e-5 and rel_err(s2, s_whole) < 1e-5


def test_moe_grouped_equals_loop_over_all_experts():
    cfg = TextConfig.from_hf(tiny.text_config(True))
    block = SparseMoeBlock(cfg)
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 11, cfg.hidden_size)
    flat = x.reshape(-1, cfg.hidden_size)
    probs = torch.softmax(flat @ block.gate.weight.T, -1)
    top_w, top_i = probs.topk(cfg.num_experts_per_tok, -1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    expected = torch.zeros_like(flat)
    for e in range(cfg.num_experts):  # the naive reference: every expert, dense
        gate, up = (flat @ block.experts.gate_up_proj[e].T).chunk(2, -1)
        y = (F.silu(gate) * up) @ block.experts.down_proj[e].T
        expected += y * (top_w * (top_i == e)).sum(-1, keepdim=True)
    shared = block.shared_expert(flat) * torch.sigmoid(flat @ block.shared_expert_gate.weight.T)
    with torch.no_grad():
        assert rel_err(block(x).reshape(-1, cfg.hidden_size), expected + shared) < 1e-5


def test_interleaved_mrope_layout_of_the_real_config():
    axis = mrope_axis_of_frequency(64, (11, 11, 10))
    assert axis[1:33:3].eq(1).all() and axis[2:30:3].eq(2).all()
    assert axis.eq(0).sum() == 11 and axis.eq(1).sum() == 11 and axis.eq(2).sum() == 10


def test_rotary_matches_reference_with_distinct_rows():
    text = tiny.text_config(True)
    ours = MRotaryEmbedding(TextConfig.from_hf(text))
    from transformers import Qwen3_5MoeTextConfig

    theirs = ref.Qwen3_5MoeTextRotaryEmbedding(Qwen3_5MoeTextConfig(**text))
    positions = torch.randint(0, 300, (3, 2, 9))
    cos, sin = ours(positions, torch.float32)
    cos_ref, sin_ref = theirs(torch.zeros(1), positions)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)


def test_moe_fast_path_equals_reference_loop():
    from lm.moe import Experts

    torch.manual_seed(1)
    experts = Experts(8, 32, 16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(13, 32)  # 39 selections of 8 experts: the grouped GEMM path
    chosen = torch.stack([torch.randperm(8)[:3] for _ in range(13)])
    chosen[:, 0] = 2  # one expert gets every token, others none
    weights = torch.rand(13, 3)
    with torch.no_grad():
        fast = experts(x, chosen, weights)
        experts.grouped = False
        assert rel_err(fast, experts(x, chosen, weights)) < 1e-6


def test_decode_attention_equals_sdpa_with_gqa_and_padding():
    from lm.attention import decode_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 8, 1, 32, generator=g)
    k_buf, v_buf = torch.randn(3, 2, 50, 32, generator=g), torch.randn(3, 2, 50, 32, generator=g)
    k, v = k_buf[:, :, :40], v_buf[:, :, :40]  # a cache slice, as in decoding
    mask = torch.ones(3, 1, 1, 40, dtype=torch.bool)
    mask[1, ..., :15] = False  # left padding
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert rel_err(decode_attention(q, k, v, mask, 32**-0.5), ref) < 1e-5
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert rel_err(decode_attention(q, k, v, None, 32**-0.5), ref) < 1e-5
