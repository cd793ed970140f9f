"""``backend.nn.svdq``: Forge Neo's Nunchaku (SVDQuant) models. Their attention runs in
Nunchaku's own kernels (Flux) or through this module's own ``attention_function`` (Qwen-Image,
Z-Image), never through the model modules' swappable functions: a stand-in whose forward
calls none of them."""

import torch
from torch import nn


class NunchakuModelMixin(nn.Module):
    pass


class SVDQFluxTransformer2DModel(NunchakuModelMixin):
    def __init__(self, in_channels=16, patch_size=2):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, in_channels, 1)

    def forward(self, x, timestep, context, transformer_options={}, **kwargs):  # noqa: B006
        return self.proj(x) * torch.tanh(context.mean())
