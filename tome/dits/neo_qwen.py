"""Forge Neo's Qwen-Image (``backend.nn.qwen``): ``transformer_blocks``, each calling the
module-level ``attention_function(q, k, v, heads, mask)`` (the mask positional, None in
practice) with ``[B, S, heads * D]`` queries and keys **already rotated** over ``[text, image,
references]``; no ``transformer_options`` and no block index reach it; the latent ``[B, C, 1,
H, W]``, patch 2 (padded up); edit references (``ref_latents=`` or ``dynamic_args``) after the
image. Pooled by swapping that global per model call (``swap.py``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .family import FORGE_NEO, Dit, Family, HostPoint
from .neo_flux import image_spans, neo


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(int(model.patch_size), True, 512, 1000.0, False), model.transformer_blocks, ()


spans = image_spans(5)  # Neo's Qwen-Image takes [B, C, 1, H, W]


POINTS = (("backend.nn.qwen", "attention_function", 1, None, (1, "mask")),)

FAMILY = Family("forge neo qwen-image", neo("QwenImageTransformer2DModel"), read,
                host=HostPoint(FORGE_NEO, spans, POINTS))
