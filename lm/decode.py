"""The CPU decode fast path: one token per row through all layers in one C++ call.

A decode step of the layer-by-layer path spends 1-2 ms in Python around its kernels (some 110
module calls, ~700 attribute look-ups, views and argument checks; the interpreter's data is cold
after each weight stream): ~5% of a batch-1 step of the benchmark model. Here the layers' weights
are gathered once per generation into a `DecodePlan` (lm/kernels/decode_step.cpp), whose `run`
does the same maths with the same kernels the layers use: per Gated DeltaNet layer a norm, the
input projections, the fused DeltaNet token step and out_proj; per attention layer a norm, the
projections, the fused norm/rotary/KV-write/attention/gate kernel and o_proj; per MLP a norm and
the fused MoE block (or a SwiGLU); the residual adds; the final norm.

`decode_logits` goes one step further for token ids (the engines' decode steps): the same plan's
`step` also gathers the embeddings, computes the rotary angles and applies the LM head, so that a
step is one call from token ids to logits; `step_tokens` takes the ids and positions as Python ints
(the engine's loop after the first decode step), so that no tensor is built in Python at all. (Every tensor operation Python runs between the weight
streams runs cache-cold, ~10-100 us each: the ~30 of the embedding, rotary, head and module calls
cost ~0.5 ms of a ~14 ms int4 step of the benchmark model.)

It applies to float32 CPU activations with the kernels on (`QWEN35_CPU_KERNELS`), at most
`kernels.MAX_ROWS` rows, DeltaNet value head dims divisible by 16 and grouped experts, with weights
in any storage format (lm/formats) and any query/KV head ratio; otherwise `decode_layers` returns
None (saying once on stderr why, when the reason is the model's shape) and the caller runs its
layers. (Every norm of the model is built with the config's rms_norm_eps, which the plan takes
once.) tests/lm/test_decode.py checks it against the reference path.
"""

from __future__ import annotations

import sys
import weakref

import torch

from . import kernels
from .attention import attention_mask_for
from .cache import Cache, KVSlot
from .formats import stored
from .linear import Linear
from .moe import SparseMoeBlock

_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Cache -> DecodePlan or None (n/a)
_step_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Cache -> its DecodePlan with ends set
_verify_buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Cache -> (tokens, its verify steps)
_said: set[str] = set()  # the reasons already said by _step_aside
_NO_TENSOR, _NO_MASK = torch.empty(0), torch.empty(0, dtype=torch.bool)


def _step_aside(reason: str) -> None:
    """No plan for this model: say why, once per reason."""
    if reason not in _said:
        _said.add(reason)
        print(f"[qwen35] the one-call CPU decode step does not apply ({reason}); decoding layer by layer",
              file=sys.stderr)


def decode_layers(model, x: torch.Tensor, cache: Cache, rope, attn_mask) -> torch.Tensor | None:
    """`model` a `TextModel`; x [B, 1, hidden] token embeddings whose position the cache has reserved.
    Returns the final-normed hidden states [B, 1, hidden], or None when the fast path does not apply."""
    plan = _plan(kernels._fusable(x), model, cache, x.shape[0])
    if plan is None:
        return None
    cos, sin = rope  # [B, 1, R]
    return plan.run(x[:, 0], _states(cache), cos[:, 0], sin[:, 0], *_keep_and_pos(cache, attn_mask))[:, None]


def decode_logits(lm, input_ids: torch.Tensor, positions: torch.Tensor, cache: Cache) -> torch.Tensor | None:
    """`lm` a `CausalLM`; input_ids [B, 1] tokens whose position the cache has reserved, positions
    [3, B, 1] their mRoPE positions. Returns the logits [B, 1, vocab] of one `DecodePlan.step`, or
    None when the fast path does not apply (the caller runs the model)."""
    plan = _step_plans.get(cache)  # after the generation's first step: no look-ups, no checks
    if plan is None:
        plan = _plan_with_ends(lm, cache, input_ids.shape[0])
        if plan is None:
            return None
    keep, pos = _keep_and_pos(cache, None if cache.lengths is not None else attention_mask_for(cache, 1))
    return plan.step(input_ids, positions, _states(cache), keep, pos)[:, None]


def verify_logits(lm, cache: Cache, tokens: list[list[int]], positions: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """A speculative verify through `DecodePlan.verify`: row b's tokens `tokens[b]` (its last pick,
    then its drafts) at mRoPE positions positions[b], positions[b] + 1, ... (all three axes, as
    generated tokens'), written at the row's next cache positions: the cache's write position after
    `cache.begin_verify()` (every row the same count of tokens), or each row's own length in a
    ragged cache (the serving engine's; rows may differ). One call for up to kernels.MAX_ROWS
    tokens; more go in calls of consecutive rows of at most that many tokens each (each call reads
    the weights once). Returns the final-normed hidden states [N, hidden] and the logits [N, vocab]
    of the N tokens in order. Each DeltaNet layer's window and state are stepped in place to those
    after each row's last token; those after its other tokens wait in the slot for `Cache.commit`.
    None when the plan does not apply (the caller runs the model: lm/serving/speculative.py)."""
    counts = [len(row) for row in tokens]
    n, ragged, most = sum(counts), cache.lengths is not None, kernels.MAX_ROWS
    if max(counts) > most or (not ragged and len(set(counts)) > 1):
        return None
    plan = _step_plans.get(cache) or _plan_with_ends(lm, cache, len(tokens))
    if plan is None:
        return None
    if ragged:
        starts, keep = cache.lengths.tolist(), _NO_MASK
    else:
        start, t = cache.length, counts[0]
        cache.begin(None, t)
        starts = [start] * len(tokens)
        keep = cache.key_mask[:, : start + t].contiguous() if cache.padded else _NO_MASK
    after = _verify_steps(cache, n)
    states, parts, first, offset = _states(cache), [], 0, 0
    while first < len(tokens):  # rows [first, last) in one call
        last, m = first, 0
        while last < len(tokens) and m + counts[last] <= most:
            m, last = m + counts[last], last + 1
        rows = range(first, last)
        offsets = [sum(counts[first:i]) for i in rows]
        parts.append(plan.verify([token for i in rows for token in tokens[i]],
                                 [positions[i] + j for i in rows for j in range(counts[i])],
                                 [state[first:last] for state in states], keep[first:last] if keep.numel() else keep,
                                 [starts[i] + j for i in rows for j in range(counts[i])],
                                 [i - first for i in rows for _ in range(counts[i])],
                                 [-1 if j == 0 else o + j - 1 for i, o in zip(rows, offsets) for j in range(counts[i])],
                                 [part[offset : offset + m] for pair in after.values() for part in pair]))  # fmt: skip
        first, offset = last, offset + m
    if not ragged:
        cache.advance(counts[0])
    cache.verify_rows = counts
    for i, pair in after.items():
        cache.slots[i].after = pair
    if len(parts) == 1:
        return parts[0][0], parts[0][1]
    return torch.cat([h for h, _ in parts]), torch.cat([lg for _, lg in parts])


def _verify_steps(cache: Cache, n: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per DeltaNet layer of the cache, buffers for each of n tokens' window and state after it ([n,
    ...] each), made once per cache and count (a verify a step: fresh ones would fault in pages)."""
    held = _verify_buffers.get(cache)
    if held is None or held[0] != n:
        held = n, {i: (slot.conv.new_empty(n, *slot.conv.shape[1:]), slot.recurrent.new_empty(n, *slot.recurrent.shape[1:]))
                   for i, slot in cache.slots.items() if not isinstance(slot, KVSlot)}  # fmt: skip
        _verify_buffers[cache] = held
    return held[1]


def _plan_with_ends(lm, cache: Cache, rows: int):
    """The cache's plan with its ends set (embedding, rotary, head): a whole step in one call; None
    when the fast path does not apply."""
    model = lm.model
    plan = _plan(kernels._fusable(model.norm.weight), model, cache, rows)
    if plan is None:
        return None
    if not plan.has_ends():  # once per generation, as the plan
        head, rotary = stored(lm.lm_head), model.rotary_emb
        plan.set_ends(_w(model.embed_tokens), rotary.inv_freq, rotary.axis, kernels.weight_arg(head))
        if rows >= kernels.panel_rows() and (copy := kernels.panels(head)).numel():
            plan.add_panels(head[0], copy)
    _step_plans[cache] = plan
    return plan


def step_tokens(cache: Cache, tokens: list[int], positions: list[int], lengths: list[int] | None = None
                ) -> torch.Tensor | None:
    """Logits [B, vocab] of one decode step from Python ints: each row's token and its position (on
    all three mRoPE axes, as a generated token's), through the plan `decode_logits` made on the
    cache's first decode step; None when the cache has none (the caller calls the model). A ragged
    cache (the serving engine's) takes each row's length too (`lengths`: cache.lengths as a list,
    read from the tensor when not given). The same step as `lm(ids, positions=..., cache=cache)`,
    with no tensor built in Python around it: each tensor operation there runs cache-cold after the
    step's weight stream (30-80 us each)."""
    plan = _step_plans.get(cache)
    if plan is None:
        return None
    cache.begin_token()
    if cache.lengths is not None:  # ragged: each row attends up to its own length, no key mask
        pos = cache.lengths.tolist() if lengths is None else lengths
        logits = plan.step_tokens(tokens, positions, _states(cache), _NO_MASK, pos)
    else:
        keep = attention_mask_for(cache, 1)
        keep = _NO_MASK if keep is None else keep.reshape(cache.batch, -1)
        logits = plan.step_tokens(tokens, positions, _states(cache), keep, [cache.length] * len(tokens))
    cache.advance(1)
    return logits


def _plan(k, model, cache: Cache, rows: int):
    """The cache's plan (built on its first step: the cache lives as long as one generation), or None."""
    if k is None or rows > kernels.MAX_ROWS:
        return None
    if cache not in _plans:
        _plans[cache] = build_plan(k, model, rows)
    return _plans[cache]


def _states(cache: Cache) -> list[torch.Tensor]:
    """The cache's tensors in the plan's order: (k, v) or (conv window, recurrent state) per layer."""
    states = []
    for slot in cache.slots.values():
        states += (slot.k, slot.v) if isinstance(slot, KVSlot) else (slot.conv, slot.recurrent)
    return states


def _keep_and_pos(cache: Cache, attn_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's key mask (empty: none) and each row's cache position of its token."""
    if cache.lengths is not None:  # ragged rows: each writes at and attends up to its own length
        return _NO_MASK, cache.lengths.contiguous()
    rows = cache.batch
    keep = _NO_MASK if attn_mask is None else attn_mask.reshape(rows, -1)
    return keep, torch.full((rows,), cache.length, dtype=torch.long)


def _w(module, name: str = "weight") -> tuple[torch.Tensor, int]:
    """`module`'s weight `name` as the plan takes it: (storage, format code; lm/formats)."""
    return kernels.weight_arg(stored(module, name))


def build_plan(k, model, rows: int):
    """The `DecodePlan` of a `TextModel`'s layers (weights by reference) for `rows` tokens per step,
    or None when one of them is outside what the fused kernels take. From kernels.panel_rows() rows
    on, the attention, DeltaNet and dense-MLP products stream panel copies of their weights."""
    cfg = model.config
    if cfg.linear_value_head_dim % 16:
        return _step_aside(f"DeltaNet value head dim {cfg.linear_value_head_dim} is no multiple of 16")
    plan = k.DecodePlan(cfg.rms_norm_eps)
    streamed = []  # the mixers and dense MLPs, whose products take panel copies (moe_decode has its own)
    for layer in model.layers:
        if layer.layer_type == "linear_attention":
            a = layer.linear_attn
            conv = a.conv1d.weight
            plan.add_deltanet(layer.input_layernorm.weight, _w(a.in_proj_qkv), _w(a.in_proj_z), _w(a.in_proj_b),
                              _w(a.in_proj_a), conv.view(conv.shape[0], -1), a.A_log, a.dt_bias, a.norm.weight,
                              _w(a.out_proj), a.num_k_heads)
        else:
            a = layer.self_attn
            projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
            biases = [_NO_TENSOR if p.bias is None else p.bias for p in projections]
            plan.add_attention(layer.input_layernorm.weight, *(_w(p) for p in projections), biases,
                               a.q_norm.weight, a.k_norm.weight, a.head_dim**-0.5)
        streamed.append(a)
        norm, mlp = layer.post_attention_layernorm.weight, layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            if not mlp.experts.grouped:
                return _step_aside("the experts run on their reference path (grouped=False)")
            shared = mlp.shared_expert
            plan.add_moe(norm, _w(mlp.gate), _w(mlp.experts, "gate_up_proj"), _w(mlp.experts, "down_proj"),
                         mlp.gate.top_k, _w(shared.gate_proj), _w(shared.up_proj), _w(shared.down_proj),
                         mlp.shared_expert_gate.weight, kernels.moe_pieces())
        else:
            plan.add_dense_mlp(norm, _w(mlp.gate_proj), _w(mlp.up_proj), _w(mlp.down_proj))
            streamed.append(mlp)
    plan.set_final_norm(model.norm.weight)
    if rows >= kernels.panel_rows():
        for module in (m for part in streamed for m in part.modules()):
            if isinstance(module, Linear) and (copy := kernels.panels(stored(module))).numel():
                plan.add_panels(module.weight, copy)
    return plan
