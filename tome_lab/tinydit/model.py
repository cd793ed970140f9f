"""The tiny DiT: the real diffusers ``FluxTransformer2DModel`` (double-stream blocks with joint
text+image attention, then single-stream blocks, rotary positions from token ids) at a tiny
width, in pixel space: 64x64 RGB packed 2x2 as Flux packs latents (12 channels, 32x32 = 1024
image tokens), a class table standing in for the text encoder (4 "text" tokens and a pooled
vector per class; class 4 is the null class for classifier-free guidance), trained with
rectified flow (Flux's objective) and sampled with Euler steps on a shifted schedule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

DEFAULT_WEIGHTS = Path(__file__).with_name("tinydit64.safetensors")
CLASSES = ("landscape", "flower", "foliage", "object")
NULL = len(CLASSES)
TEXT_TOKENS = 4
CONFIG = {"patch_size": 1, "in_channels": 12, "num_layers": 3, "num_single_layers": 3,
          "attention_head_dim": 32, "num_attention_heads": 3, "joint_attention_dim": 96,
          "pooled_projection_dim": 96, "guidance_embeds": False, "axes_dims_rope": [8, 12, 12]}
SHIFT = 1.0  # the sampling schedule's shift (Flux shifts towards noise at high resolution)


class TinyDiT(nn.Module):
    """``transformer`` (what ``tome.apply_patch`` finds) plus the class table."""

    def __init__(self, config: dict | None = None):
        super().__init__()
        from diffusers import FluxTransformer2DModel

        self.config = dict(config or CONFIG)
        self.transformer = FluxTransformer2DModel(**self.config)
        width = self.config["joint_attention_dim"]
        self.text = nn.Embedding(NULL + 1, TEXT_TOKENS * width)
        self.pooled = nn.Embedding(NULL + 1, self.config["pooled_projection_dim"])
        nn.init.normal_(self.text.weight, std=0.5)
        nn.init.normal_(self.pooled.weight, std=0.5)

    def forward(self, x: torch.Tensor, t: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """Velocity for images ``x`` (B, 3, H, W) at flow times ``t`` (B,) in [0, 1]."""
        b, _, h, w = x.shape
        tokens, ids = pack(x)
        text = self.text(classes).view(b, TEXT_TOKENS, -1)
        out = self.transformer(hidden_states=tokens, encoder_hidden_states=text,
                               pooled_projections=self.pooled(classes), timestep=t,
                               img_ids=ids.to(x.device), txt_ids=torch.zeros(TEXT_TOKENS, 3,
                                                                              device=x.device),
                               return_dict=False)[0]
        return unpack(out, h, w)


def pack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C, H, W) -> 2x2-packed tokens (B, H/2 * W/2, 4C) and their ids (row, column), as
    Flux's pipeline packs latents."""
    b, c, h, w = x.shape
    tokens = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return tokens.reshape(b, (h // 2) * (w // 2), c * 4), ids.reshape(-1, 3)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def build_model(config: dict | None = None) -> TinyDiT:
    return TinyDiT(config)


def load_model(path: str | Path | None = None) -> TinyDiT:
    """The shipped weights (float16 on disk, float32 in memory), in eval mode."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path or DEFAULT_WEIGHTS)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    model = build_model(json.loads(meta["config"]) if "config" in meta else None)
    state = {k: v.float() for k, v in load_file(str(path)).items()}
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


def flow_loss(model: TinyDiT, x0: torch.Tensor, classes: torch.Tensor,
              g: torch.Generator, t: torch.Tensor | None = None) -> torch.Tensor:
    """Rectified flow: x_t = (1 - t) x0 + t noise, target velocity noise - x0; ``t`` from a
    logit-normal (as SD3/Flux train) unless given. ``x0`` in [-1, 1]."""
    b = x0.shape[0]
    noise = torch.randn(x0.shape, generator=g).to(x0)
    if t is None:
        t = torch.sigmoid(torch.randn(b, generator=g)).to(x0)
    xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
    return ((model(xt, t, classes) - (noise - x0)) ** 2).mean()


def schedule(steps: int, shift: float = SHIFT) -> torch.Tensor:
    """Flow times from 1 (noise) to 0, shifted as Flux shifts its sigmas."""
    s = torch.linspace(1, 0, steps + 1)
    return shift * s / (1 + (shift - 1) * s)


@torch.no_grad()
def sample(model: TinyDiT, classes, seed: int | torch.Generator = 0, steps: int = 20,
           guidance: float = 1.0, size: int = 64) -> torch.Tensor:
    """Images (B, 3, size, size) in [0, 1]; Euler steps; noise from a private generator.
    ``guidance`` > 1 batches the null class as SD samplers do (one call per step)."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    p = next(model.parameters())
    cls = torch.as_tensor(classes, dtype=torch.long, device=p.device)
    x = torch.randn((len(cls), 3, size, size), generator=g).to(p)
    ts = schedule(steps).tolist()
    for t, t_next in zip(ts[:-1], ts[1:]):
        tt = torch.full((len(cls),), t, device=p.device, dtype=p.dtype)
        if guidance != 1.0:
            v_both = model(torch.cat([x, x]), torch.cat([tt, tt]),
                           torch.cat([cls, torch.full_like(cls, NULL)]))
            v_c, v_u = v_both.chunk(2)
            v = v_u + guidance * (v_c - v_u)
        else:
            v = model(x, tt, cls)
        x = x + (t_next - t) * v
    return ((x.clamp(-1, 1) + 1) / 2).float()


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_note(size: int = 64) -> str:
    tokens = (size // 2) ** 2
    return f"{tokens} image tokens ({int(math.sqrt(tokens))}x{int(math.sqrt(tokens))} grid)"
