"""The hybrid decoder (`TextModel`) and its language-model head (`CausalLM`)."""

from __future__ import annotations

import torch
from torch import nn

from .attention import attention_mask_for
from .cache import Cache
from .config import TextConfig
from .decode import decode_layers, decode_logits
from .decoder import DecoderLayer
from .formats import gather_rows, stored
from .linear import Linear
from .mtp import MTPLayer
from .norm import RMSNorm
from .rotary import MRotaryEmbedding


class TextModel(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Cache, real: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, hidden] embeddings; positions [3, B, T]; the cache already has the T positions reserved."""
        rope = self.rotary_emb(positions, x.dtype)
        attn_mask = attention_mask_for(cache, x.shape[1])
        if x.shape[1] == 1 and real is None and (out := decode_layers(self, x, cache, rope, attn_mask)) is not None:
            return out  # one token per row on CPU: the same maths with the kernels called directly
        for i, layer in enumerate(self.layers):
            x = layer(x, cache.slots[i], rope, attn_mask, real)
        return self.norm(x)


def text_positions(cache: Cache, num_tokens: int) -> torch.Tensor:
    """Positions [3, B, T] of the next tokens when all three mRoPE rows are equal: the count of real
    tokens before each one (left padding does not shift positions; padding itself gets 0)."""
    if cache.lengths is not None:  # ragged (one token per row): its position is the row's length
        return cache.lengths[None, :, None].expand(3, -1, num_tokens)
    start, end = cache.length, cache.length + num_tokens
    pos = (cache.key_mask[:, :end].long().cumsum(-1) - 1)[:, start:end].clamp(min=0)
    return pos[None].expand(3, -1, -1)


class CausalLM(nn.Module):
    """Decoder + LM head. Parameter names equal the HF `Qwen3_5*ForCausalLM` names."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp: MTPLayer | None = None  # the checkpoint's MTP layer, when loaded (`add_mtp`)
        self.num_speculative_tokens = 0  # tokens the MTP layer drafts per step in generation (0: off)
        self.tie_weights()

    def add_mtp(self, num_speculative_tokens: int = 1) -> None:
        """Give the model its MTP layer (lm/mtp.py, parameters `mtp.*`; build on the meta device before
        allocating) and draft `num_speculative_tokens` (1..3) tokens per generation step with it."""
        if not 1 <= num_speculative_tokens <= 3:
            raise ValueError(f"num_speculative_tokens must be 1, 2 or 3, got {num_speculative_tokens}")
        self.mtp = MTPLayer(self.config)
        self.num_speculative_tokens = num_speculative_tokens

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (after building on the meta device and `to_empty`)."""
        rotary = MRotaryEmbedding(self.config).to(self.lm_head.weight.device)
        self.model.rotary_emb = rotary

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of activations and caches (float32 on CPU). The norms are stored in it; large
        weights may be stored in a compact format (lm/formats)."""
        return self.model.norm.weight.dtype

    def make_cache(self, batch: int, max_len: int) -> Cache:
        return Cache(self.config, batch, max_len, device=self.model.norm.weight.device, dtype=self.compute_dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, hidden] in the compute dtype (the table may be stored in bf16)."""
        table, fmt = stored(self.model.embed_tokens)
        return gather_rows(table, input_ids, fmt).to(self.compute_dtype)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, 1, vocab] with `last_only`) for the next T tokens.

        Give `input_ids` [B, T] or `inputs_embeds` [B, T, hidden]; `attention_mask` [B, T] is 0 on
        left padding; `positions` [3, B, T] are mRoPE positions (default: text positions). Without a
        cache, a fresh one just large enough is used and dropped.
        """
        b, t = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
        cache = self.make_cache(b, t) if cache is None else cache
        positions = _begin(cache, attention_mask, t, positions)
        if inputs_embeds is None and t == 1 and attention_mask is None:  # a decode step from token ids
            if (logits := decode_logits(self, input_ids, positions, cache)) is not None:
                cache.advance(t)
                return logits
        hidden = self._layers(input_ids, inputs_embeds, positions, attention_mask, cache)
        if last_only:
            hidden = hidden[:, -1:]
        return self.lm_head(hidden)

    def hidden_states(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache,
    ) -> torch.Tensor:
        """The final-normed hidden states [B, T, hidden] (what the LM head reads) of the next T tokens,
        written into `cache`; arguments as `forward`'s."""
        t = (input_ids if inputs_embeds is None else inputs_embeds).shape[1]
        positions = _begin(cache, attention_mask, t, positions)
        return self._layers(input_ids, inputs_embeds, positions, attention_mask, cache)

    def _layers(self, input_ids, inputs_embeds, positions, attention_mask, cache: Cache) -> torch.Tensor:
        """The decoder over T tokens whose positions `cache` has reserved; advances the cache."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        real = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
        hidden = self.model(x, positions, cache, real)
        cache.advance(x.shape[1])
        return hidden


def _begin(cache: Cache, attention_mask: torch.Tensor | None, t: int, positions: torch.Tensor | None) -> torch.Tensor:
    """Reserve the next `t` positions of `cache`; the tokens' positions (default: text positions)."""
    cache.begin(attention_mask, t)
    return text_positions(cache, t) if positions is None else positions
