"""The per-token cost of structured outputs: each grammar library's next-token mask beside a decode step.

    python -m bench.constraints [--checkpoint DIR | --big] [--weights int4] [--tokens 200] [--engine]

On the real Qwen3.5 tokenizer (the built-in model's, 248,320 ids), for a JSON schema with nested
objects, arrays, enums, numbers and bounded strings: a random walk through the grammar (each step
picks a random allowed token), timing per token what a request's rule pays: the library's bitmask
fill and token accept, and applying the bitmask to the logits as the engine does (one kernel pass:
lm/sampling.py apply_token_bits). xgrammar (the one the pipeline uses, through its rule in
mm/constraints.py) and llguidance side by side. With --checkpoint (or --big: Qwen3.5-35B-A3B as
bench.big builds it), a decode step of that model at batch 1 and 8 for scale: at batch 8 a step
pays 8 masks (one per row), so the share printed is 8 x mask / step. With --engine, whole engine
steps of the built-in model (its real vocabulary, a tiny, fast step: the masks' worst case) at
batch 8: free requests against requests under a grammar.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from mm.default_model import default_model_path
from lm.sampling import apply_token_bits
from mm.processor import Processor

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}, "score": {"type": "number"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 6},
    "place": {"type": "object", "properties": {"x": {"type": "integer"}, "label": {"type": "string", "maxLength": 12}},
              "required": ["x"], "additionalProperties": False}},
    "required": ["name", "age", "place"], "additionalProperties": False}  # fmt: skip
def walk(bits, accept, done, vocab: int, tokens: int, rng: random.Random) -> list[float]:
    """Seconds per token of fill + apply + accept over a random walk of up to `tokens` tokens: what a
    request's rule and the engine pay per token (the pick itself, which every request pays, is not
    timed)."""
    times = []
    logits = torch.randn(vocab)
    while len(times) < tokens and not done():
        start = time.perf_counter()
        masked = apply_token_bits(logits, bits())  # what the engine pays to apply it (lm/sampling.py)
        middle = time.perf_counter()
        allowed = torch.isfinite(masked).nonzero()[:, 0]
        token = int(allowed[rng.randrange(len(allowed))])
        resumed = time.perf_counter()
        accept(token)
        times.append(middle - start + time.perf_counter() - resumed)
    return times


def xgrammar_times(tokenizer, vocab: int, tokens: int, seed: int) -> list[float]:
    """The pipeline's own rule (mm/constraints.py: xgrammar, with its masks of banned tokens)."""
    from lm.sampling import SamplingParams
    from mm.constraints import Grammars

    ends = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    state = Grammars(tokenizer, vocab, ends).rule(SamplingParams(json_schema=SCHEMA), in_thinking=False,
                                                think_end=None).state  # fmt: skip
    return walk(state.bits, state.take, lambda: state.done, vocab, tokens, random.Random(seed))


def llguidance_times(tokenizer, vocab: int, tokens: int, seed: int) -> list[float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})  # fmt: skip
    matcher = llguidance.LLMatcher(tok, grammar)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def bits():
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        return bitmask[0]

    return walk(bits, matcher.consume_token, matcher.is_stopped, vocab, tokens, random.Random(seed))


def step_seconds(model, batch: int) -> float:
    """The median seconds of one decode step of `model` (a VLModel) at `batch` rows (greedy, 32 steps)."""
    from lm import SamplingParams, stream_generate

    ids = torch.randint(3, 1000, (batch, 8), generator=torch.Generator().manual_seed(0))
    stamps = []
    for _ in stream_generate(model.lm, ids, SamplingParams(max_new_tokens=33)):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[batch - 1 :: batch], stamps[2 * batch - 1 :: batch])]
    return statistics.median(gaps)


def big_model(weights: str):
    """Qwen3.5-35B-A3B (real config, random weights in `weights`' storage), as bench.big builds it."""
    from bench.big import build, fill_random

    model, formats = build(weights)
    fill_random(model, formats)
    return model


def engine_step_ms(constrained: bool, tokens: int, rounds: int) -> float:
    """Median ms per engine step of 8 requests of the built-in model running `tokens` tokens each."""
    from lm import SamplingParams
    from mm import Pipeline, load_model

    path = default_model_path()
    pipeline = Pipeline(load_model(path), Processor.from_pretrained(path),
                        engine_options=dict(max_batch=8, prefix_cache_bytes=0))  # fmt: skip
    never_end = {token: -100.0 for token in pipeline.model.eos_token_ids()}
    grammar = "root ::= [a-z] root" if constrained else None  # never complete: runs to max_new_tokens
    times = []
    for r in range(rounds + 1):
        params = [SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=r * 8 + i, grammar=grammar,
                                 logit_bias=None if constrained else never_end) for i in range(8)]  # fmt: skip
        steps, start = pipeline.engine.stats()["steps"], time.perf_counter()
        with pipeline.engine.paused():
            answers = [pipeline.submit([{"role": "user", "content": "Go."}], p, enable_thinking=False) for p in params]
        for answer in answers:
            answer.output()
        if r:  # the first round warms up
            times.append((time.perf_counter() - start) / (pipeline.engine.stats()["steps"] - steps))
    pipeline.engine.close()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200, help="tokens per walk (default 200)")
    parser.add_argument("--walks", type=int, default=5)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint whose decode step to show beside")
    parser.add_argument("--big", action="store_true", help="the decode step of Qwen3.5-35B-A3B beside (bench.big)")
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--engine", action="store_true", help="engine steps at batch 8, free and constrained")
    args = parser.parse_args()
    if args.engine:
        free, constrained = engine_step_ms(False, args.tokens, 3), engine_step_ms(True, args.tokens, 3)
        print(f"built-in model, 8 requests x {args.tokens} tokens, ms per engine step (all of it, prefill "
              f"included): free {free:.1f}, under a grammar {constrained:.1f} ({constrained / free - 1:+.1%})")
        return
    processor = Processor.from_pretrained(default_model_path())
    vocab = 248320
    print(f"tokenizer: the built-in model's ({len(processor.tokenizer)} tokens, vocab {vocab}); "
          f"{torch.get_num_threads()} threads")
    results = {}
    for name, run in (("xgrammar", xgrammar_times), ("llguidance", llguidance_times)):
        times = [t for seed in range(args.walks) for t in run(processor.tokenizer, vocab, args.tokens, seed)]
        results[name] = statistics.median(times)
        print(f"{name:>10}: mask + accept per token median {results[name] * 1e3:.3f} ms, p90 "
              f"{statistics.quantiles(times, n=10)[-1] * 1e3:.3f} ms over {len(times)} tokens")
    if args.checkpoint or args.big:
        import mm

        model = big_model(args.weights) if args.big else mm.load_model(args.checkpoint, weights=args.weights)
        print(f"decode steps of {'Qwen3.5-35B-A3B (random)' if args.big else args.checkpoint}, {args.weights}")
        for batch in (1, 8):
            step = step_seconds(model, batch)
            shares = ", ".join(f"{name} {batch * t / step:.1%}" for name, t in results.items())
            print(f"decode step, batch {batch}: {step * 1e3:.1f} ms; masks of the batch / step: {shares}")


if __name__ == "__main__":
    main()
