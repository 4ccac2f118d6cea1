"""Fit a checkpoint's MTP layer to its own model's greedy continuations, for a real acceptance.

    python -m bench.mtp_fit --checkpoint DIR --out DIR2 [--prompts 32] [--tokens 48] [--steps 300]

Random weights draft tokens the main model never picks, so speculative decoding cannot be shown
paying on them. This writes a copy of the checkpoint whose `mtp.*` layer was trained (Adam,
cross-entropy) to predict the main model's greedy token after next from its hidden state and the
next token, on the main model's own greedy continuations of random prompts: a draft model as real
ones are made, for the benchmark's honest figures (`python -m bench.mtp --checkpoint DIR2`). Only
the MTP layer is trained; the main model, its embeddings and its head are the checkpoint's. It
runs on the reference PyTorch paths (QWEN35_CPU_KERNELS=0, set here: the C++ kernels have no
backward), so it suits small models such as the built-in one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from lm import SamplingParams, generate
from mm.loading import load_model


def continuations(lm, prompts: int, prompt_len: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """[prompts, prompt_len + tokens]: random prompts, each followed by the model's greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 20000, (prompts, prompt_len), generator=g)
    out = generate(lm, ids, SamplingParams(max_new_tokens=tokens, temperature=0.0))
    return torch.cat([ids, torch.tensor(out)], dim=1)


def mtp_loss(lm, seq: torch.Tensor, hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the MTP layer's drafts over the greedy part of `seq` [B, T] (from `start`),
    with the main model's hidden states [B, T, H]; and the share of drafts equal to the target."""
    b, t = seq.shape
    embeds = lm.embed(seq[:, 1:])  # token i + 1 beside hidden state i
    positions = torch.arange(t - 1)[None, None].expand(3, b, -1)
    cache = lm.mtp.make_cache(b, t)
    g = lm.mtp(embeds, hidden[:, :-1], lm.model.rotary_emb(positions, embeds.dtype), cache)  # [B, T-1, H]
    g, target = g[:, start - 2 : -1], seq[:, start:]  # drafts of token i + 2 for the greedy tokens
    logits = F.linear(g, lm.lm_head.weight)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return loss, float((logits.argmax(-1) == target).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    if os.environ.get("QWEN35_CPU_KERNELS") != "0":
        os.environ["QWEN35_CPU_KERNELS"] = "0"
        print("[qwen35] fitting on the reference PyTorch paths (QWEN35_CPU_KERNELS=0): the C++ kernels have no "
              "backward", file=sys.stderr)  # fmt: skip
    started = time.perf_counter()
    model = load_model(args.checkpoint, weights="fp32", speculative="mtp")
    lm = model.lm
    with torch.no_grad():
        seq = continuations(lm, args.prompts + 8, args.prompt_len, args.tokens)
        hidden = torch.cat([lm.hidden_states(seq[i : i + 8], cache=lm.make_cache(8, seq.shape[1]))
                            for i in range(0, len(seq), 8)])  # fmt: skip
    train, held = (seq[: args.prompts], hidden[: args.prompts]), (seq[args.prompts :], hidden[args.prompts :])
    print(f"{len(seq)} greedy continuations of {args.tokens} tokens in {time.perf_counter() - started:.0f} s",
          flush=True)  # fmt: skip
    for p in lm.parameters():
        p.requires_grad_(False)
    params = [p for p in lm.mtp.parameters()]
    for p in params:
        p.requires_grad_(True)
    optim = torch.optim.Adam(params, lr=args.lr)
    g = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):
        rows = torch.randint(0, args.prompts, (args.batch,), generator=g)
        loss, hit = mtp_loss(lm, train[0][rows], train[1][rows], args.prompt_len + 1)
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 50 == 0 or step == args.steps:
            with torch.no_grad():
                _, held_hit = mtp_loss(lm, *held, args.prompt_len + 1)
            print(f"step {step}: loss {loss.item():.3f}, drafts right {hit:.0%} (held-out prompts {held_hit:.0%}), "
                  f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    out = Path(args.out)
    shutil.copytree(args.checkpoint, out, dirs_exist_ok=True)
    tensors = load_file(str(out / "model.safetensors"))
    dtype = next(t.dtype for n, t in tensors.items() if n.startswith("mtp."))
    fitted = {f"mtp.{n}": p.detach().to(dtype).contiguous() for n, p in lm.mtp.state_dict().items()}
    missing = [n for n in fitted if n not in tensors]
    if missing:
        raise SystemExit(f"the checkpoint's MTP tensors are laid out otherwise (no {missing[0]})")
    save_file({**tensors, **fitted}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "mtp_fit.json").write_text(json.dumps(vars(args), indent=2))
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
