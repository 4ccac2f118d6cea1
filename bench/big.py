"""Qwen3.5-35B-A3B on a 24 GiB CPU machine: the full model (real config, 40 layers, the vision tower)
with random weights, built straight in a compact storage format.

    python -m bench.big [--weights int4] [--compute auto] [--cache-file PATH] [--new-tokens 8]
    python -m bench.big --from-cache PATH          # the load time of a cache file written by the above
    python -m bench.big --apps                     # time to the first token of a VQA question and a caption

No 70 GB bf16 checkpoint is written: the parameters get the storage of their format (lm/formats) on
the meta device and are filled with random quants (fp16 scales of a real-like size) in place, so the
float32 model never exists. Prints peak RSS, decode tok/s at batch 1 and 8, prefill tok/s and the time
to the first token of a 1,000-token prompt, and the vision tower's time on a 1,000-token image. With
--cache-file the LM weights are written as the converted-weights cache would hold them, and
`--from-cache` times reading that file into a fresh model (as the second start of a real checkpoint
does). The streaming load of a real-shape checkpoint
slice is measured by `python -m bench.big --slice DIR` (e.g. `make_model.py --shape slice35b --layers 4`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lm import SamplingParams, kernels, stream_generate
from lm.formats import policy
from mm.config import ModelConfig
from lm.kernels.compute import CHOICES
from mm.loading import allocate, set_compute
from mm.model import VLModel
from lm.weight_cache import write_safetensors

CONFIG = Path(__file__).resolve().parents[1] / "tests/data/reference/qwen3.5-35b-a3b.config.json"


def rss_gib(field: str = "VmHWM") -> float:
    """Peak (VmHWM) or current (VmRSS) resident memory of this process, GiB."""
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) / 2**20


def build(weights: str) -> tuple[VLModel, dict]:
    """The full model in its storage formats, parameters allocated but not yet filled; and the
    format of each compact LM parameter."""
    config = ModelConfig.from_hf(json.loads(CONFIG.read_text()))
    with torch.device("meta"):
        model = VLModel(config)
    shapes = {n: tuple(p.shape) for n, p in model.lm.named_parameters(remove_duplicate=False)}
    formats = policy.plan(shapes, weights, torch.bfloat16, groups=kernels.bf16_groups())
    model = allocate(model, formats, "cpu", policy.vision_dtype(weights, torch.bfloat16))
    return model.eval().requires_grad_(False), {f"lm.{n}": f for n, f in formats.items()}


@torch.no_grad()
def fill_random(model: VLModel, formats: dict) -> None:
    """Random weights with a standard deviation of 0.6 / sqrt(K), as make_model.py's, written in
    place in each parameter's storage format (block formats: uniform quants and one fp16 scale)."""
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        fmt = formats.get(name)
        if fmt is not None and fmt.blocked:
            k = fmt.inputs(p.shape[-1])
            scales = fmt.rows * 2  # bytes of fp16 scales at the head of a block (int4: 8 rows' together)
            blocks = p.view(-1, fmt.block_bytes * fmt.rows)
            blocks[:, scales:].random_(0, 256, generator=g)
            spread = 74.0 if fmt.name == "int8" else 4.6  # std of uniform int8 quants / of q - 8
            scale = torch.tensor([0.6 / k**0.5 / spread], dtype=torch.float16).view(torch.uint8)
            blocks[:, :scales] = scale.repeat(fmt.rows)
        elif p.dim() == 1:
            p.normal_(0, 0.1, generator=g)
        else:  # bf16 in groups of 8 rows (uint16): random values need no layout
            (p.view(torch.bfloat16) if p.dtype == torch.uint16 else p).normal_(0, 0.6 / p.shape[-1] ** 0.5, generator=g)


def image_grid(model: VLModel, tokens: int) -> torch.Tensor:
    """grid_thw [1, 3] of an image of about `tokens` LM tokens (after the 2x2 merge)."""
    merge = model.config.vision.spatial_merge_size
    side = max(1, round(tokens**0.5)) * merge
    return torch.tensor([[1, side, side]])


def timed_decode(model: VLModel, batch: int, new: int) -> float:
    ids = torch.randint(0, 1000, (batch, 4))
    stamps = [time.perf_counter() for e in stream_generate(model.lm, ids, SamplingParams(max_new_tokens=new))
              if e.row == 0]
    return batch * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--compute", default="auto", choices=CHOICES, help="prefill's and the vision tower's")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--cache-file", type=Path, default=None)
    parser.add_argument("--from-cache", type=Path, default=None)
    parser.add_argument("--slice", type=Path, default=None, help="a real-shape checkpoint slice: its streaming load")
    parser.add_argument("--apps", action="store_true",
                        help="only the front ends' time to the first token: a VQA image question and one caption")
    parser.add_argument("--prefix-cache-mb", type=int, default=None, help="--apps: the engine's prefix cache "
                        "(default: the engine's default)")
    args = parser.parse_args()
    if args.slice:
        return slice_load(args.slice, args.weights)
    start = time.perf_counter()
    model, formats = build(args.weights)
    if args.from_cache:
        from safetensors import safe_open

        with safe_open(str(args.from_cache), framework="pt") as f, torch.no_grad():
            for n, p in model.lm.named_parameters():
                p.copy_(f.get_tensor(n))
        print(f"LM weights read from {args.from_cache} ({args.from_cache.stat().st_size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - start:.1f} s; peak RSS {rss_gib():.2f} GiB")
        return
    fill_random(model, formats)
    set_compute(args.compute, model)
    lm_bytes = sum(p.numel() * p.element_size() for p in model.lm.parameters())
    vis_bytes = sum(p.numel() * p.element_size() for p in model.visual.parameters())
    vis_dtype = str(model.visual.blocks[0].mlp.linear_fc1.weight.dtype).removeprefix("torch.")
    print(f"built in {time.perf_counter() - start:.1f} s: LM {lm_bytes / 2**30:.2f} GiB ({args.weights}), vision "
          f"{vis_bytes / 2**30:.2f} GiB (matrices {vis_dtype}); RSS {rss_gib('VmRSS'):.2f} GiB; compute "
          f"{args.compute} (vision {model.visual.compute})", flush=True)
    if args.apps:
        return apps_ttft(model, args.prefix_cache_mb)
    for batch in (1, 8):
        print(f"decode batch {batch}: {timed_decode(model, batch, args.new_tokens):.2f} tok/s; "
              f"peak RSS {rss_gib():.2f} GiB", flush=True)
    ids = torch.randint(0, 1000, (1, args.prompt))
    start = time.perf_counter()
    next(stream_generate(model.lm, ids, SamplingParams(max_new_tokens=1)))
    ttft = time.perf_counter() - start
    print(f"prefill {args.prompt} tokens: time to first token {ttft:.1f} s ({args.prompt / ttft:.1f} tok/s); "
          f"peak RSS {rss_gib():.2f} GiB", flush=True)
    grid = image_grid(model, args.prompt)
    pixels = torch.randn(int(grid.prod()), model.config.vision.patch_dim)
    start = time.perf_counter()
    features = model.visual(pixels, grid)
    vision = time.perf_counter() - start
    print(f"vision tower on a {features.shape[0]}-token image (grid {grid.tolist()[0]}): "
          f"{vision:.1f} s; peak RSS {rss_gib():.2f} GiB", flush=True)
    print(f"an image question of {args.prompt} prompt tokens: time to the first token {vision + ttft:.1f} s "
          "(vision tower + prefill)", flush=True)
    if args.cache_file:
        start = time.perf_counter()
        write_safetensors(args.cache_file, {n: p.data for n, p in model.lm.named_parameters()})
        print(f"wrote {args.cache_file} in {time.perf_counter() - start:.1f} s")


def clip(path: Path, seconds: int = 30, fps: int = 24, size: tuple[int, int] = (1280, 720)) -> Path:
    """A synthetic 720p clip: moving colour gradients, `seconds` long (PyAV)."""
    import av
    import numpy as np

    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(seconds * fps):
            frame = np.stack([(xx + 8 * i) % 256, (yy + 3 * i) % 256, (xx + yy + 5 * i) % 256], -1).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return path


def apps_ttft(model: VLModel, prefix_cache_mb: int | None = None) -> None:
    """Time to the first token through the front ends' own paths, on `model` with the default model's
    tokenizer and processor: `app.VQA` on a 1024 x 1024 image (1,024 image tokens), and one caption
    of a 30 s 720p clip at the captioner's defaults (app.caption: its prompt, --fps 2, --max-frames
    64), each from the call to its first token (decoding and sampling the input included)."""
    import tempfile

    import numpy as np

    from app.caption import DEFAULT_PROMPT
    from app.default_model import default_model_path
    from app.vqa import VQA
    from lm.serving import EngineConfig
    from mm.pipeline import Pipeline
    from mm.processor import Processor

    model.generation_config = {"eos_token_id": [248046, 248044]}
    options = {} if prefix_cache_mb is None else {"prefix_cache_bytes": prefix_cache_mb << 20}
    vqa = VQA.from_pipeline(Pipeline(model, Processor.from_pretrained(default_model_path()), engine_options=options))
    cache = EngineConfig.of(**options).cache_bytes()  # the engine's budget, the model loaded
    print(f"engine: prefix cache {cache / 2**20:.0f} MiB", flush=True)
    image = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    start = time.perf_counter()
    answer = vqa.ask("What is in this picture?", image=image, max_new_tokens=1, enable_thinking=False)
    print(f"VQA, 1024 x 1024 image: {answer.prompt_tokens} prompt tokens, time to the first token "
          f"{time.perf_counter() - start:.1f} s; peak RSS {rss_gib():.2f} GiB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        video = clip(Path(tmp) / "clip.mp4")
        start = time.perf_counter()
        answer = vqa.ask(DEFAULT_PROMPT, video=str(video), fps=2.0, max_frames=64, max_new_tokens=1)
        print(f"caption of a 30 s 720p clip (captioner defaults): {answer.prompt_tokens} prompt tokens, time to "
              f"the first token {time.perf_counter() - start:.1f} s; peak RSS {rss_gib():.2f} GiB", flush=True)


def slice_load(path: Path, weights: str) -> None:
    """Streaming load of a real-shape slice, twice (converting, then from the converted-weights
    cache): time and the peak of anonymous memory (sampled; the checkpoint's mmap'd pages are page
    cache) against the final size and the largest checkpoint tensor."""
    import math
    import os
    import tempfile
    import threading

    import mm
    from safetensors import safe_open

    largest = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            largest = max([largest, *(math.prod(f.get_slice(k).get_shape()) * 2 for k in f.keys())])
    os.environ["QWEN35_CACHE"] = tempfile.mkdtemp(prefix="qwen35-bench-")  # a cold cache: the first load converts
    for run in ("converting", "from the cache"):
        base, peak, done = rss_gib("RssAnon"), [0.0], []

        def sample():
            while not done:
                peak[0] = max(peak[0], rss_gib("RssAnon"))
                time.sleep(0.005)

        thread = threading.Thread(target=sample)
        thread.start()
        start = time.perf_counter()
        model = mm.load_model(path, weights=weights)
        seconds = time.perf_counter() - start
        done.append(1)
        thread.join()
        layers = model.config.text.num_hidden_layers
        final = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        print(f"{path.name}, {run}: {layers} layers as {weights} in {seconds:.1f} s; final size {final:.2f} GiB; "
              f"peak anonymous memory +{peak[0] - base:.2f} GiB (final + largest tensor {final + largest / 2**30:.2f})",
              flush=True)
        del model


if __name__ == "__main__":
    main()
