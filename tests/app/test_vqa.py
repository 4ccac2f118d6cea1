"""app.VQA end to end on the built-in default model: images, videos, streaming, batches, errors."""

from __future__ import annotations

import contextlib
import io

import pytest

import preprocess
from app import RANDOM_WEIGHTS_NOTICE, VQA, Answer
from mm import split_thinking

TOKENS = 6


@pytest.fixture(scope="module")
def vqa_and_log() -> tuple[VQA, str]:
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        vqa = VQA(preset="greedy")
    return vqa, log.getvalue()


@pytest.fixture(scope="module")
def vqa(vqa_and_log) -> VQA:
    return vqa_and_log[0]


def test_default_model_announces_random_weights(vqa_and_log):
    assert RANDOM_WEIGHTS_NOTICE in vqa_and_log[1]


def test_ask_text_image_and_video(vqa, media):
    text = vqa.ask("Hello?", max_new_tokens=TOKENS, enable_thinking=False)
    image = vqa.ask("What is in the picture?", image=media["image"], max_new_tokens=TOKENS, enable_thinking=False)
    video = vqa.ask("What happens?", video=str(media["video"]), fps=4, max_frames=8, max_new_tokens=TOKENS,
                    enable_thinking=False)  # fmt: skip
    for answer in (text, image, video):
        assert isinstance(answer, Answer)
        assert answer.thinking == "" and answer.text
        assert answer.completion_tokens == TOKENS and answer.finish_reason == "length"
        assert answer.seconds > 0
    assert image.prompt_tokens > text.prompt_tokens + 16  # the image's placeholder tokens
    assert video.prompt_tokens > text.prompt_tokens + 4  # frame groups with timestamps
    again = vqa.ask("What is in the picture?", image=media["image"], max_new_tokens=TOKENS, enable_thinking=False)
    assert again.text == image.text  # greedy preset: deterministic


def test_thinking_goes_to_thinking(vqa):
    answer = vqa.ask("Hello?", max_new_tokens=TOKENS)  # the template's default: thinking
    assert answer.thinking  # the random model never closes the block in a few tokens


def test_stream_pieces_make_the_answer(vqa, media):
    # 4x the usual tokens: the stream holds back split characters and possible stop strings, so a few
    # tokens of the random model's text can come as one piece
    pieces = list(vqa.stream("Describe it.", image=media["image"], max_new_tokens=4 * TOKENS, enable_thinking=False))
    assert len(pieces) >= 2 and all(isinstance(p, str) and p for p in pieces)
    answer = vqa.ask("Describe it.", image=media["image"], max_new_tokens=4 * TOKENS, enable_thinking=False)
    assert split_thinking("".join(pieces))[1] == answer.text


def test_ask_many_batches_mixed_items(vqa, media):
    items = [
        "Hello?",
        {"question": "What is in the picture?", "image": media["image"]},
        {"question": "What happens?", "video": str(media["video"]), "fps": 4, "max_frames": 8},
        {"question": "Compare them.", "images": [media["image"], media["image"]]},
    ]
    answers = vqa.ask_many(items, max_new_tokens=TOKENS, enable_thinking=False)
    assert len(answers) == 4 and all(isinstance(a, Answer) and a.completion_tokens == TOKENS for a in answers)
    single = vqa.ask("What is in the picture?", image=media["image"], max_new_tokens=TOKENS, enable_thinking=False)
    assert answers[1].prompt_tokens == single.prompt_tokens
    assert answers[3].prompt_tokens > answers[1].prompt_tokens  # two images


def test_sampling_overrides_apply(vqa):
    assert vqa.params().temperature == 0.0  # the greedy preset
    params = vqa.params(temperature=0.7, top_k=5, seed=3, stop=["x"])
    assert (params.temperature, params.top_k, params.seed, params.stop) == (0.7, 5, 3, ("x",))
    first = vqa.ask("Hi", max_new_tokens=TOKENS, temperature=1.0, seed=11, enable_thinking=False)
    second = vqa.ask("Hi", max_new_tokens=TOKENS, temperature=1.0, seed=11, enable_thinking=False)
    assert first.text == second.text


def test_errors_name_the_problem(vqa, media, tmp_path):
    with pytest.raises(TypeError, match="unknown sampling option.*tempreature"):
        vqa.ask("Hi", tempreature=0.5)
    with pytest.raises(ValueError, match="item 1: unknown key.*'imgae'"):
        vqa.ask_many(["Hi", {"question": "x", "imgae": media["image"]}])
    with pytest.raises(ValueError, match="non-empty list"):
        vqa.ask_many("Hi")
    with pytest.raises(TypeError, match="images= takes a list"):
        vqa.ask("Hi", images=str(media["image"]))
    with pytest.raises(preprocess.VideoError, match="corrupt.mp4"):
        vqa.ask("Hi", video=str(media["corrupt"]), max_new_tokens=TOKENS)
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        VQA(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown sampling preset"):
        VQA.from_pipeline(vqa.pipeline, preset="creative")
