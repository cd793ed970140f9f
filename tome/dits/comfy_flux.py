"""ComfyUI's Flux (and its stand-in's): ``double_blocks`` then ``single_blocks``; [text,
image]; sigmas in [0, 1]. Pooled through the attn1 patch's DiT call form (``patcher.py``), so
only its reader is here. ComfyUI's own DiTs call attn1 patches (Forge Neo's copies, in
``backend.nn``, call none): recognised by their package and RoPE embedder."""

from __future__ import annotations

from typing import Any

from torch import nn

from .family import Dit, Family


def comfy(module: nn.Module) -> bool:
    """A ComfyUI DiT with rotary positions (``comfy.ldm...``, a ``pe_embedder``)."""
    return type(module).__module__.startswith("comfy.") and hasattr(module, "pe_embedder")


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(2, True, 512, 1000.0, True), model.double_blocks, model.single_blocks


FAMILY = Family("comfy flux", lambda m: comfy(m) and hasattr(m, "double_blocks")
                and hasattr(m, "single_blocks"), read)
