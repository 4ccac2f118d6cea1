"""The serving engine's decoding state: one region per slot (row), each row with its own length.

`SlotStore` owns, for up to `slots` sequences at once:
- per full-attention layer, K and V `[slots, KV, capacity, D]`: row r's keys are `[r, :, :length[r]]`;
- per Gated DeltaNet layer, the conv window `[slots, kernel-1, conv_dim]` and the float32 recurrent
  state `[slots, Hv, Dk, Dv]`.

The running rows always occupy slots `0 .. n-1`, so a decode step of n rows works on plain views of
the first n rows (`view(n)`, a ragged `Cache`), which the one-call decode step and the layers write
in place. A row that leaves is replaced by the last row (`move`): one copy of that row's state,
instead of re-packing every row. The capacity grows (doubling, zero-filled) with the longest row,
up to `max_len`, so memory follows the lengths in use: at most
`slots * max_len * kv_bytes_per_token() + slots * state_bytes()`.

Rows enter and leave as batch-1 `Cache`s (`load` / `save`): a finished prefill, or a prefix-cache
snapshot.
"""

from __future__ import annotations

import torch

from ..cache import Cache, KVSlot
from ..config import TextConfig


class SlotStore:
    def __init__(self, config: TextConfig, slots: int, max_len: int, *, device, dtype: torch.dtype,
                 initial_capacity: int = 256):  # fmt: skip
        self.config, self.slots, self.max_len = config, slots, max_len
        self.device, self.dtype = device, dtype
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        probe = Cache(config, slots, 0, device=device, dtype=dtype)  # the state shapes, KV of length 0
        self.kv_layers = [i for i, s in probe.slots.items() if isinstance(s, KVSlot)]
        self.linear = {i: (s.conv, s.recurrent) for i, s in probe.slots.items() if not isinstance(s, KVSlot)}
        self.capacity = 0
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._views: dict[int, Cache] = {}
        self.ensure(min(initial_capacity, max_len))

    # -- sizes ---------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        c = self.config
        return len(self.kv_layers) * 2 * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def state_bytes(self) -> int:
        """The DeltaNet conv + recurrent state of one row."""
        return sum(t[0].numel() * t.element_size() for pair in self.linear.values() for t in pair)

    def nbytes(self) -> int:
        """Bytes held now (all slots at the current capacity)."""
        return self.slots * (self.capacity * self.kv_bytes_per_token() + self.state_bytes())

    def max_bytes(self) -> int:
        """The most this store can hold (every slot at max_len)."""
        return self.slots * (self.max_len * self.kv_bytes_per_token() + self.state_bytes())

    # -- storage -------------------------------------------------------------------------------
    def ensure(self, length: int) -> None:
        """Make room for rows of `length` positions (grows by doubling, up to max_len)."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"a row of {length} positions does not fit in max_len={self.max_len}")
        new = min(self.max_len, max(length, 2 * self.capacity))
        c = self.config
        for i in self.kv_layers:
            k = torch.zeros(self.slots, c.num_key_value_heads, new, c.head_dim, device=self.device, dtype=self.dtype)
            v = torch.zeros_like(k)
            if i in self.kv:  # keep what is there
                k[:, :, : self.capacity].copy_(self.kv[i][0])
                v[:, :, : self.capacity].copy_(self.kv[i][1])
            self.kv[i] = (k, v)
        self.capacity = new
        self._views.clear()  # views of the old tensors

    def view(self, rows: int, length: int | None = None) -> Cache:
        """A ragged cache over slots 0..rows-1 (views: a forward writes the store in place). The same
        object for the same rows until the capacity grows, so the decode plan built for it is reused.
        `length`: the longest of those rows, when the caller has it (else read from `lengths`)."""
        if rows not in self._views:
            kv = {i: (k[:rows], v[:rows]) for i, (k, v) in self.kv.items()}
            linear = {i: (conv[:rows], rec[:rows]) for i, (conv, rec) in self.linear.items()}
            self._views[rows] = Cache.ragged(kv, linear, self.lengths[:rows], self.capacity)
        view = self._views[rows]
        view.length = int(self.lengths[:rows].max()) if length is None else length
        return view

    def sync(self, view: Cache, rows: int) -> None:
        """After a forward through `view(rows)`: states that a layer replaced instead of updating in
        place (the reference DeltaNet path) are copied back into the store."""
        for i, (conv, rec) in self.linear.items():
            slot = view.slots[i]
            for new, stored, name in ((slot.conv, conv[:rows], "conv"), (slot.recurrent, rec[:rows], "recurrent")):
                if new.data_ptr() != stored.data_ptr():
                    stored.copy_(new)
                    setattr(slot, name, stored)

    # -- rows in and out -----------------------------------------------------------------------
    def load(self, row: int, state: Cache) -> None:
        """Put a batch-1 cache's state (its first `state.length` positions) into slot `row`."""
        length = state.length
        self.ensure(length + 1)
        for i in self.kv_layers:
            src = state.slots[i]
            self.kv[i][0][row, :, :length] = src.k[0, :, :length]
            self.kv[i][1][row, :, :length] = src.v[0, :, :length]
        for i, (conv, rec) in self.linear.items():
            conv[row] = state.slots[i].conv[0]
            rec[row] = state.slots[i].recurrent[0]
        self.lengths[row] = length

    def save(self, row: int) -> Cache:
        """A copy of slot `row`'s state as a batch-1 cache of exactly its length."""
        length = int(self.lengths[row])
        kv = {i: (k[row : row + 1, :, :length].clone(), v[row : row + 1, :, :length].clone())
              for i, (k, v) in self.kv.items()}  # fmt: skip
        linear = {i: (conv[row : row + 1].clone(), rec[row : row + 1].clone()) for i, (conv, rec) in self.linear.items()}
        return batch1_cache(kv, linear, length)

    def move(self, src: int, dst: int) -> None:
        """Copy slot `src`'s state into slot `dst` (src's slot is then free)."""
        length = int(self.lengths[src])
        for k, v in self.kv.values():
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]
        for conv, rec in self.linear.values():
            conv[dst] = conv[src]
            rec[dst] = rec[src]
        self.lengths[dst] = length


def batch1_cache(kv: dict, linear: dict, length: int) -> Cache:
    """A plain batch-1 cache of exactly `length` positions over the given tensors."""
    return Cache.over(kv, linear, length=length, max_len=length)


def row_state(cache: Cache, row: int, start: int) -> Cache:
    """Row `row` of a batch cache as a batch-1 cache (views) of its positions [start, cache.length):
    e.g. one prompt of a left-padded batch, `start` its padding."""
    kv = {i: (s.k[row : row + 1, :, start : cache.length], s.v[row : row + 1, :, start : cache.length])
          for i, s in cache.slots.items() if isinstance(s, KVSlot)}  # fmt: skip
    linear = {i: (s.conv[row : row + 1], s.recurrent[row : row + 1])
              for i, s in cache.slots.items() if not isinstance(s, KVSlot)}  # fmt: skip
    return batch1_cache(kv, linear, cache.length - start)


def trimmed(cache: Cache, *, copy: bool) -> Cache:
    """A batch-1 cache's state in tensors of exactly its length: copies, or (`copy=False`, for a
    cache that is not written again) views where the sizes already fit."""
    length = cache.length
    kv, linear = {}, {}
    for i, slot in cache.slots.items():
        if isinstance(slot, KVSlot):
            fits = slot.k.shape[2] == length and not copy
            kv[i] = (slot.k, slot.v) if fits else (slot.k[:, :, :length].clone(), slot.v[:, :, :length].clone())
        else:
            linear[i] = (slot.conv.clone(), slot.recurrent.clone()) if copy else (slot.conv, slot.recurrent)
    return batch1_cache(kv, linear, length)


def resumed(state: Cache, max_len: int) -> Cache:
    """A fresh batch-1 cache of `max_len` positions that starts from `state` (copied)."""
    length = state.length
    kv, linear = {}, {}
    for i, slot in state.slots.items():
        if isinstance(slot, KVSlot):
            shape = (1, slot.k.shape[1], max_len, slot.k.shape[3])
            k, v = slot.k.new_zeros(shape), slot.v.new_zeros(shape)
            k[:, :, :length], v[:, :, :length] = slot.k[:, :, :length], slot.v[:, :, :length]
            kv[i] = (k, v)
        else:
            linear[i] = (slot.conv.clone(), slot.recurrent.clone())
    return Cache.over(kv, linear, length=length, max_len=max_len)
