"""The server's structured outputs and thinking budget (`response_format`, `thinking_budget`) on the
built-in model, through the real app in this process (uvicorn on a loopback port)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import pytest
import uvicorn

from app.serve import ServeConfig, create_app
from app.serve_backend import Backend
from mm import Pipeline, constraints
from mm.constraints import BUDGET_CLOSING
from tests.app.serve_helpers import free_port
from tests.mm.test_constraints import SCHEMA

pytestmark = pytest.mark.subprocess  # a server thread on a port


@pytest.fixture(scope="module")
def url(pipeline):
    server = uvicorn.Server(uvicorn.Config(create_app(Backend(pipeline), ServeConfig("default")), host="127.0.0.1",
                                           port=(port := free_port()), log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def _body(**fields) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 600,
            "temperature": 1.0, "seed": 5, **fields}  # fmt: skip


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def _streamed(url: str, body: dict) -> tuple[str, str, dict]:
    content, reasoning, usage = "", "", {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=120) as reply:  # fmt: skip
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                content += choice["delta"].get("content") or ""
                reasoning += choice["delta"].get("reasoning_content") or ""
    return content, reasoning, usage


@pytest.mark.parametrize("thinking", [False, True])
def test_json_schema_answers_validate_streamed_and_not(url, thinking):
    body = _body(response_format=_json_schema(SCHEMA), chat_template_kwargs={"enable_thinking": thinking},
                 **({"thinking_budget": 4} if thinking else {}))  # fmt: skip
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert bool(message.get("reasoning_content")) == thinking and "{" not in (message.get("reasoning_content") or "")
    content, reasoning, usage = _streamed(url, body)
    assert content == message["content"] and reasoning == (message.get("reasoning_content") or "")
    assert (usage["completion_tokens_details"]["reasoning_tokens"] > 0) == thinking


def test_json_object_and_the_reasoning_token_count(url, pipeline):
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=_body(
        response_format={"type": "json_object"}, chat_template_kwargs={"enable_thinking": True}, thinking_budget=3,
        max_tokens=400))  # fmt: skip
    assert reply.status_code == 200, reply.text
    # any object: a closed one ('{}', or keys whose unbounded strings the sample happened to close),
    # else, run to max_tokens, an object's opening
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    closing = len(pipeline.processor.tokenizer(BUDGET_CLOSING, add_special_tokens=False)["input_ids"])
    assert 0 < reply.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] <= 3 + closing


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": _json_schema({"type": "strin"})}, "response_format", 'Unsupported type "strin"'),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": _json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})},
     "response_format", "uniqueItems at # is not enforced"),
    ({"thinking_budget": -1}, "thinking_budget", "thinking_budget"),
    ({"response_format": _json_schema({"type": "object"}), "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]},
     "response_format", "tool_choice cannot"),
])  # fmt: skip
def test_bad_constraints_are_400s_that_name_the_field(url, fields, param, message):
    reply = httpx.post(f"{url}/v1/chat/completions", json=_body(**fields), timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_a_request_makes_its_rule_once_and_runs_that_rule(url, pipeline, monkeypatch):
    """The rule checked at admission is the one the engine runs: made once per answer (each of n
    choices its own: a rule keeps its answer's state)."""
    made, grammar_rules, ran = [], [], []
    make, grammar_rule, submit = Pipeline.constraint_rule, constraints.GrammarRule, pipeline.engine.submit

    def counting_make(self, *args, **kwargs):
        made.append(make(self, *args, **kwargs))
        return made[-1]

    def counting_grammar_rule(*args, **kwargs):
        grammar_rules.append(grammar_rule(*args, **kwargs))
        return grammar_rules[-1]

    def recording_submit(*args, **kwargs):
        ran.append(kwargs.get("rule"))
        return submit(*args, **kwargs)

    monkeypatch.setattr(Pipeline, "constraint_rule", counting_make)
    monkeypatch.setattr(constraints, "GrammarRule", counting_grammar_rule)
    monkeypatch.setattr(pipeline.engine, "submit", recording_submit)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for fields, answers, grammars in [
        ({"response_format": _json_schema(SCHEMA)}, 1, 1),
        ({"response_format": _json_schema(SCHEMA), "n": 2}, 2, 2),
        ({"response_format": _json_schema(SCHEMA), "thinking_budget": 3, "chat_template_kwargs": {}}, 1, 1),
        ({"tools": tools, "tool_choice": "required", "max_tokens": 40}, 1, 0),
    ]:  # fmt: skip
        made.clear(), grammar_rules.clear(), ran.clear()
        body = {"chat_template_kwargs": {"enable_thinking": False}, **fields}
        reply = httpx.post(f"{url}/v1/chat/completions", json=_body(**body), timeout=120)
        assert reply.status_code == 200, reply.text
        assert len(made) == answers and len(grammar_rules) == grammars, fields
        assert sorted(map(id, ran)) == sorted(map(id, made)) and None not in ran, fields  # the rules made, run
        for choice in reply.json()["choices"] if "response_format" in fields else []:
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_logprobs_streamed_and_not_and_logit_bias(url, pipeline):
    body = _body(max_tokens=6, logprobs=True, top_logprobs=3, logit_bias={"13": 100},
                 chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == reply.json()["usage"]["completion_tokens"]
    comma = pipeline.processor.tokenizer.decode([13])
    assert all(entry["token"] in (comma, "") or entry["logprob"] < -1 for entry in content)  # a +100 bias: 13 or EOS
    assert all(len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token"] == comma for entry in content[:-1])
    assert all(entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode()) for entry in content)
    streamed = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("content") or []
    assert streamed == content  # seeded: the same tokens, each once


@pytest.mark.parametrize("fields, param", [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                                           ({"top_logprobs": 2}, "top_logprobs"),
                                           ({"logit_bias": {"999999999": 1}}, "logit_bias"),
                                           ({"logit_bias": {"abc": 1}}, "logit_bias"),
                                           ({"logit_bias": {"5": 101}}, None)])
def test_bad_logprobs_and_logit_bias_are_400s(url, fields, param):
    reply = httpx.post(f"{url}/v1/chat/completions", json=_body(**fields), timeout=60)
    assert reply.status_code == 400 and (param is None or reply.json()["error"]["param"] == param), reply.text


def test_n_choices_share_the_prompt_and_are_seeded_each(url, pipeline):
    body = _body(max_tokens=8, n=3, seed=11, logprobs=True, chat_template_kwargs={"enable_thinking": False},
                 messages=[{"role": "user", "content": "A prompt for three choices, long enough to cache " * 6}])
    before = pipeline.engine.prefix.stats()
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in data["choices"]]
    assert len(set(texts)) == 3  # seed, seed + 1, seed + 2
    assert data["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in data["choices"])
    assert pipeline.engine.prefix.stats()["hits"] >= before["hits"] + 2  # choices 1 and 2 resumed choice 0's prompt
    one = httpx.post(f"{url}/v1/chat/completions", json={**body, "n": 1, "seed": 12}, timeout=120).json()
    assert one["choices"][0]["message"]["content"] == texts[1]  # choice 1 is the request seeded seed + 1
    streamed = {0: "", 1: "", 2: ""}
    finishes = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed[choice["index"]] += choice["delta"].get("content") or ""
                    finishes[choice["index"]] = choice["finish_reason"] or finishes.get(choice["index"])
    assert [streamed[i] for i in range(3)] == texts and all(finishes[i] for i in range(3))


def test_n_beyond_the_slots_or_with_a_forced_tool_is_a_400(url):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for fields in ({"n": 9}, {"n": 2, "tools": tools, "tool_choice": "required"}):
        reply = httpx.post(f"{url}/v1/chat/completions", json=_body(**fields), timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "n", reply.text
