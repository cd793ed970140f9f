"""Forge Neo's Flux 2 (Klein: ``backend.nn.flux.IntegratedFluxTransformer2DModel`` built with
global modulation, ``double_stream_modulation_img``): Flux's blocks, swap point and call
reading (``neo_flux``; references after the image), on a 128-channel latent at 1/16 of the
image with ``patch_size`` 1: one token is 16 image pixels, two of the 8 px latent pixels the
console's sizes count in (``Dit.patch`` 2). Named as itself; tried before Neo's Flux."""

from __future__ import annotations

from typing import Any

from torch import nn

from .family import FORGE_NEO, Dit, Family, HostPoint
from .neo_flux import POINTS, neo, spans


def recognise(module: nn.Module) -> bool:
    return neo("IntegratedFluxTransformer2DModel")(module) \
        and hasattr(module, "double_stream_modulation_img")


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(2, True, 512, 1000.0, True), model.double_blocks, model.single_blocks


FAMILY = Family("forge neo flux 2", recognise, read, host=HostPoint(FORGE_NEO, spans, POINTS))
