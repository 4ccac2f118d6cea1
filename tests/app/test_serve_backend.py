"""The server's backend on the real default model: concurrent requests share the engine's batch,
a 503 when no slot frees within the queue timeout, cancellation that frees the slot at once."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn

from app.serve import ServeConfig, create_app
from app.serve_backend import Backend, ServerBusy
from app.serve_chat import ChatJob
from mm import Pipeline
from tests.app.serve_helpers import free_port


LONG = "Tell me a very long story"  # greedy, thinking on: the default model loops without an end of turn


def _job(pipeline, text: str, tokens: int) -> ChatJob:
    params = pipeline.default_params("greedy", max_new_tokens=tokens)
    return ChatJob([{"role": "user", "content": text}], params, None, {}, [], True)


def _slots(pipeline, n: int) -> Pipeline:
    """The same model and processor with an engine of n slots."""
    return Pipeline(pipeline.model, pipeline.processor, engine_options=dict(max_batch=n))


def test_concurrent_requests_share_the_batch(pipeline):
    async def scenario():
        backend = Backend(_slots(pipeline, 4))
        alone = [pipeline.generate([_job(pipeline, f"Number {i}", 6).conversation],
                                   pipeline.default_params("greedy", max_new_tokens=6))[0] for i in range(3)]  # fmt: skip
        gens = [backend.start(_job(pipeline, f"Number {i}", 6)) for i in range(3)]
        outs = await asyncio.gather(*[_collect(g) for g in gens])
        for out, ref in zip(outs, alone):  # the same tokens as each alone; the pieces join to the text
            assert out[-1].token_ids == ref.token_ids
            assert "".join(out[:-1]) == pipeline.processor.decode(ref.token_ids)
        assert backend.pipeline.engine.stats()["steps"] < 3 * 7  # decoded together, not one after another
        assert backend.running == 0 and backend.waiting == 0

    asyncio.run(scenario())


async def _collect(generation):
    return [item async for item in generation.events()]


def test_full_engine_timeout_and_cancel(pipeline):
    async def scenario():
        backend = Backend(_slots(pipeline, 1), queue_timeout=0.5)
        long = backend.start(_job(pipeline, LONG, 3000))
        events = long.events()
        assert isinstance(await anext(events), str) and backend.running == 1
        start = time.monotonic()
        with pytest.raises(ServerBusy, match="--queue-timeout"):
            await anext(backend.start(_job(pipeline, "Me too?", 2)).events())
        assert 0.4 < time.monotonic() - start < 5
        backend.queue_timeout = 60
        deadline = time.monotonic() + 30  # the timed-out request leaves the engine's queue first: counted
        while backend.pipeline.engine.stats()["waiting"] and time.monotonic() < deadline:  # as waiting, it let
            await asyncio.sleep(0.01)  # the loop below start job i + 1 before job i was in (1 run in ~6)
        queued = []
        for i in range(3):  # one after another into the engine's queue
            queued.append(backend.start(_job(pipeline, f"Number {i}", 2)))
            deadline = time.monotonic() + 30
            while backend.pipeline.engine.stats()["waiting"] < i + 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        assert backend.waiting == 3
        order: list[int] = []

        async def drain(i: int) -> None:
            items = [item async for item in queued[i].events()]
            assert items[-1].completion_tokens == 2
            order.append(i)

        tasks = [asyncio.create_task(drain(i)) for i in (2, 0, 1)]
        long.cancel()
        rest = [item async for item in events]
        assert all(isinstance(item, str) for item in rest)  # cancelled: it ends with no Output
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        assert sorted(order) == [0, 1, 2]
        # first come, first served, in the engine: with one slot each request is sampled only after the
        # one before it ended (the order the drains finish in is the worker threads', not the engine's)
        times = [queued[i].answer.request.token_times for i in range(3)]
        assert all(len(t) == 2 for t in times) and times[0][-1] < times[1][0] and times[1][-1] < times[2][0]
        assert backend.running == 0 and backend.waiting == 0

    asyncio.run(scenario())


@pytest.fixture()
def small_server(pipeline):
    """The app in this process (uvicorn in a thread): an engine of one slot, a 0.5 s queue timeout."""
    backend = Backend(_slots(pipeline, 1), queue_timeout=0.5)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(backend, ServeConfig("default")), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", backend
    server.should_exit = True
    thread.join(timeout=30)


@pytest.mark.subprocess
def test_busy_server_answers_503(small_server):
    url, backend = small_server
    long = {"model": "default", "messages": [{"role": "user", "content": LONG}], "max_tokens": 3000,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=long, timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()  # kept: a dropped line iterator would close the connection
        assert next(lines).startswith("data: ") and backend.running == 1
        busy = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert busy.status_code == 503
        error = busy.json()["error"]
        assert error["code"] == "server_busy" and "--queue-timeout" in error["message"]
    deadline = time.monotonic() + 10
    while backend.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.running == 0  # the disconnect cancelled the long one
    fine = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 2


@pytest.mark.subprocess
def test_an_overflowing_seed_is_a_400_and_generation_goes_on(small_server):
    url, backend = small_server
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 1}
    for seed in (1 << 64, 10**100, -(1 << 63) - 1):
        reply = httpx.post(f"{url}/v1/chat/completions", json=dict(body, seed=seed), timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "seed", reply.text
    reply = httpx.post(f"{url}/v1/chat/completions", json=dict(body, seed=(1 << 64) - 1), timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


@pytest.mark.subprocess
def test_a_stopped_engine_makes_health_503_and_requests_fail_at_once(small_server, monkeypatch):
    url, backend = small_server
    engine = backend.pipeline.engine

    def fatal(self):
        raise SystemExit("the engine loop broke")

    monkeypatch.setattr(type(engine.scheduler), "step", fatal)
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    first = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert first.status_code == 503 and "engine stopped" in first.json()["error"]["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "the engine loop broke" in health.json()["error"]
    started = time.monotonic()
    again = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert again.status_code == 503 and again.json()["error"]["code"] == "engine_stopped"
    assert time.monotonic() - started < 30  # refused at once, not after the queue timeout
