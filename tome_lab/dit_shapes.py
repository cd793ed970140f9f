"""The DiT shapes the lab times and compares: diffusers' Flux, SD3, Qwen-Image and Wan
transformers with their released configs' widths and head counts, a few blocks, random weights;
the sizes they run at (an image's px, a video's WxHxF) and one call's arguments.

Configs (less their depth): black-forest-labs/FLUX.1-dev, stabilityai/stable-diffusion-3.5-medium,
Qwen/Qwen-Image, Wan-AI/Wan2.1-T2V-1.3B (and -14B), each ``transformer/config.json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

FLUX = dict(patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
            joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
SD3 = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
           num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
           pooled_projection_dim=2048, pos_embed_max_size=384, qk_norm="rms_norm")
QWEN = dict(patch_size=2, in_channels=64, out_channels=16, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
           out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True,
           qk_norm="rms_norm_across_heads", eps=1e-6)
WAN_14B = dict(WAN, num_attention_heads=40, ffn_dim=13824)
TINY = {
    "flux": dict(FLUX, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=16, axes_dims_rope=(4, 6, 6)),
    "sd3": dict(SD3, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=64),
    "qwen": dict(QWEN, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 axes_dims_rope=(4, 6, 6)),
    "wan": dict(WAN, num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=16,
                ffn_dim=48),
}
# Text as the pipelines hand it: Flux 512 T5 tokens, SD3 333 (77 CLIP + 256 T5), Qwen-Image an
# unpadded prompt (its template's tokens dropped), Wan 512 umT5 tokens (its cross-attention).
TEXT = {"flux": 512, "sd3": 333, "qwen": 128, "wan": 512}
QUICK_TEXT = 8
FAMILIES = ("flux", "sd3", "qwen", "wan")
VIDEO = ("wan",)
VAE_SCALE, VAE_FRAMES = 8, 4  # latent pixels per image pixel side; video frames per latent frame


@dataclass(frozen=True)
class Size:
    """An image (``frames`` 1) or a video of ``frames`` frames, ``width x height`` px."""

    width: int
    height: int
    frames: int = 1

    @classmethod
    def parse(cls, text: str | int) -> Size:
        """``1024`` (a square image) or ``832x480`` or ``832x480x33`` (a video)."""
        parts = [int(p) for p in str(text).lower().split("x")]
        if len(parts) == 1:
            parts = parts * 2
        return cls(*parts)

    @property
    def label(self) -> str | int:
        if self.frames == 1 and self.width == self.height:
            return self.width
        return f"{self.width}x{self.height}" + (f"x{self.frames}" if self.frames > 1 else "")

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // VAE_FRAMES + 1

    @property
    def side(self) -> int:
        """The larger side in px (what --rounds-large and "large" go by)."""
        return max(self.width, self.height)

    def grid(self) -> tuple[int, int, int]:
        """Token grid (frames, rows, columns): latent px / 8, 2x2 tokens."""
        return (self.latent_frames, self.height // VAE_SCALE // 2, self.width // VAE_SCALE // 2)

    @property
    def tokens(self) -> int:
        return math.prod(self.grid())


def _config(family: str, blocks: tuple[int, int], quick: bool, wide: bool = False
            ) -> tuple[type, dict[str, Any]]:
    import diffusers
    double, single = blocks
    base = TINY[family] if quick else None
    if family == "flux":
        return diffusers.FluxTransformer2DModel, dict(base or FLUX, num_layers=double,
                                                      num_single_layers=single)
    if family == "sd3":
        return diffusers.SD3Transformer2DModel, dict(base or SD3, num_layers=double,
                                                     dual_attention_layers=sd3_dual(double))
    if family == "qwen":
        return diffusers.QwenImageTransformer2DModel, dict(base or QWEN, num_layers=double)
    if family == "wan":
        return diffusers.WanTransformer3DModel, dict(base or (WAN_14B if wide else WAN),
                                                     num_layers=double)
    raise ValueError(f"unknown model {family!r}; choose from {', '.join(FAMILIES)}")


def sd3_dual(blocks: int) -> tuple[int, ...]:
    """SD3.5-medium's dual-attention blocks scaled to ``blocks``: the first half, rounded up
    (13 of its 24). With 2 blocks: one dual block and the last one (``context_pre_only``)."""
    return tuple(range((blocks + 1) // 2))


def parameters(family: str, blocks: tuple[int, int], quick: bool = False,
               wide: bool = False) -> int:
    """The model's parameter count, from a build on the meta device (nothing allocated)."""
    cls, cfg = _config(family, blocks, quick, wide)
    with torch.device("meta"):
        return sum(p.numel() for p in cls(**cfg).parameters())


def build(family: str, blocks: tuple[int, int], quick: bool, dtype: torch.dtype,
          device: torch.device | str = "cpu", wide: bool = False):
    """The transformer with random weights (std 0.02: activations stay finite). ``blocks``:
    (double-stream / joint / Wan blocks, Flux's single-stream blocks)."""
    cls, cfg = _config(family, blocks, quick, wide)
    model = cls(**cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval().to(device, dtype)


def text_tokens(family: str, quick: bool) -> int:
    return QUICK_TEXT if quick else TEXT[family]


def width(model) -> int:
    cfg = model.config
    return cfg.num_attention_heads * cfg.attention_head_dim


def inputs(model, family: str, size: Size, dtype: torch.dtype, quick: bool,
           seed: int = 1, latents: torch.Tensor | None = None, t: float = 0.5
           ) -> dict[str, Any]:
    """One call's arguments at ``size`` on the model's device: latents from ``seed`` (or
    ``latents``), a random text, the timestep at progress ``1 - t`` in the family's units."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    dev = next(model.parameters()).device
    text = text_tokens(family, quick)
    frames, h, w = size.grid()

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, dtype)

    if family == "wan":
        x = latents if latents is not None else rand(1, cfg.in_channels, frames, 2 * h, 2 * w)
        return dict(hidden_states=x.to(dev, dtype),
                    encoder_hidden_states=rand(1, text, cfg.text_dim),
                    timestep=torch.tensor([1000.0 * t], device=dev))
    ctx = rand(1, text, cfg.joint_attention_dim)
    if family == "qwen":
        return dict(hidden_states=rand(1, h * w, cfg.in_channels), encoder_hidden_states=ctx,
                    timestep=torch.tensor([t], device=dev), img_shapes=[[(1, h, w)]])
    pooled = rand(1, cfg.pooled_projection_dim)
    if family == "flux":
        ids = torch.zeros(h * w, 3)
        ids[:, 1] = torch.arange(h).repeat_interleave(w)
        ids[:, 2] = torch.arange(w).repeat(h)
        return dict(hidden_states=rand(1, h * w, cfg.in_channels), encoder_hidden_states=ctx,
                    pooled_projections=pooled, timestep=torch.tensor([t], device=dev),
                    img_ids=ids.to(dev), txt_ids=torch.zeros(text, 3, device=dev),
                    guidance=torch.tensor([3.5], device=dev) if cfg.guidance_embeds else None)
    return dict(hidden_states=rand(1, cfg.in_channels, 2 * h, 2 * w), encoder_hidden_states=ctx,
                pooled_projections=pooled, timestep=torch.tensor([1000.0 * t], device=dev))
