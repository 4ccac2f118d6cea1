"""lm.serving: the serving engine (continuous batching with chunked prefill beside decode, and a
prefix cache) and synchronous batched generation, on one generation core.

    engine.py        Engine: the thread that owns the model; submit / cancel / close from any thread
    scheduler.py     admission and the step's token budget: which rows decode, which prompt prefills
    runner.py        the generation core: a prefill forward, one decode step, the finish rules
    slots.py         SlotStore: the running rows' caches, one region per slot
    prefix_cache.py  PrefixCache: snapshots of prompt states, resumed by later requests
    request.py       Prompt, Request and their errors
    config.py        EngineConfig: every engine option and its default, written once
    generate.py      stream_generate / generate: one left-padded batch, synchronously
    speculative.py   speculative decoding with the MTP layer: its maths, and stream_generate's
    drafts.py        ... in the engine: each row's MTP state, one draft-and-verify step of the slots

`Engine(lm)` runs one background thread that owns the model. Any thread may `submit` a request
(its prompt and its own `SamplingParams`) and iterate the returned `Request` for its tokens as they
are sampled, or `cancel()` it. Each engine step:

1. drops cancelled requests (a running row's slot is freed at once);
2. decodes one token for every running row together, each row at its own length (slots.py:
   no shared write position, no left padding);
3. spends the rest of the step's token budget (`step_tokens` of EngineConfig, minus the running rows)
   on the prompt at the head of the queue, in chunks: a long prompt arriving costs the running
   streams at most one chunk of prefill per token. With no stream running, a chunk is
   `prefill_chunk` tokens, for throughput. Short text prompts without a cached prefix that
   wait together are prefilled together, left-padded in one forward. A prompt that finishes
   samples its first token and takes the next free slot.

Memory is bounded: `max_batch` slots of at most `max_len`
positions each (SlotStore), one prompt in prefill at a time, and the prefix cache's byte budget,
which holds every snapshot (a copy too large for the whole budget is never made). A prompt takes at
most `named_snapshots` of the snapshots its caller names (one per message would be a copy of the
state per message: 5,000 short messages, 5,000 copies of a growing KV cache).
Requests beyond the free slots wait in order, never dropped; a request that cannot fit in one slot
(prompt + max_new_tokens > max_len) is refused at `submit` with `RequestTooLargeError`.

Prefix cache (prefix_cache.py): before its prefill, a request resumes from the longest stored
snapshot whose key starts its own key, and prefills only the rest. Snapshots are taken at the end
of each prompt, at the prompt positions the caller names (`Prompt.snapshot_at`: the chat front end
names each message's start and the start of the assistant turn, where the next turn's history
diverges; at most `named_snapshots` of them: the first and the last ones), where the prompt leaves
the longest prefix it shares with a stored snapshot's key,
every `snapshot_every` tokens of long prompts, and at the end of each generation.

Greedy outputs equal one-request-at-a-time generation (`stream_generate` with batch 1): every row
is computed as it would be alone; tests/lm/serving/test_scheduler.py checks this token for token.

With the model's MTP layer loaded (`speculative="mtp"`), step 2 drafts and verifies (drafts.py):
each row drafts up to K tokens and keeps 1 to K + 1; greedy outputs stay those of one request at a
time (tests/lm/serving/test_speculative_engine.py). Every 32nd such step runs without drafts, timed,
and the engine says once when drafting makes decoding slower than that (`stats()`:
`speculative_speedup`).
"""

from .config import EngineConfig, default_prefix_cache_bytes
from .engine import Engine
from .generate import TokenEvent, generate, stream_generate
from .request import EngineClosedError, Prompt, Request, RequestTooLargeError
from .speculative import SpeculativeStats

__all__ = [
    "Engine", "EngineClosedError", "EngineConfig", "Prompt", "Request", "RequestTooLargeError", "SpeculativeStats",
    "TokenEvent", "default_prefix_cache_bytes", "generate", "stream_generate",
]
