"""The demo's model call without a server: error texts that name uploads, thinking that never closes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.demo import RANDOM_MODEL_THINKING_NOTICE, build_demo, first_impression, launch
from app.demo_chat import (ERROR_TITLE, STOPPED_LOG, THINKING_TITLE, UNFINISHED_LOG, stopped_reply, stream_reply,
                           user_message)  # fmt: skip
from tests.app.serve_helpers import free_port
from lm import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def reply(pipeline, files: list[Path], text: str = "What is this?", thinking: bool = False) -> list[dict]:
    history = [user_message(text, [str(f) for f in files])]
    *_, last = stream_reply(pipeline, history, GREEDY, thinking=thinking, fps=4.0, max_frames=8)
    return last[1:]


def upload(tmp_path: Path, name: str) -> Path:
    """A path like Gradio's upload folder gives one: /tmp/gradio/<hash>/<the user's file name>."""
    folder = tmp_path / "gradio" / "5f0c2d9e8a7b"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def test_errors_name_the_upload_and_the_cause(pipeline, media, tmp_path):
    image = upload(tmp_path, "photo.png")
    image.write_bytes(media["image"].read_bytes())
    corrupt = upload(tmp_path, "holiday.mp4")
    corrupt.write_bytes(b"not a video at all " * 30)
    [error] = reply(pipeline, [image, corrupt])
    assert error["metadata"] == {"title": ERROR_TITLE}
    assert error["content"] == "holiday.mp4: not a readable video file (Invalid data found when processing input)"

    tall = upload(tmp_path, "tall.png")
    Image.fromarray(np.zeros((10000, 20, 3), np.uint8)).save(tall)  # 20 wide, 10000 high
    [error] = reply(pipeline, [tall])
    assert error["content"] == ("tall.png: aspect ratio 500.0 of a 20x10000 (width x height) image is over the "
                                "supported maximum of 200")  # fmt: skip

    [error] = reply(pipeline, [upload(tmp_path, "gone.jpg")])
    assert error["content"] == "image file not found: gone.jpg"


def test_unfinished_thinking_is_shown_open_and_marked(pipeline):
    thought, *answer = reply(pipeline, [], text="Hi", thinking=True)
    assert thought["metadata"]["title"] == THINKING_TITLE and thought["content"]
    assert "status" not in thought["metadata"] and thought["metadata"]["log"] == UNFINISHED_LOG
    assert answer == []


def test_random_model_starts_with_thinking_off_and_says_why():
    random = first_impression(None)
    assert random["enable_thinking"] is False and RANDOM_MODEL_THINKING_NOTICE in random["notice"]
    assert first_impression("/models/Qwen3.5-0.8B") == {"notice": None, "enable_thinking": True}


def test_stop_during_thinking_leaves_no_spinner(pipeline):
    """Stop cancels the reply mid-thinking; its handler closes the pending block (issue 43)."""
    history = [user_message("Hi", [])]
    replies = stream_reply(pipeline, history, GREEDY, thinking=True, fps=4.0, max_frames=8)
    shown = next(replies)  # what the chat shows when Stop is clicked
    replies.close()
    assert shown[-1]["metadata"]["status"] == "pending"
    thought = stopped_reply(shown)[-1]
    assert "status" not in thought["metadata"] and thought["metadata"]["log"] == STOPPED_LOG
    assert thought["content"] == shown[-1]["content"] and stopped_reply(None) == []
    demo = build_demo(pipeline)  # the Stop click runs it beside the cancel of the chat event
    [stop_id] = [i for i, block in demo.fns.items() if block.fn is stopped_reply]
    [chat_id] = [i for i, block in demo.fns.items() if getattr(block.fn, "__name__", "") == "chat"]
    on = {d["id"]: d for d in demo.config["dependencies"]}
    assert any(d["cancels"] == [chat_id] and d["targets"] == on[stop_id]["targets"] for d in on.values())


@pytest.mark.subprocess
def test_launch_names_the_share_option_not_gradios(capsys):
    import gradio as gr

    with gr.Blocks(analytics_enabled=False) as demo:
        gr.Markdown("hi")
    try:
        launch(demo, host="127.0.0.1", port=free_port(), share=False, max_file_size="1mb")
    finally:
        demo.close()
    out = capsys.readouterr().out
    assert "pass --share" in out and "share=True" not in out and "http://127.0.0.1:" in out
