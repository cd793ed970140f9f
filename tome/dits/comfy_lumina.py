"""ComfyUI's Lumina 2 and Z-Image (``comfy.ldm.lumina.model.NextDiT``, Z-Image's pixel-space
``NextDiTPixelSpace`` too): ``layers``, each a joint self-attention over ``[caption, image]``,
both padded to ``pad_tokens_multiple`` where the model has one (Z-Image; Lumina 2: none);
before them a context refiner over the caption alone and a noise refiner over the image
alone (no block index: they share the blocks' factor where all blocks have one). Every call
is ``optimized_attention_masked(q, k, v, heads, mask, skip_reshape=True, ...)`` with keys
already rotated; the model is called with the sigma. Pooled through ComfyUI's attention
override (``override.py``): ``spans`` says where a model call's image tokens sit."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint


def recognise(module: nn.Module) -> bool:
    return type(module).__module__.startswith("comfy.") \
        and any(c.__name__ == "NextDiT" for c in type(module).__mro__)


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(int(model.patch_size), True, 256, 1000.0, True), model.layers, ()


def _padded(n: int, multiple: Any) -> int:
    return n + (-n) % int(multiple) if multiple else n


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``percall.Spans``) of a ComfyUI
    ``apply_model`` call, or None: the caption (padded) first, the image's ``ceil(H/p) x
    ceil(W/p)`` tokens, its padding after (unpooled). The refiners' calls are placed by
    their lengths: the image alone is pooled like a joint call's image, the caption alone
    is not (nor an image as long as the caption: ``Spans.start``). Z-Image's omni calls
    (``ref_latents``: captions, SigLIP features and reference images before the image) are
    not placed."""
    if x.dim() != 4 or not isinstance(context, torch.Tensor) or context.dim() != 3 \
            or conds.get("ref_latents"):
        return None
    p, multiple = int(model.patch_size), getattr(model, "pad_tokens_multiple", None)
    h, w = math.ceil(x.shape[-2] / p), math.ceil(x.shape[-1] / p)
    return (_padded(int(context.shape[1]), multiple), True, 0, 1, h, w,
            _padded(h * w, multiple) - h * w)


FAMILY = Family("comfy lumina", recognise, read, host=HostPoint(COMFYUI, spans))
