"""ComfyUI's Kandinsky 5, video and image (``comfy.ldm.kandinsky5.model.Kandinsky5``):
``text_transformer_blocks`` (a self-attention over the text alone, left whole) then
``visual_transformer_blocks`` (named ``block_type`` "double", ``block_index``), each a
self-attention over the visual tokens alone (frame-major, patch ``(1, 2, 2)``, keys rotated,
``[B, heads, S, D]``) and a cross-attention to the text. A 4-D latent (the image model) is
one frame. Pooled through ComfyUI's attention override (``override.py``): ``spans`` says
where a model call's visual tokens sit."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint, comfy_class


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    patch = getattr(model, "patch_size", (1, 2, 2))
    return Dit(int(patch[-1]), True, 256, 1.0, True), model.visual_transformer_blocks, ()


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``) of a ComfyUI
    ``apply_model`` call, or None: the visual tokens alone (the latent padded up to whole
    patches). Visual tokens as many as the text's (its self-attention and the
    cross-attention could not be told apart) are not placed; the text's length is the
    cross-attention's (``cross``), also where it is longer."""
    if x.dim() not in (4, 5):
        return None
    patch = tuple(int(p) for p in getattr(model, "patch_size", (1, 2, 2)))
    sides = (1, *x.shape[-2:]) if x.dim() == 4 else x.shape[-3:]
    frames, h, w = (math.ceil(int(s) / p) for s, p in zip(sides, patch))
    cross = (int(context.shape[-2]),) if isinstance(context, torch.Tensor) else ()
    if frames * h * w in cross:
        return None
    return (0, True, 0, frames, h, w, 0, cross)


FAMILY = Family("comfy kandinsky 5", comfy_class("Kandinsky5"), read,
                host=HostPoint(COMFYUI, spans),
                video=True)
