"""The serving engine (lm/serving) on the bench model: batching, prefill beside decode, prefix cache.

    python -m bench.serve --checkpoint DIR [--weights auto] [--quick]

DIR is a bench checkpoint (bench.formats.make_checkpoint: the bench/lm.py
proportions with the real vocabulary, bf16). Prints:

1. aggregate decode tok/s of 1, 4 and 8 concurrent streams against the same requests run one after
   another, with the batch-1 step's share of its bandwidth limit (weight bytes per step / measured
   read bandwidth);
2. the decode latency (time between tokens) of 4 running streams before and while a 2,048-token
   prompt is prefilled, for step budgets of 64, 128 (the default) and 256 tokens, and that prompt's
   prefill rate against its rate with nothing beside it;
3. time to first token of turn 2 of a chat whose turn 1 had a ~1,000-token image prompt, with and
   without the prefix cache (the model gets a vision tower of Qwen3.5-0.8B's size, random weights,
   built in memory, and the default model's tokenizer);
4. the prefix hit rate (share of prompt tokens not recomputed) of 100 chat requests that share a
   300-token system prompt, against what a block-granular cache with 528-token blocks (vLLM's
   hybrid "align" mode) would reuse on the same requests.

No timing is asserted anywhere; the figures go to the README.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import mm
from app.default_model import default_model_path
from bench.limits import ReadBandwidth
from bench.lm import weight_bytes_per_step
from lm import SamplingParams
from lm.serving import Engine
from mm import ModelConfig, Pipeline, Processor, VLModel
from vision import VisionModel

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference"  # the real checkpoints' configs


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(1000, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()  # any vocabulary >= 32k


def batching(model, engine_of, quick: bool) -> None:
    new = 32 if quick else 64
    print(f"\n1. aggregate decode, 64-token prompts, {new} new tokens each (greedy)")
    print("   streams | concurrent tok/s | one after another tok/s | ratio | concurrent decode only tok/s")
    print("   (wall time from submit to the end, prefills included; decode only: while all streams decode)")
    bw = ReadBandwidth()()
    for streams in (1, 4, 8):
        engine = engine_of(max_batch=8, prefix_cache_bytes=0)
        prompts = [_ids(s, 64) for s in range(streams)]
        params = SamplingParams(max_new_tokens=new)
        engine.submit(prompts[0], SamplingParams(max_new_tokens=4)).result()  # warm up
        start = time.perf_counter()
        for ids in prompts:
            engine.submit(ids, params).result()
        sequential = streams * new / (time.perf_counter() - start)
        start = time.perf_counter()
        handles = [engine.submit(ids, params) for ids in prompts]
        for h in handles:
            h.result()
        concurrent = streams * new / (time.perf_counter() - start)  # both wall times include the prefills
        step = (handles[0].token_times[-1] - handles[0].token_times[0]) / (new - 1)
        window = (max(h.token_times[0] for h in handles), min(h.token_times[-1] for h in handles))
        inside = sum(window[0] < t <= window[1] for h in handles for t in h.token_times)
        decode = inside / (window[1] - window[0])
        print(f"   {streams:7d} | {concurrent:16.1f} | {sequential:23.1f} | {concurrent / sequential:5.2f} | {decode:10.1f}")
        if streams == 1:
            touched = model.config.text.num_experts_per_tok if model.config.text.num_experts else 0
            limit = bw / weight_bytes_per_step(model, touched)
            print(f"   (batch-1 decode step {1e3 * step:.1f} ms = {1 / step:.1f} tok/s: {1 / step / limit:.0%} of its "
                  f"bandwidth limit {limit:.1f} tok/s at {bw / 1e9:.1f} GB/s)")  # fmt: skip
        engine.close()


def interference(engine_of, quick: bool) -> None:
    print("\n2. decode latency of 4 running streams while a 2,048-token prompt is prefilled")
    print("   step budget | between tokens before | during the prefill: median (x before), max | "
          "prefill tok/s (x alone)")
    for budget in (64, 128, 256) if not quick else (128,):
        engine = engine_of(max_batch=8, step_tokens=budget, prefix_cache_bytes=0)
        engine.submit(_ids(98, 64), SamplingParams(max_new_tokens=1)).result()  # warm up
        start = time.perf_counter()
        engine.submit(_ids(99, 2048), SamplingParams(max_new_tokens=1)).result()
        alone = 2048 / (time.perf_counter() - start)  # the same prompt with nothing beside it
        engine.close()
        engine = engine_of(max_batch=8, step_tokens=budget, prefix_cache_bytes=0)
        streams = [engine.submit(_ids(10 + i, 32), SamplingParams(max_new_tokens=4000)) for i in range(4)]
        time.sleep(3)  # the streams decode alone for a while
        submitted = time.perf_counter()
        engine.submit(_ids(99, 2048), SamplingParams(max_new_tokens=1)).result()
        done = time.perf_counter()
        for h in streams:
            h.cancel()
        before, during = [], []
        for h in streams:
            h.result()
            for a, b in zip(h.token_times, h.token_times[1:]):
                if b < submitted:
                    before.append(b - a)
                elif a >= submitted and b <= done:
                    during.append(b - a)
        rate, gap, gap0 = 2048 / (done - submitted), statistics.median(during), statistics.median(before)
        print(f"   {budget:11d} | {1e3 * gap0:18.0f} ms | {1e3 * gap:9.0f} ms ({gap / gap0:.1f}x), "
              f"{1e3 * max(during):5.0f} ms | {rate:6.0f} ({rate / alone:.2f}x of {alone:.0f})")  # fmt: skip
        engine.close()


def vl_pipeline(checkpoint: Path, **engine_options) -> Pipeline:
    """The bench LM with a random vision tower of Qwen3.5-0.8B's size, and the default model's tokenizer."""
    text = mm.load_model(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    vision = json.loads((REFERENCE / "qwen3.5-0.8b.config.json").read_text())["vision_config"]
    vision["out_hidden_size"] = config["hidden_size"]
    full = dict(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"],
                text_config=dict(config, model_type="qwen3_5_moe_text"), vision_config=vision,
                image_token_id=248056, video_token_id=248057)  # fmt: skip
    with torch.device("meta"):
        model = VLModel(ModelConfig.from_hf(full))
    model.lm = text.lm
    model.generation_config = {"eos_token_id": [248046, 248044]}  # the chat end token ends a turn
    torch.manual_seed(0)
    model.visual = VisionModel(model.config.vision).float().eval()
    return Pipeline(model, Processor.from_pretrained(default_model_path()), engine_options=engine_options)


def chat_turn_two(checkpoint: Path) -> None:
    print("\n3. time to first token of turn 2, turn 1 a ~1,000-token image prompt (greedy, 16 new tokens)")
    image = np.random.default_rng(0).integers(0, 256, (768, 1280, 3), dtype=np.uint8)
    params = SamplingParams(max_new_tokens=16)
    turn1 = [{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": "Describe this picture in detail."}]}]  # fmt: skip
    for cached in (True, False):
        pipeline = vl_pipeline(checkpoint, prefix_cache_bytes=(2 << 30) if cached else 0)
        first = pipeline.generate([turn1], params)[0]
        turn2 = turn1 + [{"role": "assistant", "content": first.text or "It is a picture."},
                         {"role": "user", "content": "What colours stand out?"}]  # fmt: skip
        if not cached:
            pipeline.vision_cache.max_bytes = 0  # a cold turn 2: no cache of any kind
            pipeline.vision_cache._items.clear()
            pipeline.vision_cache.nbytes = 0
        second = pipeline.generate([turn2], params)[0]
        label = "with the prefix cache" if cached else "without (cold)"
        print(f"   {label:22s}: turn 1 prompt {first.prompt_tokens} tokens, TTFT {first.timings['prefill']:.2f} s; "
              f"turn 2 prompt {second.prompt_tokens} tokens ({second.cached_tokens} cached), "
              f"TTFT {second.timings['prefill']:.3f} s")  # fmt: skip
        if cached:
            with_cache = second.timings["prefill"]
        else:
            print(f"   turn-2 TTFT speed-up from the cache: {second.timings['prefill'] / with_cache:.1f}x")
        pipeline.engine.close()


def hit_rate(checkpoint: Path, quick: bool) -> None:
    n = 30 if quick else 100
    print(f"\n4. prefix hit rate: {n} chat requests sharing a ~300-token system prompt (1 new token each)")
    pipeline = vl_pipeline(checkpoint)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    system, count = "", 0
    while count < 300:  # ~300 tokens of system prompt
        system += words[count % len(words)] + " "
        count = len(pipeline.processor.tokenizer(system, add_special_tokens=False)["input_ids"])
    rng = np.random.default_rng(1)
    prompts, reused_block, seen = 0, 0, []
    for i in range(n):
        question = " ".join(rng.choice(words, size=int(rng.integers(10, 40))))
        conv = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: {question}"}]
        ids = pipeline.prepare([conv], SamplingParams(max_new_tokens=1), None).input_ids[0].tolist()
        shared = max((_common(ids, old) for old in seen), default=0)
        reused_block += (shared // 528) * 528  # whole 528-token blocks shared with an earlier request
        seen.append(ids)
        prompts += len(ids)
        pipeline.generate([conv], SamplingParams(max_new_tokens=1))
    stats = pipeline.engine.prefix.stats()
    print(f"   system prompt {_common(seen[0], seen[1])} shared tokens; prompts {prompts / n:.0f} tokens on average")
    print(f"   ours: {stats['hit_tokens'] / stats['lookup_tokens']:.1%} of prompt tokens reused "
          f"({stats['hits']} hits, {stats['misses']} misses); 528-token blocks: {reused_block / prompts:.1%}")
    pipeline.engine.close()


def _common(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="the bench checkpoint (make_model.py --shape bench)")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and requests")
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run, e.g. 1,3")
    parser.add_argument("--weights", default="auto", help="weights= of parts 1 and 2 (mm.load_model)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    parts = {int(p) for p in args.parts.split(",")}
    print(f"bench.serve on {args.checkpoint}, weights={args.weights} ({torch.get_num_threads()} threads)")
    if parts & {1, 2}:
        model = mm.load_model(args.checkpoint, weights=args.weights)
        engine_of = lambda **o: Engine(model.lm, eos_token_ids=(), **o)  # noqa: E731 - no EOS: fixed lengths
        if 1 in parts:
            batching(model, engine_of, args.quick)
        if 2 in parts:
            interference(engine_of, args.quick)
        del model, engine_of
    if 3 in parts:
        chat_turn_two(args.checkpoint)
    if 4 in parts:
        hit_rate(args.checkpoint, args.quick)


if __name__ == "__main__":
    main()
