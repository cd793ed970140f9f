"""Forge Neo's Lumina 2 and Z-Image (``backend.nn.lumina.NextDiT``): ``layers``, each calling
the module-level ``attention_function(q, k, v, heads, mask, skip_reshape=True,
transformer_options=)`` with ``[B, heads, S, D]`` queries and keys **already rotated** (keys
repeated to every head) over ``[caption, image, image padding]``, the caption and the image
each padded to ``pad_tokens_multiple``; the refiners before them call it on the caption alone
and on the image alone (left unpooled: a caption as long as the padded image could not be
told from it); no block index. The latent ``[B, C, H, W]``, patch 2 (padded up); the model is
called with ``1 - sigma``. Pooled by swapping that global per model call (``swap.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .family import FORGE_NEO, Dit, Family, HostPoint
from .neo_flux import neo, text_of, tokens


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(int(model.patch_size), True, 256, 1000.0, False), model.layers, ()


def _padded(n: int, multiple: int | None) -> int:
    return n + (-n) % multiple if multiple else n


def spans(model: nn.Module, x: torch.Tensor, c: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` of a model call, or None."""
    text = text_of(c)
    if x.dim() != 4 or text is None:
        return None
    p, multiple = int(model.patch_size), getattr(model, "pad_tokens_multiple", None)
    h, w = tokens(x.shape, (p, p))
    return _padded(text, multiple), True, 0, 1, h, w, _padded(h * w, multiple) - h * w


POINTS = (("backend.nn.lumina", "attention_function", 2, None, (1, "mask")),)


FAMILY = Family("forge neo lumina", neo("NextDiT"), read, host=HostPoint(FORGE_NEO, spans, POINTS))
