"""ComfyUI's Flux (and its stand-in's): ``double_blocks`` then ``single_blocks``; [text,
image, reference images]; sigmas in [0, 1]. Pooled through ComfyUI's attention override
(``override.py``): ``spans`` says where a model call's image tokens sit. ComfyUI's own DiTs
(Forge Neo's copies, in ``backend.nn``, are not these): recognised by their package and RoPE
embedder."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint


def comfy(module: nn.Module) -> bool:
    """A ComfyUI DiT with rotary positions (``comfy.ldm...``, a ``pe_embedder``)."""
    return type(module).__module__.startswith("comfy.") and hasattr(module, "pe_embedder")


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(2, True, 512, 1000.0, True), model.double_blocks, model.single_blocks


def recognise(module: nn.Module) -> bool:
    """ComfyUI's Flux and Kontext: Flux's double and single blocks and one patch size for
    both sides (an int; the stand-ins carry none: 2). Chroma and Flux 2 share them and are
    tried first (``comfy_chroma``, ``comfy_flux2``: named as themselves); HunyuanVideo (and
    HunyuanImage 2.1) has Flux's blocks but a patch per axis (``[1, 2, 2]``, ``[1, 1]``), a
    5-D latent and [image, text] in 0.8.0's joint calls, which ``spans`` does not place: its
    own family (``comfy_hunyuan_video``), never this one."""
    return comfy(module) and hasattr(module, "double_blocks") \
        and hasattr(module, "single_blocks") and isinstance(getattr(module, "patch_size", 2), int)




def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """Where a ComfyUI ``apply_model`` call's tokens sit in joint attention (Flux, Kontext,
    Qwen-Image): ``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``), or
    None. The latent is ``[B, C, H, W]`` (Flux) or ``[B, C, T, H, W]`` (Qwen-Image), packed
    ``patch x patch`` (padded up); the text is the conditioning's length; each reference
    latent (``ref_latents``: Kontext, Qwen-Image edit) follows the image, unpooled."""
    p = getattr(model, "patch_size", 2)
    if x.dim() not in (4, 5) or not isinstance(context, torch.Tensor) or context.dim() != 3 \
            or not isinstance(p, int):  # HunyuanVideo (its blocks are Flux's): [1, 2, 2]
        return None

    def tokens(t: torch.Tensor) -> tuple[int, int, int]:
        return (int(t.shape[2]) if t.dim() == 5 else 1, math.ceil(t.shape[-2] / p),
                math.ceil(t.shape[-1] / p))

    after = sum(math.prod(tokens(r)) for r in conds.get("ref_latents") or ())
    return (int(context.shape[1]), True, 0, *tokens(x), after)


FAMILY = Family("comfy flux", recognise, read, host=HostPoint(COMFYUI, spans))
