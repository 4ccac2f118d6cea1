"""Weight formats on CPU: speed and accuracy of fp32, bf16, int8 (Q8_0) and int4 (Q4_0) storage.

    python -m bench.formats [--checkpoint DIR] [--formats fp32,bf16,int8,int4] [--batches 1,4,8]
                            [--gguf-dir DIR] [--quick] [--context N] [--rounds 2]

On one bf16 checkpoint (default: a random one with bench/lm.py's proportions; `--checkpoint` takes
any, e.g. one written for a llama.cpp comparison), for each format: decode
tok/s at each batch (64 tokens after an 8-token prompt, or after `--context` tokens as llama-bench's
-d; best of `--rounds`, 2 by default, as llama-bench's tg64), the share of its own bandwidth limit (the bytes one step
touches: its weights in that format and the cache it reads and writes, DeltaNet states and attended
keys and values, over the read bandwidth probed right before and after each timed run; the median
over the runs), prefill tok/s of a 512-token
prompt (llama-bench's pp512: last token's logits only; not run with `--context`), and the error
against fp32 on the same weights: max relative error of the logits of a 64-token prompt, and greedy
agreement over 64 new tokens (not run with `--quick`). With `--gguf-dir` (the `PREFIX-q8_0.gguf` /
`PREFIX-q4_0.gguf` / `PREFIX-q4_k_m.gguf` files llamacpp.sh convert writes), the same error figures
for llama.cpp's quantized tensors, dequantized with the `gguf` package into the fp32 model.
The random bench model amplifies any change of its weights through its 16 layers (on it, Q8_0
weights alone move the logits by ~70% of their range), so these figures compare formats with each
other and with llama.cpp's, not with what a trained model loses.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import mm
from bench.limits import ReadBandwidth, best_time
from bench.lm import CONFIG, ExpertCounter, cache_bytes_per_step, probed_run, weight_bytes_per_step
from lm import SamplingParams, kernels, stream_generate


def make_checkpoint(path: Path, vocab: int) -> Path:
    """bench/lm.py's model shape in bf16 with weights of a real-like scale (as make_model.py)."""
    import transformers

    config = transformers.AutoConfig.for_model(**dict(CONFIG, vocab_size=vocab))
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    real_like(model)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def real_like(model) -> None:
    """Random weights of a real-like scale in place (as the llama.cpp comparison's checkpoints): vectors
    (norms, biases, gates) near their init, matrices N(0, 0.6^2 / fan_in)."""
    for p in model.parameters():
        if p.dim() == 1:
            p.add_(torch.randn_like(p) * 0.1)
        else:
            p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.6 / p.shape[-1] ** 0.5).to(p.dtype))


def decode(models: dict, batch: int, new: int, read: ReadBandwidth, rounds: int = 2, context: int = 8) -> dict:
    """Per format: (tok/s best of `rounds` runs after a `context`-token prompt, share of the bandwidth
    limit: median over the runs, GB per step, the bandwidth probed beside the best run: which memory
    state it caught). The formats take turns (each round runs every one), so
    that all see the same states of this VM's memory, which move a single run by up to ~40%.

    Each run's share is its own: the bytes a step touches times the run's steps a second, over the
    read bandwidth probed right before and right after the run (the higher of the two: a run during
    which the memory turned slow is held to the fast state). Steps timed one by one between probes
    (bench.lm.probed_steps) run cold after each 1 GiB probe, with the recurrent states, caches and
    activations a step reuses evicted: they were 1-10% slower than a run's steps in the same memory
    state, so their shares understated the runs whose tok/s this prints (docs/kernel-decisions.md)."""
    ids = torch.randint(0, next(iter(models.values())).config.text.vocab_size, (batch, context),
                        generator=torch.Generator().manual_seed(batch))
    touched, best, best_probe = {}, dict.fromkeys(models, float("inf")), {}
    shares = {fmt: [] for fmt in models}
    for fmt, model in models.items():
        counter = ExpertCounter(model)
        greedy(model, ids[:, :8], new)  # warm-up; the counter sees the routing
        counter.close()
        touched[fmt] = (weight_bytes_per_step(model, counter.mean() if counter.counts else 0)
                        + cache_bytes_per_step(model, batch, context + new // 2))  # at the run's mean context
    for _ in range(rounds):
        for fmt, model in models.items():
            step, before, after = probed_run(model, ids, new, read)
            if step < best[fmt]:
                best[fmt], best_probe[fmt] = step, max(before, after)
            shares[fmt].append(touched[fmt] / step / max(before, after))
    return {fmt: (batch / best[fmt], statistics.median(shares[fmt]), touched[fmt] / 1e9, best_probe[fmt])
            for fmt in models}


def greedy(model, ids, new: int) -> list[list[int]]:
    out = [[] for _ in range(ids.shape[0])]
    for e in stream_generate(model.lm, ids, SamplingParams(max_new_tokens=new)):
        out[e.row].append(e.token)
    return out


def prefill(models: dict, tokens: int, rounds: int = 3) -> dict:
    """Per format: prefill tok/s of a `tokens` prompt (last token's logits), best of `rounds`, the
    formats taking turns as in `decode`."""
    return {fmt: tokens / min(times) for fmt, times in prefill_rounds(models, tokens, rounds).items()}


def prefill_rounds(models: dict, tokens: int, rounds: int = 3) -> dict:
    """Per format: the seconds of each round's prefill of a `tokens` prompt, the formats taking turns
    (round r of every format close together in time, so that their ratios see the same machine)."""
    ids = torch.randint(0, next(iter(models.values())).config.text.vocab_size, (1, tokens),
                        generator=torch.Generator().manual_seed(1))
    times = {fmt: [] for fmt in models}
    with torch.no_grad():
        for model in models.values():
            model.lm(ids, last_only=True)  # warm-up
        for _ in range(rounds):
            for fmt, model in models.items():
                times[fmt].append(best_time(lambda: model.lm(ids, last_only=True), repeats=1, warmup=0))
    return times


def accuracy(model, reference: dict) -> tuple[float, float]:
    """(max rel err of the prompt logits, share of the 64 greedy tokens equal to the reference's)."""
    with torch.no_grad():
        logits = model.lm(reference["ids"])
    err = float((logits - reference["logits"]).abs().max() / reference["logits"].abs().max())
    tokens = greedy(model, reference["ids"], len(reference["greedy"]))[0]
    agree = next((i for i, (a, b) in enumerate(zip(tokens, reference["greedy"])) if a != b), len(tokens))
    return err, agree / len(tokens)


def gguf_into(model, gguf_file: Path) -> None:
    """Replace the fp32 model's LM weights by llama.cpp's quantized tensors of the same names,
    dequantized with the gguf package (its reference for the error of those tensors)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    per_layer = {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                 "ssm_out": "linear_attn.out_proj", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                 "ffn_down_shexp": "mlp.shared_expert.down_proj"}
    params = dict(model.lm.named_parameters())
    done = 0
    for t in GGUFReader(str(gguf_file)).tensors:
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        parts = t.name.split(".")
        target = names.get(t.name)
        if parts[0] == "blk" and len(parts) == 4:
            layer, kind = parts[1], parts[2]
            if kind in per_layer:
                target = f"model.layers.{layer}.{per_layer[kind]}.weight"
            elif kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                fused = params[f"model.layers.{layer}.mlp.experts." + ("down_proj" if "down" in kind else "gate_up_proj")]
                inter = fused.shape[1] // 2
                dst = fused if "down" in kind else (fused[:, :inter] if "gate" in kind else fused[:, inter:])
                with torch.no_grad():
                    dst.copy_(w.view(dst.shape))
                done += 1
                continue
        if target in params and params[target].shape == w.shape:
            with torch.no_grad():
                params[target].copy_(w)
            done += 1
    print(f"    {gguf_file.name}: {done} tensors dequantized into the fp32 model")


def setup() -> str:
    """Which kernels the figures are of, and the layout of their bf16 matrices."""
    module = kernels._kernels()
    build = module.__name__ if module is not None else "off (the reference paths)"
    return f"kernels {build}; bf16 {'rows in groups of 8' if kernels.bf16_groups() else 'rows'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="a bf16 checkpoint (default: make one)")
    parser.add_argument("--formats", default="fp32,bf16,int8,int4")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--gguf-dir", type=Path, default=None, help="llama.cpp's GGUF files of the same checkpoint")
    parser.add_argument("--gguf-prefix", default="bench")
    parser.add_argument("--vocab", type=int, default=248320, help="vocabulary of the made checkpoint")
    parser.add_argument("--quick", action="store_true", help="16 new tokens, no accuracy run")
    parser.add_argument("--rounds", type=int, default=2,
                        help="decode runs per format and batch, the formats in turns; the best counts")
    parser.add_argument("--context", type=int, default=8,
                        help="decode after a prompt of this many tokens (llama-bench's -d: the attention "
                             "layers then read that many keys and values a step); prefill then is skipped")
    args = parser.parse_args()
    read = ReadBandwidth()
    new = 16 if args.quick else 64
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or make_checkpoint(Path(tmp) / "bench-bf16", args.vocab)
        models, loads, reference, errors = {}, {}, None, {}
        for fmt in args.formats.split(","):  # all formats at once (the bench models take 1-6 GB each)
            start = time.perf_counter()
            models[fmt] = model = mm.load_model(path, weights=fmt)
            loads[fmt] = time.perf_counter() - start
            if reference is None and not args.quick:  # the first format (fp32 by default) is the reference
                ids = torch.randint(0, model.config.text.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
                with torch.no_grad():
                    reference = dict(ids=ids, logits=model.lm(ids), greedy=greedy(model, ids, new)[0], name=fmt)
            errors[fmt] = accuracy(model, reference) if reference and reference["name"] != fmt else (0.0, 1.0)
            print(f"  {fmt}: loaded in {loads[fmt]:.1f} s" + (
                f"; vs {reference['name']}: logits rel err {errors[fmt][0]:.2e}, greedy agreement "
                f"{errors[fmt][1] * 100:.0f}%" if reference else " (no accuracy run with --quick)"), flush=True)
            if not reference:
                errors[fmt] = (float("nan"), float("nan"))
        decs = {b: decode(models, b, new, read, args.rounds, args.context) for b in map(int, args.batches.split(","))}
        pres = prefill(models, 512) if args.context == 8 else dict.fromkeys(models, float("nan"))
        rows = [(fmt, {b: decs[b][fmt] for b in decs}, pres[fmt], errors[fmt], loads[fmt]) for fmt in models]
        for fmt, dec, pre, _, _ in rows:
            print(f"  {fmt}: prefill 512 {pre:.1f} tok/s; "
                  + "; ".join(f"batch {b} {t:.1f} tok/s ({sh * 100:.0f}% of the limit, {gb:.2f} GB/step; "
                              f"best run beside a {bw / 1e9:.0f} GB/s probe)" for b, (t, sh, gb, bw) in dec.items()),
                  flush=True)
        names = list(models)
        del models  # before the fp32 models of the GGUF comparison
        if "fp32" in names and args.gguf_dir and reference:
            for quant in ("q8_0", "q4_0", "q4_k_m"):
                file = args.gguf_dir / f"{args.gguf_prefix}-{quant}.gguf"
                if file.exists():
                    model = mm.load_model(path, weights="fp32")
                    gguf_into(model, file)
                    e = accuracy(model, reference)
                    print(f"  llama.cpp {quant} tensors: logits rel err {e[0]:.2e}, greedy agreement {e[1] * 100:.0f}%")
                    del model
        print(f"\nread bandwidth now {read() / 1e9:.1f} GB/s; {torch.get_num_threads()} threads; {setup()}")
        base = {b: t for b, (t, _, _, _) in rows[0][1].items()}
        print(f"{'format':8s}" + "".join(f"{'B' + str(b) + ' tok/s':>12s}{'x ' + rows[0][0]:>9s}{'limit':>7s}" for b in base)
              + f"{'pp512':>8s}{'rel err':>10s}{'greedy':>8s}")
        for fmt, dec, pre, err, _ in rows:
            print(f"{fmt:8s}" + "".join(f"{t:12.1f}{t / base[b]:8.2f}x{s * 100:6.0f}%" for b, (t, s, _, _) in dec.items())
                  + f"{pre:8.1f}{err[0]:10.2e}{err[1] * 100:7.0f}%")


if __name__ == "__main__":
    main()
