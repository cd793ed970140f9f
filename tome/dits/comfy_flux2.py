"""ComfyUI's Flux 2 (dev and Klein: ``comfy.ldm.flux.model.Flux`` built with global
modulation, ``double_stream_modulation_img``): Flux's double and single blocks and joint
attention over [text, image, reference images] (read by ``comfy_flux.spans``; each
reference latent's tokens follow the image, unpooled; v0.30 also tells their counts as
``reference_image_num_tokens``, and its KV cache appends cached reference keys, which the
core places after the image). Its latent is 128 channels at 1/16 of the image, one token per
latent pixel (``patch_size`` 1): one token is 16 image pixels, two of the 8 px latent pixels
the console's sizes count in (``Dit.patch`` 2). Sigmas in [0, 1]."""

from __future__ import annotations

from typing import Any

from torch import nn

from .comfy_flux import comfy, spans  # noqa: F401 (its call reading)
from .family import COMFYUI, Dit, Family, HostPoint


def recognise(module: nn.Module) -> bool:
    return comfy(module) and hasattr(module, "double_stream_modulation_img") \
        and hasattr(module, "double_blocks") and hasattr(module, "single_blocks")


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(2, True, 512, 1000.0, True), model.double_blocks, model.single_blocks


FAMILY = Family("comfy flux 2", recognise, read, host=HostPoint(COMFYUI, spans))
