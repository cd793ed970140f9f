"""The tiny video DiT: the real diffusers ``WanTransformer3DModel`` (self-attention over frames x
height x width with 3-D rotary positions, cross-attention to text, AdaLN from the timestep) at a
tiny width, in pixel space: 9 frames of 32x32 RGB in (1, 4, 4) patches (Wan's (1, 2, 2) over a
latent 8x smaller), so 9 x 8 x 8 = 576 video tokens; a class table stands in for the text
encoder (4 "text" tokens per class; class 4 is the null class for classifier-free guidance);
trained with rectified flow (Wan's objective) and sampled with Euler steps on a shifted
schedule.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

DEFAULT_WEIGHTS = Path(__file__).with_name("tinyvdit32.safetensors")
CLASSES = ("landscape", "flower", "foliage", "object")
NULL = len(CLASSES)
TEXT_TOKENS = 4
SIZE, FRAMES = 32, 9
CONFIG = {"patch_size": [1, 4, 4], "num_attention_heads": 3, "attention_head_dim": 32,
          "in_channels": 3, "out_channels": 3, "text_dim": 64, "freq_dim": 64, "ffn_dim": 256,
          "num_layers": 4, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
          "rope_max_seq_len": 64}
SHIFT = 2.0  # the sampling schedule's shift towards noise (Wan's flow_shift; 3-5 at 480-720p)


class TinyVDiT(nn.Module):
    """``transformer`` (what ``tome.apply_patch`` finds) plus the class table."""

    def __init__(self, config: dict | None = None):
        super().__init__()
        from diffusers import WanTransformer3DModel

        self.config = dict(config or CONFIG)
        self.config["patch_size"] = tuple(self.config["patch_size"])
        self.transformer = WanTransformer3DModel(**self.config)
        self.text = nn.Embedding(NULL + 1, TEXT_TOKENS * self.config["text_dim"])
        nn.init.normal_(self.text.weight, std=0.5)

    def forward(self, x: torch.Tensor, t: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """Velocity for videos ``x`` (B, 3, F, H, W) at flow times ``t`` (B,) in [0, 1]
        (Wan's timestep: 1000 t)."""
        text = self.text(classes).view(len(classes), TEXT_TOKENS, -1)
        return self.transformer(hidden_states=x, timestep=t * 1000, encoder_hidden_states=text,
                                return_dict=False)[0]


def build_model(config: dict | None = None) -> TinyVDiT:
    return TinyVDiT(config)


def load_model(path: str | Path | None = None) -> TinyVDiT:
    """The shipped weights (float16 on disk, float32 in memory), in eval mode."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path or DEFAULT_WEIGHTS)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    model = build_model(json.loads(meta["config"]) if "config" in meta else None)
    model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()})
    return model.eval().requires_grad_(False)


def flow_loss(model: TinyVDiT, x0: torch.Tensor, classes: torch.Tensor,
              g: torch.Generator, t: torch.Tensor | None = None) -> torch.Tensor:
    """Rectified flow: x_t = (1 - t) x0 + t noise, target velocity noise - x0; ``t`` from a
    logit-normal unless given. ``x0`` (B, 3, F, H, W) in [-1, 1]."""
    noise = torch.randn(x0.shape, generator=g).to(x0)
    if t is None:
        t = torch.sigmoid(torch.randn(len(x0), generator=g)).to(x0)
    tt = t.view(-1, 1, 1, 1, 1)
    return ((model((1 - tt) * x0 + tt * noise, t, classes) - (noise - x0)) ** 2).mean()


def schedule(steps: int, shift: float = SHIFT) -> torch.Tensor:
    """Flow times from 1 (noise) to 0, shifted as Wan shifts its sigmas."""
    s = torch.linspace(1, 0, steps + 1)
    return shift * s / (1 + (shift - 1) * s)


@torch.no_grad()
def sample(model: TinyVDiT, classes, seed: int | torch.Generator = 0, steps: int = 20,
           guidance: float = 1.0, size: int = SIZE, frames: int = FRAMES) -> torch.Tensor:
    """Videos (B, 3, frames, size, size) in [0, 1]; Euler steps; noise from a private
    generator. ``guidance`` > 1 batches the null class as samplers do (one call per step)."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    p = next(model.parameters())
    cls = torch.as_tensor(classes, dtype=torch.long, device=p.device)
    x = torch.randn((len(cls), 3, frames, size, size), generator=g).to(p)
    ts = schedule(steps).tolist()
    for t, t_next in zip(ts[:-1], ts[1:]):
        tt = torch.full((len(cls),), t, device=p.device, dtype=p.dtype)
        if guidance != 1.0:
            v_c, v_u = model(torch.cat([x, x]), torch.cat([tt, tt]),
                             torch.cat([cls, torch.full_like(cls, NULL)])).chunk(2)
            v = v_u + guidance * (v_c - v_u)
        else:
            v = model(x, tt, cls)
        x = x + (t_next - t) * v
    return ((x.clamp(-1, 1) + 1) / 2).float()


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
