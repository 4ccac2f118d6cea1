"""The per-token cost of structured outputs: each grammar library's next-token mask beside a decode step.

    python -m bench.constraints [--checkpoint DIR --weights int4] [--tokens 200] [--engine]

On the real Qwen3.5 tokenizer (the built-in model's, 248,320 ids), for a JSON schema with nested
objects, arrays, enums, numbers and bounded strings: a random walk through the grammar (each step
picks a random allowed token), timing per token what a request's rule pays: the library's bitmask
fill and token accept, and turning the bitmask into the bool mask the engine applies
(mm/constraints.py). xgrammar (the one the pipeline uses) and llguidance side by side. With
--checkpoint, a decode step of that checkpoint at batch 1 and 8 for scale: at batch 8 a step pays
8 masks (one per row), so the share printed is 8 x mask / step. With --engine, whole engine steps of
the built-in model (its real vocabulary, a tiny, fast step: the masks' worst case) at batch 8: free
requests against requests under a grammar.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from mm.default_model import default_model_path
from mm.processor import Processor

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}, "score": {"type": "number"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 6},
    "place": {"type": "object", "properties": {"x": {"type": "integer"}, "label": {"type": "string", "maxLength": 12}},
              "required": ["x"], "additionalProperties": False}},
    "required": ["name", "age", "place"], "additionalProperties": False}  # fmt: skip
SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    return ((words[:, None] >> SHIFTS) & 1).bool().reshape(-1)[:vocab]


def walk(fill, accept, done, bitmask, vocab: int, tokens: int, rng: random.Random) -> list[float]:
    """Seconds per token of fill + unpack + accept over a random walk of up to `tokens` tokens."""
    times = []
    logits = torch.randn(vocab)
    while len(times) < tokens and not done():
        start = time.perf_counter()
        fill(bitmask)
        mask = unpack(bitmask[0], vocab)
        logits.masked_fill(~mask, float("-inf"))  # what the engine pays to apply it
        allowed = mask.nonzero()[:, 0]
        token = int(allowed[rng.randrange(len(allowed))])
        accept(token)
        times.append(time.perf_counter() - start)
    return times


def xgrammar_times(tokenizer, vocab: int, tokens: int, seed: int) -> list[float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))  # fmt: skip
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    return walk(matcher.fill_next_token_bitmask, matcher.accept_token, matcher.is_terminated, bitmask, vocab, tokens,
                random.Random(seed))  # fmt: skip


def llguidance_times(tokenizer, vocab: int, tokens: int, seed: int) -> list[float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})  # fmt: skip
    matcher = llguidance.LLMatcher(tok, grammar)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    fill = lambda b: llguidance.torch.fill_next_token_bitmask(matcher, b, 0)  # noqa: E731
    return walk(fill, matcher.consume_token, matcher.is_stopped, bitmask, vocab, tokens, random.Random(seed))


def step_seconds(checkpoint: str, weights: str, batch: int) -> float:
    """The median seconds of one decode step of `checkpoint` at `batch` rows (greedy, 32 steps)."""
    import mm
    from lm import SamplingParams, stream_generate

    model = mm.load_model(checkpoint, weights=weights)
    ids = torch.randint(3, 1000, (batch, 8), generator=torch.Generator().manual_seed(0))
    stamps = []
    for _ in stream_generate(model.lm, ids, SamplingParams(max_new_tokens=33)):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[batch - 1 :: batch], stamps[2 * batch - 1 :: batch])]
    return statistics.median(gaps)


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
    if args.checkpoint:
        for batch in (1, 8):
            step = step_seconds(args.checkpoint, args.weights, batch)
            shares = ", ".join(f"{name} {batch * t / step:.1%}" for name, t in results.items())
            print(f"decode step, batch {batch}: {step * 1e3:.1f} ms; masks of the batch / step: {shares}")


if __name__ == "__main__":
    main()
