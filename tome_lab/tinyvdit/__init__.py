"""The tiny trained video DiT (Wan architecture, 32 px x 9 frames, pixel space) the video
quality checks of DiT pooling run on; see MODEL_CARD.md."""

from .model import CLASSES, NULL, TinyVDiT, build_model, load_model, sample

__all__ = ["CLASSES", "NULL", "TinyVDiT", "build_model", "load_model", "sample"]
