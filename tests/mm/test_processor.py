"""mm.Processor against transformers' Qwen3VLProcessor, built from the same checkpoint directory.

The reference uses the checkpoint's own video processor (Qwen3VLVideoProcessor) and the PIL backend
of its image processor (Qwen2VLImageProcessorPil), which preprocess/ matches bit for bit (the default
torchvision backend resizes differently, by up to one uint8 level). Videos are given to both as the
same frames; the reference gets metadata (fps, frame indices) whose idx / fps are our timestamps.
"""

from __future__ import annotations

import json

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

import preprocess
from app.tokenizer_files import write_tokenizer
from mm.processor import ModelInputs, Processor, PromptTooLongError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("processor")
    write_tokenizer(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    return path


@pytest.fixture(scope="module")
def ours(checkpoint) -> Processor:
    return Processor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf(checkpoint) -> Qwen3VLProcessor:
    processor = Qwen3VLProcessor.from_pretrained(checkpoint)
    processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    return processor


def noise_image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def noise_frames(count: int, height: int = 64, width: int = 80, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def user(*parts):
    return {"role": "user", "content": list(parts)}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def reference(hf, conversations, images=(), clips=(), enable_thinking=None):
    """transformers' output for the same conversations, images and sampled video clips."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    prompts = [hf.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **kwargs) for c in conversations]
    metadata = [VideoMetadata(total_num_frames=c.total_frames, fps=c.source_fps, frames_indices=list(c.frame_indices),
                              height=c.frames.shape[1], width=c.frames.shape[2], duration=c.duration)
                for c in clips]  # fmt: skip
    out = hf(text=prompts, images=list(images) or None, videos=[c.frames for c in clips] or None,
             video_metadata=metadata or None, do_sample_frames=False, padding=True, padding_side="left",
             return_tensors="pt")  # fmt: skip
    return prompts, out


def assert_same(ours_out: ModelInputs, prompts, ref, ours_proc: Processor):
    assert ours_out.prompts == prompts
    assert torch.equal(ours_out.input_ids, ref["input_ids"])
    assert torch.equal(ours_out.attention_mask, ref["attention_mask"])
    types = ours_out.mm_token_types(ours_proc.image_token_id, ours_proc.video_token_id)
    assert torch.equal(types, ref["mm_token_type_ids"])
    for mine, theirs in [("pixel_values", "pixel_values"), ("image_grid_thw", "image_grid_thw"),
                         ("pixel_values_videos", "pixel_values_videos"), ("video_grid_thw", "video_grid_thw")]:  # fmt: skip
        if theirs not in ref:
            assert getattr(ours_out, mine) is None, mine
        else:
            assert torch.equal(getattr(ours_out, mine), ref[theirs]), mine


def test_text_only(ours, hf):
    conversation = [{"role": "system", "content": "Be terse."}, user(text("What is in the picture?"))]
    for thinking in (None, False):
        out = ours(conversation, enable_thinking=thinking)
        assert_same(out, *reference(hf, [conversation], enable_thinking=thinking), ours)
        assert out.input_ids.shape[0] == 1 and out.attention_mask.all()


def test_one_image_from_a_file(ours, hf, tmp_path):
    image = noise_image(70, 110, seed=1)
    image.save(tmp_path / "a.png")
    out = ours([user({"type": "image", "image": str(tmp_path / "a.png")}, text("Describe it."))])
    conversation = [user({"type": "image", "image": image}, text("Describe it."))]
    assert_same(out, *reference(hf, [conversation], images=[image]), ours)
    t, h, w = out.image_grid_thw[0].tolist()
    assert int((out.input_ids == 248056).sum()) == t * h * w // 4


def test_two_images_of_different_sizes(ours, hf):
    images = [noise_image(300, 200, seed=2), noise_image(64, 400, seed=3)]
    conversation = [user({"type": "image", "image": images[0]}, text("and"),
                         {"type": "image_url", "image_url": {"url": _data_uri(images[1])}}, text("Compare."))]  # fmt: skip
    out = ours(conversation)
    ref_conversation = [user({"type": "image", "image": images[0]}, text("and"), {"type": "image"}, text("Compare."))]
    assert_same(out, *reference(hf, [ref_conversation], images=images), ours)
    assert out.image_grid_thw.tolist() != [out.image_grid_thw[0].tolist()] * 2


def test_one_video_as_frames(ours, hf):
    frames = noise_frames(8)
    conversation = [user({"type": "video", "video": list(frames), "fps": 3.0}, text("What happens?"))]
    out = ours(conversation)
    clip = preprocess.sample_video(list(frames), fps=3.0)
    assert_same(out, *reference(hf, [conversation], clips=[clip]), ours)
    info = out.videos[0]
    assert info.timestamps == [i / 3.0 for i in range(8)] and info.num_frames == 8 and info.frame_indices == [*range(8)]
    assert info.group_timestamps == [(2 * g / 3.0 + (2 * g + 1) / 3.0) / 2 for g in range(4)]
    assert "<|vision_start|><0.2 seconds><|vision_start|>" in ours.decode(out.input_ids[0], skip_special_tokens=False)


def test_one_video_file(ours, hf, tmp_path):
    path = _encode_video(tmp_path / "clip.mp4", noise_frames(12, 64, 64, seed=4), fps=4)
    conversation = [user({"type": "video", "video": str(path), "fps": 2.0, "max_frames": 4}, text("Summarize."))]
    out = ours(conversation)
    clip = preprocess.sample_video(str(path), fps=2.0, max_frames=4)
    assert out.videos[0].timestamps == [i / clip.source_fps for i in clip.frame_indices]  # HF's idx / fps
    assert out.videos[0].source == str(path) and out.videos[0].total_frames == 12
    assert_same(out, *reference(hf, [conversation], clips=[clip]), ours)


def test_video_clip_and_image_mixed(ours, hf):
    image = noise_image(90, 90, seed=5)
    clip = preprocess.sample_video(noise_frames(10, seed=6), fps=4.0, num_frames=4)
    conversation = [user({"type": "video", "video": clip}, {"type": "image", "image": image},
                         text("Is the picture in the video?"))]  # fmt: skip
    out = ours(conversation, enable_thinking=False)
    assert_same(out, *reference(hf, [conversation], images=[image], clips=[clip], enable_thinking=False), ours)
    assert out.videos[0].frame_indices == clip.frame_indices


def test_batch_is_left_padded_in_conversation_order(ours, hf):
    images = [noise_image(100, 60, seed=8), noise_image(40, 40, seed=9), noise_image(128, 96, seed=10)]
    batch = [
        [user(text("Hi"))],
        [user({"type": "image", "image": images[0]}, text("One?"))],
        [user({"type": "image", "image": images[1]}, {"type": "image", "image": images[2]}, text("Two?"))],
    ]
    out = ours(batch)
    assert_same(out, *reference(hf, batch, images=images), ours)
    assert out.attention_mask[0, 0] == 0 and out.input_ids[0, 0] == 248044  # the short one is padded on the left


def test_errors_are_clear(ours, tmp_path):
    with pytest.raises(PromptTooLongError, match="conversation 0: the prompt is [0-9]+ tokens, longer than the 5 allowed"):
        ours([user(text("Hello there"))], max_length=5)
    with pytest.raises(ValueError, match="System message cannot contain images"):
        ours([{"role": "system", "content": [{"type": "image", "image": noise_image(8, 8, 0)}]}, user(text("Hi"))])
    with pytest.raises(ValueError, match="literal placeholder"):
        ours([user(text("look: <|image_pad|>"))])
    with pytest.raises(ValueError, match="unknown content part type 'audio'"):
        ours([user({"type": "audio", "audio": "a.wav"})])
    bad = tmp_path / "broken.mp4"
    bad.write_bytes(b"not a video at all")
    with pytest.raises(preprocess.VideoError, match="broken.mp4"):
        ours([user({"type": "video", "video": str(bad)})])
    with pytest.raises(preprocess.ImageError, match="message 0, part 0.*missing.png"):
        ours([user({"type": "image", "image": str(tmp_path / "missing.png")})])
    clip = preprocess.sample_video(noise_frames(4), fps=2.0)
    with pytest.raises(ValueError, match="video options \\['max_frames'\\] do not apply to a VideoClip"):
        ours([user({"type": "video", "video": clip, "max_frames": 4})])


def test_decode_and_thinking(ours):
    out = ours([user(text("Hi"))], enable_thinking=True)
    assert ours.decode(out.input_ids[0]) == "user\nHi\nassistant\n<think>\n"
    assert ours.decode(out.input_ids[0].tolist(), skip_special_tokens=False) == out.prompts[0]
    generated = ours.tokenizer("Red or blue?\n</think>\n\nBlue.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ours.split_thinking(ours.decode(generated), in_thinking=True) == ("Red or blue?", "Blue.")


def test_to_moves_tensors(ours):
    out = ours([user({"type": "image", "image": noise_image(40, 40, 0)})]).to("cpu", torch.bfloat16)
    assert out.pixel_values.dtype == torch.bfloat16 and out.input_ids.dtype == torch.long


def _data_uri(image: Image.Image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _encode_video(path, frames: np.ndarray, fps: int):
    """A lossless-enough H.264 file of `frames` (decoded frames differ slightly; both sides use the same decode)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
