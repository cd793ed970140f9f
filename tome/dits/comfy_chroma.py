"""ComfyUI's Chroma and Chroma Radiance (``comfy.ldm.chroma.model.Chroma``,
``comfy.ldm.chroma_radiance.model.ChromaRadiance``): Flux's double and single blocks and
[text, image] joint attention (its calls are read by ``comfy_flux.spans``), but no guidance
or pooled-text vector: one ``distilled_guidance_layer`` makes every block's modulation, and
no reference latents. Chroma packs an 8x latent 2x2; Radiance works on pixels with a 16 px
patch: either way one token is 16 image pixels, two of the 8 px latent pixels the console's
sizes count in (``Dit.patch`` 2). ``block_type`` / ``block_index`` (and in v0.30 the single
blocks' ``img_slice``) in ``transformer_options``; a text mask (``attention_mask``) reaches
attention as the model gets it."""

from __future__ import annotations

from typing import Any

from torch import nn

from .comfy_flux import comfy, spans  # noqa: F401 (its call reading)
from .family import COMFYUI, Dit, Family, HostPoint, by_class


def recognise(module: nn.Module) -> bool:
    return comfy(module) and by_class("Chroma", "ChromaRadiance")(module) \
        and hasattr(module, "double_blocks") and hasattr(module, "single_blocks")


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(2, True, 512, 1000.0, True), model.double_blocks, model.single_blocks


FAMILY = Family("comfy chroma", recognise, read, host=HostPoint(COMFYUI, spans))
