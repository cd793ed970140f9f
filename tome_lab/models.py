"""The model zoo: real SD UNets built from their configs with random weights, their inputs,
and ldm attention through PyTorch's fused ``scaled_dot_product_attention``.

The ``ldm`` package on PyPI ships the stock ``CrossAttention.forward``, which materialises the
whole score matrix with einsum; the WebUI replaces it at class level with SDPA (its default
"sdp" optimisation). The benchmark and the shipped tiny model use the same kernel, so
speed-ups are measured against the attention people actually run.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# SD1.5 (v1-inference.yaml) and SD2 (v2-inference.yaml) UNets, ldm layout.
SD15 = {"image_size": 64, "in_channels": 4, "out_channels": 4, "model_channels": 320,
        "attention_resolutions": [4, 2, 1], "num_res_blocks": 2, "channel_mult": [1, 2, 4, 4],
        "num_heads": 8, "use_spatial_transformer": True, "transformer_depth": 1,
        "context_dim": 768, "use_checkpoint": False, "legacy": False}
SD2 = {**SD15, "num_heads": -1, "num_head_channels": 64, "context_dim": 1024,
       "use_linear_in_transformer": True}
# SDXL base (sd_xl_base.yaml) as a diffusers UNet2DConditionModel (same blocks and levels).
SDXL = {"sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
        "block_out_channels": (320, 640, 1280),
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        "transformer_layers_per_block": (1, 2, 10), "attention_head_dim": (5, 10, 20),
        "cross_attention_dim": 2048, "use_linear_projection": True,
        "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816}
DIFFUSERS_SD15 = {"sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
                  "block_out_channels": (320, 640, 1280, 1280), "cross_attention_dim": 768,
                  "attention_head_dim": 8}
MODELS = {
    # name: (family, config, context length, context dim)
    "sd15": ("ldm", SD15, 77, 768),
    "sd2": ("ldm", SD2, 77, 1024),
    "sdxl": ("diffusers", SDXL, 77, 2048),
    "diffusers-sd15": ("diffusers", DIFFUSERS_SD15, 77, 768),
}


def wake(model: nn.Module, seed: int) -> nn.Module:
    """Random weights for zero-initialised layers (ldm's ``zero_module`` outputs).

    A fresh UNet's transformer and residual outputs are exactly zero, so merging could not
    change anything: benchmarks would report no deviation and tests would pass vacuously.
    """
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1 and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p[0].numel() ** 0.5))
    return model


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                device: torch.device | str = "cpu") -> nn.Module:
    """The named UNet (see ``MODELS``) with random weights, in eval mode, on ``device``."""
    family, cfg, _, _ = MODELS[name]
    torch.manual_seed(seed)
    if family == "ldm":
        from ldm.modules.diffusionmodules.openaimodel import UNetModel
        model = UNetModel(**cfg)
    else:
        from diffusers import UNet2DConditionModel
        model = UNet2DConditionModel(**cfg)
    # diffusers warns on every ``.to(dtype=...)`` ("modules that should be kept in float32:
    # []") even when there are none: not a message for people reading a benchmark.
    quiet = logging.getLogger("diffusers.models.modeling_utils")
    level, _ = quiet.level, quiet.setLevel(logging.ERROR)
    try:
        model = wake(model, seed).to(device=device, dtype=dtype).eval().requires_grad_(False)
    finally:
        quiet.setLevel(level)
    if family == "ldm":  # ldm casts the latent to .dtype but not the timestep embedding
        model.dtype = dtype
        for m in model.modules():  # GroupNorm32 normalises in fp32: keep its affine in fp32
            if type(m).__name__ == "GroupNorm32":
                m.float()
        model.time_embed.register_forward_pre_hook(lambda m, a: (a[0].to(dtype), *a[1:]))
    return model


@dataclass
class Case:
    """One model at one size: the model, its inputs and how to call it."""

    model_name: str
    size: int                      # pixels (latent = size // 8)
    dtype: str = "fp32"
    batch: int = 2
    seed: int = 0
    model: nn.Module | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def family(self) -> str:
        return MODELS[self.model_name][0]

    @property
    def label(self) -> str:
        return f"{self.model_name} {self.size}px {self.dtype} b{self.batch}"

    def forward(self, model: nn.Module | None = None) -> torch.Tensor:
        """One UNet call on the case's inputs (``model``: e.g. a compiled wrapper of it)."""
        model = self.model if model is None else model
        assert model is not None
        i = self.inputs
        if self.family == "ldm":
            return model(i["x"], i["t"], context=i["ctx"])
        return model(i["x"], i["t"], encoder_hidden_states=i["ctx"],
                     added_cond_kwargs=i.get("added"), return_dict=False)[0]


def build_case(model_name: str, size: int, dtype: str = "fp32", batch: int = 2, seed: int = 0,
               model: nn.Module | None = None, context_dim: int | None = None,
               device: torch.device | str = "cpu") -> Case:
    """A case with its model (built unless given: then ``context_dim`` may say its width)
    and fixed random inputs (drawn on the CPU, so every device sees the same numbers)."""
    dt, dev = DTYPES[dtype], torch.device(device)
    _, _, ctx_len, ctx_dim = MODELS[model_name]
    ctx_dim = context_dim or ctx_dim
    if model is None:
        model = build_model(model_name, dt, seed, dev)
    g = torch.Generator().manual_seed(seed + 7)
    lat = size // 8
    inputs: dict[str, Any] = {
        "x": torch.randn(batch, 4, lat, lat, generator=g).to(dev, dt),
        "t": torch.full((batch,), 500.0, device=dev),
        "ctx": torch.randn(batch, ctx_len, ctx_dim, generator=g).to(dev, dt),
    }
    if model_name == "sdxl":
        inputs["added"] = {"text_embeds": torch.randn(batch, 1280, generator=g).to(dev, dt),
                           "time_ids": torch.tensor([[size, size, 0, 0, size, size]] * batch,
                                                    dtype=dt, device=dev)}
    return Case(model_name, size, dtype, batch, seed, model, inputs, dev)


# ----------------------------------------------------------------------------- attention


def sdpa_forward(self: nn.Module, x: torch.Tensor, context: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """ldm ``CrossAttention.forward`` with PyTorch's fused ``scaled_dot_product_attention``
    (what the WebUI's "sdp" cross-attention optimisation does for SD1/SD2)."""
    heads = self.heads
    context = x if context is None else context
    q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
    B, N, _ = q.shape
    q, k, v = (t.view(B, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        mask = mask.reshape(B, 1, 1, -1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return self.to_out(out.transpose(1, 2).reshape(B, N, -1))


@contextlib.contextmanager
def ldm_sdpa():
    """Install ``sdpa_forward`` on ldm's CrossAttention class for the duration."""
    try:
        from ldm.modules import attention
    except ImportError:
        yield
        return
    old = attention.CrossAttention.forward
    attention.CrossAttention.forward = sdpa_forward
    try:
        yield
    finally:
        attention.CrossAttention.forward = old
