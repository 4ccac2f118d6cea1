"""The pipeline on the serving engine, on the built-in default model: concurrent conversations with
images and videos equal each generated alone, and the prefix and vision caches are exact."""

import threading

import numpy as np
import pytest
import torch

from app.default_model import default_model_path
from lm import SamplingParams
from mm import Pipeline

GREEDY = SamplingParams(max_new_tokens=10)
rng = np.random.default_rng(0)
IMAGES = [rng.integers(0, 256, (48 + 16 * i, 64, 3), dtype=np.uint8) for i in range(2)]
VIDEO = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(4)]


@pytest.fixture(scope="module")
def model_and_processor(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("QWEN35_CACHE", str(tmp_path_factory.getbasetemp() / "qcache"))
    p = Pipeline.from_pretrained(default_model_path())
    yield p.model, p.processor
    mp.undo()


def _pipeline(model_and_processor, **options) -> Pipeline:
    return Pipeline(*model_and_processor, engine_options=options)


def _ask(text, image=None, video=None, system=None):
    content = [{"type": "image", "image": image}] if image is not None else []
    content += [{"type": "video", "video": video}] if video is not None else []
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": content + [{"type": "text", "text": text}]}]


def _static(pipeline: Pipeline, conversation, params=GREEDY, enable_thinking=None) -> list[int]:
    """The same answer through the static-batch path (VLModel.generate, batch 1, no engine)."""
    inputs = pipeline.prepare([conversation], params, enable_thinking)
    return pipeline.model.generate(
        inputs.input_ids, params=params, attention_mask=inputs.attention_mask, pixel_values=inputs.pixel_values,
        image_grid_thw=inputs.image_grid_thw, pixel_values_videos=inputs.pixel_values_videos,
        video_grid_thw=inputs.video_grid_thw)[0]  # fmt: skip


def test_concurrent_conversations_with_media_equal_each_alone(model_and_processor):
    pipeline = _pipeline(model_and_processor, max_batch=3, step_tokens=24)  # 3 slots for 5 requests
    convs = [_ask("What is this?", IMAGES[0]), _ask("Say hello."), _ask("And this video?", video=VIDEO),
             _ask("Compare.", IMAGES[1]), _ask("Both?", IMAGES[0], VIDEO)]  # fmt: skip
    lengths = [10, 4, 14, 7, 12]
    results = {}

    def ask(i):
        results[i] = pipeline.generate([convs[i]], SamplingParams(max_new_tokens=lengths[i]))[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, conv in enumerate(convs):
        assert results[i].token_ids == _static(pipeline, conv, SamplingParams(max_new_tokens=lengths[i]))
    assert pipeline.engine.stats()["finished"] == len(convs)


def test_multi_turn_chat_with_an_image_reuses_turn_one(model_and_processor):
    pipeline = _pipeline(model_and_processor)
    turn1 = _ask("What is in the picture?", IMAGES[0])
    first = pipeline.generate([turn1], GREEDY)[0]
    vision_runs = pipeline.vision_cache.misses
    assert vision_runs == 1
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Tell me more."}]
    second = pipeline.generate([turn2], GREEDY)[0]
    # the reusable prefix of turn 2 ends where turn 1's answer began: after "<|im_start|>assistant\n"
    # of turn 1's prompt (the history drops turn 1's <think> block), the snapshot taken there
    ids1 = pipeline.prepare([turn1], GREEDY, None).input_ids[0].tolist()
    opener = pipeline.processor.tokenizer("<think>\n", add_special_tokens=False)["input_ids"]
    assert ids1[-len(opener):] == opener
    assert second.cached_tokens == len(ids1) - len(opener)
    assert pipeline.vision_cache.misses == vision_runs  # the image lay inside the cached prefix: no vision run
    assert second.token_ids == _static(pipeline, turn2)  # the same as a cold run
    cold = _pipeline(model_and_processor, prefix_cache_bytes=0)
    assert cold.generate([turn2], GREEDY)[0].token_ids == second.token_ids


def test_full_and_partial_hits_and_the_vision_cache(model_and_processor):
    pipeline = _pipeline(model_and_processor)
    system = "You are a careful assistant. " * 8
    a = pipeline.generate([_ask("First question?", system=system)], GREEDY)[0]
    again = pipeline.generate([_ask("First question?", system=system)], GREEDY)[0]
    assert again.token_ids == a.token_ids and again.cached_tokens == again.prompt_tokens  # full hit
    other = pipeline.generate([_ask("A different one?", system=system)], GREEDY)[0]  # partial: the system prompt
    assert 0 < other.cached_tokens < other.prompt_tokens
    assert other.token_ids == _static(pipeline, _ask("A different one?", system=system))
    # the same image after a different system prompt: a prefix miss, but no second vision run
    pipeline.generate([_ask("Look.", IMAGES[1], system="Be brief.")], GREEDY)
    misses = pipeline.vision_cache.misses
    late = pipeline.generate([_ask("Look.", IMAGES[1], system="Be very brief.")], GREEDY)[0]
    assert pipeline.vision_cache.misses == misses and pipeline.vision_cache.hits >= 1
    assert late.token_ids == _static(pipeline, _ask("Look.", IMAGES[1], system="Be very brief."))
    # a different image with the same text never hits the first image's snapshot
    swapped = pipeline.generate([_ask("Look.", IMAGES[0], system="Be very brief.")], GREEDY)[0]
    ids = pipeline.prepare([_ask("Look.", IMAGES[0], system="Be very brief.")], GREEDY, None).input_ids[0].tolist()
    first_pad = ids.index(pipeline.model.config.image_token_id)
    assert swapped.cached_tokens <= first_pad
    assert swapped.token_ids == _static(pipeline, _ask("Look.", IMAGES[0], system="Be very brief."))


def test_closing_a_stream_frees_its_slot(model_and_processor):
    pipeline = _pipeline(model_and_processor, max_batch=1)
    stream = pipeline.stream(_ask("Go on forever."), SamplingParams(max_new_tokens=500))
    next(stream)
    stream.close()
    out = pipeline.generate([_ask("Hi.")], SamplingParams(max_new_tokens=3))[0]  # gets the only slot
    assert out.completion_tokens == 3
    stats = pipeline.engine.stats()
    assert stats["cancelled"] == 1 and stats["running"] == 0
    torch.testing.assert_close(pipeline.engine.store.lengths, torch.zeros_like(pipeline.engine.store.lengths))
