"""Forge Neo's Flux (``backend.nn.flux``; Flux 2 and Chroma: ``neo_flux2``, ``neo_chroma``):
``double_blocks`` then ``single_blocks``, every block calling the module-level
``backend.nn.flux.attention(q, k, v, pe, mask=, transformer_options=)`` with ``[B, heads, S,
D]`` queries and keys **before** RoPE and ``pe`` the rotation matrices (Chroma's blocks are
Flux's), the joint sequence ``[text, image, references]``; the latent ``[B, C, H, W]``, one
token per ``patch x patch`` latent pixels (padded up); Kontext references (``ref_latents=``,
or Neo's process-wide ``dynamic_args.ref_latents``) appended after the image; sigmas in
[0, 1]. Pooled by swapping that global per model call (``swap.py``: ``POINTS``, ``spans``).
Also the helpers Neo's other families share."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .family import FORGE_NEO, Dit, Family, HostPoint

PACKAGE = "backend.nn."  # where Neo's model modules live (Nunchaku's too: backend.nn.svdq)


def neo(*names: str):
    """``recognise`` for a Neo model class (any base class counts) from Neo's own package."""
    return lambda module: type(module).__module__.startswith(PACKAGE) \
        and any(c.__name__ in names for c in type(module).__mro__)


def tokens(shape: Iterable[int], sides: tuple[int, ...]) -> tuple[int, ...]:
    """Tokens per axis of a latent's last ``len(sides)`` sides (padded up to whole patches)."""
    return tuple(math.ceil(int(s) / p) for s, p in zip(tuple(shape)[-len(sides):], sides))


def references(c: dict) -> list[torch.Tensor]:
    """Reference latents of a Kontext / Qwen-Image edit call: ``ref_latents=``, else Neo's
    process-wide ``backend.args.dynamic_args.ref_latents`` (what the model reads)."""
    refs = c.get("ref_latents")
    if refs is None:
        args = getattr(sys.modules.get("backend.args"), "dynamic_args", None)
        refs = getattr(args, "ref_latents", None)
    return [r for r in refs or () if isinstance(r, torch.Tensor)]


def text_of(c: dict) -> int | None:
    context = c.get("c_crossattn")
    return int(context.shape[1]) if isinstance(context, torch.Tensor) and context.dim() == 3 \
        else None


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return (Dit(int(model.patch_size), True, 512, 1000.0, True), model.double_blocks,
            model.single_blocks)


def image_spans(dims: int):
    """``spans`` of a Neo image DiT called with a ``dims``-D latent (Flux 4; Qwen-Image 5, a
    frame axis of one): ``(text, text_first, before, frames, h, w, after)`` of a model call,
    the references after the image, or None."""
    def spans(model: nn.Module, x: torch.Tensor, c: dict) -> tuple | None:
        text = text_of(c)
        if x.dim() != dims or text is None:
            return None
        p = int(model.patch_size)
        h, w = tokens(x.shape, (p, p))
        after = sum(math.prod(tokens(r.shape, (p, p))) for r in references(c))
        return text, True, 0, 1, h, w, after
    return spans


spans = image_spans(4)


# (module, global, sequence axis, pre-RoPE embedding (position, keyword), mask (position,
# keyword)): positions count the arguments after q, k, v.
POINTS = (("backend.nn.flux", "attention", 2, (0, "pe"), (1, "mask")),)

FAMILY = Family("forge neo flux", neo("IntegratedFluxTransformer2DModel"), read,
                host=HostPoint(FORGE_NEO, spans, POINTS))  # Flux 2, Chroma: tried first
