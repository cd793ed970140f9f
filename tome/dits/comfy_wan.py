"""ComfyUI's Wan 2.x (``comfy.ldm.wan.model.WanModel`` and its subclasses: VACE, camera,
S2V, HuMo): ``blocks``, each self-attention over the video tokens alone (frame-major, one
frame of ``ceil(H/2) x ceil(W/2)`` tokens per latent frame: patch ``(1, 2, 2)``, RoPE over
frame, row and column) and cross-attention to the text through the same attention call; the
model's timestep is ``sigma * 1000``. Pooled through ComfyUI's attention override
(``override.py``): ``spans`` says where a model call's video tokens sit."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint


def recognise(module: nn.Module) -> bool:
    return type(module).__module__.startswith("comfy.") \
        and any(c.__name__ == "WanModel" for c in type(module).__mro__)


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    patch = getattr(model, "patch_size", (1, 2, 2))
    return Dit(int(patch[-1]), True, 512, 1.0, True), model.blocks, ()


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``) of a ComfyUI
    ``apply_model`` call, or None: no text in the self-attention; a reference latent's tokens
    first where the model has ``ref_conv`` (unpooled); with a ``denoise_mask`` (Wan 2.2's
    image to video: the first frame is the given image, at timestep 0) the first frame kept
    whole; ``time_dim_concat`` frames after the video, then v0.30.0's in-context references
    (``context_latents``, each its own grid), unpooled. A sequence as long as the
    text (or an image prompt's ``clip_fea``) cannot be told from cross-attention by its
    lengths: None (not pooled); those lengths are the call's cross-attention (``cross``:
    a text longer than the video is not self-attention with extra keys)."""
    if x.dim() != 5:
        return None
    pt, ph, pw = (int(v) for v in getattr(model, "patch_size", (1, 2, 2)))

    def tokens(t: torch.Tensor, sides: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(math.ceil(int(s) / p) for s, p in zip(t.shape[-len(sides):], sides))

    frames, h, w = tokens(x, (pt, ph, pw))
    ref = conds.get("reference_latent")
    before = (int(ref.shape[-2]) // ph) * (int(ref.shape[-1]) // pw) \
        if isinstance(ref, torch.Tensor) and getattr(model, "ref_conv", None) is not None \
        else 0  # ref_conv: a strided convolution of the unpadded reference (sides rounded down)
    if isinstance(conds.get("denoise_mask"), torch.Tensor) and frames > 1:
        before, frames = before + h * w, frames - 1  # Wan 2.2 TI2V: the image's frame
    extra = conds.get("time_dim_concat")
    after = tokens(extra, (pt, ph, pw))[0] * h * w if isinstance(extra, torch.Tensor) else 0
    after += sum(math.prod(tokens(c, (pt, ph, pw))) for c in conds.get("context_latents") or ())
    keys = tuple(int(t.shape[-2]) for t in (context, conds.get("clip_fea"))
                 if isinstance(t, torch.Tensor))
    if before + frames * h * w + after in keys:
        return None
    return (0, True, before, frames, h, w, after, keys)


FAMILY = Family("comfy wan", recognise, read, host=HostPoint(COMFYUI, spans),
                video=True)
