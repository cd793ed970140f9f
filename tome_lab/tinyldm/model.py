"""A tiny pixel-space diffusion model built from the real ``ldm`` UNet.

The network is ``ldm.modules.diffusionmodules.openaimodel.UNetModel`` - the code the
WebUI runs - with ``SpatialTransformer`` blocks (self- and cross-attention) at the
64x64 and 32x32 levels, so the top level sees 4096 tokens, as SD 1.5 does at 512 px.
It is conditioned on a class through cross-attention: a learned table maps each class
to a few context tokens, like a (very) short text prompt.

The wrapper mirrors the LatentDiffusion layout (``model.model.diffusion_model`` is the
UNet), so code that patches Stable Diffusion models finds the UNet where it expects it.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from ldm.modules.attention import CrossAttention
from ldm.modules.diffusionmodules.openaimodel import UNetModel
from torch import nn

from ..models import DTYPES, sdpa_forward

DEFAULT_WEIGHTS = Path(__file__).with_name("tiny64.safetensors")

#: Architecture and diffusion settings; stored as JSON in the weights' metadata.
CONFIG: dict = {
    "unet": {
        "image_size": 64,
        "in_channels": 3,
        "out_channels": 3,
        "model_channels": 32,
        "channel_mult": [1, 2, 4, 4],
        "num_res_blocks": [1, 1, 2, 2],
        "attention_resolutions": [1, 2],  # downsampling factors: the 64x64 and 32x32 levels
        "num_head_channels": 32,
        "use_spatial_transformer": True,
        "transformer_depth": 1,
        "context_dim": 128,
        "use_linear_in_transformer": True,
        "legacy": False,
        "use_checkpoint": False,
    },
    "classes": ["landscape", "flower", "foliage", "object"],
    "context_tokens": 4,
    "timesteps": 1000,
    "beta_start": 1e-4,
    "beta_end": 2e-2,
    "prediction": "v",  # v = sqrt(a) * noise - sqrt(1 - a) * x0, as in SD 2.x
}


class SDPACrossAttention(CrossAttention):
    """CrossAttention whose forward uses SDPA; swapped in per instance by ``build_model``.

    Swapping ``__class__`` of our own modules (instead of assigning to the ldm class)
    keeps the speed-up local to this package: ldm stays unmodified, in memory and on disk.
    """

    forward = sdpa_forward


class _Wrapper(nn.Module):
    """Holds the UNet as ``diffusion_model``, like ldm's DiffusionWrapper."""

    def __init__(self, unet: UNetModel):
        super().__init__()
        self.diffusion_model = unet


class TinyLDM(nn.Module):
    """Class-conditional pixel-space diffusion model.

    It predicts v rather than the noise: with only about an hour of CPU training, an
    epsilon model's small errors at high noise levels are amplified ~150x in its x0
    estimate and DDIM samples stay noisy; a v model predicts the image there directly.
    """

    def __init__(self, config: dict | None = None):
        super().__init__()
        self.config = json.loads(json.dumps(config or CONFIG))
        c = self.config
        self.model = _Wrapper(UNetModel(**c["unet"]))
        self.num_classes = len(c["classes"])
        self.context_tokens = c["context_tokens"]
        # One extra row: the "null" class for classifier-free guidance (id == num_classes).
        self.cond_emb = nn.Embedding(
            (self.num_classes + 1) * self.context_tokens, c["unet"]["context_dim"]
        )
        nn.init.normal_(self.cond_emb.weight, std=0.5)
        betas = torch.linspace(c["beta_start"], c["beta_end"], c["timesteps"], dtype=torch.float64)
        self.register_buffer(
            "alphas_cumprod", torch.cumprod(1 - betas, 0).float(), persistent=False
        )

    @property
    def null_class(self) -> int:
        return self.num_classes

    def context(self, class_ids: torch.Tensor) -> torch.Tensor:
        """(B,) class ids -> (B, context_tokens, context_dim) cross-attention context."""
        rows = class_ids[:, None] * self.context_tokens + torch.arange(self.context_tokens)
        return self.cond_emb(rows)

    def forward(self, x: torch.Tensor, t: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
        """The UNet's prediction (v, see CONFIG) for ``x`` in [-1, 1] scale at timesteps ``t``."""
        return self.model.diffusion_model(x, t, context=self.context(class_ids))


def build_model(config: dict | None = None) -> TinyLDM:
    """A freshly initialised model (fp32, eval mode) with SDPA attention."""
    model = TinyLDM(config)
    for m in model.modules():
        if type(m) is CrossAttention:
            m.__class__ = SDPACrossAttention
    return model.eval()


def load_model(path: str | Path | None = None) -> TinyLDM:
    """Load weights (default: the file shipped in this package); never uses the network."""
    from safetensors import safe_open

    path = Path(path) if path is not None else DEFAULT_WEIGHTS
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        state = {k: f.get_tensor(k).float() for k in f.keys()}
    model = build_model(json.loads(meta["config"]) if "config" in meta else None)
    model.load_state_dict(state)
    model.metadata = meta
    return model


def _as_generator(seed: int | torch.Generator) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    return torch.Generator().manual_seed(int(seed))


def _autocast(device: torch.device, dtype: torch.dtype | str | None):
    """Mixed precision in ``dtype`` (a torch dtype or fp32/bf16/fp16) on ``device``; none for
    fp32 or None: the weights stay fp32 and only the compute dtype changes."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if dtype is None or dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def denoising_loss(
    model: TinyLDM,
    images: torch.Tensor,
    class_ids: torch.Tensor,
    timesteps: torch.Tensor | int,
    seed: int | torch.Generator,
    dtype: torch.dtype | str | None = None,
) -> torch.Tensor:
    """Mean squared error of the model's prediction target (v, or noise for epsilon models).

    ``images`` are in [0, 1]; noise comes from ``seed`` only, so a fixed batch, timesteps
    and seed give a repeatable number (used both for training and held-out evaluation).
    Differentiable; wrap in ``torch.no_grad()`` for evaluation. ``dtype``: the compute dtype
    (autocast; None = fp32).
    """
    dev = _device(model)
    x0 = images.to(dev) * 2 - 1
    b = x0.shape[0]
    t = torch.as_tensor(timesteps, dtype=torch.long).expand(b).to(dev)
    noise = torch.randn(x0.shape, generator=_as_generator(seed)).to(dev)
    a = model.alphas_cumprod[t].view(b, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    target = (
        noise if model.config["prediction"] == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * x0
    )
    with _autocast(dev, dtype):
        pred = model(xt, t, class_ids.to(dev))
    return F.mse_loss(pred.float(), target)


@torch.no_grad()
def sample(
    model: TinyLDM,
    class_ids,
    seed: int | torch.Generator,
    steps: int = 25,
    size: int = 64,
    guidance: float = 1.0,
    dtype: torch.dtype | str | None = None,
) -> torch.Tensor:
    """Deterministic DDIM (eta=0) sampling; returns (B, 3, size, size) images in [0, 1].

    The starting noise comes from a private generator seeded with ``seed``; torch's
    global RNG is never used. ``guidance`` > 1 runs classifier-free guidance with the
    conditional and null-class halves in one batch, as Stable Diffusion samplers do.
    ``dtype``: the compute dtype (autocast on the model's device; None = fp32). Runs on the
    model's device; the starting noise is drawn on the CPU, so every device starts alike.
    """
    dev = _device(model)
    class_ids = torch.as_tensor(class_ids, dtype=torch.long).reshape(-1).to(dev)
    b = class_ids.shape[0]
    x = torch.randn((b, 3, size, size), generator=_as_generator(seed)).to(dev)
    acp = model.alphas_cumprod
    ts = torch.linspace(acp.shape[0] - 1, 0, steps).round().long().tolist()
    for i, t in enumerate(ts):
        tt = torch.full((b,), t, dtype=torch.long, device=dev)
        with _autocast(dev, dtype):
            if guidance == 1.0:
                out = model(x, tt, class_ids).float()
            else:
                null = torch.full_like(class_ids, model.null_class)
                both = model(torch.cat([x, x]), torch.cat([tt, tt]), torch.cat([class_ids, null]))
                cond, uncond = both.float().chunk(2)
                out = uncond + guidance * (cond - uncond)
        a = acp[t]
        a_prev = acp[ts[i + 1]] if i + 1 < len(ts) else torch.ones((), device=dev)
        if model.config["prediction"] == "epsilon":
            x0 = (x - (1 - a).sqrt() * out) / a.sqrt()
        else:
            x0 = a.sqrt() * x - (1 - a).sqrt() * out
        x0 = x0.clamp(-1, 1)
        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()  # consistent with the clipped x0
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    return ((x + 1) / 2).clamp(0, 1)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "CONFIG",
    "DEFAULT_WEIGHTS",
    "TinyLDM",
    "build_model",
    "load_model",
    "sample",
    "denoising_loss",
    "num_params",
]
