"""The official Qwen3.5 chat template renders the real checkpoint's format; media collection and errors."""

from __future__ import annotations

import pytest

from mm.chat import DEFAULT_CHAT_TEMPLATE_PATH, collect_media, load_chat_template, render, split_thinking

GEN_THINK = "<|im_start|>assistant\n<think>\n"
GEN_NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def show(tokenizer, tokenizer_checkpoint):
    template = load_chat_template(tokenizer_checkpoint)

    def show(conversation, add_generation_prompt=True, enable_thinking=None):
        messages, _ = collect_media(conversation, 0)
        return render(tokenizer, template, messages, 0, add_generation_prompt=add_generation_prompt,
                      enable_thinking=enable_thinking)  # fmt: skip

    return show


def user(content):
    return {"role": "user", "content": content}


def test_checkpoint_template_is_the_stored_official_one(tokenizer_checkpoint):
    assert load_chat_template(tokenizer_checkpoint) == DEFAULT_CHAT_TEMPLATE_PATH.read_text()


def test_template_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0].content }}"}')
    assert load_chat_template(tmp_path) == "{{ messages[0].content }}"
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default", "template": "T"}]}')
    assert load_chat_template(tmp_path) == "T"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no chat template in"):
        load_chat_template(tmp_path)


def test_text_and_thinking_switch(show):
    body = "<|im_start|>user\nHello<|im_end|>\n"
    assert show([user("Hello")]) == body + GEN_THINK  # thinking is the default
    assert show([user("Hello")], enable_thinking=True) == body + GEN_THINK
    assert show([user("Hello")], enable_thinking=False) == body + GEN_NO_THINK
    assert show([user("Hello")], add_generation_prompt=False) == body


def test_system_message(show):
    conversation = [{"role": "system", "content": "Be terse."}, user([{"type": "text", "text": "Hi"}])]
    expected = "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" + GEN_NO_THINK
    assert show(conversation, enable_thinking=False) == expected


def test_image_and_video_parts(show):
    conversation = [user([
        {"type": "image", "image": "a.png"}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "http://x/b.png"}}, {"type": "video", "video": "c.mp4"},
        {"type": "text", "text": "What changed?"},
    ])]  # fmt: skip
    expected = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|image_pad|>"
                "<|vision_end|><|vision_start|><|video_pad|><|vision_end|>What changed?<|im_end|>\n" + GEN_THINK)  # fmt: skip
    assert show(conversation) == expected


def test_multi_turn_reasoning_kept_only_after_the_last_user_query(show):
    conversation = [
        user("Q1"),
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        user("Q2"),
        {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"},
    ]
    expected = ("<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
                "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n")  # fmt: skip
    assert show(conversation, add_generation_prompt=False) == expected
    follow_up = show(conversation + [user("Q3")], enable_thinking=False)
    assert follow_up.endswith("<|im_start|>assistant\nA2<|im_end|>\n<|im_start|>user\nQ3<|im_end|>\n" + GEN_NO_THINK)


def test_non_thinking_prompt_tokens(show, tokenizer):
    """Tokens: [248045, user, 198, ..., 248046, 198, 248045, assistant, 198, 248068, 271, 248069, 271]."""
    ids = tokenizer(show([user("Hi")], enable_thinking=False), add_special_tokens=False)["input_ids"]

    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    nl, nlnl = enc("\n") + enc("\n\n")
    assert ids == [248045, *enc("user"), nl, *enc("Hi"), 248046, nl, 248045, *enc("assistant"), nl,
                   248068, nlnl, 248069, nlnl]  # fmt: skip


def test_media_are_collected_in_prompt_order():
    conversation = [
        {"role": "system", "content": "sys"},
        user([{"type": "video", "video": "v.mp4", "fps": 1.0, "max_frames": 8}, {"type": "image", "image": "a"}]),
        {"role": "assistant", "content": "ok"},
        user([{"image_url": "b"}]),
    ]
    messages, media = collect_media(conversation, 3)
    assert [(m.kind, m.source) for m in media] == [("video", "v.mp4"), ("image", "a"), ("image", "b")]
    assert media[0].options == {"fps": 1.0, "max_frames": 8}
    assert media[2].where == "conversation 3, message 3, part 0"
    assert messages[1]["content"] == [{"type": "video"}, {"type": "image"}]
    assert conversation[1]["content"][1] == {"type": "image", "image": "a"}  # the caller's messages are untouched


def test_image_in_system_message_is_refused(show):
    conversation = [{"role": "system", "content": [{"type": "image", "image": "a.png"}]}, user("Hi")]
    with pytest.raises(ValueError, match="conversation 0: the chat template refused it: System message cannot "
                                         "contain images"):  # fmt: skip
        show(conversation)


@pytest.mark.parametrize("part, message", [
    ({"type": "audio", "audio": "x.wav"}, "part 1: unknown content part type 'audio'"),
    ({"type": "image"}, "part 1: an image part needs 'image'"),
    ({"type": "video"}, "part 1: a video part needs 'video'"),
    ({"type": "text", "text": 3}, "part 1: a text part needs a string 'text'"),
    ("plain", "part 1: a content part must be a dict"),
])  # fmt: skip
def test_bad_parts_are_named(part, message):
    with pytest.raises(ValueError, match="conversation 0, message 0, " + message):
        collect_media([user([{"type": "text", "text": "x"}, part])], 0)


def test_bad_conversations_are_named():
    with pytest.raises(ValueError, match="conversation 2 must be a non-empty list"):
        collect_media([], 2)
    with pytest.raises(ValueError, match="conversation 0, message 0: expected a dict with 'role'"):
        collect_media([{"content": "x"}], 0)


def test_split_thinking():
    assert split_thinking("Let me see.\n</think>\n\nIt is red.") == ("Let me see.", "It is red.")
    assert split_thinking("<think>\nhmm\n</think>\n\nYes") == ("hmm", "Yes")
    assert split_thinking("\n</think>\n\nYes") == ("", "Yes")
    assert split_thinking("Just an answer.") == ("", "Just an answer.")
    assert split_thinking("still thinking", in_thinking=True) == ("still thinking", "")
