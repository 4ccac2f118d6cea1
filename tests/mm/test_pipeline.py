"""`mm.Pipeline` end to end on the built-in default model (random weights, real architecture)."""

import numpy as np
import pytest

from app.default_model import default_model_path
from lm import SamplingParams
from lm.config import ConfigError
from mm import Pipeline
from mm.processor import PromptTooLongError

IMAGE = (np.arange(48 * 80 * 3) % 251).astype(np.uint8).reshape(48, 80, 3)
SAMPLE = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, seed=0)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("QWEN35_CACHE", str(tmp_path_factory.getbasetemp() / "qcache"))
    return Pipeline.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _ask(text, image=None):
    content = [{"type": "image", "image": image}] if image is not None else []
    return [{"role": "user", "content": content + [{"type": "text", "text": text}]}]


def test_batched_generate_equals_each_alone(pipeline):
    convs = [_ask("What is this?", IMAGE), _ask("Say hello.")]
    both = pipeline.generate(convs, SamplingParams(max_new_tokens=10), enable_thinking=False)
    for conv, out in zip(convs, both):
        alone = pipeline.generate([conv], SamplingParams(max_new_tokens=10), enable_thinking=False)[0]
        assert out.token_ids == alone.token_ids and out.text == alone.text
    assert both[0].prompt_tokens > both[1].prompt_tokens  # the image's placeholders count
    assert all(o.completion_tokens == len(o.token_ids) for o in both)
    assert set(both[0].timings) == {"prefill", "decode", "total"}


def test_stream_pieces_join_to_the_generated_text(pipeline):
    pieces = list(pipeline.stream(_ask("Describe.", IMAGE), SAMPLE, enable_thinking=False))
    out = pipeline.generate([_ask("Describe.", IMAGE)], SAMPLE, enable_thinking=False)[0]
    assert len(pieces) > 1 and "".join(pieces) == out.text


def test_thinking_mode_puts_text_before_think_close_into_thinking(pipeline):
    out = pipeline.generate([_ask("Hi")], SAMPLE, enable_thinking=True)[0]
    # the random model never closes </think>: everything it wrote is thinking
    assert out.text == "" and out.thinking != ""
    assert pipeline.processor.decode(out.token_ids).strip("\n") == out.thinking


def test_stop_string_cuts_text_and_stops(pipeline):
    free = pipeline.generate([_ask("Go on.")], SamplingParams(max_new_tokens=24), enable_thinking=False)[0]
    word = free.text.strip().split()[1] if len(free.text.split()) > 1 else free.text.strip()[:3]
    out = pipeline.generate([_ask("Go on.")], SamplingParams(max_new_tokens=24, stop=(word,)), enable_thinking=False)[0]
    assert word not in out.text and free.text.startswith(out.text)
    assert out.finish_reason == "stop" and out.completion_tokens < free.completion_tokens


def test_default_params_and_presets(pipeline):
    default = pipeline.default_params()
    assert (default.temperature, default.top_k, default.top_p) == (1.0, 20, 0.95)  # generation_config.json
    thinking, instruct = pipeline.default_params("thinking"), pipeline.default_params("instruct")
    assert (thinking.temperature, thinking.top_p, thinking.presence_penalty) == (1.0, 0.95, 1.5)
    assert (instruct.temperature, instruct.top_p, instruct.top_k) == (0.7, 0.8, 20)
    assert pipeline.default_params("greedy", max_new_tokens=5).max_new_tokens == 5
    with pytest.raises(ValueError, match="unknown sampling preset"):
        pipeline.default_params("fast")


def test_prompt_longer_than_the_context_is_refused(pipeline):
    small = Pipeline(pipeline.model, pipeline.processor, max_context=64)
    with pytest.raises(PromptTooLongError, match="prompt is 111 tokens.*context is 64 tokens.*max_new_tokens=8"):
        small.generate([_ask("word " * 100)], SamplingParams(max_new_tokens=8))


def test_a_huge_text_is_refused_before_it_is_tokenized(pipeline, monkeypatch):
    """A 10 MB message once took 12 s of tokenizing before the length check (issue 43): the fewest
    tokens its bytes can make already exceed the context."""
    small = Pipeline(pipeline.model, pipeline.processor, max_context=2048)
    monkeypatch.setattr(small.processor, "_tokenize", lambda *a: pytest.fail("tokenized"))
    huge = [{"role": "user", "content": [{"type": "text", "text": "hello world " * 900_000}]}]
    with pytest.raises(PromptTooLongError, match=r"at least \d+ tokens \(10800000 bytes of text.*context is 2048"):
        small.prepare(huge, SamplingParams(max_new_tokens=8), None)
    monkeypatch.undo()
    near = [{"role": "user", "content": "word " * 3000}]  # 15,000 bytes: could fit, so it is tokenized
    with pytest.raises(PromptTooLongError, match=r"the prompt is 30\d\d tokens"):
        small.prepare(near, SamplingParams(max_new_tokens=8), None)


def test_no_path_is_the_builtin_random_model_and_a_bad_config_is_named(pipeline, capsys, tmp_path):
    """As the front ends: no path loads the built-in default model and says its weights are random."""
    builtin = Pipeline.from_pretrained()
    assert builtin.model.config == pipeline.model.config and "RANDOM weights" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe", "text_config": []}')
    with pytest.raises(ConfigError, match="text_config must be a JSON object"):
        Pipeline.from_pretrained(tmp_path)


def test_stream_returns_its_output_and_takes_template_variables(pipeline):
    conv, params = _ask("Say hello."), SamplingParams(max_new_tokens=8)
    pieces = pipeline.stream(conv, params, enable_thinking=False)
    text = []
    while True:
        try:
            text.append(next(pieces))
        except StopIteration as end:
            output = end.value
            break
    [alone] = pipeline.generate([conv], params, enable_thinking=False)
    assert output.token_ids == alone.token_ids and output.text == alone.text == "".join(text)
    assert output.prompt_tokens == alone.prompt_tokens and output.completion_tokens == 8
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    [with_tools] = pipeline.generate([conv], params, enable_thinking=False, template_kwargs={"tools": tools})
    assert with_tools.prompt_tokens > alone.prompt_tokens + 50  # the template's "# Tools" block
