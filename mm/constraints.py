"""Constraints on an answer's tokens, as rules for the serving engine (lm/serving: before each token
a request's rule says which tokens may come next): structured outputs and a thinking budget.

- Structured outputs (`SamplingParams.json_schema`, `regex`, `grammar`) go through xgrammar, the
  grammar library vLLM and SGLang use: its compiler turns the schema into a grammar over this
  tokenizer's vocabulary once (cached by source), and a matcher per request gives the bitmask of the
  tokens that keep the output inside the grammar. JSON is compact (no whitespace between tokens),
  so a model cannot drift into endless whitespace, and no token with a raw control character
  (U+0000-U+001F) may appear: JSON allows them only escaped, which xgrammar's string rule does not
  enforce, so they are masked out (compact JSON has no other place for them). Nor may a token write
  a UTF-16 surrogate (U+D800-U+DFFF) in UTF-8 form (bytes ED A0-BF xx; see `Surrogates`): that is no
  valid UTF-8, but xgrammar's character classes count one as a character, so a string would decode
  to replacement characters past its maxLength. A schema with a keyword xgrammar would not enforce
  is refused (mm/schema_check.py). Once the grammar is complete, only the end of
  the turn may follow. With thinking on, the thinking is free and the grammar applies from the
  first token after `</think>`; nothing constrained lands in the reasoning.
- A thinking budget (`SamplingParams.thinking_budget`): after that many thinking tokens, the
  thinking is closed for the model with the sentence Qwen's documentation recommends, then
  `</think>`; the answer (and its own rule, if any) follows.

A grammar that admits no next token fails its request with `ConstraintError`; the engine's fault
isolation keeps the other requests going. Random weights (the built-in model) never close a string
or the thinking by themselves: a schema's strings need `maxLength` and the thinking a budget to end
there, a property of grammar-constrained decoding, not of this code.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence

import torch

from lm.sampling import SamplingParams, TokenRule, pack_tokens, unpack_tokens

from .schema_check import unenforced

THINK_END = "</think>"
BUDGET_CLOSING = ("\n\nConsidering the limited time by the user, I have to give the solution based on the thinking "
                  "directly now.\n" + THINK_END)  # fmt: skip

Rule = Callable[[list[int]], TokenRule | None]


class ConstraintError(ValueError):
    """A schema, regex or grammar that cannot be compiled, or one that admits no next token; `param`
    names the request field at fault where it is not the response format (the server's 400 says it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Surrogates:
    """The tokens that could write a UTF-16 surrogate (U+D800-U+DFFF) as UTF-8 bytes, ED A0-BF xx.

    Such bytes are no valid UTF-8 (each surrogate decodes to three U+FFFD). xgrammar's matcher takes
    one as a character (it refuses every other invalid form: a stray continuation byte, an overlong
    form, a cut character, a code point past U+10FFFF), so a string under maxLength could decode to
    three times as many characters. A grammar state masks `inside` always, and `high` right after a
    token in `lead`; ED is only ever a lead byte, so this leaves every valid character possible."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int):
        texts = list(enumerate(decoded_vocab[:vocab_size]))
        self.inside = _flags(vocab_size, [i for i, text in texts if _SURROGATE.search(text)])  # holds ED A0-BF
        self.high = _flags(vocab_size, [i for i, text in texts if text[:1] and 0xA0 <= text[0] <= 0xBF])
        self.lead = frozenset(i for i, text in texts if text.endswith(b"\xed"))  # goes on in the next token


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def _flags(size: int, ids: list[int]) -> torch.Tensor:
    """A bool [size] tensor, True at `ids`."""
    flags = torch.zeros(size, dtype=torch.bool)
    flags[torch.tensor(ids, dtype=torch.long)] = True
    return flags


class Grammars:
    """xgrammar's compiler for one tokenizer (made on first use; compiled grammars cached by source)."""

    def __init__(self, tokenizer, vocab_size: int, end_ids: Sequence[int]):
        self.tokenizer, self.vocab_size, self.end_ids = tokenizer, vocab_size, tuple(end_ids)
        self._compiler = None
        self.control = torch.zeros(vocab_size, dtype=torch.bool)  # tokens with a raw control character
        self.surrogates: Surrogates | None = None  # with the compiler
        self._lock = threading.Lock()

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.end_ids))  # fmt: skip
                control = [i for i, text in enumerate(info.decoded_vocab) if any(b < 0x20 for b in text)]
                self.control[torch.tensor(control, dtype=torch.long)] = True
                self.surrogates = Surrogates(info.decoded_vocab, self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, params: SamplingParams):
        """The compiled grammar of params' json_schema, regex or grammar (ConstraintError naming the field)."""
        field, source = next((f, getattr(params, f)) for f in ("json_schema", "regex", "grammar")
                             if getattr(params, f) is not None)  # fmt: skip
        if field == "json_schema":
            try:
                json.loads(source)  # a clear error for text that is no JSON at all
            except json.JSONDecodeError as error:
                raise ConstraintError(f"json_schema: {error}") from None
        return self._compiled(field, source)

    def value_grammar(self, schema: dict) -> tuple[object, torch.Tensor | None] | None:
        """(compiled grammar, banned tokens) of a tool parameter's value under its JSON schema, or None
        for free text: a value that may be a string is written raw (the template's way), so only a
        string enum is a grammar (its alternatives, raw); other types are compact JSON."""
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            pattern = "|".join(re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", v) for v in enum)
            return self._compiled("regex", pattern), None
        if "string" in kinds or not (kinds or enum is not None or "properties" in schema or "items" in schema):
            return None
        return self._compiled("json_schema", json.dumps(schema)), self.control

    def _compiled(self, field: str, source: str):
        """`source` compiled as a "json_schema" (compact JSON), "regex" or "grammar" (EBNF)."""
        if field == "json_schema" and (reason := unenforced(json.loads(source))) is not None:
            raise ConstraintError(f"json_schema: {reason}")
        compiler = self.compiler()
        try:
            if field == "json_schema":
                return compiler.compile_json_schema(source, any_whitespace=False, separators=(",", ":"),
                                                    strict_mode=True)  # fmt: skip
            if field == "regex":
                return compiler.compile_regex(source)
            return compiler.compile_grammar(source)
        except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError alike
            raise ConstraintError(f"{field}: {_reason(error)}") from None

    def rule(self, params: SamplingParams, *, in_thinking: bool, think_end: int | None) -> "GrammarRule":
        banned = self.control if params.json_schema is not None else None
        compiled = self.compile(params)  # (first: it makes the compiler, and with it the surrogate tables)
        return GrammarRule(compiled, self.vocab_size, self.end_ids, in_thinking=in_thinking, think_end=think_end,
                           banned=banned, surrogates=self.surrogates)  # fmt: skip

    def state(self, compiled, banned: torch.Tensor | None = None) -> "GrammarState":
        """A walk through `compiled` (from this compiler) that writes no surrogate."""
        return GrammarState(compiled, self.vocab_size, banned, self.surrogates)


class GrammarState:
    """One walk through a compiled grammar: the mask of the tokens that may come next (without the
    `banned` ones, nor, given `surrogates`, those that would write one), and each token taken."""

    def __init__(self, compiled, vocab_size: int, banned: torch.Tensor | None = None,
                 surrogates: Surrogates | None = None):  # fmt: skip
        xgr = _xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        if surrogates is not None and bool(surrogates.inside.any()):
            banned = surrogates.inside if banned is None else banned | surrogates.inside
        self.vocab_size = vocab_size
        # the masks as packed words (the bitmask's layout): each token costs a few word-wise ANDs
        self.keep = None if banned is None else pack_tokens(~banned)  # tokens the grammar may allow
        self.not_high = None if surrogates is None else pack_tokens(~surrogates.high)
        self.surrogates = surrogates
        self.after_lead = False  # the last token ended in byte ED
        self._leads: list[bool] = []  # after_lead before each token taken (for rollback)

    @property
    def done(self) -> bool:
        """Whether the grammar took its end (a stop token)."""
        return self.matcher.is_terminated()

    def take(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise ConstraintError(f"token {token} does not fit the grammar")  # only a rule-less pick could
        self._leads.append(self.after_lead)
        self.after_lead = self.surrogates is not None and token in self.surrogates.lead

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens taken (speculative drafts: lm/serving/drafts.py)."""
        if n:
            self.matcher.rollback(n)
            self.after_lead = self._leads[-n]
            del self._leads[-n:]

    def bits(self) -> torch.Tensor:
        """The next token's mask as int32 words (TokenRule.bits' layout, a new tensor): the grammar's
        (its end as the stop tokens), less the banned."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        filled = self.bitmask[0]
        bits = filled if self.keep is None else filled & self.keep
        if self.after_lead:  # ED then A0-BF is a surrogate
            bits = bits & self.not_high
        if not bool(bits.any()):
            raise ConstraintError("the grammar admits no next token")
        return bits.clone() if bits is filled else bits

    def mask(self) -> torch.Tensor:
        """The bool [V] mask of the next token (`bits` unpacked)."""
        return unpack_tokens(self.bits(), self.vocab_size)


class GrammarRule:
    """A request's grammar: each call takes the tokens generated so far and returns the rule of the
    next one (None while thinking: free); once the grammar is complete, only the end of the turn."""

    def __init__(self, compiled, vocab_size: int, end_ids: Sequence[int], *, in_thinking: bool,
                 think_end: int | None, banned: torch.Tensor | None = None,
                 surrogates: Surrogates | None = None):  # fmt: skip
        self.state = GrammarState(compiled, vocab_size, banned, surrogates)
        self.end_ids = tuple(end_ids)
        self.thinking, self.think_end = in_thinking, think_end
        self.seen = 0
        self._steps: list[tuple[bool, bool]] = []  # per token seen: (thinking before it, whether the grammar took it)

    def __call__(self, tokens: list[int]) -> TokenRule | None:
        for token in tokens[self.seen :]:
            self.seen += 1
            took = not self.thinking and not self.state.done
            self._steps.append((self.thinking, took))
            if self.thinking:
                self.thinking = token != self.think_end
            elif took:
                self.state.take(token)
        if self.thinking:
            return None
        if self.state.done:
            return TokenRule(allow=self.end_ids)
        return TokenRule(bits=self.state.bits())

    def rollback_to(self, length: int) -> None:
        """Back to the state after the first `length` tokens (speculative drafts that were shown to
        the rule for their masks and then dropped: lm/serving/drafts.py)."""
        if length >= self.seen:
            return
        undone = self._steps[length:]
        self.state.rollback(sum(took for _, took in undone))
        self.thinking = undone[0][0]
        del self._steps[length:]
        self.seen = length


class BudgetRule:
    """At most `budget` thinking tokens: from then on the closing (`closing` token ids, ending in
    `</think>`) is forced token by token; `inner` (the answer's rule, or None) decides otherwise."""

    def __init__(self, budget: int, closing: Sequence[int], think_end: int, inner: Rule | None):
        self.budget, self.closing, self.think_end, self.inner = budget, tuple(closing), think_end, inner
        self.closed_at: int | None = None  # the count of tokens up to and including `</think>`
        self.seen = 0

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def __call__(self, tokens: list[int]) -> TokenRule | None:
        if not self.closed and self.think_end in tokens[self.seen :]:
            self.closed_at = self.seen + tokens[self.seen :].index(self.think_end) + 1
        self.seen = len(tokens)
        if not self.closed and len(tokens) >= self.budget:
            forced = len(tokens) - self.budget
            if forced < len(self.closing):
                return TokenRule(allow=(self.closing[forced],))
        return self.inner(tokens) if self.inner is not None else None

    def rollback_to(self, length: int) -> None:
        """Back to the state after the first `length` tokens (see GrammarRule.rollback_to); an inner
        rule without rollback_to is never shown drafts (lm/serving/drafts.py checks `rewinds`)."""
        self.seen = min(self.seen, length)
        if self.closed_at is not None and self.closed_at > length:
            self.closed_at = None
        if self.inner is not None:
            self.inner.rollback_to(length)

    @property
    def rewinds(self) -> bool:
        """Whether this rule and its inner one can roll back (drafts may be shown to it)."""
        return self.inner is None or hasattr(self.inner, "rollback_to")


def reasoning_tokens(tokens: Sequence[int], think_end: int | None, in_thinking: bool) -> int:
    """How many of an answer's tokens are thinking: up to and including `</think>` (all of them when
    it never came), 0 when the prompt did not open the thinking."""
    if not in_thinking or think_end is None:
        return 0
    return next((i + 1 for i, t in enumerate(tokens) if t == think_end), len(tokens))


def _reason(error: Exception) -> str:
    """The first line of a compiler error, without xgrammar's "[time] source.cc:line: " prefix."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0])


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:
        raise ConstraintError("structured outputs need the xgrammar package: pip install -e '.[dev]' "
                              f"(or pip install xgrammar) ({error})") from None  # fmt: skip
    return xgrammar
