"""ComfyUI's Cosmos: predict1 (``comfy.ldm.cosmos.model.GeneralDIT``, ``blocks`` a
``ModuleDict``) and predict2 (``comfy.ldm.cosmos.predict2.MiniTrainDIT``, and Anima, its
subclass: ``blocks`` a list). Each block: self-attention over the video tokens alone
(frame-major, ``ceil(T/pt) x ceil(H/ps) x ceil(W/ps)``: ``patch_temporal``,
``patch_spatial``; keys rotated, ``[B, heads, S, D]``), then cross-attention to the text.
predict2 names its block (``block_index``) in v0.30.0 only, predict1 never: read as
``UnnamedDit`` (one factor for all blocks, no residual reuse) in both. Pooled through
ComfyUI's attention override (``override.py``): ``spans`` says where a model call's video
tokens sit."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Family, HostPoint, UnnamedDit, comfy_class

CLASSES = ("GeneralDIT", "MiniTrainDIT")


def read(model: nn.Module) -> tuple[UnnamedDit, Any, Any]:
    blocks = model.blocks
    blocks = list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else blocks
    return UnnamedDit(int(model.patch_spatial), True, 512, 1.0, True), blocks, ()


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``) of a ComfyUI
    ``apply_model`` call, or None: the video's tokens alone (the latent padded up to whole
    patches). A video as long as the text (cross-attention could not be told apart) is not
    placed; the text's length is the cross-attention's (``cross``; Anima's adapter pads its
    text to at least 512 tokens where the call carries ``t5xxl_ids``)."""
    if x.dim() != 5:
        return None
    pt, ps = int(model.patch_temporal), int(model.patch_spatial)
    frames, h, w = (math.ceil(int(s) / p) for s, p in zip(x.shape[-3:], (pt, ps, ps)))
    cross = (int(context.shape[-2]),) if isinstance(context, torch.Tensor) else ()
    ids = conds.get("t5xxl_ids")  # Anima outside inference mode: its adapter's text
    if isinstance(ids, torch.Tensor):
        cross += (max(512, int(ids.shape[-1])),)
    if frames * h * w in cross:
        return None
    return (0, True, 0, frames, h, w, 0, cross)


FAMILY = Family("comfy cosmos", comfy_class(*CLASSES), read, host=HostPoint(COMFYUI, spans),
                video=True)
