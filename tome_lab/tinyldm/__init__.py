"""A small trained pixel-space diffusion model for measuring token merging's quality effect.

``load_model()`` loads the shipped weights (no network); ``sample`` runs deterministic
DDIM; ``denoising_loss`` scores held-out crops. See MODEL_CARD.md.
"""

from .model import (
    CONFIG,
    DEFAULT_WEIGHTS,
    TinyLDM,
    build_model,
    denoising_loss,
    load_model,
    num_params,
    sample,
)

__all__ = [
    "CONFIG",
    "DEFAULT_WEIGHTS",
    "TinyLDM",
    "build_model",
    "denoising_loss",
    "load_model",
    "num_params",
    "sample",
]
