"""The MTP layer (lm/mtp.py), its loading, and greedy speculative decoding with it
(lm/serving/speculative.py): the same tokens as without it, and a rollback that leaves no trace."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import mm
from lm import SamplingParams, WeightError, generate, stream_generate
from lm.cache import KVSlot
from lm.delta_rule import recurrent_gated_delta_rule, stepwise_gated_delta_rule
from lm.serving import SpeculativeStats, speculative
from tests import tiny
from tests.conftest import rel_err
from tests.lm.test_layers import _delta_inputs
from tests.mm.test_model import _mm_inputs

PROMPT = torch.randint(3, 500, (1, 21), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def mtp_checkpoint(checkpoints, tmp_path_factory):
    """(kind, fused_experts) -> a tiny checkpoint directory with an MTP layer, built once."""
    made = {}

    def make(kind: str, fused_experts: bool = True):
        if (kind, fused_experts) not in made:
            hf, _ = checkpoints(kind)
            path = tiny.save(hf, tmp_path_factory.mktemp(f"mtp-{kind}"))
            made[kind, fused_experts] = tiny.add_mtp(path, fused_experts=fused_experts)
        return made[kind, fused_experts]

    return make


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _rotary(x, positions, cfg):
    """x [T, heads, D]: the first rotary_dim dims rotated (rotate-half) at text positions [T]."""
    rot = cfg.rotary_dim
    inv = cfg.rope_theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = positions[:, None].double() * inv
    cos, sin = (f(torch.cat([angles, angles], -1)).float()[:, None] for f in (torch.cos, torch.sin))
    r = x[..., :rot]
    half = torch.cat([-r[..., rot // 2 :], r[..., : rot // 2]], -1)
    return torch.cat([r * cos + half * sin, x[..., rot:]], -1)


def _attention(a, x, positions, cfg):
    t, d, heads, kv = x.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q, gate = (x @ a.q_proj.weight.T).view(t, heads, 2 * d).split(d, -1)
    k, v = (x @ a.k_proj.weight.T).view(t, kv, d), (x @ a.v_proj.weight.T).view(t, kv, d)
    q = _rotary(_rms(q, a.q_norm.weight), positions, cfg)
    k = _rotary(_rms(k, a.k_norm.weight), positions, cfg).repeat_interleave(heads // kv, 1)
    v = v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * d**-0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, heads * d)
    return (out * torch.sigmoid(gate.reshape(t, -1))) @ a.o_proj.weight.T


def _swiglu(m, x):
    return (F.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)) @ m.down_proj.weight.T


def _mlp(mlp, x, cfg):
    if not cfg.is_moe:
        return _swiglu(mlp, x)
    probs = (x @ mlp.gate.weight.T).softmax(-1)
    top = probs.topk(cfg.num_experts_per_tok, -1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    out = _swiglu(mlp.shared_expert, x) * torch.sigmoid(x @ mlp.shared_expert_gate.weight.T)
    for t in range(x.shape[0]):
        for e, w in zip(top.indices[t].tolist(), weights[t]):
            gate, up = (mlp.experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += w * (mlp.experts.down_proj[e] @ (F.silu(gate) * up))
    return out


def _mtp_equations(mtp, embeds, hidden, positions, cfg):
    """The MTP layer written out (lm/mtp.py's docstring): one sequence, float32, no cache."""
    x = torch.cat([_rms(embeds, mtp.pre_fc_norm_embedding.weight), _rms(hidden, mtp.pre_fc_norm_hidden.weight)], -1)
    x = x @ mtp.fc.weight.T
    layer = mtp.layers[0]
    x = x + _attention(layer.self_attn, _rms(x, layer.input_layernorm.weight), positions, cfg)
    x = x + _mlp(layer.mlp, _rms(x, layer.post_attention_layernorm.weight), cfg)
    return _rms(x, mtp.norm.weight)


@pytest.mark.parametrize("kind", ["moe_text", "dense_vl"])
def test_mtp_layer_equals_its_equations(mtp_checkpoint, kind):
    """A prefill of 7 positions then a decode step through the layer's own KV cache, against the
    equations over all 8 at once (float32; max error 1e-5 of the largest output)."""
    lm = mm.load_model(mtp_checkpoint(kind), speculative="mtp").lm
    cfg, g = lm.config, torch.Generator().manual_seed(3)
    embeds, hidden = (torch.randn(1, 8, cfg.hidden_size, generator=g) for _ in range(2))
    positions = torch.arange(4, 12)
    rope = [lm.model.rotary_emb(positions[None, None, s].expand(3, 1, -1), torch.float32) for s in (slice(0, 7),
                                                                                                    slice(7, 8))]
    cache = lm.mtp.make_cache(1, 8)
    with torch.no_grad():
        ours = torch.cat([lm.mtp(embeds[:, :7], hidden[:, :7], rope[0], cache),
                          lm.mtp(embeds[:, 7:], hidden[:, 7:], rope[1], cache)], dim=1)[0]  # fmt: skip
        ref = _mtp_equations(lm.mtp, embeds[0], hidden[0], positions, cfg)
    assert cache.length == 8
    assert float((ours - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_mtp_weights_load_per_expert_or_fused_and_in_compact_formats(mtp_checkpoint):
    fused = mm.load_model(mtp_checkpoint("moe_text"), speculative="mtp").lm.mtp
    split = mm.load_model(mtp_checkpoint("moe_text", fused_experts=False), speculative="mtp").lm.mtp
    ours, theirs = dict(fused.named_parameters()), dict(split.named_parameters())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    int8 = mm.load_model(mtp_checkpoint("moe_text"), speculative="mtp", weights="int8").lm
    stored = {n: p.dtype for n, p in int8.mtp.named_parameters()}
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.experts.gate_up_proj"):
        assert stored[name] == int8.model.layers[3].self_attn.q_proj.weight.dtype != torch.float32, name
    assert stored["norm.weight"] == torch.float32
    assert len(generate(int8, PROMPT, SamplingParams(max_new_tokens=6))[0]) == 6


def test_mtp_is_skipped_unless_asked(mtp_checkpoint):
    lm = mm.load_model(mtp_checkpoint("dense_vl")).lm
    assert lm.mtp is None and lm.num_speculative_tokens == 0
    assert not any(n.startswith("mtp.") for n, _ in lm.named_parameters())


def test_a_checkpoint_without_mtp_is_refused_by_name(checkpoints, mtp_checkpoint, tmp_path):
    names = r"no mtp\.\* tensors: missing mtp\.pre_fc_norm_embedding\.weight.*mtp\.fc\.weight"
    with pytest.raises(WeightError, match=names):
        mm.load_model(checkpoints("moe_text")[1], speculative="mtp")
    shutil.copytree(mtp_checkpoint("dense_vl"), tmp_path / "partial")
    tensors = load_file(str(tmp_path / "partial" / "model.safetensors"))
    del tensors["mtp.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "partial" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"missing 1 .*mtp\.layers\.0\.mlp\.up_proj\.weight"):
        mm.load_model(tmp_path / "partial", speculative="mtp")
    with pytest.raises(ValueError, match="speculative"):
        mm.load_model(tmp_path / "partial", speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        mm.load_model(mtp_checkpoint("dense_vl"), speculative="mtp", num_speculative_tokens=4)


@pytest.mark.parametrize("kind", ["moe_text", "dense_vl"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_with_mtp_equals_without(mtp_checkpoint, kind, k):
    path = mtp_checkpoint(kind)
    plain = generate(mm.load_model(path).lm, PROMPT, SamplingParams(max_new_tokens=30))[0]
    lm = mm.load_model(path, speculative="mtp", num_speculative_tokens=k).lm
    stats = SpeculativeStats()
    assert generate(lm, PROMPT, SamplingParams(max_new_tokens=30), stats=stats)[0] == plain
    assert stats.steps <= stats.drafted <= k * stats.steps
    assert stats.tokens_per_step == (stats.accepted + stats.steps) / stats.steps
    if stats.accepted == 0:  # (random weights: the drafts are wrong) token 1 from the prompt, then a step
        # per token, drafting min(k, tokens left - 1), and a last step without drafts
        assert stats.steps == 28 and stats.drafted == sum(min(k, 29 - n) for n in range(1, 29))


def _forced_drafts(monkeypatch, truth: list[list[int]], prompt_ends: list[int], wrong_last: bool = False
                   ) -> list[tuple[int, list[int]]]:  # fmt: skip
    """Make each row's drafts its true greedy continuation `truth[row]` (the MTP layer still runs, so
    its cache moves as in a real run); `prompt_ends[row]` is the position after its prompt. With
    `wrong_last`, the last draft of several is wrong in every other row (0, 2, ...). Returns, per
    step, the number of drafts and the rows drafted for."""
    real, counts = speculative.draft, []

    def forced(lm, mtp_cache, embeds, hidden, positions, mask, k, next_positions, pick=None):
        real(lm, mtp_cache, embeds, hidden, positions, mask, k, next_positions)  # greedy rows: no pick to record
        drafts, rows = [], []
        for i, at in enumerate(next_positions):
            row = next(r for r, (out, end) in enumerate(zip(truth, prompt_ends))  # the row whose token at `at`
                       if 0 <= at - end < len(out) and torch.equal(lm.embed(torch.tensor([out[at - end]]))[0],
                                                                   embeds[i, -1]))  # fmt: skip
            start = at - prompt_ends[row] + 1  # the index in truth of the token after the one at `at`
            drafts.append(truth[row][start : start + k])
            rows.append(row)
            if wrong_last and k > 1 and row % 2 == 0:
                drafts[-1][-1] = (drafts[-1][-1] + 1) % 512
        counts.append((k, rows))
        return drafts

    monkeypatch.setattr(speculative, "draft", forced)
    return counts


@pytest.mark.parametrize("kind", ["moe_text", "dense_vl"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_right_drafts_are_accepted_and_commit_several_tokens(monkeypatch, mtp_checkpoint, kind, k):
    path = mtp_checkpoint(kind)
    plain = generate(mm.load_model(path).lm, PROMPT, SamplingParams(max_new_tokens=30))[0]
    lm = mm.load_model(path, speculative="mtp", num_speculative_tokens=k).lm
    counts = _forced_drafts(monkeypatch, [plain], [PROMPT.shape[1]])
    stats = SpeculativeStats()
    events = list(stream_generate(lm, PROMPT, SamplingParams(max_new_tokens=30), stats=stats))
    assert [e.token for e in events] == plain
    assert [e.finish_reason for e in events] == [None] * 29 + ["length"]
    drafted = [n for n, _ in counts]
    assert stats.accepted == stats.drafted == sum(drafted) and stats.steps == len(counts)
    assert max(drafted) == k and stats.acceptance == 1.0
    made = 1 + sum(n + 1 for n in drafted)  # the prompt's token, then k + 1 a step
    assert made in (29, 30)  # (29: a last step without drafts)
    assert stats.tokens_per_step == (sum(drafted) + len(counts)) / len(counts)


@pytest.mark.parametrize("kind", ["moe_text", "dense_vl"])
def test_partly_right_drafts_roll_back_and_keep_the_output(monkeypatch, mtp_checkpoint, kind):
    """3 drafts a step, the last one wrong: 2 accepted, the verify's last token rolled back."""
    path = mtp_checkpoint(kind)
    params = SamplingParams(max_new_tokens=30)
    plain = generate(mm.load_model(path).lm, PROMPT, params)[0]
    lm = mm.load_model(path, speculative="mtp", num_speculative_tokens=3).lm
    counts = _forced_drafts(monkeypatch, [plain], [PROMPT.shape[1]], wrong_last=True)
    stats = SpeculativeStats()
    assert generate(lm, PROMPT, params, stats=stats)[0] == plain
    assert stats.accepted == sum(n - 1 if n > 1 else 1 for n, _ in counts)
    assert stats.drafted == sum(n for n, _ in counts)


def test_stepwise_delta_rule_keeps_each_prefix_state():
    """The verify forward's DeltaNet form: T decode steps on the state in place, the state after
    each token but the last kept; against the recurrent form of each prefix (1e-5 relative)."""
    q, k, v, g, beta, state = _delta_inputs(t=4)
    live, steps = state.clone(), []
    out, final = stepwise_gated_delta_rule(q, k, v, g, beta, live, steps)
    assert final is live and len(steps) == 3
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(live, ref_state) < 1e-5
    for n, kept in enumerate(steps, start=1):
        _, prefix = recurrent_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state)
        assert rel_err(kept, prefix) < 1e-5


def _states(cache):
    out = []
    for slot in cache.slots.values():
        out += [slot.k, slot.v] if isinstance(slot, KVSlot) else [slot.conv, slot.recurrent]
    return out


@pytest.mark.parametrize("kind", ["moe_text", "dense_text"])
def test_a_rejected_token_leaves_no_trace_in_the_caches(checkpoints, kind):
    """After a verify of [7, 8, 9] that keeps 2 tokens, every DeltaNet conv window and recurrent
    state, every KV buffer (rejected positions zeroed) and the key mask equal a cache that saw
    [7, 8] alone: within 1e-5 relative, 1e-6 absolute (a forward of 3 tokens and one of 2 round the
    same rows differently, a few float32 ulps after the layers),
    and bit for bit against a verify whose rejected token differed (dense: each row's products do
    not depend on the other rows)."""
    lm = mm.load_model(checkpoints(kind)[1]).lm

    def run(tokens, kept=None):
        cache = lm.make_cache(1, 30)
        with torch.no_grad():
            lm.hidden_states(PROMPT, cache=cache)
            if kept is not None:
                cache.begin_verify()
            lm.hidden_states(torch.tensor([tokens]), cache=cache)
            if kept is not None:
                cache.commit(kept)
            return cache

    rolled, never, other = run([7, 8, 9], kept=2), run([7, 8]), run([7, 8, 300], kept=2)
    assert rolled.length == never.length == 23 and torch.equal(rolled.key_mask, never.key_mask)
    for ours, ref, alt in zip(_states(rolled), _states(never), _states(other)):
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        if kind.startswith("dense"):
            assert torch.equal(ours, alt)
    for slot in rolled.slots.values():
        if isinstance(slot, KVSlot):
            assert not slot.k[:, :, 23:].any() and not slot.v[:, :, 23:].any()
    # and it decodes on as the cache that never saw the token
    with torch.no_grad():
        after = [lm(torch.tensor([[11]]), cache=c)[0, -1] for c in (rolled, never)]
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=1e-5)


ROUNDS = {  # rows x tokens: (tokens per row, kept per row) per round
    (2, 3): [([[7, 8, 9], [10, 11, 12]], [1, 3]), ([[13, 14, 15], [16, 17, 18]], [3, 2])],
    (3, 4): [([[7, 8, 9, 20], [10, 11, 12, 21], [30, 31, 32, 33]], [1, 4, 2]),
             ([[13, 14, 15, 22], [16, 17, 18, 23], [34, 35, 36, 37]], [4, 2, 3])],  # 12 tokens: 2 calls
}


@pytest.mark.parametrize("kind", ["moe_text", "dense_text"])
@pytest.mark.parametrize("shape", list(ROUNDS))
def test_a_verify_through_the_decode_plan_equals_the_layers_verify(checkpoints, kind, shape):
    """A left-padded batch verifies 3 tokens a row (2 rows: one plan call) or 4 (3 rows: 12 tokens,
    two calls of at most 8) twice, through the decode plan (lm/decode.py verify_logits) and through
    the layers: hidden states and logits within 1e-5 relative (the kernels sum in another order),
    and after each round's commit every DeltaNet window and state, KV buffer and the key mask as the
    layers leave them."""
    from lm import decode

    lm = mm.load_model(checkpoints(kind)[1]).lm
    rows, t = shape
    ids, mask = _left_padded(BATCH[:rows])
    caches, outputs = [], []
    for through_plan in (True, False):
        cache, seen = lm.make_cache(rows, 60), []
        with torch.no_grad():
            lm.hidden_states(ids, attention_mask=mask, cache=cache)
            at = [int(m.sum()) for m in mask]
            for tokens, kept in ROUNDS[shape]:
                cache.begin_verify()
                if through_plan:
                    verified = decode.verify_logits(lm, cache, tokens, at)
                    assert verified is not None
                    verified = tuple(part.view(rows, t, -1) for part in verified)
                else:
                    pos = (torch.tensor(at)[:, None] + torch.arange(t))[None].expand(3, -1, -1)
                    hidden = lm.hidden_states(torch.tensor(tokens), positions=pos, cache=cache)
                    verified = hidden, lm.lm_head(hidden)
                seen.append(verified)
                cache.commit(kept)
                at = [a + n for a, n in zip(at, kept)]
        caches.append(cache)
        outputs.append(seen)
    for (hidden, logits), (ref_hidden, ref_logits) in zip(*outputs):
        assert rel_err(hidden, ref_hidden) < 1e-5 and rel_err(logits, ref_logits) < 1e-5
    plan, layers = caches
    assert plan.length == layers.length and torch.equal(plan.key_mask, layers.key_mask)
    for ours, ref in zip(_states(plan), _states(layers)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_drafting_leaves_the_mtp_cache_with_the_committed_positions_only(mtp_checkpoint):
    lm = mm.load_model(mtp_checkpoint("dense_vl"), speculative="mtp", num_speculative_tokens=3).lm
    cfg, g = lm.config, torch.Generator().manual_seed(4)
    embeds, hidden = (torch.randn(1, 5, cfg.hidden_size, generator=g) for _ in range(2))
    cache, fresh = lm.mtp.make_cache(1, 12), lm.mtp.make_cache(1, 12)
    positions = torch.arange(5)[None, None].expand(3, 1, 5)
    with torch.no_grad():
        drafts = speculative.draft(lm, cache, embeds, hidden, positions, torch.ones(1, 5), 3, [5])
        lm.mtp(embeds, hidden, lm.model.rotary_emb(positions, torch.float32), fresh)
    assert len(drafts) == 1 and len(drafts[0]) == 3 and cache.length == fresh.length == 5
    assert torch.equal(cache.key_mask, fresh.key_mask)
    assert all(torch.equal(a, b) for a, b in zip(_states(cache), _states(fresh)))


def test_a_constrained_generation_is_refused_with_or_without_mtp(mtp_checkpoint):
    """Rules live in mm.Pipeline's engine; stream_generate refuses a constrained row either way."""
    path = mtp_checkpoint("moe_text")
    for lm in (mm.load_model(path).lm, mm.load_model(path, speculative="mtp").lm):
        with pytest.raises(ValueError, match="enforced by a rule: generate through mm.Pipeline"):
            generate(lm, PROMPT, SamplingParams(max_new_tokens=6, regex="a+"))


CHI2_7_DOF = 24.32  # chi-square bound at p = 0.001 for 7 degrees of freedom (8 tokens)
CHI2_4_DOF = 18.47  # ... for 4


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic of `counts` against `expected` counts (cells with none expected left out)."""
    cells = expected > 0
    return float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())


def _homogeneity(a: list[int], b: list[int], tokens: list[int]) -> float:
    """The chi-square statistic of two samples over `tokens` (same law?); dof len(tokens) - 1."""
    table = torch.tensor([[a.count(t), b.count(t)] for t in tokens], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return _chi2(table.flatten(), expected.flatten())


def test_speculative_pick_keeps_a_draft_with_probability_min_1_p_over_q():
    """The acceptance probability is min(1, p(d) / q(d)) for each draft d (within 4.5 binomial
    standard deviations over 4,000 trials each), and a draft from q followed by the pick is
    distributed as p (chi-square, 4 dof, under the p = 0.001 bound, fixed seed); the drafts
    themselves (q) are far from p under the same test, so it can fail."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.4, 0.1, 0.1, 0.0, 0.3], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for d in (0, 1, 2, 3, 5):
        kept = sum(speculative.speculative_pick(p, q, d, g)[1] for _ in range(4000))
        rate = min(1.0, float(p[d] / q[d]))
        assert abs(kept / 4000 - rate) <= 4.5 * (rate * (1 - rate) / 4000) ** 0.5 + 1e-9, (d, kept, rate)
    n = 20000
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    picks = [speculative.speculative_pick(p, q, d, g)[0] for d in drafts]
    counts = torch.bincount(torch.tensor(picks), minlength=6).double()
    assert counts[5] == 0  # p gives it nothing, whatever q does
    assert _chi2(counts, n * p) < CHI2_4_DOF
    assert _chi2(torch.bincount(torch.tensor(drafts), minlength=6).double(), n * p) > 100 * CHI2_4_DOF


@pytest.mark.slow
def test_sampled_tokens_with_mtp_follow_the_distribution_without(monkeypatch, mtp_checkpoint):
    """A tiny vocabulary (logit_bias leaves 8 tokens) at temperature 0.1: the 2nd and 3rd tokens
    (the first two a verify decides, K = 2) of 2,000 seeded rows with MTP against 2,000 without:
    the same law (chi-square homogeneity, 7 dof, under the p = 0.001 bound; fixed seeds, so the
    test is deterministic); drafts are both kept and rejected; a greedy row in the same batch gives
    the greedy tokens. Keeping every draft (q's law instead of p's) breaks the bound."""
    path = mtp_checkpoint("moe_text")
    plain, lm = mm.load_model(path).lm, mm.load_model(path, speculative="mtp", num_speculative_tokens=2).lm
    tokens, n = list(range(40, 48)), 2000
    bias = {t: -100.0 for t in range(512) if t not in tokens}
    prompts = PROMPT.expand(n, -1)

    def params(offset: int) -> list[SamplingParams]:
        return [SamplingParams(max_new_tokens=3, temperature=0.1, seed=offset + s, logit_bias=bias) for s in range(n)]

    greedy = SamplingParams(max_new_tokens=3)
    stats = SpeculativeStats()
    ours = generate(lm, prompts, [greedy, *params(0)[1:]], stats=stats)
    theirs = generate(plain, prompts, params(10**6))
    assert ours[0] == generate(plain, PROMPT, greedy)[0]
    assert 0.1 < stats.acceptance < 0.9, stats
    for at in (1, 2):
        assert _homogeneity([o[at] for o in ours[1:]], [o[at] for o in theirs], tokens) < CHI2_7_DOF, at
    monkeypatch.setattr(speculative, "speculative_pick", lambda p, q, d, g=None: (d, True))
    wrong = generate(lm, prompts, params(0))
    assert _homogeneity([o[1] for o in wrong], [o[1] for o in theirs], tokens) > CHI2_7_DOF


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    return ids, mask


BATCH = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 30, 17)]


@pytest.mark.parametrize("kind", ["moe_text", "dense_vl"])
def test_a_left_padded_batch_with_mtp_equals_each_prompt_alone(mtp_checkpoint, kind):
    path = mtp_checkpoint(kind)
    plain = mm.load_model(path).lm
    lm = mm.load_model(path, speculative="mtp", num_speculative_tokens=2).lm
    ids, mask = _left_padded(BATCH)
    params = [SamplingParams(max_new_tokens=n) for n in (12, 20, 5)]  # rows finish at different steps
    stats = SpeculativeStats()
    batched = generate(lm, ids, params, attention_mask=mask, stats=stats)
    assert batched == [generate(plain, p[None], q)[0] for p, q in zip(BATCH, params)]
    assert stats.steps > 0


@pytest.mark.parametrize("kind", ["moe_text", "dense_vl"])
def test_rows_accept_their_own_drafts(monkeypatch, mtp_checkpoint, kind):
    """Rows 0 and 2 accept 2 of 3 drafts a step, row 1 all 3: the rejected positions become holes
    in rows 0 and 2, and every row's output is still its greedy output alone."""
    path = mtp_checkpoint(kind)
    plain = mm.load_model(path).lm
    lm = mm.load_model(path, speculative="mtp", num_speculative_tokens=3).lm
    ids, mask = _left_padded(BATCH)
    params = SamplingParams(max_new_tokens=16)
    truth = [generate(plain, p[None], params)[0] for p in BATCH]
    counts = _forced_drafts(monkeypatch, truth, [len(p) for p in BATCH], wrong_last=True)
    stats = SpeculativeStats()
    assert generate(lm, ids, params, attention_mask=mask, stats=stats) == truth
    assert stats.drafted == sum(n * len(rows) for n, rows in counts)
    assert stats.accepted == sum(n - (n > 1 and row % 2 == 0) for n, rows in counts for row in rows)
    assert {row for _, rows in counts for row in rows} == {0, 1, 2} and len(counts[-1][1]) < 3  # row 1 ends first


def test_commit_keeps_each_rows_own_prefix(checkpoints):
    """A batch of 2 verifies 3 tokens each, keeping 1 and 3: row 0 holds holes at the 2 positions it
    dropped (zeroed, masked out) and its DeltaNet states equal row 0 run alone keeping 1 (within
    1e-6 of each tensor's largest value, a few float32 ulps: other row counts round differently in
    the projections), row 1 equals itself run alone."""
    lm = mm.load_model(checkpoints("dense_text")[1]).lm
    prompts, verify = PROMPT.repeat(2, 1), torch.tensor([[7, 8, 9], [10, 11, 12]])

    def run(rows, kept):
        cache = lm.make_cache(len(rows), 30)
        with torch.no_grad():
            lm.hidden_states(prompts[rows], cache=cache)
            cache.begin_verify()
            lm.hidden_states(verify[rows], cache=cache)
            cache.commit(kept)
        return cache

    both, first, second = run([0, 1], [1, 3]), run([0], 1), run([1], 3)
    assert both.length == 24 and first.length == 22 and both.padded
    assert both.key_mask[0, :24].tolist() == [True] * 22 + [False] * 2 and both.key_mask[1, :24].all()
    for ours, a, b in zip(_states(both), _states(first), _states(second)):
        ulps = 1e-6 * max(1.0, float(b.abs().max()), float(a.abs().max()))
        torch.testing.assert_close(ours[1:], b, rtol=0, atol=ulps)
        if ours.dim() == 4 and ours.shape[2] == 30:  # KV [B, KV, L, D]
            torch.testing.assert_close(ours[:1, :, :22], a[:, :, :22], rtol=0, atol=ulps)
            assert not ours[0, :, 22:].any()
        else:
            torch.testing.assert_close(ours[:1], a, rtol=0, atol=ulps)


def test_left_padding_and_the_vl_model_generate(mtp_checkpoint):
    path = mtp_checkpoint("dense_vl")
    plain, model = mm.load_model(path), mm.load_model(path, speculative="mtp", num_speculative_tokens=2)
    ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), PROMPT], 1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(PROMPT)], 1)
    stats = SpeculativeStats()
    ours = list(model.stream_generate(ids, SamplingParams(max_new_tokens=12), attention_mask=mask, stats=stats))
    assert [e.token for e in ours] == plain.generate(PROMPT, max_new_tokens=12)[0]
    assert stats.steps > 0


def test_image_and_video_prompts_with_mtp_equal_without(monkeypatch, mtp_checkpoint):
    """A left-padded batch with two images in one row and a video in the other: the MTP layer takes
    the fused embeddings and the mRoPE positions; with its own drafts and with right drafts (the
    last of two wrong in row 0), the output is the output without it."""
    path, x = mtp_checkpoint("moe_vl"), _mm_inputs()
    plain = mm.load_model(path).generate(max_new_tokens=10, **x)
    model = mm.load_model(path, speculative="mtp", num_speculative_tokens=2)
    stats = SpeculativeStats()
    assert model.generate(max_new_tokens=10, stats=stats, **x) == plain and stats.steps > 0
    positions, _ = mm.mrope_positions(x["input_ids"], x["image_grid_thw"], x["video_grid_thw"], x["attention_mask"],
                                      config=model.config)  # fmt: skip
    ends = (positions.masked_fill(~x["attention_mask"].bool()[None], 0).amax(dim=(0, 2)) + 1).tolist()
    counts = _forced_drafts(monkeypatch, plain, ends, wrong_last=True)
    stats = SpeculativeStats()
    assert model.generate(max_new_tokens=10, stats=stats, **x) == plain
    assert stats.accepted == sum(n - (n > 1 and row % 2 == 0) for n, rows in counts for row in rows) > 0


def test_a_stop_inside_accepted_drafts_ends_the_row_there(monkeypatch, mtp_checkpoint):
    """With right drafts a step commits 4 tokens; a stop token, EOS or `stop_when` among them ends
    the output at that token, as without drafts."""
    path = mtp_checkpoint("dense_vl")
    params = SamplingParams(max_new_tokens=30)
    plain = generate(mm.load_model(path).lm, PROMPT, params)[0]
    lm = mm.load_model(path, speculative="mtp", num_speculative_tokens=3).lm
    _forced_drafts(monkeypatch, [plain], [PROMPT.shape[1]])
    first = next(i for i, t in enumerate(plain) if i >= 6 and plain.index(t) == i)  # a token of a later step
    stop = plain[first]
    for kwargs in (dict(params=SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))),
                   dict(params=params, eos_token_ids=(stop,)),
                   dict(params=params, stop_when=lambda row, tokens: tokens[-1] == stop)):
        events = list(stream_generate(lm, PROMPT, **kwargs))
        assert [e.token for e in events] == plain[: first + 1]
        assert [e.finish_reason for e in events] == [None] * first + ["stop"]
