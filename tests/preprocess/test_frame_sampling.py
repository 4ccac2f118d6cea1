"""Frame selection arithmetic: consistent with transformers' Qwen3VLVideoProcessor for constant frame rate."""

from fractions import Fraction

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from preprocess import sample_video
from preprocess.frame_sampling import frame_count, select_frames


def _cfr(total: int, rate: int):
    """pts, time_base and end of a constant-rate video whose frame i is at i / rate seconds."""
    return np.arange(total, dtype=np.int64), Fraction(1, rate), total


def test_fps_sampling_equals_transformers_indices():
    reference = Qwen3VLVideoProcessor()
    checked = 0
    for total in (5, 9, 30, 97, 100, 241, 1000, 5000):
        for rate in (10, 24, 25, 30, 60):
            for fps in (0.5, 1.0, 2.0, 4.0):
                meta = VideoMetadata(total_num_frames=total, fps=rate, duration=total / rate)
                expected = reference.sample_frames(meta, fps=fps).tolist()
                ours = select_frames(*_cfr(total, rate), fps=fps, num_frames=None, min_frames=4, max_frames=768,
                                     start=None, end=None)
                if len(expected) % 2 == 0:  # transformers does not round to even; we do (qwen-vl-utils)
                    assert ours == expected, (total, rate, fps)
                    checked += 1
                else:  # odd: we take the even count below, or pad the last frame when the video is short
                    assert len(ours) in (len(expected) - 1, len(expected) + 1)
    assert checked > 100


@pytest.mark.parametrize("count", [2, 4, 6, 8, 16, 64, 100])
def test_num_frames_equals_linspace_round(count):
    for total in (count, count + 1, 3 * count + 7, 1001):
        ours = select_frames(*_cfr(total, 30), fps=2.0, num_frames=count, min_frames=4, max_frames=768,
                             start=None, end=None)
        assert ours == np.linspace(0, total - 1, count).round().astype(int).tolist()


def test_count_rule():
    assert frame_count(10, 2.0, 4, 768) == 20
    assert frame_count(3.95, 2.0, 4, 768) == 6  # 7.9 rounded down to even
    assert frame_count(1, 2.0, 4, 768) == 4  # min_frames
    assert frame_count(1, 2.0, 5, 768) == 6  # min_frames rounded up to even
    assert frame_count(10000, 2.0, 4, 768) == 768
    assert frame_count(10000, 2.0, 4, 101) == 100  # max_frames rounded down to even


def test_window_and_padding():
    pts, tb, end = _cfr(100, 10)
    window = select_frames(pts, tb, end, fps=2.0, num_frames=None, min_frames=4, max_frames=768, start=2.0, end=5.0)
    assert window == [20, 26, 32, 38, 44, 50]  # 3 s at 2 fps, first..last frame of [2 s, 5 s]
    short = select_frames(*_cfr(3, 10), fps=2.0, num_frames=None, min_frames=4, max_frames=768, start=None, end=None)
    assert short == [0, 1, 2, 2]
    odd = select_frames(pts, tb, end, fps=2.0, num_frames=5, min_frames=4, max_frames=768, start=None, end=None)
    assert odd == [0, 25, 50, 74, 99, 99]  # linspace(0, 99, 5).round(), last repeated to an even count
    with pytest.raises(ValueError, match="no frame between"):
        select_frames(pts, tb, end, fps=2.0, num_frames=None, min_frames=4, max_frames=768, start=20.0, end=None)
    with pytest.raises(ValueError, match="must be after start"):
        select_frames(pts, tb, end, fps=2.0, num_frames=None, min_frames=4, max_frames=768, start=3.0, end=2.0)


def test_variable_rate_picks_nearest_timestamp():
    pts = np.array([0, 100, 150, 400, 410, 420, 1000, 1010, 1500, 2000])
    chosen = select_frames(pts, Fraction(1, 1000), 2100, fps=2.0, num_frames=6, min_frames=4, max_frames=768,
                           start=None, end=None)
    # targets 0, .4, .8, 1.2, 1.6, 2.0 s -> nearest frames at 0, .4, 1.0, 1.01, 1.5, 2.0 s
    assert chosen == [0, 3, 6, 7, 8, 9]


def test_frames_in_memory_use_the_assumed_fps():
    frames = [np.full((8, 8, 3), i, dtype=np.uint8) for i in range(30)]
    clip = sample_video(frames, fps=2.0)  # 30 frames taken as 15 s at 2 fps: all kept
    assert len(clip) == 30 and clip.timestamps[:3] == [0.0, 0.5, 1.0] and clip.duration == 15.0
    clip = sample_video(np.stack(frames), fps=2.0, num_frames=4, start=5.0)
    assert clip.frame_indices == [10, 16, 23, 29] and clip.frames[:, 0, 0, 0].tolist() == [10, 16, 23, 29]
    assert clip.timestamps == [5.0, 8.0, 11.5, 14.5]
    assert clip.group_timestamps() == [6.5, 13.0]
    pil = sample_video([Image.fromarray(f) for f in frames[:3]], fps=1.0)
    assert pil.frames.shape == (4, 8, 8, 3) and pil.frame_indices == [0, 1, 2, 2]
    with pytest.raises(ValueError, match="one shape"):
        sample_video([frames[0], np.zeros((4, 4, 3), np.uint8)])
