"""The pipeline with the MTP layer's speculative decoding, on the built-in default model (which ships
an MTP layer, as real checkpoints do): images, videos, a chat's prefix-cache hit, constrained
requests (a JSON schema, a thinking budget, a tool call) give the answers without it."""

import json
import threading

import numpy as np
import pytest
import torch

from app.default_model import default_model_path
from lm import SamplingParams
from lm.serving import drafts
from mm import Pipeline

rng = np.random.default_rng(1)
IMAGE = rng.integers(0, 256, (64, 48, 3), dtype=np.uint8)
VIDEO = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(4)]
SCHEMA = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}  # bounded: a random model closes it


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """(without MTP, with MTP drafting 2 tokens a step) over the same checkpoint."""
    mp = pytest.MonkeyPatch()
    mp.setenv("QWEN35_CACHE", str(tmp_path_factory.getbasetemp() / "qcache"))
    path = default_model_path()
    yield Pipeline.from_pretrained(path), Pipeline.from_pretrained(path, speculative="mtp", num_speculative_tokens=2)
    mp.undo()


def _ask(text, image=None, video=None):
    content = [{"type": "image", "image": image}] if image is not None else []
    content += [{"type": "video", "video": video}] if video is not None else []
    return [{"role": "user", "content": content + [{"type": "text", "text": text}]}]


def _forced(monkeypatch, truths: list[list[int]]) -> list[int]:
    """Drafts from each row's true continuation (found by its tokens so far); returns a list that
    counts the drafts made."""
    real, made = drafts.draft_all, []

    def forced(lm, states, outputs, positions, ks, pick):
        out = real(lm, states, outputs, positions, ks, pick)
        for i, k in enumerate(ks):
            truth = next((t for t in truths if t[: len(outputs[i])] == outputs[i]), None)
            if k and truth is not None:
                out[i] = truth[len(outputs[i]) : len(outputs[i]) + k]
                made.append(len(out[i]))
        return out

    monkeypatch.setattr(drafts, "draft_all", forced)
    return made


def test_media_chat_and_a_constrained_request_equal_the_answers_without(monkeypatch, pipelines):
    plain, spec = pipelines
    greedy = SamplingParams(max_new_tokens=12)
    convs = [_ask("What is this?", IMAGE), _ask("And this video?", video=VIDEO), _ask("Say hello.")]
    schema = SamplingParams(max_new_tokens=40, json_schema=SCHEMA)
    want = [plain.generate([c], greedy, enable_thinking=False)[0] for c in convs]
    want_json = plain.generate([_ask("A number?")], schema, enable_thinking=False)[0]
    made = _forced(monkeypatch, [o.token_ids for o in [*want, want_json]])
    results = {}

    def ask(i):
        if i < len(convs):
            results[i] = spec.generate([convs[i]], greedy, enable_thinking=False)[0]
        else:
            results[i] = spec.generate([_ask("A number?")], schema, enable_thinking=False)[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(convs) + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, ref in enumerate(want):
        assert results[i].token_ids == ref.token_ids
        assert results[i].timings["tokens_per_step"] > 1 and results[i].timings["draft_acceptance"] == 1.0
    constrained = results[len(convs)]  # its drafts verified under its grammar, as a plain step's pick
    assert constrained.token_ids == want_json.token_ids and constrained.timings["tokens_per_step"] > 1
    assert json.loads(constrained.text)["n"] in (1, 2, 3)
    assert sum(made) > 0
    # turn 2 of the image chat resumes from turn 1's snapshot, with its MTP state
    turn2 = convs[0] + [{"role": "assistant", "content": want[0].text}, {"role": "user", "content": "More?"}]
    second = spec.generate([turn2], greedy, enable_thinking=False)[0]
    assert second.cached_tokens > 0
    assert second.token_ids == plain.generate([turn2], greedy, enable_thinking=False)[0].token_ids


def test_sampled_answers_are_reproducible_with_a_seed(pipelines):
    _, spec = pipelines
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3)
    first = spec.generate([_ask("Tell a story.")], params)[0]
    assert spec.generate([_ask("Tell a story.")], params)[0].token_ids == first.token_ids
    assert first.timings["tokens_per_step"] >= 1


def test_drafts_under_a_grammar_fit_it(monkeypatch, pipelines):
    """The MTP layer's own drafts for a JSON-schema request are masked by its grammar (rolled back
    after): every draft it makes is a token the grammar allows there, and the answer is the one
    without MTP; so is a thinking budget's."""
    plain, spec = pipelines
    shown = []
    real = drafts.draft_all

    def recording(lm, states, outputs, positions, ks, pick):
        out = real(lm, states, outputs, positions, ks, pick)
        shown.extend((list(o), list(d)) for o, d in zip(outputs, out) if d)
        return out

    monkeypatch.setattr(drafts, "draft_all", recording)
    schema = SamplingParams(max_new_tokens=40, json_schema=SCHEMA)
    want = plain.generate([_ask("A number?")], schema, enable_thinking=False)[0]
    got = spec.generate([_ask("A number?")], schema, enable_thinking=False)[0]
    assert got.token_ids == want.token_ids and shown
    for output, made in shown:  # replay: each draft fits a fresh walk of the grammar
        rule = spec.constraint_rule(schema, False)
        for j, token in enumerate(made):
            allowed = rule(output + made[:j])
            assert allowed is None or bool(allowed.apply(torch.zeros(spec.model.lm.config.vocab_size))[token] == 0)
    budget = SamplingParams(max_new_tokens=30, thinking_budget=8)
    assert (spec.generate([_ask("Think.")], budget, enable_thinking=True)[0].token_ids
            == plain.generate([_ask("Think.")], budget, enable_thinking=True)[0].token_ids)  # fmt: skip


def test_a_tool_call_rule_without_rollback_verifies_unmasked_drafts(pipelines):
    """tool_choice's rule (app/tool_choice.py) cannot roll back, so it is never shown drafts: the
    drafts come unmasked and each position is verified under the rule as in a plain step."""
    from app.tool_choice import ToolCallRule

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
    answers = []
    for pipeline in pipelines:
        rule = ToolCallRule(pipeline.processor.tokenizer, [weather], pipeline.model.eos_token_ids(), in_thinking=False,
                            value_tokens=4, max_tokens=60, grammars=pipeline.grammars)  # fmt: skip
        answers.append(pipeline.submit(_ask("Weather?"), SamplingParams(max_new_tokens=60), enable_thinking=False,
                                       template_kwargs={"tools": [weather]}, rule=rule).output())  # fmt: skip
    assert answers[0].token_ids == answers[1].token_ids and answers[1].timings["tokens_per_step"] >= 1
