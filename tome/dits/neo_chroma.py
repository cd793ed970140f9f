"""Forge Neo's Chroma (``backend.nn.chroma.IntegratedChromaTransformer2DModel``): Flux's
blocks (imported from ``backend.nn.flux``, so they call the same ``attention`` global: the
same swap point and call reading as ``neo_flux``), T5 tokens only (no pooled CLIP vector, no
guidance input: an approximator network makes every block's modulation). Named as itself in
the console and the report; tried before Neo's Flux (in Neo it may subclass it)."""

from __future__ import annotations

from .family import FORGE_NEO, Family, HostPoint
from .neo_flux import POINTS, neo, read, spans

FAMILY = Family("forge neo chroma", neo("IntegratedChromaTransformer2DModel"), read,
                host=HostPoint(FORGE_NEO, spans, POINTS))
