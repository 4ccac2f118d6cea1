"""The pipeline with the MTP layer's speculative decoding, on the built-in default model (which ships
an MTP layer, as real checkpoints do): images, videos, a chat's prefix-cache hit and a constrained
request beside drafting ones give the answers without it."""

import json
import threading

import numpy as np
import pytest

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
    made = _forced(monkeypatch, [o.token_ids for o in want])
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
    constrained = results[len(convs)]
    assert constrained.token_ids == want_json.token_ids and "tokens_per_step" not in constrained.timings
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
