"""`python -m app.serve`: bad input, limits, keys and tools, each answered with the right status and
an OpenAI error naming the problem (never a 500 for a client's mistake)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.app.serve_helpers import API_KEY, data_uri, free_port

pytestmark = pytest.mark.subprocess

HI = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _create(client, messages=HI, **kwargs):
    kwargs.setdefault("max_tokens", 3)
    return client.chat.completions.create(model=kwargs.pop("model", "default"), messages=messages, **kwargs)


def _refused(client, status: int, *words: str, **kwargs) -> dict:
    with pytest.raises(openai.APIStatusError) as caught:
        _create(client, **kwargs)
    error = caught.value
    assert error.status_code == status, error.message
    body = error.body
    assert set(body) == {"message", "type", "param", "code"}, body  # the client unwraps {"error": ...}
    for word in words:
        assert word in body["message"], body["message"]
    return body


def test_bad_fields_and_types(client):
    body = _refused(client, 400, "unknown field", "colour", extra_body={"colour": "blue"})
    assert body["param"] == "colour" and body["type"] == "invalid_request_error"
    assert _refused(client, 400, "temperature", "number", temperature="hot")["param"] == "temperature"
    assert _refused(client, 400, "max_tokens", max_tokens=0)["param"] == "max_tokens"
    assert _refused(client, 400, "non-empty", messages=[])["param"] == "messages"
    _refused(client, 400, "messages.0", "'robot'", messages=[{"role": "robot", "content": "x"}])
    _refused(client, 400, "messages.0.content", messages=[{"role": "user", "content": 5}])
    _refused(client, 400, "more choices than the engine", n=99)
    assert _refused(client, 400, "seed", seed=1 << 64)["param"] == "seed"
    assert _refused(client, 400, "top_k", extra_body={"top_k": 1 << 40})["param"] == "top_k"
    assert _create(client, frequency_penalty=0.5).usage.completion_tokens == 3  # taken, not refused
    _refused(client, 400, "enable_thinking", extra_body={"chat_template_kwargs": {"enable_thinking": "no"}})
    _refused(client, 400, "No user query", messages=[{"role": "system", "content": "Only a system turn."}])


def test_bad_json_and_oversized_body(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    url = f"{server.url}/v1/chat/completions"
    reply = httpx.post(url, content=b'{"model": "default", "messages": [', headers=headers)
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    big = {"model": "default", "messages": [{"role": "user", "content": "x" * (1 << 20)}]}
    reply = httpx.post(url, json=big, headers=headers)
    assert reply.status_code == 400 and "--max-request-bytes" in reply.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/nothing", headers=headers).status_code == 404


def test_media_errors(client, media, tmp_path):
    def image(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is it?"}]}]  # fmt: skip

    not_image = data_uri(media["corrupt"], "image/png")
    _refused(client, 400, "messages[0].content[0]", messages=image(not_image))
    _refused(client, 400, "base64", messages=image("data:image/png;base64,@@@"))
    outside = tmp_path / "elsewhere.png"
    outside.write_bytes(media["image"].read_bytes())
    _refused(client, 400, "outside the allowed local media folder", messages=image(f"file://{outside}"))
    _refused(client, 400, "no such file", messages=image(str(media["image"].parent / "missing.png")))
    start = time.monotonic()  # loopback is refused after resolving (no --allow-private-media): nothing is sent
    body = _refused(client, 400, "could not fetch URL", "--allow-private-media",
                    messages=image(f"http://127.0.0.1:{free_port()}/x.png"))  # fmt: skip
    assert time.monotonic() - start < 10 and "refused" not in body["message"]
    _refused(client, 400, "unsupported URL scheme", messages=image("ftp://127.0.0.1/x.png"))
    corrupt = {"type": "video_url", "video_url": {"url": data_uri(media["corrupt"], "video/mp4")}}
    video = [{"role": "user", "content": [corrupt]}]
    _refused(client, 400, "not a readable video", messages=video)


def test_limits(client, media):
    picture = {"type": "image_url", "image_url": {"url": data_uri(media["image"], "image/png")}}
    body = _refused(client, 400, "--max-images", messages=[{"role": "user", "content": [picture] * 3}])
    assert body["code"] == "too_many_images"
    clip = {"type": "video_url", "video_url": {"url": data_uri(media["video"], "video/mp4")}}
    _refused(client, 400, "--max-video-frames", messages=[{"role": "user", "content": [clip]}],
             extra_body={"mm_processor_kwargs": {"max_frames": 16}})  # fmt: skip
    long = [{"role": "user", "content": "word " * 5000}]
    body = _refused(client, 400, "prompt length limit", "4096", messages=long)
    assert body["code"] == "context_length_exceeded"
    _refused(client, 400, "does not fit the context", max_tokens=4096)


def test_keys_and_model_names(server, client):
    bare = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        _create(bare)
    assert "incorrect API key" in caught.value.message
    reply = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "default", "messages": HI})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
    with pytest.raises(openai.NotFoundError) as caught:
        _create(client, model="gpt-4o")
    assert "'gpt-4o' does not exist" in caught.value.message


TWO_TOOLS = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}, "precise": {"type": "boolean"}}}}}]


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_choice_named_and_required_give_a_call_even_from_a_random_model(client, thinking):
    """Decoding enforces the call (app/tool_choice.py): the random default model's answer is one
    well-formed call of an allowed tool, streamed or not."""
    kwargs = dict(tools=TWO_TOOLS, max_tokens=120, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})  # fmt: skip
    if thinking:  # the random model never closes its thinking by itself: no call within max_tokens
        reply = _create(client, tool_choice="required", **kwargs)
        assert reply.choices[0].finish_reason == "length" and not reply.choices[0].message.tool_calls
        return
    named = _create(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, **kwargs)
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
    assert set(json.loads(calls[0].function.arguments)) <= {"zone", "precise"}
    required = _create(client, tool_choice="required", **kwargs)
    calls = required.choices[0].message.tool_calls
    assert calls and calls[0].function.name in {"get_weather", "get_time"}
    stream = client.chat.completions.create(model="default", messages=HI, stream=True, tool_choice="required",
                                            **kwargs)  # fmt: skip
    streamed = [d.function.name for chunk in stream for d in (chunk.choices[0].delta.tool_calls or [])
                if chunk.choices and d.function and d.function.name]  # fmt: skip
    assert streamed == [calls[0].function.name]


def test_tools_reach_the_template(client):
    plain = _create(client, max_tokens=2)
    with_tools = _create(client, tools=TOOLS, tool_choice="auto", max_tokens=2)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the "# Tools" system block
    without = _create(client, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert without.usage.prompt_tokens == plain.usage.prompt_tokens
    named = _create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    max_tokens=2)  # fmt: skip
    assert named.usage.prompt_tokens > with_tools.usage.prompt_tokens  # plus the "must call" note
    history = HI + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]  # fmt: skip
    echoed = [*HI, _create(client, max_tokens=2).choices[0].message.model_dump(), {"role": "user", "content": "And?"}]
    assert _create(client, messages=echoed, max_tokens=2).usage.prompt_tokens > plain.usage.prompt_tokens
    after = _create(client, messages=history, tools=TOOLS, max_tokens=2)
    assert after.usage.prompt_tokens > with_tools.usage.prompt_tokens + 10  # the call and its <tool_response>
    _refused(client, 400, "not among the tools", tools=TOOLS,
             tool_choice={"type": "function", "function": {"name": "nope"}})  # fmt: skip
    _refused(client, 400, "tool_choice requires tools", tool_choice="required")
    bad_history = [*history[:1], {**history[1], "tool_calls": [{"id": "c", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{not json"}}]}, history[2]]  # fmt: skip
    _refused(client, 400, "arguments is not valid JSON", messages=bad_history, tools=TOOLS)
