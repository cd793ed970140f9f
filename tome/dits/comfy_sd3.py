"""ComfyUI's SD3 and SD3.5 (``comfy.ldm.modules.diffusionmodules.mmdit``:
``OpenAISignatureMMDITWrapper``, Stability's reference MMDiT, the same in 0.8.0 and v0.30):
``joint_blocks``, each one joint attention over [context, image] (``[B, S, heads * D]``, no
RoPE), the model's ``register_length`` learned tokens before the context; SD3.5 Medium's image
blocks also run ``attn2``, a self-attention over the image alone (pooled as an image-only
call). The latent ``[B, C, H, W]`` is padded to the patch (``ceil(H/p) x ceil(W/p)`` tokens,
row-major); the timestep is ``sigma * 1000``. Its blocks write no ``block_type`` /
``block_index`` into ``transformer_options`` (``UnnamedDit``): every block shares one factor
(a schedule whose blocks differ pools nothing here) and residual reuse, kept per block, does
not apply (a preset runs its point without it).
A1111's SD3 (the same class name, called without ``transformer_options``) is ``mmdit.py``'s."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint, UnnamedDit, by_class


def recognise(module: nn.Module) -> bool:
    return type(module).__module__.startswith("comfy.ldm.") and by_class("MMDiT")(module) \
        and hasattr(module, "joint_blocks") and hasattr(module, "x_embedder")


def patch(model: nn.Module) -> int:
    p = model.x_embedder.patch_size
    return int(p[0] if isinstance(p, (tuple, list)) else p)


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return UnnamedDit(patch(model), True, 154, 1.0, False), model.joint_blocks, ()


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``): the context
    and the registers before it, then the padded latent's tokens; None without a context."""
    if x.dim() != 4 or not isinstance(context, torch.Tensor) or context.dim() != 3:
        return None
    p = patch(model)
    text = int(context.shape[1]) + int(getattr(model, "register_length", 0) or 0)
    return (text, True, 0, 1, math.ceil(x.shape[-2] / p), math.ceil(x.shape[-1] / p), 0)


FAMILY = Family("comfy sd3", recognise, read, host=HostPoint(COMFYUI, spans))
