"""tool_choice "required" and a named function, enforced while decoding.

`ToolCallRule` is a `rule` for the serving engine (lm/serving): before each token it says which
tokens may come next, so that the answer is one well-formed Qwen3 XML call (app/tool_calls.py):

    [thinking ... </think>\\n\\n]<tool_call>\\n<function=NAME>\\n
    (<parameter=P>\\n VALUE \\n</parameter>\\n)*  </function>\\n</tool_call>  <end of turn>

- the thinking (when the prompt opened it) is free, up to `</think>`;
- the fixed parts are forced token by token; NAME is one of the allowed tools and P one of that
  tool's parameters not given yet (a choice among the tokenisations of the alternatives); the call
  closes (`</function>`) only once every parameter its schema lists as `required` is given;
- a VALUE follows its JSON schema (with `grammars`, mm/constraints.py): a number, integer, boolean,
  null, object or array is compact JSON of that schema through xgrammar's masks, closed (forced
  `\\n</parameter>\\n`) where the schema lets it end; a string enum is one of its strings; a value that
  may be a string is free text, ended by the model's `\\n</parameter>` or forced closed after
  `value_tokens` tokens. Any value is forced closed as soon as the rest of the answer's `max_tokens` is only enough to
  close the call (each required parameter still missing with a one-token value); the turn cannot end
  inside the call;
- after `</tool_call>` the turn ends.
"""

from __future__ import annotations

from typing import Any

import torch

from lm.sampling import TokenRule
from mm.constraints import Grammars, GrammarState


class ToolCallRule:
    def __init__(self, tokenizer, tools: list[dict[str, Any]], end_ids: tuple[int, ...], *, in_thinking: bool,
                 value_tokens: int = 512, max_tokens: int | None = None,
                 grammars: Grammars | None = None):  # fmt: skip
        self.encode = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        self.decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self.required = {name: _required(name, schema) for name, schema in schemas.items()}
        self.params = {name: list(dict.fromkeys([*(schema.get("properties") or {}), *self.required[name]]))
                       for name, schema in schemas.items()}  # fmt: skip
        self.given: set[str] = set()  # the parameters of the call so far
        self.typed = {}  # (tool, parameter) -> (compiled grammar, banned tokens) of a typed value
        for name, schema in schemas.items():
            for param, spec in (schema.get("properties") or {}).items():
                if grammars is not None and isinstance(spec, dict) and (typed := grammars.value_grammar(spec)):
                    self.typed[(name, param)] = typed
        self.grammars = grammars  # makes each typed value's GrammarState
        self.vocab_size = grammars.vocab_size if grammars is not None else 0
        self.grammar: GrammarState | None = None  # the typed value being written
        self.end_ids, self.value_tokens, self.max_tokens = tuple(end_ids), value_tokens, max_tokens
        self.closing: dict[str, tuple[int, ...]] = {}  # token ids of the call's fixed parts (encoded once)
        self._mask = None  # (value tokens, the typed value's grammar mask then)
        self.seen = 0  # tokens of the answer already processed
        self.state = "thinking" if in_thinking else "open"
        self.tool: str | None = None
        self.forcing: list[tuple[tuple[int, ...], str]] = []  # (token ids, what comes after) alternatives
        self.taken: list[int] = []  # tokens into the alternatives so far
        self.value: list[int] = []
        if not in_thinking:
            self._expect([(self.encode("<tool_call>\n<function="), "name")])

    def __call__(self, tokens: list[int]) -> TokenRule | None:
        for i in range(self.seen, len(tokens)):
            self.seen = i + 1
            self._advance(tokens[i], tokens[max(0, i - 7) : i + 1])
        self.seen = len(tokens)
        return self._rule()

    # -- the state machine ---------------------------------------------------------------------
    def _expect(self, alternatives: list[tuple[tuple[int, ...], str]]) -> None:
        self.forcing, self.taken = alternatives, []

    def _advance(self, token: int, recent: list[int]) -> None:
        """Take the answer's next token (`recent`: the last few tokens, ending with it)."""
        if self.state == "thinking":
            if "</think>" in self.decode(recent):
                self.state = "open"
                self._expect([(self.encode("\n\n<tool_call>\n<function="), "name")])
            return
        if self.forcing:
            self.taken.append(token)
            for ids, after in self.forcing:
                if tuple(self.taken) == ids:
                    self._then(after)
                    return
            return
        if self.state == "typed":
            allowed = self._typed_mask_raw()  # the grammar's mask where this token came
            self.value.append(token)
            if token == self._close()[0] and not bool(allowed[token]):  # the close, where the value may end
                self._expect([(self._close(), "parameters")])
                self._advance(token, recent)
                return
            self.grammar.take(token)
            if self._must_close():  # (value_tokens bounds free text only: a grammar ends by itself)
                self._expect([(self._close(), "parameters")])
            return
        if self.state == "value":
            self.value.append(token)
            if self.decode(self.value).endswith("\n</parameter>"):
                self._parameters()
            elif len(self.value) >= self.value_tokens or self._must_close():
                self._expect([(self.encode("\n</parameter>\n"), "parameters")])

    def _must_close(self) -> bool:
        """Whether the tokens left under max_tokens are just enough to close the call from inside a value."""
        if self.max_tokens is None:
            return False
        close, end = self._length("\n</parameter>\n"), self._length("</function>\n</tool_call>")
        missing = [p for p in self.required[self.tool] if p not in self.given]
        need = close + end + 1 + sum(self._length(f"<parameter={p}>\n") + 1 + close for p in missing)
        return self.max_tokens - self.seen <= need

    def _length(self, text: str) -> int:
        """Tokens of a fixed part of the call (encoded once; _must_close asks at every value token)."""
        return len(self._ids(text))

    def _then(self, after: str) -> None:
        self.forcing, self.taken = [], []
        if after == "name":
            self.state = "name"
            self._expect([(self.encode(f"{name}>\n"), f"tool:{name}") for name in self.params])
        elif after.startswith("tool:"):
            self.tool, self.given = after[5:], set()
            self._parameters()
        elif after == "parameters":
            self._parameters()
        elif after.startswith("value:"):
            self.state, self.value = "value", []
            self.given.add(after[6:])
            if (typed := self.typed.get((self.tool, after[6:]))) is not None:
                self.state, self.grammar = "typed", self.grammars.state(*typed)
                self._mask = None
        elif after == "end":
            self.state = "end"

    def _parameters(self) -> None:
        """Next: a parameter not given yet, or the end of the call once every required one is given."""
        self.state = "parameters"
        left = [p for p in self.params[self.tool] if p not in self.given]
        options = [(self.encode(f"<parameter={p}>\n"), f"value:{p}") for p in left]
        if self.given.issuperset(self.required[self.tool]):
            options.append((self.encode("</function>\n</tool_call>"), "end"))
        self._expect(options)

    def _rule(self) -> TokenRule | None:
        if self.state == "thinking":
            return None
        if self.state == "end":
            return TokenRule(allow=self.end_ids)
        if self.forcing:
            n = len(self.taken)
            allow = {ids[n] for ids, _ in self.forcing if len(ids) > n and ids[:n] == tuple(self.taken)}
            return TokenRule(allow=tuple(sorted(allow)))
        if self.state == "typed":
            mask = self._typed_mask_raw().clone()
            ends = torch.tensor(self.end_ids)
            if bool(mask[ends].any()):  # the schema lets the value end here: its close may come instead
                mask[ends] = False
                mask[self._close()[0]] = True
            return TokenRule(mask=mask)
        return TokenRule(ban=self.end_ids)  # inside a value: the turn cannot end here

    def _close(self) -> tuple[int, ...]:
        return self._ids("\n</parameter>\n")

    def _ids(self, text: str) -> tuple[int, ...]:
        if text not in self.closing:
            self.closing[text] = self.encode(text)
        return self.closing[text]

    def _typed_mask_raw(self) -> torch.Tensor:
        """The typed value's grammar mask at this point (computed once per token)."""
        if self._mask is None or self._mask[0] != len(self.value):
            self._mask = (len(self.value), self.grammar.mask())
        return self._mask[1]


def _required(name: str, schema: dict[str, Any]) -> list[str]:
    """The parameters a tool's JSON schema lists as required."""
    required = schema.get("required") or []
    if not isinstance(required, list) or not all(isinstance(p, str) for p in required):
        raise ValueError(f"tool {name!r}: parameters.required must be a list of parameter names")
    return required
