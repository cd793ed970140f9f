"""InvokeAI's own Flux (``invokeai.backend.flux.model.Flux``, not diffusers'): the BFL layout,
``double_blocks`` then ``single_blocks``, every block calling the module-level
``invokeai.backend.flux.modules.layers.attention(q, k, v, pe=, attn_mask=None)`` (bound there
by name at import) with ``[B, heads, S, D]`` queries and keys **before** RoPE, ``pe`` the
rotation matrices, the joint sequence ``[text, image, references]``; ``forward(img, img_ids,
txt, txt_ids, timesteps, y, ...)`` takes the packed image tokens and their ``(0, row, col)``
ids (Kontext references after them, their first id 1); timesteps in [0, 1].

No new adapter: Forge Neo's interception (its globals swapped per model call, ``swap.py``)
with another bracket, the module's own ``forward`` (``swap.patch_module``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .family import INVOKEAI, Dit, Family, HostPoint

PACKAGE = "invokeai.backend.flux."


def recognise(module: nn.Module) -> bool:
    return type(module).__module__.startswith(PACKAGE) and type(module).__name__ == "Flux"


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(2, True, 512, 1000.0, True), model.double_blocks, model.single_blocks


def grid(ids: torch.Tensor, memo: dict) -> tuple[int, int]:
    """The image's rows and columns from its token ids: one host read per ids tensor (the
    denoising loop builds them once per generation), remembered by identity."""
    key = (ids.data_ptr(), tuple(ids.shape), ids._version)
    if memo.get("key") != key:
        main = ids[0, ids[0, :, 0] == 0, 1:]
        memo["key"], memo["grid"] = key, tuple(int(n) + 1 for n in main.amax(0).tolist())
    return memo["grid"]


_memo: dict = {}


def spans(model: nn.Module, x: torch.Tensor, c: dict) -> tuple | None:
    """``(text, text_first, before, frames, h, w, after)`` of a call, or None."""
    ids, txt = c.get("img_ids"), c.get("txt")
    if x.dim() != 3 or not isinstance(ids, torch.Tensor) or not isinstance(txt, torch.Tensor):
        return None
    h, w = grid(ids, _memo)
    after = int(x.shape[1]) - h * w
    return (int(txt.shape[1]), True, 0, 1, h, w, after) if after >= 0 else None


# (module, global, sequence axis, pre-RoPE embedding (position, keyword), mask (position,
# keyword), always rotates): positions count the arguments after q, k, v. InvokeAI's
# ``attention`` rotates whatever it is given: the core rotates first and hands it the identity.
POINTS = (("invokeai.backend.flux.modules.layers", "attention", 2, (0, "pe"),
           (1, "attn_mask"), True),)

FAMILY = Family("invokeai flux", recognise, read, host=HostPoint(INVOKEAI, spans, POINTS))
