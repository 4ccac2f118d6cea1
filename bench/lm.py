"""Language-model speed: our engine against transformers on the same random weights, in one process.

    python -m bench.lm [--quick]

Builds a float32 Qwen3.5-MoE text model with the real proportions scaled down (hidden 1024, 16 layers
= 12 Gated DeltaNet + 4 gated attention, 64 experts top-8 of width 256 plus a shared expert, head_dim
256, 8 q / 2 kv heads, DeltaNet 8 key / 16 value heads of dim 128, vocab 32768), saves it as a real
checkpoint and loads it with `mm.load_model`. Prints prefill and decode speed for both, the ratio, and
the share of the physical limit: decode = bytes touched per step (weights, and the cache it reads and
writes) / measured read bandwidth; prefill = matmul FLOPs / measured float32 matmul FLOP/s.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import lm.model
from bench.limits import ReadBandwidth, best_time, matmul_flops
from lm import SamplingParams, stream_generate
from lm.delta_rule import CHUNK_SIZE

CONFIG = dict(
    model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], vocab_size=32768,
    hidden_size=1024, num_hidden_layers=16, full_attention_interval=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
    shared_expert_intermediate_size=256, rms_norm_eps=1e-6, max_position_embeddings=16384,
    tie_word_embeddings=False, eos_token_id=None,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
)


def build(workdir: Path):
    """(transformers model, our model) with identical random weights, via a saved checkpoint."""
    import transformers

    import mm

    config = transformers.AutoConfig.for_model(**CONFIG)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(workdir)
    return hf, mm.load_model(workdir)


# ---------------------------------------------------------------- physical limits of this model


def weight_bytes_per_step(model, experts_touched_per_layer: float) -> float:
    """Bytes of weights one decode step reads, in their storage format: everything but the
    embedding table and unused experts. A head tied to the embedding table is counted: it streams."""
    total, per_expert = 0, 0  # per_expert: one expert's bytes in every layer
    for name, p in model.lm.named_parameters(remove_duplicate=False):
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            per_expert += p[0].numel() * p.element_size()
            continue
        if "embed_tokens" not in name:
            total += p.numel() * p.element_size()
    return total + experts_touched_per_layer * per_expert


def cache_bytes_per_step(model, batch: int, context: int) -> float:
    """Bytes of the cache one decode step of `batch` rows touches at `context` tokens, in float32 as
    it is held: each DeltaNet layer reads and writes its recurrent state [Hv, Dk, Dv] and conv window;
    each attention layer reads its keys and values up to `context` and writes one position."""
    cfg = model.config.text
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    deltanet = 2 * (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
                    + (cfg.linear_conv_kernel_dim - 1) * conv_dim)
    attention = 2 * cfg.num_key_value_heads * cfg.head_dim * (context + 1)
    layers = len(cfg.linear_attention_layers) * deltanet + len(cfg.full_attention_layers) * attention
    return 4.0 * batch * layers


def weights_per_token(model) -> tuple[int, int]:
    """(weights of the 2-D products one token goes through, without the embedding table and the
    LM head; weights of its top-k experts)."""
    cfg = model.config.text
    # a Linear's weights by its shape (int8 / int4 storage holds bytes, not weights); other matrices
    # (the routers, kept in float) by their size
    linears = {n: m for n, m in model.lm.named_modules() if isinstance(m, torch.nn.Linear)}
    dense = sum(m.in_features * m.out_features for n, m in linears.items() if "lm_head" not in n)
    dense += sum(p.numel() for n, p in model.lm.named_parameters()
                 if p.ndim == 2 and n.rpartition(".")[0] not in linears and "embed_tokens" not in n)
    experts = cfg.num_hidden_layers * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return dense, experts


def prefill_flops(model, tokens: int) -> float:
    """Matmul FLOPs of a prefill: active weights x tokens, attention scores, DeltaNet chunk maths."""
    cfg = model.config.text
    head = cfg.hidden_size * cfg.vocab_size
    flops = 2 * tokens * sum(weights_per_token(model)) + 2 * head  # lm_head: last token only
    n_full = len(cfg.full_attention_layers)
    flops += n_full * 2 * 2 * (tokens * tokens / 2) * cfg.num_attention_heads * cfg.head_dim  # QK^T, PV (causal)
    c, hv, dk, dv = CHUNK_SIZE, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per_chunk = 2 * hv * (c * c * dk * 2 + c * c * dv + c * c * (dv + dk) + 2 * c * dk * dv * 2 + c * c * dv)
    flops += len(cfg.linear_attention_layers) * per_chunk * (tokens / c)
    return flops


def decode_flops(model, batch: int) -> float:
    """Matmul FLOPs of one decode step of `batch` rows (each row through its top-k experts and the LM head)."""
    cfg = model.config.text
    return 2 * batch * (sum(weights_per_token(model)) + cfg.hidden_size * cfg.vocab_size)


class ExpertCounter:
    """Counts distinct experts per MoE block call in decode steps, recomputing the routing in a
    forward pre-hook. Use it on an untimed run: while it counts, decode steps go through the layer
    modules (the fast paths of lm/decode.py call the kernels without them, so no hook would run)."""

    def __init__(self, model):
        self.counts: list[int] = []
        self.hooks = [m.register_forward_pre_hook(self._hook) for n, m in model.lm.named_modules()
                      if n.endswith(".mlp") and hasattr(m, "gate")]
        self._fast = lm.model.decode_layers, lm.model.decode_logits
        lm.model.decode_layers = lm.model.decode_logits = lambda *args: None  # "does not apply": the layers run

    def _hook(self, module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        if args[0].dim() == 3 and args[0].shape[1] == 1:  # a decode step [B, 1, H], not a prompt
            experts, _ = module.gate(x)
            self.counts.append(int(experts.unique().numel()))

    def mean(self) -> float:
        return sum(self.counts) / max(1, len(self.counts))

    def close(self):
        for h in self.hooks:
            h.remove()
        lm.model.decode_layers, lm.model.decode_logits = self._fast


# ---------------------------------------------------------------- timings


def ours_prefill(model, ids) -> float:
    """Time to the first token through our engine (its chunked prefill, then one sample)."""

    def run():
        next(stream_generate(model.lm, ids, SamplingParams(max_new_tokens=1)))

    return best_time(run, repeats=2, warmup=1)


def hf_prefill(hf, ids) -> float:
    def run():
        with torch.no_grad():
            hf(input_ids=ids, logits_to_keep=1, use_cache=True)

    return best_time(run, repeats=2, warmup=1)


def ours_decode(model, ids, new_tokens: int, repeats: int = 3) -> float:
    """Seconds per decode step (first token excluded: it comes from the prefill); best of `repeats`."""
    params = SamplingParams(max_new_tokens=new_tokens)
    best = float("inf")
    for _ in range(repeats):
        stamps = []
        for event in stream_generate(model.lm, ids, params):
            if event.row == 0:
                stamps.append(time.perf_counter())
        best = min(best, (stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return best


def hf_decode(hf, ids, new_tokens: int, repeats: int = 3) -> float:
    def gen(n):
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - start

    return min((gen(new_tokens + 1) - gen(1)) / new_tokens for _ in range(repeats))


class Limits:
    """The machine's limits. This machine's speed drifts (its streaming read rate swings between
    ~40 and ~78 GB/s from one second to the next), so each figure is related to the limits measured
    right before and right after it (the better of the two, which keeps our share conservative);
    each decode run to probes of its own (`decode_share`)."""

    def __init__(self):
        self.read = ReadBandwidth()
        self.bandwidth, self.flops = self.read(), matmul_flops()

    def around(self, measure):
        """Run `measure()`; return (its result, best bandwidth, best FLOP/s of before and after)."""
        before = (self.bandwidth, self.flops)
        result = measure()
        self.bandwidth, self.flops = self.read(), matmul_flops()
        return result, max(before[0], self.bandwidth), max(before[1], self.flops)

    def decode_share(self, model, ids, new_tokens: int, touched: float, runs: int = 3) -> tuple[float, float, float]:
        """`runs` decode runs, each between two bandwidth probes (probed_run): returns the best
        seconds a step, the median share of the limit (each run's: bytes touched a step x its steps
        a second / the better probe of the two around it) and the probe beside the best run. The
        share comes from the runs whose speed is printed: steps timed one by one between probes run
        cold after each probe and read 1-10% slower (docs/kernel-decisions.md)."""
        timed = [probed_run(model, ids, new_tokens, self.read) for _ in range(runs)]
        best = min(timed)
        return best[0], median([touched / step / max(a, b) for step, a, b in timed]), max(best[1], best[2])


def probed_run(model, ids, new_tokens: int, read: ReadBandwidth) -> tuple[float, float, float]:
    """(seconds a decode step of one greedy generation, the read bandwidth probed right before it,
    right after it)."""
    before = read(repeats=2)
    step = ours_decode(model, ids, new_tokens, repeats=1)
    return step, before, read(repeats=2)


def median(values) -> float:
    return sorted(values)[len(values) // 2]


def probed_steps(model, ids, new_tokens: int, read: ReadBandwidth):
    """Yield (seconds, bandwidth before, bandwidth after) for each decode step of one generation,
    with a short bandwidth probe between every two steps, outside the timed steps."""
    before, start, first = read(repeats=2), time.perf_counter(), True
    for event in stream_generate(model.lm, ids, SamplingParams(max_new_tokens=new_tokens)):
        if event.row != 0:
            continue
        step = time.perf_counter() - start
        after = read(repeats=2)
        if not first:  # the first event ends the prefill, not a step
            yield step, before, after
        first, before, start = False, after, time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short prompts (for a smoke run)")
    parser.add_argument("--skip-hf", action="store_true", help="only our engine")
    args = parser.parse_args()
    torch.manual_seed(0)
    limits = Limits()
    with tempfile.TemporaryDirectory() as tmp:
        hf, model = build(Path(tmp))
    prompt, long_prompt, new = (256, 1024, 32) if args.quick else (2048, 8192, 128)
    vocab = model.config.text.vocab_size
    rows = []

    ids = torch.randint(0, vocab, (1, prompt))
    ours, _, flops_s = limits.around(lambda: ours_prefill(model, ids))
    theirs = None if args.skip_hf else hf_prefill(hf, ids)
    flops = prefill_flops(model, prompt)
    rows.append((f"prefill {prompt} tok (tok/s)", prompt / ours, theirs and prompt / theirs, flops / ours / flops_s))
    print(f"  prefill: {flops / 1e12:.2f} TFLOP, matmul limit around it {flops_s / 1e9:.0f} GFLOP/s")

    for batch in (1, 8):
        ids = torch.randint(0, vocab, (batch, 32))
        counter = ExpertCounter(model)  # on the warm-up run (untimed); greedy decoding repeats its routing
        ours_decode(model, ids, new, repeats=1)  # warm-up of each configuration, for both engines
        counter.close()
        if not args.skip_hf:
            hf_decode(hf, ids, 8, repeats=1)
        weights = weight_bytes_per_step(model, counter.mean())
        touched = weights + cache_bytes_per_step(model, batch, ids.shape[1] + new // 2)
        (step, share, bandwidth), _, flops_s = limits.around(lambda: limits.decode_share(model, ids, new, touched))
        theirs = None if args.skip_hf else hf_decode(hf, ids, new)
        rows.append((f"decode batch {batch} (tok/s)", batch / step, theirs and batch / theirs, share))
        print(f"  batch {batch}: {counter.mean():.1f} experts/layer touched per step, {weights / 1e9:.2f} GB of "
              f"weights and {(touched - weights) / 1e9:.3f} GB of cache per step; best of 3 runs {step * 1e3:.1f} ms/step "
              f"beside a {bandwidth / 1e9:.1f} GB/s probe (floor {touched / bandwidth * 1e3:.1f} ms);\n"
              f"    share of the limit per run (bytes a step x steps a second / the probes around the run), "
              f"median {share * 100:.0f}%;\n    compute floor {decode_flops(model, batch) / flops_s * 1e3:.1f} ms/step "
              f"(matmul FLOPs at {flops_s / 1e9:.0f} GFLOP/s)")

    short_ids, long_ids = torch.randint(0, vocab, (1, 128)), torch.randint(0, vocab, (1, long_prompt))
    pairs = [(ours_decode(model, short_ids, new, repeats=1), ours_decode(model, long_ids, new, repeats=1))
             for _ in range(3)]  # interleaved, so that both see the same machine state (its speed drifts)
    short, long = min(p[0] for p in pairs), min(p[1] for p in pairs)
    theirs = None if args.skip_hf else hf_decode(hf, torch.randint(0, vocab, (1, long_prompt)), new, repeats=1)
    rows.append((f"decode after {long_prompt} tok (tok/s)", 1 / long, theirs and 1 / theirs, None))
    print(f"machine: {torch.get_num_threads()} threads; limits measured around each figure (see above)")
    report(rows)
    # the same at equal bandwidth: per-step time x the bandwidth probed around the step (medians),
    # so that a run in the VM's slower memory state does not count as the longer prompt's cost
    short_cost, long_cost = (median([step * max(a, b) for step, a, b in probed_steps(model, ids, new, limits.read)])
                             for ids in (short_ids, long_ids))
    print(f"decode per token after {long_prompt} vs after 128 prompt tokens: {long_cost / short_cost:.2f}x at equal bandwidth "
          f"(step time x probed bandwidth, medians); {long / short:.2f}x between the best runs")


def report(rows) -> None:
    print(f"\n{'':34s}{'ours':>10s}{'transformers':>14s}{'ratio':>8s}{'of limit':>10s}")
    for name, ours, theirs, share in rows:
        t = f"{theirs:14.1f}" if theirs else f"{'-':>14s}"
        r = f"{ours / theirs:7.2f}x" if theirs else f"{'-':>8s}"
        s = f"{share * 100:9.0f}%" if share else f"{'-':>10s}"
        print(f"{name:34s}{ours:10.1f}{t}{r}{s}")


if __name__ == "__main__":
    main()
