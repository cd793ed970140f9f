"""ComfyUI's Qwen-Image 2.1 (``comfy.ldm.qwen_image21.model.QwenImage21Transformer2DModel``,
after v0.30.0, read at Comfy-Org/ComfyUI@b8067976): ``transformer_blocks``, all single-stream
(``block_type`` "single", ``block_index`` named), one token per latent pixel of its
64-channel latent (patch 1). Its sequence is the text with the reference images spliced in
at their slots (``image_slots``), the target image last; each block attends block-causally,
one call per segment: a text run's queries (a causal mask) or a reference's see the keys up to
their own end; the target's queries see the whole sequence. Only the target's call is pooled
(its keys: every text and reference token whole, the target image pooled); the earlier
segments' key lengths are ``Spans.cross``, so they stay whole. Its cached-prefix steps (the
text and reference keys kept from the first step) call the target alone against the same
keys: placed alike. The model is called with the sigma."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint, comfy_class


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(1, True, 512, 1000.0, True), (), model.transformer_blocks


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after, cross)`` of a model call: the text
    and references before the target (``text``), the target's ``H x W`` tokens; ``cross``:
    the key lengths of the earlier segments' calls (never pooled). None where an earlier
    segment's call is as long as the target's own tokens (a first reference of the target's
    size: its self-attention could not be told from the target's)."""
    if x.dim() != 4 or not isinstance(context, torch.Tensor) or context.dim() != 3:
        return None
    refs = list(conds.get("ref_latents") or ())
    text = int(context.shape[1])
    slots = ([int(s) for s in conds.get("image_slots") or ()] + [text] * len(refs))[:len(refs)]
    bounds, length, ends = [0, *slots, text], 0, []
    for (start, end), ref in zip(zip(bounds[:-1], bounds[1:]), [*refs, None]):
        if end > start:
            ends.append((end - start, length + end - start))
            length += end - start
        if ref is not None:
            n = int(ref.shape[-2]) * int(ref.shape[-1])
            ends.append((n, length + n))
            length += n
    image = int(x.shape[-2]) * int(x.shape[-1])
    if any(q == k == image for q, k in ends):
        return None
    return length, True, 0, 1, int(x.shape[-2]), int(x.shape[-1]), 0, \
        tuple(sorted({k for _, k in ends}))


FAMILY = Family("comfy qwen-image 2.1", comfy_class("QwenImage21Transformer2DModel"), read,
                host=HostPoint(COMFYUI, spans))
