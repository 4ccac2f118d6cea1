"""Gradio demo: multimodal chat with a Qwen3.5 / Qwen3.6 checkpoint. `python -m app.demo [--model PATH]`.

Several images and/or videos per turn, streamed answers, the thinking in a collapsible block, sampling
and video controls, stop and clear buttons. All model work happens in `demo_chat.stream_reply`,
which calls `mm.Pipeline` only.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import gradio as gr

from mm import PRESETS, Pipeline

from .demo_chat import MODEL_DEFAULT, error_message, sampling_params, stopped_reply, stream_reply, user_message
from mm.default_model import RANDOM_WEIGHTS_NOTICE
from .loading import add_model_arguments, check_model, device_problem, load_pipeline, pipeline_options

MAX_FILE_SIZE = "200mb"
API_NAME = "chat"  # gradio_client: client.submit(message, history, *controls, api_name="/chat")
RANDOM_MODEL_THINKING_NOTICE = (
    "Thinking is off by default here: the random model never closes its `<think>` block, so with Thinking "
    "on all of its text lands in an unfinished \"Thinking\" block and there is no answer."
)


def build_demo(pipeline: Pipeline, *, notice: str | None = None, title: str = "Qwen3.5 / Qwen3.6 chat",
               max_new_tokens: int = 1024, enable_thinking: bool = True, concurrency_limit: int | None = None,
               queue_size: int = 32, thinking_budget: int | None = None) -> gr.Blocks:  # fmt: skip
    """The demo's Blocks, queued (at most `concurrency_limit` generations at a time, default: the
    engine's slots, all decoded in one batch; `queue_size` waiting). Later chat turns reuse the
    earlier ones through the engine's prefix cache.

    notice: a warning shown above the chat (e.g. RANDOM_WEIGHTS_NOTICE). The chat event's inputs, in
    order: message ({"text", "files"}), history, preset, temperature, top_p, top_k, max_new_tokens,
    presence_penalty, seed, thinking, fps, max_frames, thinking_budget (-1: no limit; initially
    `thinking_budget`); outputs: the textbox and the history.
    """
    defaults = pipeline.default_params()
    with gr.Blocks(title=title, analytics_enabled=False) as demo:
        gr.Markdown(f"## {title}")
        if notice:
            gr.Markdown(f"**⚠️ {notice}**", elem_id="notice")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Chat", height=520, elem_id="chatbot", buttons=["copy"])
                textbox = gr.MultimodalTextbox(
                    placeholder="Ask about images or videos (attach several with the clip button)",
                    file_count="multiple", file_types=["image", "video"], sources=["upload"], show_label=False,
                    elem_id="message",
                )  # fmt: skip
                with gr.Row():
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    clear = gr.Button("Clear", elem_id="clear")
            with gr.Column(scale=1):
                controls = _controls(defaults, max_new_tokens, pipeline.max_context, enable_thinking,
                                     thinking_budget)  # fmt: skip
        chat = textbox.submit(_responder(pipeline), [textbox, chatbot, *controls.values()], [textbox, chatbot],
                              api_name=API_NAME)  # fmt: skip
        # the cancelled reply sends nothing more: its pending thinking block (a spinner) is closed here
        stop.click(stopped_reply, chatbot, chatbot, cancels=[chat], queue=False, api_visibility="private")
        clear.click(lambda: ([], None), None, [chatbot, textbox], cancels=[chat], api_name="clear")
        preset_outputs = [controls[k] for k in ("temperature", "top_p", "top_k", "presence_penalty", "thinking")]
        controls["preset"].change(_preset_values, controls["preset"], preset_outputs, api_visibility="private")
    limit = concurrency_limit or pipeline.engine.max_batch
    return demo.queue(default_concurrency_limit=limit, max_size=queue_size)


def _controls(defaults: Any, max_new_tokens: int, max_context: int, enable_thinking: bool,
              thinking_budget: int | None) -> dict[str, gr.components.Component]:  # fmt: skip
    """The settings column; keys in the chat event's input order (the budget last: added after the others)."""
    with gr.Accordion("Generation", open=True):
        controls = dict(
            preset=gr.Dropdown([MODEL_DEFAULT, *PRESETS], value=MODEL_DEFAULT, label="Preset"),
            temperature=gr.Slider(0.0, 2.0, value=defaults.temperature, step=0.05, label="Temperature (0 = greedy)"),
            top_p=gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="Top-p"),
            top_k=gr.Slider(0, 200, value=defaults.top_k, step=1, label="Top-k (0 = off)"),
            max_new_tokens=gr.Slider(1, max_context, value=min(max_new_tokens, max_context), step=1,
                                     label="Max new tokens", elem_id="max_new_tokens"),  # fmt: skip
            presence_penalty=gr.Slider(0.0, 2.0, value=defaults.presence_penalty, step=0.05, label="Presence penalty"),
            seed=gr.Number(-1, precision=0, label="Seed (-1 = random)"),
            thinking=gr.Checkbox(value=enable_thinking, label="Thinking", elem_id="thinking"),
        )
        budget = gr.Number(-1 if thinking_budget is None else thinking_budget, precision=0, minimum=-1,
                           label="Thinking budget in tokens (-1 = no limit)", elem_id="thinking_budget")  # fmt: skip
    with gr.Accordion("Video", open=True):
        controls["fps"] = gr.Slider(0.25, 8.0, value=2.0, step=0.25, label="Frames per second")
        controls["max_frames"] = gr.Slider(4, 768, value=64, step=2, label="Max frames")
    controls["thinking_budget"] = budget
    return controls


def _preset_values(preset: str) -> tuple[Any, ...]:
    """Slider values for a preset: its own; "model default" leaves the controls as they are."""
    if preset == MODEL_DEFAULT:
        return (gr.skip(),) * 5
    values = PRESETS[preset]
    thinking = {"thinking": True, "instruct": False}.get(preset, gr.skip())
    return values["temperature"], values["top_p"], values["top_k"], values["presence_penalty"], thinking


def _responder(pipeline: Pipeline):
    def chat(message: dict | None, history: list | None, preset: str, temperature: float, top_p: float,
             top_k: float, max_new_tokens: float, presence_penalty: float, seed: float | None, thinking: bool,
             fps: float, max_frames: float, thinking_budget: float | None = None):  # fmt: skip
        """Answer the message given the history; yields (textbox, history) as the answer streams."""
        text = ((message or {}).get("text") or "").strip()
        files = [f if isinstance(f, str) else f["path"] for f in (message or {}).get("files") or []]
        if not text and not files:
            gr.Warning("Type a question or attach an image or video.")
            yield gr.skip(), history or []
            return
        history = list(history or []) + [user_message(text, files)]
        yield gr.MultimodalTextbox(value=None), history
        try:
            params = sampling_params(pipeline, preset, temperature, top_p, top_k, max_new_tokens, presence_penalty,
                                     seed, thinking_budget)  # fmt: skip
        except ValueError as error:
            yield gr.skip(), history + [error_message(error)]
            return
        for update in stream_reply(pipeline, history, params, thinking=bool(thinking), fps=float(fps),
                                   max_frames=int(max_frames)):  # fmt: skip
            yield gr.skip(), update

    return chat


def first_impression(model: str | None) -> dict[str, Any]:
    """`build_demo`'s notice and initial thinking switch for a --model (None: the built-in random
    model, which gets the random-weights notice and Thinking off, so its first reply shows text)."""
    if model is None:
        return {"notice": f"{RANDOM_WEIGHTS_NOTICE} {RANDOM_MODEL_THINKING_NOTICE}", "enable_thinking": False}
    return {"notice": None, "enable_thinking": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.demo", description="Gradio chat demo for Qwen3.5 / Qwen3.6")
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true", help="also make a public gradio.live link (off by default)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="generations running at once (default: --max-batch, all in one batch)")
    parser.add_argument("--max-file-size", default=MAX_FILE_SIZE, help="upload size limit, e.g. 200mb")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="initial max new tokens")
    parser.add_argument("--thinking-budget", type=int, default=None, metavar="N",
                        help="initial thinking budget: at most N thinking tokens, then the thinking is closed and "
                             "the answer follows (default: no limit; the page can change it)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.thinking_budget is not None and args.thinking_budget < 0:
        parser.error(f"--thinking-budget must be >= 0, got {args.thinking_budget}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Start the demo server (blocks until interrupted)."""
    args = parse_args(argv)
    if (problem := device_problem(args.device)) is not None:
        raise SystemExit(f"error: {problem}")
    try:
        path = check_model(args.model)  # prints the random-weights notice when no --model
        pipeline = load_pipeline(path, **pipeline_options(args))  # kernels first
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    title = f"Qwen3.5 / Qwen3.6 chat: {Path(path).name}"
    demo = build_demo(pipeline, title=title, max_new_tokens=args.max_new_tokens, concurrency_limit=args.concurrency,
                      thinking_budget=args.thinking_budget, **first_impression(args.model))  # fmt: skip
    launch(demo, host=args.host, port=args.port, share=args.share, max_file_size=args.max_file_size)
    demo.block_thread()


def launch(demo: gr.Blocks, *, host: str, port: int, share: bool, max_file_size: str) -> None:
    """Start serving `demo` in the background and say where. Gradio's own lines are silenced: they
    advise to "set `share=True` in `launch()`", which is no option of this command (--share is)."""
    demo.launch(server_name=host, server_port=port, share=share, max_file_size=max_file_size, quiet=True,
                prevent_thread_lock=True)  # fmt: skip
    print(f"The demo runs at {demo.local_url}", flush=True)
    print(f"Public link: {demo.share_url}" if share else "For a public gradio.live link as well, pass --share.",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
