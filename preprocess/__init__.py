"""preprocess: images and videos to vision-tower inputs (see docs/architecture.md)."""

from .errors import ImageError, VideoError
from .image_load import load_image
from .image_processor import ImageProcessor
from .inputs import VisualInputs
from .smart_resize import smart_resize
from .video import VideoClip, sample_video
from .video_processor import VideoProcessor

__all__ = ["ImageError", "ImageProcessor", "VideoClip", "VideoError", "VideoProcessor", "VisualInputs",
           "load_image", "sample_video", "smart_resize"]
