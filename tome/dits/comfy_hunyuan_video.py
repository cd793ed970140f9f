"""ComfyUI's HunyuanVideo 1.0 and 1.5 and HunyuanImage 2.1 (``comfy.ldm.hunyuan_video.model.
HunyuanVideo``): Flux's ``double_blocks`` and ``single_blocks`` over a 5-D latent (patch
``[1, 2, 2]``; 1.5 and the refiners ``[1, 1, 1]``; HunyuanImage 2.1 a 4-D latent and a 2-D
patch), queries and keys rotated, ``[B, heads, S, D]``, ``block_type`` / ``block_index`` in
``transformer_options``. The joint order changed between versions: 0.8.0's double blocks
carry ``flipped_img_txt`` and run [image, text] (single blocks over ``cat(image, text)``);
v0.30 runs [text, image]. The text is the conditioning (after the token refiner's own
attention over it, left unpooled), with ByT5 glyph tokens (``txt_byt5``, where the model has
``byt5_in``) and image-prompt tokens (``clip_fea``, where it has ``vision_in``) joined to
it; a ``ref_latent`` (1.5's image to video) is patched as the image is and sits just before
it (unpooled). A text mask comes as a mask over the joint keys (its text part kept). The
timestep is ``sigma * 1000``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint, by_class


def recognise(module: nn.Module) -> bool:
    return type(module).__module__.startswith("comfy.ldm.") and by_class("HunyuanVideo")(module) \
        and hasattr(module, "double_blocks") and hasattr(module, "single_blocks")


def text_first(model: nn.Module) -> bool:
    """[text, image] (v0.30), not 0.8.0's [image, text] (its blocks' ``flipped_img_txt``)."""
    blocks = list(model.double_blocks) or list(model.single_blocks)
    return not any(getattr(b, "flipped_img_txt", False) for b in blocks[:1])


def pixels(model: nn.Module) -> int:
    """``Dit.patch``: one token's side in the 8 px latent pixels the console's sizes count in:
    1.0's 2x2 patch over an 8x latent 2; 1.5's (and the refiner's) patch 1 over a 16x latent
    2; HunyuanImage 2.1's 2-D patch 1 over a 32x latent 4."""
    patch = [int(p) for p in model.patch_size]
    return patch[-1] if patch[-1] > 1 else 4 if len(patch) == 2 else 2


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return (Dit(pixels(model), text_first(model), 256, 1.0, True), model.double_blocks,
            model.single_blocks)


def _tokens(t: torch.Tensor, patch: list[int]) -> tuple[int, int, int]:
    """A latent's (frames, rows, columns) of tokens: padded to the patch per axis."""
    sides = [math.ceil(int(s) / p) for s, p in zip(t.shape[-len(patch):], patch)]
    return (1, *sides) if len(sides) == 2 else (sides[0], sides[1], sides[2])


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``) of a model
    call, or None. A video as long as the conditioning cannot be told from the token
    refiner's text-only attention by its length: None (not pooled)."""
    patch = [int(p) for p in model.patch_size]
    if x.dim() != 2 + len(patch) or not isinstance(context, torch.Tensor) \
            or context.dim() != 3:
        return None
    text = int(context.shape[1])
    byt5, clip = conds.get("txt_byt5"), conds.get("clip_fea")
    if isinstance(byt5, torch.Tensor) and getattr(model, "byt5_in", None) is not None:
        text += int(byt5.shape[-2])
    if isinstance(clip, torch.Tensor) and getattr(model, "vision_in", None) is not None:
        text += int(clip.shape[-2])
    ref = conds.get("ref_latent")
    before = math.prod(_tokens(ref, patch)) if isinstance(ref, torch.Tensor) else 0
    frames, h, w = _tokens(x, patch)
    if before + frames * h * w == int(context.shape[1]):
        return None
    return (text, text_first(model), before, frames, h, w, 0)


FAMILY = Family("comfy hunyuan-video", recognise, read, host=HostPoint(COMFYUI, spans),
                video=True)
