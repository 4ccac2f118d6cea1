"""Decoding state of the hybrid decoder: one owner (`Cache`), each layer receives its own slot.

Full-attention layers keep a preallocated KV cache that grows with the sequence; Gated DeltaNet
layers keep a fixed-size conv window and recurrent state whatever the length.

Two ways to share a cache between rows:
- one write position (`length`) for all rows: prompts are left-padded, and `key_mask` records which
  positions are real (`stream_generate`'s static batches);
- ragged (`lengths`, one per row): each row has its own length and no padding, for the serving
  engine's decode steps, whose rows joined at different times (lm/serving/slots.py builds these views over
  its per-slot storage). A ragged cache takes one token per row per forward.
"""

from __future__ import annotations

import weakref

import torch

from .config import TextConfig


class CacheOverflowError(ValueError):
    """More tokens than the cache was made for."""


class KVSlot:
    """Key/value buffers `[B, KV, max_len, D]` of one full-attention layer. It refers to its cache
    weakly: a strong reference would make every cache a reference cycle, whose tensors (a prefix
    snapshot's KV, gigabytes of them) only Python's cyclic collector would free, seldom and late."""

    def __init__(self, cache: "Cache", k: torch.Tensor, v: torch.Tensor):
        self._cache, self.k, self.v = weakref.ref(cache), k, v

    @property
    def cache(self) -> "Cache":
        cache = self._cache()
        if cache is None:
            raise RuntimeError("a KV slot used after its cache was freed")
        return cache

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k, v` [B, KV, T, D] at the cache's write position; return all keys/values so far."""
        if self.cache.lengths is not None:  # ragged: row b writes its token at its own length
            rows, at = torch.arange(k.shape[0], device=k.device), self.cache.lengths
            self.k[rows, :, at] = k[:, :, 0]
            self.v[rows, :, at] = v[:, :, 0]
            end = self.cache.length + 1
            return self.k[:, :, :end], self.v[:, :, :end]
        start = self.cache.length
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class LinearSlot:
    """Conv window `[B, kernel-1, conv_dim]` and float32 recurrent state `[B, Hv, Dk, Dv]` of one DeltaNet layer."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent
        # during a verify forward (Cache.begin_verify): the state after each token but the last, and
        # the conv's inputs (the window before the forward, then each token's), for Cache.commit
        self.steps: list[torch.Tensor] | None = None
        self.conv_inputs: torch.Tensor | None = None
        # ... or, of a verify through the decode plan (lm/decode.py verify_logits), which steps conv
        # and recurrent in place to the state after each row's last token: the window and state after
        # each other token, [N, ...] each for the N tokens of all rows in order (Cache.verify_rows
        # says where each row's are; a row's last entry is not written)
        self.after: tuple[torch.Tensor, torch.Tensor] | None = None


class Cache:
    """All per-sequence decoding state. Made by `CausalLM.make_cache`, held by the engine."""

    def __init__(self, config: TextConfig, batch: int, max_len: int, *, device, dtype: torch.dtype):
        self.max_len = max_len
        self.length = 0  # positions written so far (shared by all rows; the longest row when ragged)
        self.lengths: torch.Tensor | None = None  # int64 [B] when ragged (see `ragged`)
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.padded = False  # whether key_mask may mark a written position as padding (see begin)
        self.verify_start: int | None = None  # the write position before a verify forward (begin_verify)
        self.verify_rows: list[int] | None = None  # each row's token count in a verify through the decode plan
        self.drafts = None  # a serving row's MTP state, carried by prefix snapshots (lm/serving/drafts.py)
        self.slots: dict[int, KVSlot | LinearSlot] = {}
        kv_shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
            config.linear_num_value_heads * config.linear_value_head_dim
        )
        state_shape = (batch, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
        for i, kind in enumerate(config.layer_types):
            if kind == "full_attention":
                k = torch.zeros(kv_shape, device=device, dtype=dtype)
                self.slots[i] = KVSlot(self, k, torch.zeros_like(k))
            else:
                conv = torch.zeros(batch, config.linear_conv_kernel_dim - 1, conv_dim, device=device, dtype=dtype)
                state = torch.zeros(state_shape, device=device, dtype=torch.float32)
                self.slots[i] = LinearSlot(conv, state)

    @classmethod
    def over(cls, kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
             linear: dict[int, tuple[torch.Tensor, torch.Tensor]], *, length: int, max_len: int) -> "Cache":
        """An unpadded cache over existing tensors (views, written in place) with `length` positions
        written: `kv` maps each full-attention layer to its (k, v) [B, KV, >=length, D], `linear` each
        DeltaNet layer to its (conv, recurrent). (lm/serving/slots.py: a slot's state, a snapshot.)"""
        self = cls.__new__(cls)
        self.max_len, self.length, self.lengths = max_len, length, None
        first = next(iter({**kv, **linear}.values()))[0]
        self.key_mask = torch.ones(first.shape[0], max_len, dtype=torch.bool, device=first.device)
        self.padded, self.verify_start, self.verify_rows, self.drafts = False, None, None, None
        slots = {i: KVSlot(self, k, v) for i, (k, v) in kv.items()}
        self.slots = dict(sorted({**slots, **{i: LinearSlot(*pair) for i, pair in linear.items()}}.items()))
        return self

    @classmethod
    def ragged(cls, kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
               linear: dict[int, tuple[torch.Tensor, torch.Tensor]], lengths: torch.Tensor, max_len: int) -> "Cache":
        """A ragged cache over existing storage (as `over`, k and v [B, KV, max_len, D]): `lengths`
        [B] int64 is each row's count of positions written, advanced in place by each forward."""
        self = cls.over(kv, linear, length=int(lengths.max()) if lengths.numel() else 0, max_len=0)
        self.max_len, self.lengths = max_len, lengths  # no key mask: rows have no padding
        return self

    @property
    def batch(self) -> int:
        return self.key_mask.shape[0]

    def begin(self, attention_mask: torch.Tensor | None, num_tokens: int) -> None:
        """Reserve `num_tokens` positions for the next forward; `attention_mask` [B, T] marks real tokens."""
        if self.lengths is not None:
            if num_tokens != 1 or attention_mask is not None:
                raise ValueError("a ragged cache takes one token per row and no padding")
            if self.length + 1 > self.max_len:
                raise CacheOverflowError(f"a row of {self.length + 1} tokens does not fit in max_len={self.max_len}")
            return
        end = self._end(num_tokens)
        real = True if attention_mask is None else attention_mask.bool()
        self.key_mask[:, self.length : end] = real
        # once a row has padding, attention needs the key mask; until then a decode step (one token
        # per row, all real) skips building it (attention_mask_for)
        self.padded = self.padded or (attention_mask is not None and not bool(real.all()))

    def begin_token(self) -> None:
        """`begin(None, 1)` of a CPU cache (the steps of the CPU decode plan, lm/decode.py): one real
        token per row, its column of the key mask written through a numpy view. (Right after a
        decode step's weight stream a tensor operation from Python costs 30-80 us.)"""
        if self.lengths is not None:
            return self.begin(None, 1)
        column = self._end(1) - 1
        view = getattr(self, "_key_mask_view", None)  # (the mask it views, the view): `keep` replaces the mask
        if view is None or view[0] is not self.key_mask:
            view = self._key_mask_view = (self.key_mask, self.key_mask.numpy())
        view[1][:, column] = True

    def _end(self, num_tokens: int) -> int:
        """The end of the next `num_tokens` positions, which must fit in max_len."""
        end = self.length + num_tokens
        if end > self.max_len:
            raise CacheOverflowError(
                f"{end} tokens do not fit in a cache made for max_len={self.max_len}; "
                "shorten the prompt or ask for fewer new tokens"
            )
        return end

    def advance(self, num_tokens: int) -> None:
        if self.lengths is not None:
            self.lengths += num_tokens
        self.length += num_tokens

    def begin_verify(self) -> None:
        """Make the next forward a verify of speculative tokens: its DeltaNet layers keep each token's
        state (lm/gated_deltanet.py), so that `commit` can keep any prefix of its tokens."""
        self.verify_start = self.length
        for slot in self.slots.values():
            if isinstance(slot, LinearSlot):
                slot.steps, slot.conv_inputs = [], None

    def commit(self, kept: int | list[int]) -> None:
        """Keep the first `kept` (>= 1; one count per row, or one for all) tokens of each row of the
        forward since `begin_verify` (or of a verify through the decode plan) and leave each row as
        if it had never seen the others: its DeltaNet recurrent states and conv windows become those
        after its last kept token, and its dropped KV positions are zeroed and masked out. Positions
        that every row dropped are given back (the write position moves back); those that only some
        rows dropped stay as masked holes in those rows, as left padding is. A ragged cache (the
        serving engine's) just counts each row's kept positions: its dropped ones lie beyond the
        row's length, unread, and are overwritten by its next tokens. Costs one copy of a row's
        DeltaNet states when it drops tokens, nothing when it keeps all."""
        counts = self.verify_rows or [self.length - self.verify_start] * self.batch
        kept = [kept] * self.batch if isinstance(kept, int) else list(kept)
        if len(kept) != self.batch or not all(1 <= n <= total for n, total in zip(kept, counts)):
            raise ValueError(f"cannot keep {kept} of the {counts} tokens of a verify forward of {self.batch} row(s)")
        ends = [sum(counts[:row]) + n - 1 for row, n in enumerate(kept)]  # each row's last kept token in `after`
        for slot in self.slots.values():
            if isinstance(slot, LinearSlot):
                window = slot.conv.shape[1]
                for row, n in enumerate(kept):
                    if n == counts[row]:  # all kept: the state is the forward's own
                        continue
                    if slot.after is not None:  # the plan's verify: the state after the last kept token
                        slot.conv[row].copy_(slot.after[0][ends[row]])
                        slot.recurrent[row].copy_(slot.after[1][ends[row]])
                    else:
                        slot.recurrent[row].copy_(slot.steps[n - 1][row])
                        slot.conv[row].copy_(slot.conv_inputs[row, n : n + window])
                slot.steps, slot.conv_inputs, slot.after = None, None, None
        self.verify_rows = None
        if self.lengths is not None:
            self.lengths += torch.tensor(kept, device=self.lengths.device)
            self.length = int(self.lengths.max())
            return
        start, self.verify_start = self.verify_start, None
        for row, n in enumerate(kept):
            self._drop_positions(start + n, rows=slice(row, row + 1))
        self.length = start + max(kept)
        self.padded = self.padded or min(kept) < max(kept)

    def truncate(self, length: int) -> None:
        """Forget the positions from `length` on of a cache whose layers are all full attention (the
        MTP layer's), as if they had never been written."""
        if any(isinstance(slot, LinearSlot) for slot in self.slots.values()):
            raise ValueError("a DeltaNet state cannot be truncated; verify with begin_verify / commit")
        self._drop_positions(length)
        self.length = min(self.length, length)

    def _drop_positions(self, length: int, rows: slice = slice(None)) -> None:
        """Zero and mask out the given rows' KV positions from `length` to the write position."""
        if self.lengths is not None:
            raise ValueError("a ragged cache cannot drop positions")
        if length < self.length:
            for slot in self.slots.values():
                if isinstance(slot, KVSlot):
                    slot.k[rows, :, length : self.length] = 0
                    slot.v[rows, :, length : self.length] = 0
            self.key_mask[rows, length : self.length] = False

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (e.g. drop finished sequences), in that order."""
        self.key_mask = self.key_mask[rows]
        for slot in self.slots.values():
            if isinstance(slot, KVSlot):
                slot.k, slot.v = slot.k[rows], slot.v[rows]
            else:
                slot.conv, slot.recurrent = slot.conv[rows], slot.recurrent[rows]

    def nbytes(self) -> int:
        total = self.key_mask.numel()
        for slot in self.slots.values():
            for t in (slot.k, slot.v) if isinstance(slot, KVSlot) else (slot.conv, slot.recurrent):
                total += t.numel() * t.element_size()
        return total + (self.drafts.nbytes() if self.drafts is not None else 0)
