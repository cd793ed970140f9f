"""ComfyUI's AuraFlow (``comfy.ldm.aura.mmdit.MMDiT``, the same in 0.8.0 and v0.30):
``double_layers`` (joint attention over [registers + text, image]) then ``single_layers``
(one stream over their concatenation), ``[B, heads, S, D]`` with ``skip_reshape``, no RoPE
(a centred crop of a learned position table). The text is the conditioning behind the
model's ``register_tokens`` (8 learned tokens); the latent ``[B, C, H, W]`` is padded to the
patch (``ceil(H/p) x ceil(W/p)`` tokens, row-major); the timestep is the sigma. Its layers
write no ``block_type`` / ``block_index`` (``UnnamedDit``): every block shares one factor, so
the double and single layers are read as one kind (a schedule whose blocks differ pools
nothing here), and residual reuse, kept per block, does not apply (a preset runs its point
without it). Its class is called ``MMDiT`` as A1111's SD3 is, with none of its structure."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Family, HostPoint, UnnamedDit


def recognise(module: nn.Module) -> bool:
    return type(module).__module__.startswith("comfy.ldm.") and type(module).__name__ == "MMDiT" \
        and all(hasattr(module, a) for a in ("double_layers", "single_layers",
                                                "register_tokens"))


def read(model: nn.Module) -> tuple[UnnamedDit, Any, Any]:
    return (UnnamedDit(int(model.patch_size), True, 256, 1000.0, False),
            [*model.double_layers, *model.single_layers], ())  # one kind: see the docstring


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``): the
    registers and the text first, then the padded latent's tokens."""
    if x.dim() != 4 or not isinstance(context, torch.Tensor) or context.dim() != 3:
        return None
    p = int(model.patch_size)
    text = int(context.shape[1]) + int(model.register_tokens.shape[1])
    return (text, True, 0, 1, math.ceil(x.shape[-2] / p), math.ceil(x.shape[-1] / p), 0)


FAMILY = Family("comfy auraflow", recognise, read, host=HostPoint(COMFYUI, spans))
