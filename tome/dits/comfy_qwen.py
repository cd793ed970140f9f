"""ComfyUI's Qwen-Image: ``transformer_blocks`` (all double-stream), joint attention over
[text, image, reference images] like its Flux, on a 5-D latent (``[B, C, 1, H, W]``; its
calls are read by ``comfy_flux.spans``); sigmas in [0, 1]."""

from __future__ import annotations

from typing import Any

from torch import nn

from .comfy_flux import comfy, spans  # noqa: F401 (its call reading)
from .family import COMFYUI, Dit, Family, HostPoint


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return (Dit(int(getattr(model, "patch_size", 2)), True, 512, 1000.0, True),
            model.transformer_blocks, ())


FAMILY = Family("comfy qwen-image",
                lambda m: comfy(m) and type(m).__name__ == "QwenImageTransformer2DModel", read,
                host=HostPoint(COMFYUI, spans))
