"""Forge Neo's Qwen-Image (``backend.nn.qwen``): ``transformer_blocks``, each calling the
module-level ``attention_function(q, k, v, heads, mask)`` (the mask positional, None in
practice) with ``[B, S, heads * D]`` queries and keys **already rotated** over ``[text, image,
references]``; no ``transformer_options`` and no block index reach it; the latent ``[B, C, 1,
H, W]``, patch 2 (padded up); edit references (``ref_latents=`` or ``dynamic_args``) after the
image. Pooled by swapping that global per model call (``swap.py``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import Dit, Family
from .neo_flux import neo, references, text_of, tokens


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(int(model.patch_size), True, 512, 1000.0, False), model.transformer_blocks, ()


def spans(model: nn.Module, x: torch.Tensor, c: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` of a model call, or None."""
    text = text_of(c)
    if x.dim() != 5 or text is None:
        return None
    p = int(model.patch_size)
    h, w = tokens(x.shape, (p, p))
    after = sum(math.prod(tokens(r.shape, (p, p))) for r in references(c))
    return text, True, 0, 1, h, w, after


POINTS = (("backend.nn.qwen", "attention_function", 1, None, (1, "mask")),)

FAMILY = Family("forge neo qwen-image", neo("QwenImageTransformer2DModel"), read)
