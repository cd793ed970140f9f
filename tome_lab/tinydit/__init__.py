"""The tiny trained DiT (Flux architecture, 64 px, pixel space) the quality checks of DiT
pooling run on; see MODEL_CARD.md."""

from .model import CLASSES, NULL, TinyDiT, build_model, load_model, sample

__all__ = ["CLASSES", "NULL", "TinyDiT", "build_model", "load_model", "sample"]
