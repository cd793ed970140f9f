"""ComfyUI's Mochi (``comfy.ldm.genmo.joint_model.asymm_models_joint.AsymmDiTJoint``, the same
in 0.8.0 and v0.30): ``blocks``, each joint attention over **[video, text]**, the text
cropped to its real tokens (``num_tokens``, the text mask's count, 256 where none is given),
``[B, heads, S, D]``, video queries and keys rotated. The latent ``[B, C, T, H, W]``: each
frame packed ``p x p`` (``H // p x W // p`` tokens, frame-major). No ``block_type`` /
``block_index`` (``UnnamedDit``): one factor shared by every block, no residual reuse (a
preset runs its point without it). The timestep is the sigma."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Family, HostPoint, UnnamedDit, by_class


def recognise(module: nn.Module) -> bool:
    return type(module).__module__.startswith("comfy.ldm.") and by_class("AsymmDiTJoint")(module)


def read(model: nn.Module) -> tuple[UnnamedDit, Any, Any]:
    return UnnamedDit(int(model.patch_size), False, 256, 1000.0, True), model.blocks, ()


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``), or None."""
    if x.dim() != 5 or not isinstance(context, torch.Tensor) or context.dim() != 3:
        return None
    p = int(model.patch_size)
    crop = conds.get("num_tokens", 256)
    text = min(int(crop), int(context.shape[1])) if isinstance(crop, (int, float)) else None
    if text is None:
        return None
    return (text, False, 0, int(x.shape[2]), int(x.shape[3]) // p, int(x.shape[4]) // p, 0)


FAMILY = Family("comfy mochi", recognise, read, host=HostPoint(COMFYUI, spans),
                video=True)
