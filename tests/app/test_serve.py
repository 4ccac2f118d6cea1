"""`python -m app.serve` end to end with the official `openai` client, on the default model (random
weights, greedy): text, streaming, reasoning on / off, an image, a video, a burst, the log, disconnects."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from app import RANDOM_WEIGHTS_NOTICE
from tests.app.serve_helpers import API_KEY, data_uri

pytestmark = pytest.mark.subprocess

TOKENS = 6
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
LONG = "Tell me a very long story"  # greedy, thinking on: the default model loops without an end of turn


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _ask(client, content, *, extra=THINKING_OFF, tokens=TOKENS, **kwargs):
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}],
                                          max_tokens=tokens, temperature=0, extra_body=extra, **kwargs)  # fmt: skip


def _stream(client, content, *, extra=THINKING_OFF, tokens=TOKENS):
    chunks = list(_ask(client, content, extra=extra, tokens=tokens, stream=True,
                       stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)  # fmt: skip
    return chunks, text, reasoning


def test_models_health_and_random_weights_notice(server, client):
    [model] = client.models.list().data
    assert model.id == "default" and model.model_extra["max_model_len"] == 4096
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    assert RANDOM_WEIGHTS_NOTICE in server.log()


def test_text_streamed_and_not_agree(client):
    answer = _ask(client, "Hello, who are you?")
    assert answer.id.startswith("chatcmpl-") and answer.object == "chat.completion"
    [choice] = answer.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert choice.message.model_extra.get("reasoning_content") is None  # thinking off
    assert answer.usage.completion_tokens == TOKENS and answer.usage.prompt_tokens > 5
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + TOKENS
    chunks, text, reasoning = _stream(client, "Hello, who are you?")
    assert text == choice.message.content and reasoning == ""
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.model_dump() == answer.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_reasoning_content_with_thinking_on(client):
    answer = _ask(client, "Think about it.", extra={})  # the template's default: thinking
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"]  # the random model never closes the block in a few tokens
    assert message.content == ""
    _, text, reasoning = _stream(client, "Think about it.", extra={})
    assert reasoning == message.model_extra["reasoning_content"] and text == ""
    hidden = _ask(client, "Think about it.", extra={"include_reasoning": False})
    assert hidden.choices[0].message.model_extra.get("reasoning_content") is None
    assert hidden.usage.completion_tokens == TOKENS


def test_image_turn(client, media):
    text_only = _ask(client, [{"type": "text", "text": "What is this?"}])
    parts = [{"type": "image_url", "image_url": {"url": data_uri(media["image"], "image/png")}},
             {"type": "text", "text": "What is this?"}]  # fmt: skip
    image = _ask(client, parts)
    assert image.usage.prompt_tokens > text_only.usage.prompt_tokens + 16  # the image's placeholder tokens
    local = _ask(client, [{"type": "image_url", "image_url": {"url": f"file://{media['image']}"}}, parts[1]])
    assert local.usage.prompt_tokens == image.usage.prompt_tokens
    assert local.choices[0].message.content == image.choices[0].message.content


def test_video_turn(client, media):
    parts = [{"type": "video_url", "video_url": {"url": data_uri(media["video"], "video/mp4")}},
             {"type": "text", "text": "What happens?"}]  # fmt: skip
    few = _ask(client, parts, extra={**THINKING_OFF, "mm_processor_kwargs": {"fps": 4, "max_frames": 4}})
    more = _ask(client, parts, extra={**THINKING_OFF, "mm_processor_kwargs": {"fps": 4, "max_frames": 8}})
    assert few.choices[0].message.content and few.usage.completion_tokens == TOKENS
    group = (more.usage.prompt_tokens - few.usage.prompt_tokens) / 2  # 8 frames: 4 groups, 4 frames: 2
    assert group > 4  # each 2-frame group: a timestamp, vision start / end and its pads


def test_parallel_burst_of_16_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int):
        stream = await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"Question number {i}?"}], max_tokens=4,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True}, extra_body=THINKING_OFF)
        chunks = [chunk async for chunk in stream]
        return chunks[0].id, chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    async def burst():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as client:  # fmt: skip
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(burst())
    assert len({rid for rid, _, _ in results}) == 16
    prompt_tokens = {usage.prompt_tokens for _, usage, _ in results}
    assert len(prompt_tokens) <= 2 and min(prompt_tokens) > 5  # "number 1?" vs "number 12?" may tokenize apart
    for _, usage, finish in results:
        assert 1 <= usage.completion_tokens <= 4 and finish in ("stop", "length")
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert server.wait_idle(10)["running"] == 0


def test_one_log_line_per_request(server, client):
    answer = _ask(client, "Log me.")
    deadline = time.monotonic() + 10
    while answer.id not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    [line] = [line for line in server.log().splitlines() if answer.id in line]
    assert f"prompt_tokens={answer.usage.prompt_tokens} completion_tokens={TOKENS}" in line
    assert re.search(r"status=200 .* ttft=\d+\.\d+s total=\d+\.\d+s finish=length", line)


def test_client_disconnect_mid_stream_frees_the_slot(server, client):
    body = {"model": "default", "messages": [{"role": "user", "content": LONG}], "max_tokens": 3000,
            "temperature": 0, "stream": True}  # a minute of tokens if it were not cancelled
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as reply:
        lines = reply.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert httpx.get(f"{server.url}/health").json()["running"] == 1
    closed = time.monotonic()
    health = server.wait_idle(10)
    assert health["running"] == 0 and health["waiting"] == 0 and time.monotonic() - closed < 10
    answer = _ask(client, "Still there?")  # the slot is free: the next request is served at once
    assert answer.usage.completion_tokens == TOKENS
    deadline = time.monotonic() + 10
    while f"{first['id']} status=499" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert re.search(re.escape(first["id"]) + r" status=499 .*finish=cancelled", server.log())


def test_speculative_server_answers_as_without_and_logs_its_drafts(client, tmp_path):
    """`--speculative mtp`: the same greedy answer as the server without it, and the request's log
    line says its draft acceptance and tokens per verify step."""
    from tests.app.serve_helpers import start_server, stop_server

    want = _ask(client, "Hello, who are you?", tokens=12).choices[0].message.content
    spec = start_server(["--api-key", API_KEY, "--speculative", "mtp", "--num-speculative-tokens", "2"],
                        tmp_path / "server.log")  # fmt: skip
    try:
        other = openai.OpenAI(base_url=f"{spec.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        assert _ask(other, "Hello, who are you?", tokens=12).choices[0].message.content == want
        deadline = time.time() + 10
        while "tokens_per_step=" not in spec.log() and time.time() < deadline:
            time.sleep(0.05)
        assert re.search(r"status=200 .* draft_acceptance=\d\.\d\d tokens_per_step=\d\.\d\d", spec.log())
    finally:
        stop_server(spec)
