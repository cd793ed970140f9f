"""ComfyUI's OmniGen2 (``comfy.ldm.omnigen.omnigen2.OmniGen2Transformer2DModel``, the same
calls in 0.8.0 and v0.30): refiners first (the text's own attention, the image's alone,
the references' alone), then ``layers``, one stream over **[text, reference images,
image]**, ``[B, heads, S, D]`` (fewer key heads: GQA), queries and keys rotated. The latent
and each reference latent (``ref_latents``) padded to the patch (``ceil(H/p) x ceil(W/p)``
tokens). The references are kept whole; the noise refiner's image-only call is pooled only
where there are none (its length is then the image's). No ``block_type`` / ``block_index``
(``UnnamedDit``): one factor shared by every block, no residual reuse (a preset runs its
point without it). The timestep is the sigma."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Family, HostPoint, UnnamedDit, by_class


def recognise(module: nn.Module) -> bool:
    return type(module).__module__.startswith("comfy.ldm.") \
        and by_class("OmniGen2Transformer2DModel")(module)


def read(model: nn.Module) -> tuple[UnnamedDit, Any, Any]:
    return UnnamedDit(int(model.patch_size), True, 256, 1000.0, True), (), model.layers


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``), or None."""
    if x.dim() != 4 or not isinstance(context, torch.Tensor) or context.dim() != 3:
        return None
    p = int(model.patch_size)

    def tokens(t: torch.Tensor) -> int:
        return math.ceil(t.shape[-2] / p) * math.ceil(t.shape[-1] / p)

    refs = sum(tokens(r) for r in conds.get("ref_latents") or () if isinstance(r, torch.Tensor))
    return (int(context.shape[1]), True, refs, 1, math.ceil(x.shape[-2] / p),
            math.ceil(x.shape[-1] / p), 0)


FAMILY = Family("comfy omnigen2", recognise, read, host=HostPoint(COMFYUI, spans))
