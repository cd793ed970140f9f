"""ComfyUI's HiDream I1 and E1 (``comfy.ldm.hidream.model.HiDreamImageTransformer2DModel``, the
same in 0.8.0 and v0.30): ``double_stream_blocks`` with joint attention over **[image,
text]**, then ``single_stream_blocks`` over ``cat(image, text)``, ``[B, S, heads * D]``,
queries and keys rotated. The text every block sees: the T5 conditioning, the last Llama
layer's tokens and the block's own Llama layer's (``encoder_hidden_states_llama3``, ``[B,
layers, L, D]``): ``T5 + 2 L``. E1's ``image_cond`` is joined to the latent along its width,
so the grid is ``ceil(H/p) x ceil((W + W_cond)/p)`` (its tokens interleave with the image's
row by row and are pooled with them). No ``block_type`` / ``block_index`` (``UnnamedDit``):
one factor shared by every block (double and single read as one kind), no residual reuse (a
preset runs its point without it). The timestep is ``sigma * 1000``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Family, HostPoint, UnnamedDit, by_class


def recognise(module: nn.Module) -> bool:
    return type(module).__module__.startswith("comfy.ldm.") \
        and by_class("HiDreamImageTransformer2DModel")(module)


def read(model: nn.Module) -> tuple[UnnamedDit, Any, Any]:
    return (UnnamedDit(int(model.patch_size), False, 128 * 3, 1.0, True),
            [*model.double_stream_blocks, *model.single_stream_blocks], ())  # one kind


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` (``kv.Spans``), or None
    without the Llama layers (the model cannot run then)."""
    llama = conds.get("encoder_hidden_states_llama3")
    if x.dim() != 4 or not isinstance(context, torch.Tensor) or context.dim() != 3 \
            or not isinstance(llama, torch.Tensor) or llama.dim() != 4:
        return None
    p = int(model.patch_size)
    width = int(x.shape[-1])
    cond = conds.get("image_cond")
    if isinstance(cond, torch.Tensor):
        width += int(cond.shape[-1])
    text = int(context.shape[1]) + 2 * int(llama.shape[-2])
    return (text, False, 0, 1, math.ceil(x.shape[-2] / p), math.ceil(width / p), 0)


FAMILY = Family("comfy hidream", recognise, read, host=HostPoint(COMFYUI, spans))
