"""ComfyUI's LTX-Video (``comfy.ldm.lightricks.model.LTXVModel``): ``transformer_blocks``,
each a self-attention over the video tokens alone (one token per latent pixel: patch 1,
frame-major, keys rotated, ``[B, S, heads * D]``) and a cross-attention to the text; no block
index (``UnnamedDit``: all blocks share one factor, no residual reuse). Guide frames
(``LTXVAddGuide``: latent frames appended after the video, their token positions in
``keyframe_idxs``) stay whole; v0.30.0 splits a guided self-attention's queries (keys the
whole sequence, a guide mask pooled with them). The model's timestep is ``sigma * 1000``.
Pooled through ComfyUI's attention override (``override.py``): ``spans`` says where a model
call's video tokens sit."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Family, HostPoint, UnnamedDit


def recognise(module: nn.Module) -> bool:
    """LTX-Video; not LTX-2 (``LTXAVModel``, its subclass: video and audio latents in one
    call, audio self-attention and audio-video cross-attention beside the video's), which
    passes through with the "not supported" line."""
    mro = [c.__name__ for c in type(module).__mro__ if c.__module__.startswith("comfy.ldm.")]
    return "LTXVModel" in mro and "LTXAVModel" not in mro


def read(model: nn.Module) -> tuple[UnnamedDit, Any, Any]:
    return UnnamedDit(1, True, 128, 1.0, True), model.transformer_blocks, ()


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``) of a ComfyUI
    ``apply_model`` call, or None: the latent's ``F x H x W`` tokens, the guide frames'
    tokens (``keyframe_idxs``) last and unpooled. A call whose guide tokens are not whole
    frames, or whose video is as long as the text (cross-attention could not be told
    apart), is not placed; a call whose tokens the model drops (a negative
    ``denoise_mask``) has other lengths and is not pooled. The text's length is the
    cross-attention's (``cross``), also where it is longer than the video."""
    if x.dim() != 5:
        return None
    f, h, w = (int(s) for s in x.shape[-3:])
    guides = conds.get("keyframe_idxs")
    after = int(guides.shape[2]) if isinstance(guides, torch.Tensor) else 0
    if after % (h * w) or after >= f * h * w:
        return None
    frames = f - after // (h * w)
    cross = (int(context.shape[-2]),) if isinstance(context, torch.Tensor) else ()
    if f * h * w in cross:
        return None
    return (0, True, 0, frames, h, w, after, cross)


FAMILY = Family("comfy ltx-video", recognise, read, host=HostPoint(COMFYUI, spans),
                video=True)
