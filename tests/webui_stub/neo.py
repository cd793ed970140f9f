"""Forge Neo's loaded model (a ``ForgeDiffusionEngine``) and how it samples, for the stand-in.

What Neo 2.26 does around a DiT generation, written from its observed behaviour: the engine
holds ``forge_objects`` (its ``unet`` is a ``backend.patcher.unet.UnetPatcher``) and resets
them from ``forge_objects_after_applying_lora`` right before ``process_before_every_sampling``
(so a patched clone never outlives its job); the sampler reads ``forge_objects.unet`` at
every step and calls the model through ``backend.sampling.sampling_function`` with the
k-diffusion sigmas of Neo's "Simple" schedule (Flux, 4 steps: 1.0, 0.9045, 0.7595, 0.5128);
cond and uncond share one batch (``cond_or_uncond`` [0, 1]) unless CFG is 1. Latents: Flux,
Chroma, Z-Image ``[B, 16, H/8, W/8]``; Wan ``[B, 16, T, H/8, W/8]``; Qwen-Image
``[B, 16, 1, H/8, W/8]``.
"""

from __future__ import annotations

import hashlib

import torch
from backend import attention as kernel
from backend.args import dynamic_args
from backend.modules.k_model import KModel
from backend.modules.k_prediction import PredictionDiscreteFlow, PredictionFlux
from backend.nn import chroma, flux, lumina, qwen, svdq, wan
from backend.patcher.unet import UnetPatcher
from backend.sampling.sampling_function import calc_batch

# For the tests (they reach the stand-in through the harness, which puts it on the path).
__all__ = ["NeoModel", "denoise", "dynamic_args", "flux", "kernel", "lumina", "qwen", "wan"]

TEXT_TOKENS = 7
FRAMES = 3  # Wan's latent frames (a 9-frame video)


def _diffusion_model(kind: str):
    if kind == "flux":
        return flux.IntegratedFluxTransformer2DModel(), PredictionFlux(1.15)
    if kind == "chroma":
        return chroma.IntegratedChromaTransformer2DModel(), PredictionFlux(1.15)
    if kind == "wan":
        return wan.WanModel(), PredictionDiscreteFlow(shift=5.0)
    if kind == "qwen":
        return qwen.QwenImageTransformer2DModel(), PredictionDiscreteFlow(shift=3.1)
    if kind == "lumina":
        return lumina.NextDiT(), PredictionDiscreteFlow(shift=3.0)
    if kind == "nunchaku":
        return svdq.SVDQFluxTransformer2DModel(), PredictionFlux(1.15)
    if kind == "sd15":  # a shallow SD1.5 UNet with Forge's block contract (tests/stubs.py)
        from models import SHALLOW_SD15
        from stubs import Predictor, forge_unet
        return forge_unet(SHALLOW_SD15), Predictor()
    raise ValueError(kind)


class ForgeObjects:
    def __init__(self, unet, clip=None, vae=None, clipvision=None):
        self.unet, self.clip, self.vae, self.clipvision = unet, clip, vae, clipvision

    def shallow_copy(self) -> ForgeObjects:
        return ForgeObjects(self.unet, self.clip, self.vae, self.clipvision)


class NeoModel:
    """A loaded Neo checkpoint (tiny, random weights fixed by ``seed``): a DiT, or ``sd15``."""

    def __init__(self, kind: str = "flux", seed: int = 0):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            net, predictor = _diffusion_model(kind)
        self.kind = kind
        unet = UnetPatcher(KModel(net.eval(), predictor))
        self.forge_objects = ForgeObjects(unet)
        self.forge_objects_original = self.forge_objects.shallow_copy()
        self.forge_objects_after_applying_lora = self.forge_objects.shallow_copy()
        self.is_sd1, self.is_sdxl = kind == "sd15", False
        self.is_wan = kind in ("wan", "qwen")  # Neo's flag for the 5-D (video VAE) latent
        self.context_dim = 32

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = height // 8, width // 8
        frames = {"wan": (FRAMES,), "qwen": (1,)}.get(self.kind, ())
        return (4 if self.kind == "sd15" else 16, *frames, h, w)

    def conds(self, prompt: str, batch: int, negative: bool = False) -> dict:
        seed = int(hashlib.sha256((prompt * (not negative)).encode()).hexdigest()[:8], 16)
        g = torch.Generator().manual_seed(seed)
        c = {"c_crossattn": torch.randn(1, TEXT_TOKENS, 32, generator=g).expand(batch, -1, -1)}
        if self.kind == "flux":  # CLIP-L's pooled vector
            c["y"] = torch.randn(1, 16, generator=g).expand(batch, -1)
        return c


def _cat(conds: list[dict]) -> dict:
    return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}


def denoise(p, x: torch.Tensor, steps: int, each_step) -> torch.Tensor:
    """Euler over Neo's Simple sigmas from pure noise; ``each_step(i)`` runs the WebUI's
    per-step callbacks and returns the model to call (Neo reads it at every step)."""
    from modules import processing

    model = each_step(None)
    sigmas = model.forge_objects.unet.model.predictor.simple_sigmas(steps)
    batch = x.shape[0]
    x = x * sigmas[0]
    cond = model.conds(p.prompt, batch)
    uncond = model.conds(p.prompt, batch, negative=True)
    for i in range(steps):
        model = each_step(i)
        unet = model.forge_objects.unet
        sigma, after = sigmas[i], sigmas[i + 1]
        with processing.sampling_mode():
            if p.cfg_scale == 1:
                den = calc_batch(unet, x, sigma.expand(batch), cond, [0])
            else:
                both = calc_batch(unet, torch.cat([x, x]), sigma.expand(2 * batch),
                                  _cat([cond, uncond]), [0, 1])
                den_c, den_u = both.chunk(2)
                den = den_u + p.cfg_scale * (den_c - den_u)
        x = x + (x - den) / sigma * (after - sigma)
    return x
