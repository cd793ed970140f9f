"""Forge Neo's Wan 2.x (``backend.nn.wan.WanModel``): ``blocks``, each a self-attention through
the module-level ``backend.nn.wan.attention(q, k, v, heads=, transformer_options=)`` (Neo's
own hook "for Radial Attention") over the video tokens alone, ``[B, S, heads * D]``, keys
**already rotated**, frame-major, patch ``(1, 2, 2)`` (padded up); its cross-attention calls
Neo's kernel directly (never the swapped name); the latent ``[B, C, T, H, W]``, frames added
with ``time_dim_concat`` after the video; the model's timestep is ``sigma * 1000``. Pooled
by swapping that global per model call (``swap.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .family import FORGE_NEO, Dit, Family, HostPoint
from .neo_flux import neo, tokens


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(int(model.patch_size[-1]), True, 512, 1.0, False), model.blocks, ()


def spans(model: nn.Module, x: torch.Tensor, c: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` of a model call, or None: no text
    in the self-attention."""
    if x.dim() != 5:
        return None
    patch = tuple(int(v) for v in model.patch_size)
    frames, h, w = tokens(x.shape, patch)
    extra = c.get("time_dim_concat")
    after = tokens(extra.shape, patch)[0] * h * w if isinstance(extra, torch.Tensor) else 0
    return 0, True, 0, frames, h, w, after


POINTS = (("backend.nn.wan", "attention", 1, None, (1, "mask")),)

FAMILY = Family("forge neo wan", neo("WanModel"), read, host=HostPoint(FORGE_NEO, spans, POINTS))
