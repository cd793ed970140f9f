"""Forge Neo's Nunchaku (SVDQuant) models (``backend.nn.svdq``: Flux, Qwen-Image, and Z-Image
with Nunchaku's attention modules): their attention runs in Nunchaku's own kernels or through
``svdq``'s own binding of the kernel, never through the model modules' functions the swap
adapter replaces, so nothing can be pooled: recognised before the other Neo families, read,
and said so in one line (``Bypassed.unmergeable``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .family import FORGE_NEO, Dit, Family, HostPoint
from .neo_flux import PACKAGE

SVDQ = PACKAGE + "svdq"

LINE = ("ToMe: a Nunchaku (SVDQuant) model runs its attention in Nunchaku's own kernels, which "
        "ToMe cannot reach, so nothing is pooled; use the model's regular weights to pool "
        "image keys/values")


@dataclass(frozen=True)
class Bypassed(Dit):
    """A DiT whose attention ToMe cannot reach: every setting pools nothing, said once."""

    def unmergeable(self, layout: Any, config: Any) -> str | None:
        return LINE


def recognise(module: nn.Module) -> bool:
    if not type(module).__module__.startswith(PACKAGE):
        return False
    return any(type(m).__module__ == SVDQ for m in module.modules())


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    inner = getattr(model, "model", model)  # Flux: Nunchaku's transformer inside a wrapper
    blocks = [b for name in ("double_blocks", "transformer_blocks", "layers")
              for b in getattr(inner, name, None) or ()] or [model]
    return Bypassed(int(getattr(model, "patch_size", 2) or 2), True, 512, 1000.0, False), \
        blocks, ()


POINTS: tuple = ()  # nothing to swap: ``Bypassed`` says why


def spans(model: nn.Module, x: Any, c: dict) -> None:
    return None


FAMILY = Family("forge neo nunchaku", recognise, read,
                host=HostPoint(FORGE_NEO, spans, POINTS))
