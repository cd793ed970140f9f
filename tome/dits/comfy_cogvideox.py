"""ComfyUI's CogVideoX 1.0 and 1.5 (``comfy.ldm.cogvideo.model.CogVideoXTransformer3DModel``,
ComfyUI v0.30.0): ``blocks``, each one joint self-attention over ``[text, video]`` (the whole
text first; the video frame-major, patch ``(patch_size_t or 1, patch_size, patch_size)``,
padded up; keys rotated, ``[B, S, heads * D]``); no block index (``UnnamedDit``: the blocks
share one factor, no residual reuse). Pooled through ComfyUI's attention override
(``override.py``): ``spans`` says where a model call's video tokens sit."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Family, HostPoint, UnnamedDit, comfy_class


def read(model: nn.Module) -> tuple[UnnamedDit, Any, Any]:
    return UnnamedDit(int(model.patch_size), True, 226, 1.0, True), model.blocks, ()


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``) of a ComfyUI
    ``apply_model`` call, or None: the text's length first, then the video's tokens."""
    if x.dim() != 5 or not isinstance(context, torch.Tensor) or context.dim() != 3:
        return None
    p, pt = int(model.patch_size), int(getattr(model, "patch_size_t", None) or 1)
    frames, h, w = (math.ceil(int(s) / q) for s, q in zip(x.shape[-3:], (pt, p, p)))
    return (int(context.shape[1]), True, 0, frames, h, w, 0)


FAMILY = Family("comfy cogvideox", comfy_class("CogVideoXTransformer3DModel"), read,
                host=HostPoint(COMFYUI, spans),
                video=True)
