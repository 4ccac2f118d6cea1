"""Exact prefix cache for the hybrid layers: snapshots of a sequence's whole decoding state.

A Gated DeltaNet layer's state after n tokens is a fixed-size summary that cannot be cut back to a
shorter prefix, so block-granular KV reuse (vLLM, SGLang) does not carry over: their hybrid caches
only hit at block boundaries. Here a snapshot is the complete state at one length: every layer's
KV up to that length, every DeltaNet conv window and recurrent state, and the logits of the last
token (so a request whose whole prompt is cached starts decoding at once). The engine takes
snapshots where reuse is likely: at the end of each prompt, at the positions the caller names (the
chat front end names each message's start and the start of the assistant turn, where the next
turn's history diverges), where a prompt leaves the longest prefix it shares with a stored one
(`shared_length`: the second request with a common prefix of any length makes the third hit), at
chunk boundaries of long prompts and at the end of each generation. A snapshot hits any request
whose key starts with the snapshot's key, whatever the length.

Keys are sequences of ints: the token ids, with media placeholders replaced by content hashes
(mm/engine_requests.py), so two different images never share a prefix. Lookup hashes the
request's prefix at each length that has a snapshot and compares the keys themselves on a hit
(no collisions trusted). Memory is bounded by bytes (least recently used first out).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..cache import Cache


@dataclass
class Snapshot:
    key: tuple[int, ...]
    state: Cache  # batch 1, exactly len(key) positions; never written after it is stored
    logits: torch.Tensor  # [vocab] of the last position
    nbytes: int
    array: np.ndarray  # the key, for shared_length


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, int], Snapshot] = OrderedDict()  # (length, hash) -> snapshot, LRU order
        self._lengths: dict[int, int] = {}  # snapshot length -> how many snapshots have it
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self.hit_tokens = self.lookup_tokens = 0  # prompt tokens reused / looked up

    def __len__(self) -> int:
        return len(self._entries)

    def snapshots(self) -> list[Snapshot]:
        """The stored snapshots, least recently used first."""
        return list(self._entries.values())

    def lookup(self, key: Sequence[int], *, count: bool = True) -> Snapshot | None:
        """The snapshot of the longest stored prefix of `key` (marked recently used), or None."""
        key = tuple(key)
        best = None
        for length in sorted(self._lengths, reverse=True):
            if length > len(key):
                continue
            entry = self._entries.get((length, hash(key[:length])))
            if entry is not None and entry.key == key[:length]:
                best = entry
                self._entries.move_to_end((length, hash(entry.key)))
                break
        if count:
            self.count(len(key), len(best.key) if best is not None else 0)
        return best

    def count(self, tokens: int, reused: int) -> None:
        """Record a lookup of `tokens` prompt tokens that reused `reused` of them (0: a miss)."""
        self.lookup_tokens += tokens
        if reused:
            self.hits += 1
            self.hit_tokens += reused
        else:
            self.misses += 1

    def shared_length(self, key: Sequence[int]) -> int:
        """The longest prefix `key` shares with any stored snapshot's key (not necessarily a whole
        key): where this request leaves a sequence seen before. A snapshot there lets the next
        request that shares as much hit, at whatever length that is."""
        query = np.asarray(key, dtype=np.int64)
        best = 0
        for entry in self._entries.values():
            n = min(len(query), len(entry.array))
            differ = np.flatnonzero(query[:n] != entry.array[:n])
            best = max(best, int(differ[0]) if differ.size else n)
        return best

    def insert(self, key: Sequence[int], state: Cache, logits: torch.Tensor) -> bool:
        """Store a snapshot (state: a batch-1 cache of len(key) positions, not written afterwards).
        False when it alone is larger than the whole budget."""
        key = tuple(key)
        if state.length != len(key):
            raise ValueError(f"a snapshot of {state.length} positions for a key of {len(key)}")
        slot = (len(key), hash(key))
        if slot in self._entries:
            self._entries.move_to_end(slot)
            return True
        nbytes = state.nbytes() + logits.numel() * logits.element_size()
        if nbytes > self.max_bytes:
            return False
        while self.nbytes + nbytes > self.max_bytes:
            self._evict()
        self._entries[slot] = Snapshot(key, state, logits, nbytes, np.asarray(key, dtype=np.int64))
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.nbytes += nbytes
        return True

    def _evict(self) -> None:
        (length, _), entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        self.evictions += 1
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]

    def clear(self) -> None:
        while self._entries:
            self._evict()

    def stats(self) -> dict:
        return dict(snapshots=len(self), bytes=self.nbytes, max_bytes=self.max_bytes, hits=self.hits,
                    misses=self.misses, evictions=self.evictions, hit_tokens=self.hit_tokens,
                    lookup_tokens=self.lookup_tokens,
                    hit_rate=self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0)  # fmt: skip
