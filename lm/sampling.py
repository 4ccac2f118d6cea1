"""Sampling parameters and the per-step token sampler."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from . import kernels


SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes
INT_MAX = (1 << 31) - 1  # the largest token count or top_k any request may name
MAX_LOGPROBS = 20  # the most alternatives a sampled token's logprobs list (OpenAI's limit)
PREFIX_SEARCH = 1024  # top-p / min-p look for their cut among this many likeliest tokens first (_candidates)
DRAW_BLOCK = 1024  # draw() sums the probabilities in blocks of this many, then searches one block


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. `temperature=0` is greedy; `top_k=0`, `top_p=1`, `min_p=0` are off.

    `repetition_penalty` (HF semantics) divides positive / multiplies negative logits of every token
    already in the prompt or output; `presence_penalty` (OpenAI/vLLM semantics) subtracts a constant
    from tokens already generated, `frequency_penalty` (the same) that constant times how often each
    was generated. `stop` holds stop strings (checked on detokenised text by the
    pipeline); `stop_token_ids` end a sequence when sampled, like the model's EOS tokens.

    Constraints, which mm.Pipeline turns into a rule on each next token (mm/constraints.py; the lm
    engine alone refuses them): at most one of `json_schema` (a JSON schema, as a dict or its JSON
    text: the answer is one JSON value that validates, compact), `regex` and `grammar` (EBNF, the
    GBNF dialect of xgrammar); with thinking on they apply to the answer after `</think>`.
    `thinking_budget`: at most this many thinking tokens, then the thinking is closed for the model
    (a short closing sentence and `</think>`) and the answer follows.

    `logit_bias` ({token id: bias} or its pairs) is added to the logits before anything else.
    `logprobs` (0-20, None: off) records, for each sampled token, its log-probability and that many
    most likely alternatives: the log-softmax of the logits after the bias, the penalties and any
    constraint, before temperature and top-k / top-p / min-p (`Sampler.logprobs`).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    frequency_penalty: float = 0.0
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    thinking_budget: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if isinstance(self.json_schema, dict):  # held as JSON text: the params stay hashable
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.seed is None or (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX),
             f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {self.seed}"),
            (self.max_new_tokens <= INT_MAX, f"max_new_tokens must be <= {INT_MAX}"),
            (self.top_k <= INT_MAX, f"top_k must be <= {INT_MAX}"),
            (sum(c is not None for c in (self.json_schema, self.regex, self.grammar)) <= 1,
             "give at most one of json_schema, regex and grammar"),
            (self.thinking_budget is None or 0 <= self.thinking_budget <= INT_MAX,
             f"thinking_budget must be in [0, {INT_MAX}]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias needs token ids >= 0 and biases in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid SamplingParams: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def constrained(self) -> bool:
        """Whether the params ask for a constraint that a rule enforces (see the class docstring)."""
        return any(c is not None for c in (self.json_schema, self.regex, self.grammar, self.thinking_budget))

    @property
    def penalised(self) -> bool:
        """Whether a penalty or a bias changes the logits before the pick."""
        return (self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)
                or bool(self.logit_bias))  # fmt: skip


class Sampler:
    """Picks one token per active row from float32 logits, applying each row's `SamplingParams`."""

    def __init__(self, params: list[SamplingParams], prompts: list[list[int]], device: torch.device | str = "cpu"):
        self.params = params
        self.prompts = prompts
        self.generators = [_generator(p.seed, device) for p in params]
        self.plain_greedy = all(p.greedy and not p.penalised and p.logprobs is None for p in params)  # argmaxes
        self.logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}  # row -> its last pick's (see below)
        # then float32 CPU logits take one kernel call for all rows (lm/kernels/argmax.cpp): per row,
        # indexing and argmax are tensor operations from Python, and each line of Python right after
        # a decode step runs cache-cold (~10-80 us; this call ~45 us for a 248k vocabulary)
        k = kernels._kernels() if self.plain_greedy else None
        self.argmax_rows = None if k is None else k.argmax_rows  # [B, V] float32 CPU -> each row's argmax

    def argmax_all(self, logits: torch.Tensor) -> list[int] | None:
        """Each row's argmax of logits [B, V] in one kernel call, when every row is plain greedy and
        the logits are float32 on the CPU; else None."""
        if self.argmax_rows is not None and logits.dtype == torch.float32 and logits.is_cpu and logits.dim() == 2:
            return self.argmax_rows(logits)
        return None

    def __call__(self, logits: torch.Tensor, rows: list[int], outputs: list[list[int]]) -> list[int]:
        """logits [len(rows), V]; `rows` are the original batch rows; `outputs` their tokens so far."""
        if (picks := self.argmax_all(logits)) is not None:
            return picks
        picks = []
        for i, row in enumerate(rows):
            p = self.params[row]
            scores = _penalise(logits[i].float(), p, self.prompts[row], outputs[row])
            if p.greedy:
                picks.append(argmax(scores))
            else:
                candidates, probs = _candidates(scores / p.temperature, p)
                choice = draw(probs, self.generators[row])
                picks.append(choice if candidates is None else int(candidates[choice]))
            if p.logprobs is not None:
                self.logprobs[row] = _logprobs(scores, picks[-1], p.logprobs)
        return picks


    def distribution(self, logits: torch.Tensor, row: int, output: list[int]) -> torch.Tensor:
        """The probabilities [V] a sampled row's next token is drawn from after logits [V] and its
        tokens so far (`output`): the bias and penalties, the temperature, top-k / top-p / min-p, as
        in __call__ (speculative sampling compares two of them: lm/serving/speculative.py)."""
        p = self.params[row]
        scores = _penalise(logits.float(), p, self.prompts[row], output)
        candidates, probs = _candidates(scores / p.temperature, p)
        if candidates is None:
            return probs
        return torch.zeros_like(scores).index_put_((candidates,), probs)

    def logprobs_of(self, logits: torch.Tensor, row: int, output: list[int], token: int
                    ) -> tuple[float, list[tuple[int, float]]]:  # fmt: skip
        """What __call__ records in `logprobs` for a row with logprobs that picked `token` after
        logits [V] and its tokens so far (`output`): the log-softmax after the bias and penalties."""
        p = self.params[row]
        return _logprobs(_penalise(logits.float(), p, self.prompts[row], output), token, p.logprobs or 0)

    def draw(self, probs: torch.Tensor, row: int) -> int:
        """A token drawn from probs [V] with the row's generator."""
        return draw(probs, self.generators[row])


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """An index drawn from `probs` [n] (non-negative weights, any positive sum), with probability
    probs[i] / sum(probs): the inverse of their cumulative sum, in float64, at one uniform number of
    `generator` (the global one when None). Zero weights are never drawn. torch.multinomial draws one
    exponential number per entry: ~8 ms for a 248k vocabulary on 2 cores, as much as a decode step of
    a small model for each sampled row; this sums blocks of DRAW_BLOCK weights, finds the block, then
    the entry in it: ~0.3 ms (python -m bench.sampling). Raises ValueError for NaN, infinite or
    negative weights, or no positive one, as torch.multinomial does."""
    p = probs.detach().reshape(-1).cpu()
    p = (p if p.dtype in (torch.float32, torch.float64) else p.float()).contiguous().numpy()
    whole = p.size // DRAW_BLOCK * DRAW_BLOCK
    sums = p[:whole].reshape(-1, DRAW_BLOCK).sum(axis=1, dtype=np.float64)
    if whole < p.size:
        sums = np.append(sums, p[whole:].sum(dtype=np.float64))
    cdf = np.cumsum(sums)
    if not (p.size and np.isfinite(cdf[-1]) and cdf[-1] > 0 and p.min() >= 0):
        raise ValueError("draw: probabilities must be finite and non-negative with a positive sum")
    u = float(torch.rand((), dtype=torch.float64, generator=generator)) * cdf[-1]
    block = int(np.searchsorted(cdf, u, side="right"))
    if block == len(cdf):  # u rounded up to the total: the last block with weight
        block = int(np.flatnonzero(sums)[-1])
    start = cdf[block - 1] if block else 0.0
    part = p[block * DRAW_BLOCK:(block + 1) * DRAW_BLOCK]
    i = int(np.searchsorted(start + np.cumsum(part, dtype=np.float64), u, side="right"))
    if i == len(part):  # the block's own sum rounded above its running sum: its last entry with weight
        i = int(np.flatnonzero(part)[-1])
    return block * DRAW_BLOCK + i


def argmax(scores: torch.Tensor) -> int:
    """`int(scores.argmax())` of a 1-D tensor: the first largest, a NaN before any number. On CPU
    through the kernels' argmax (lm/kernels/argmax.cpp), else numpy's vectorised one, which have
    the same rules: over a 248,320-token vocabulary right after a decode step (the interpreter's
    data cache-cold) torch's takes ~300 us, numpy's ~75 us, the kernel's ~40 us; a batch-1 int4
    decode step of the benchmark model takes ~10 ms."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32:
        scores = scores.detach().contiguous()
        if (k := kernels._kernels()) is not None:
            return k.argmax(scores)
        return int(scores.numpy().argmax())
    return int(scores.argmax())


def _generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def _logprobs(scores: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of `token`, the `top` most likely (id, log-probability)) under scores' softmax."""
    logp = torch.log_softmax(scores.float(), dim=-1)
    values, ids = torch.topk(logp, top) if top else (logp[:0], logp[:0].long())
    return float(logp[token]), list(zip(ids.tolist(), values.tolist()))


def _penalise(scores: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=scores.device)
        if int(ids.max()) >= scores.shape[-1]:
            raise ValueError(f"logit_bias names token {int(ids.max())}, beyond the vocabulary of {scores.shape[-1]}")
        scores = scores.index_add(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=scores.dtype,
                                                       device=scores.device))  # fmt: skip
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), device=scores.device)
        s = scores[seen]
        scores = scores.clone()
        scores[seen] = torch.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
    if p.presence_penalty and output:
        seen = torch.tensor(sorted(set(output)), device=scores.device)
        scores = scores.clone()
        scores[seen] -= p.presence_penalty
    if p.frequency_penalty and output:
        counts = torch.bincount(torch.tensor(output, device=scores.device), minlength=scores.shape[-1])
        scores = scores - p.frequency_penalty * counts[: scores.shape[-1]].to(scores.dtype)
    return scores


@dataclass(frozen=True)
class TokenRule:
    """A constraint on one sampled token: only the ids in `allow` (when given) and those `mask` (a bool
    [V] tensor, when given) or `bits` (the same as packed int32 words, when given) keep, never those
    in `ban`. The serving engine asks a request's rule before each of its tokens (e.g. the server's
    tool_choice, a JSON schema). `bits` is the grammar libraries' layout (token t is allowed when
    bit t % 32 of word t // 32 is set): a grammar's rule hands its bitmask over as it is, and one
    kernel pass applies it (lm/kernels/token_bits.cpp; unpacking it into `mask` costs 2-3 passes)."""

    allow: tuple[int, ...] | None = None
    ban: tuple[int, ...] = ()
    mask: torch.Tensor | None = None
    bits: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every excluded token at -inf."""
        if self.bits is not None:
            logits = apply_token_bits(logits, self.bits)
        if self.mask is not None:
            logits = logits.masked_fill(~self.mask[: logits.shape[-1]], float("-inf"))
        if self.allow is not None:
            keep = torch.tensor(self.allow, device=logits.device)
            out = torch.full_like(logits, float("-inf"))
            out[keep] = logits[keep]
            logits = out
        if self.ban:
            logits = logits.clone()
            logits[torch.tensor(self.ban, device=logits.device)] = float("-inf")
        return logits


_SHIFTS = torch.arange(32, dtype=torch.int32)


def pack_tokens(mask: torch.Tensor) -> torch.Tensor:
    """A bool [V] mask as int32 words [ceil(V / 32)] (TokenRule.bits' layout)."""
    words = -(-mask.shape[-1] // 32)
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: mask.shape[-1]] = mask.to(torch.int64)
    packed = (padded.view(words, 32) << _SHIFTS.to(torch.int64)).sum(1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_tokens(bits: torch.Tensor, size: int) -> torch.Tensor:
    """int32 words (TokenRule.bits' layout) as a bool [size] mask."""
    return ((bits[:, None] >> _SHIFTS) & 1).bool().reshape(-1)[:size]


def apply_token_bits(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [V] (a new tensor) with -inf where `bits` (TokenRule.bits' layout) has a clear bit: one
    kernel pass on float32 CPU logits, else the reference (unpack, then masked_fill)."""
    if logits.is_cpu and logits.dtype == torch.float32 and (k := kernels._kernels()) is not None:
        return k.apply_token_bits(logits, bits)
    return logits.masked_fill(~unpack_tokens(bits, logits.shape[-1]).to(logits.device), float("-inf"))


def _candidates(scores: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Token ids that survive top-k, top-p (nucleus) and min-p, most likely first, and their
    renormalised probabilities (sampling then touches only the candidates, not the whole vocabulary).
    Without any filter every token is a candidate: (None, the softmax in vocabulary order). With
    top-p / min-p alone, the candidates are looked for among the PREFIX_SEARCH likeliest tokens first
    (a full sort of a 248k vocabulary takes ~16 ms) and the whole vocabulary is sorted only when they
    do not hold the cut; the result is the same."""
    if not p.top_k and p.top_p >= 1.0 and p.min_p <= 0:
        return None, torch.softmax(scores, dim=-1)
    if p.top_k:
        values, index = largest(scores, min(p.top_k, scores.shape[-1]))
        probs = torch.softmax(values, dim=-1)  # sorted, descending
    else:
        total = torch.logsumexp(scores, dim=-1)  # probabilities of the whole vocabulary, computed alike
        values, index = largest(scores, min(PREFIX_SEARCH, scores.shape[-1]))
        probs = torch.exp(values - total)
        if values.shape[-1] < scores.shape[-1] and _kept(probs, p) == values.shape[-1]:  # the cut lies beyond
            values, index = torch.sort(scores, descending=True)
            probs = torch.exp(values - total)
    n = _kept(probs, p)
    return index[:n], probs[:n] / probs[:n].sum()


def largest(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(scores, k)` of a 1-D tensor: the k largest values, largest first, and their indices.
    On CPU float32 through the kernels' `largest_k` (lm/kernels/argmax.cpp: one pass against a
    running threshold; over a 248k vocabulary 0.5-0.8 -> 0.11 ms for k = 20), which ranks as torch.topk
    does for distinct values and a NaN above every number, and equal values by index."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 1:
        if (k_ := kernels._kernels()) is not None:
            return k_.largest_k(scores.contiguous(), k)
    return torch.topk(scores, k)


def _kept(probs: torch.Tensor, p: SamplingParams) -> int:
    """How many of the sorted candidates top-p and min-p keep (they keep a prefix)."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_p < 1.0:
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        keep &= before < p.top_p
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs[0]
    return int(keep.sum())
