"""The Gradio demo, served in the test process: gradio_client turns and a real browser (Debian's chromium)."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from PIL import Image

from app import RANDOM_WEIGHTS_NOTICE
from app.demo import MAX_FILE_SIZE, build_demo, first_impression
from app.demo_chat import ERROR_TITLE, THINKING_TITLE, UNFINISHED_LOG

pytestmark = pytest.mark.subprocess  # every test talks to the demo served in this process

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]  # fmt: skip
# preset, temperature, top_p, top_k, max_new_tokens, presence_penalty, seed, thinking, fps, max_frames,
# thinking_budget
CONTROLS = ["greedy", 0.0, 1.0, 0, 10, 0.0, -1, False, 4.0, 8, -1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def url(pipeline):
    demo = build_demo(pipeline, max_new_tokens=48, **first_impression(None))  # as `python -m app.demo` builds it
    _, local_url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                                  quiet=True, max_file_size=MAX_FILE_SIZE)  # fmt: skip
    yield local_url
    demo.close()


@pytest.fixture(scope="module")
def client(url) -> Client:
    return Client(url, verbose=False)


def chat(client: Client, text: str, files=(), history=(), controls=CONTROLS) -> tuple[list, list]:
    """One turn through the /chat endpoint: (final history, every streamed history)."""
    job = client.submit({"text": text, "files": [handle_file(str(f)) for f in files]}, list(history), *controls,
                        api_name="/chat")  # fmt: skip
    job.result(timeout=120)
    updates = [output[1] for output in job.outputs()]
    return updates[-1], updates


def texts(message: dict) -> str:
    return "".join(part.get("text", "") for part in message["content"])


def test_text_turns_stream_and_continue(client, monkeypatch):
    from lm.serving import runner

    decode = runner.decode  # tokens slower than the page's updates: a fast machine decodes the 10 tokens
    monkeypatch.setattr(runner, "decode", lambda *a: (time.sleep(0.05), decode(*a))[1])  # in one update
    history, updates = chat(client, "Hello there")
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert texts(history[0]) == "Hello there" and texts(history[1])
    growing = [len(texts(u[-1])) for u in updates if len(u) == 2]
    assert len(set(growing)) >= 3 and growing[0] < growing[-1]  # streamed
    second, _ = chat(client, "And now?", history=history)
    assert [m["role"] for m in second] == ["user", "assistant", "user", "assistant"]
    assert second[:2] == history


def test_users_share_the_engine_and_turns_reuse_the_prefix_cache(pipeline, client):
    """The queue lets as many generations run as the engine has slots (one batch), and a chat's
    second turn resumes from its first through the prefix cache."""
    assert build_demo(pipeline)._queue.default_concurrency_limit == pipeline.engine.max_batch > 1
    jobs = [client.submit({"text": f"User {i}", "files": []}, [], *CONTROLS, api_name="/chat") for i in range(3)]
    histories = [job.result(timeout=120)[1] for job in jobs]
    assert all(texts(h[-1]) for h in histories)
    hits = pipeline.engine.prefix.stats()["hit_tokens"]
    chat(client, "And then?", history=histories[0])
    assert pipeline.engine.prefix.stats()["hit_tokens"] > hits


def test_image_video_and_thinking_turns(client, media):
    history, _ = chat(client, "What is this?", files=[media["image"], media["image"]])
    assert [part["type"] for part in history[0]["content"]] == ["file", "file", "text"]
    assert history[-1]["role"] == "assistant" and texts(history[-1]) and not history[-1]["metadata"]

    history, _ = chat(client, "What happens?", files=[media["video"]])
    assert str(history[0]["content"][0]["file"]).endswith(".mp4")
    assert history[-1]["role"] == "assistant" and texts(history[-1]) and not history[-1]["metadata"]

    thinking = CONTROLS[:7] + [True] + CONTROLS[8:]
    history, updates = chat(client, "Think first.", controls=thinking)
    thought = history[1]  # the random model never closes its thinking: shown open, marked unfinished
    assert thought["metadata"]["title"] == THINKING_TITLE and "status" not in thought["metadata"]
    assert thought["metadata"]["log"] == UNFINISHED_LOG and texts(thought)
    assert any(u[1]["metadata"]["status"] == "pending" for u in updates if len(u) > 1)

    budget = CONTROLS[:4] + [60] + CONTROLS[5:7] + [True] + CONTROLS[8:10] + [3]
    history, _ = chat(client, "Think briefly.", controls=budget)
    thought, answer = history[1:]  # the budget closed the thinking: an answer follows it
    assert thought["metadata"]["title"] == THINKING_TITLE and thought["metadata"].get("log") != UNFINISHED_LOG
    assert answer["role"] == "assistant" and texts(answer) and not answer["metadata"]


def test_errors_appear_in_the_chat(client, media):
    history, _ = chat(client, "What is this?", files=[media["corrupt"]])
    assert history[-1]["metadata"]["title"] == ERROR_TITLE
    # the upload's own name and the cause; not its place in the conversation nor Gradio's upload folder
    assert texts(history[-1]).startswith("corrupt.mp4: not a readable video file (")
    assert "conversation" not in texts(history[-1]) and "/" not in texts(history[-1])
    little_room = CONTROLS[:4] + [32000] + CONTROLS[5:]  # 768 of the 32768 context tokens left for the prompt
    history, _ = chat(client, "hello " * 1000, controls=little_room)
    assert history[-1]["metadata"]["title"] == ERROR_TITLE
    assert re.search(r"the prompt is \d+ tokens, longer than", texts(history[-1]))
    after, _ = chat(client, "Still there?", history=history)  # the failed turn is left out of the prompt
    assert texts(after[-1]) and not after[-1]["metadata"]


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium; `make test` does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, url):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url)
    page.wait_for_selector("#message textarea", timeout=30_000)
    yield page
    page.close()


@pytest.mark.browser
def test_browser_question_with_an_image_streams(page, media, tmp_path):
    notice = page.inner_text("#notice")
    assert "RANDOM weights" in notice and "never closes its <think> block" in notice
    assert page.is_checked("#thinking input[type=checkbox]") is False  # so the first reply shows text
    lengths = _ask_in_page(page, "What is in this image?", media["image"])
    assert len(lengths) >= 2 and 0 < lengths[0] < lengths[-1], lengths  # the answer appears, then grows
    shot = tmp_path / "demo.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(shot) as image:
        assert image.size[0] >= 1280


@pytest.mark.browser
def test_browser_stop_cancels_generation(page, client):
    page.fill("#max_new_tokens input[type=number]", "4000")
    page.press("#max_new_tokens input[type=number]", "Enter")
    assert page.input_value("#max_new_tokens input[type=number]") == "4000"  # ~2 min of tokens here
    page.fill("#message textarea", "Tell me a long story.")
    page.press("#message textarea", "Enter")
    bot = page.locator("#chatbot [data-testid='bot']").last
    page.wait_for_function("() => document.querySelectorAll('#chatbot [data-testid=\"bot\"]').length > 0")
    page.click("#stop")
    time.sleep(1.0)
    stopped = bot.inner_text()
    time.sleep(2.0)
    assert bot.inner_text() == stopped  # nothing more arrives
    start = time.monotonic()
    history, _ = chat(client, "Are you free again?")  # one generation at a time: waits if the old one still ran
    assert texts(history[-1]) and time.monotonic() - start < 30  # so the cancelled generation ended


def _ask_in_page(page, question: str, image: Path) -> list[int]:
    """Type, attach, send; returns the answer's text length at every DOM change until it settles."""
    page.set_input_files("#message input[type=file]", str(image))
    page.wait_for_selector("#message img", timeout=15_000)  # the attachment's thumbnail
    page.fill("#message textarea", question)
    page.evaluate("""() => {
        window.__lengths = [];
        const record = () => {
            const bots = document.querySelectorAll('#chatbot [data-testid="bot"]');
            const n = bots.length ? bots[bots.length - 1].innerText.length : 0;
            if (n && window.__lengths[window.__lengths.length - 1] !== n) window.__lengths.push(n);
        };
        new MutationObserver(record).observe(document.querySelector('#chatbot'),
            {subtree: true, childList: true, characterData: true});
    }""")
    page.press("#message textarea", "Enter")
    page.wait_for_selector("#chatbot [data-testid='user'] img", timeout=15_000)
    deadline, last, stable_since = time.monotonic() + 90, None, time.monotonic()
    while time.monotonic() < deadline:
        lengths = page.evaluate("() => window.__lengths")
        if lengths != last:
            last, stable_since = lengths, time.monotonic()
        elif lengths and time.monotonic() - stable_since > 3:
            return lengths
        time.sleep(0.1)
    raise AssertionError(f"the answer did not settle: lengths {last}")
