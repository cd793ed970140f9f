"""``invokeai.backend.flux.model``: ``Flux`` at tiny width (InvokeAI's own, not diffusers')."""

import math

import torch
from torch import nn

from invokeai.backend.flux.modules.layers import DoubleStreamBlock, EmbedND, SingleStreamBlock


class Flux(nn.Module):
    def __init__(self, in_channels=16, width=64, heads=2, depth=2, depth_single=2,
                 axes_dim=(8, 12, 12), theta=10_000, context_in_dim=32, vec_in_dim=24):
        super().__init__()
        self.in_channels, self.out_channels, self.num_heads = in_channels, in_channels, heads
        self.pe_embedder = EmbedND(theta, axes_dim)
        self.img_in = nn.Linear(in_channels, width)
        self.txt_in = nn.Linear(context_in_dim, width)
        self.time_in = nn.Linear(32, width)
        self.vector_in = nn.Linear(vec_in_dim, width)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(width, heads) for _ in range(depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(width, heads)
                                           for _ in range(depth_single))
        self.final_layer = nn.Linear(width, in_channels)

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None):
        half = torch.exp(-math.log(10_000) * torch.arange(16, dtype=torch.float32) / 16)
        args = 1000.0 * timesteps[:, None].float() * half[None]
        vec = self.time_in(torch.cat([args.cos(), args.sin()], -1)) + self.vector_in(y)
        img, txt = self.img_in(img), self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe)
        x = torch.cat((txt, img), 1)
        for block in self.single_blocks:
            x = block(x, vec=vec, pe=pe)
        return self.final_layer(x[:, txt.shape[1]:])
