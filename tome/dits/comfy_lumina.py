"""ComfyUI's Lumina 2 and Z-Image (``comfy.ldm.lumina.model.NextDiT``, Z-Image's pixel-space
``NextDiTPixelSpace`` too): ``layers``, each a joint self-attention over ``[caption, image]``,
both padded to ``pad_tokens_multiple`` where the model has one (Z-Image; Lumina 2: none);
before them a context refiner over the caption alone and a noise refiner over the image
alone (no block index: they share the blocks' factor where all blocks have one). Every call
is ``optimized_attention_masked(q, k, v, heads, mask, skip_reshape=True, ...)`` with keys
already rotated; the model is called with the sigma. Pooled through ComfyUI's attention
override (``override.py``): ``spans`` says where a model call's image tokens sit. Z-Image's
``direct_context`` (read at Comfy-Org/ComfyUI@dcbf1c1d, after v0.30.0): tokens already in the
model's width appended to the prompt's caption before its padding, so the caption is longer
than ``context``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint, comfy_class


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(int(model.patch_size), True, 256, 1000.0, True), model.layers, ()


def _padded(n: int, multiple: Any) -> int:
    return n + (-n) % int(multiple) if multiple else n


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``) of a ComfyUI
    ``apply_model`` call, or None: the caption (padded) first, the image's ``ceil(H/p) x
    ceil(W/p)`` tokens, its padding after (unpooled). The refiners' calls are placed by
    their lengths: the image alone is pooled like a joint call's image, the caption alone
    is not (nor an image as long as the caption: ``Spans.start``). Z-Image omni
    (``ref_latents``): ``omni`` places its references before the image. The prompt's
    caption counts ``direct_context``'s tokens too (``caption``)."""
    if x.dim() != 4 or not isinstance(context, torch.Tensor) or context.dim() != 3:
        return None
    p, multiple = int(model.patch_size), getattr(model, "pad_tokens_multiple", None)
    h, w = math.ceil(x.shape[-2] / p), math.ceil(x.shape[-1] / p)
    after = _padded(h * w, multiple) - h * w
    if conds.get("ref_latents"):
        return omni(model, p, multiple, context, conds, h * w + after, (h, w, after))
    return _padded(caption(context, conds), multiple), True, 0, 1, h, w, after


def caption(context: torch.Tensor, conds: dict) -> int:
    """The prompt's caption before padding: ``context``'s tokens, then ``direct_context``'s
    (``[B, N, dim]``, appended after the caption embedder) where the call has one."""
    direct = conds.get("direct_context")
    extra = int(direct.shape[1]) if isinstance(direct, torch.Tensor) and direct.dim() == 3 else 0
    return int(context.shape[1]) + extra


def omni(model: nn.Module, p: int, multiple: Any, context: torch.Tensor, conds: dict,
         image: int, grid: tuple[int, int, int]) -> tuple | None:
    """Z-Image omni's call (v0.30.0): ``[captions, SigLIP features, reference images,
    image]``, each padded: the captions (each reference's ``ref_contexts`` entry, or one
    multiple of pad tokens; the prompt; entries beyond the references) and the SigLIP
    features (each reference's ``siglip_feats`` ``[B, h, w, C]``, or one multiple of pad
    tokens; one multiple for the image; none without a SigLIP embedder) count as text, the
    reference images as tokens before the image (unpooled). None without padding, or where
    the captions' or the features' own refiner call is as long as the images' (their calls
    could not be told apart)."""
    if not multiple:
        return None
    refs, texts = list(conds["ref_latents"]), list(conds.get("ref_contexts") or ())
    feats = list(conds.get("siglip_feats") or ())
    m = int(multiple)
    captions = sum(_padded(int(texts[i].shape[1]), m) if i < len(texts) else m
                   for i in range(len(refs))) + _padded(caption(context, conds), m) \
        + sum(_padded(int(t.shape[1]), m) for t in texts[len(refs):])
    siglip = 0
    if getattr(model, "siglip_embedder", None) is not None:
        pad = m if getattr(model, "siglip_pad_token", None) is not None else 0
        siglip = sum(_padded(int(feats[i].shape[1]) * int(feats[i].shape[2]), pad)
                     if i < len(feats) else pad for i in range(len(refs))) + pad
    before = sum(_padded((int(r.shape[-2]) // p) * (int(r.shape[-1]) // p), m) for r in refs)
    if before + image in (captions, siglip):
        return None
    return captions + siglip, True, before, 1, *grid


FAMILY = Family("comfy lumina", comfy_class("NextDiT"), read, host=HostPoint(COMFYUI, spans))
