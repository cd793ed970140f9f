"""Real UNets built from their configs with random weights, small enough for CI, and the
helpers the library's tests share. Independent of the lab (``tome_lab``), so the library's
tests do not move when the benchmark does."""

from __future__ import annotations

import torch
from torch import nn


def wake(model: nn.Module, seed: int) -> nn.Module:
    """ldm zero-initialises its output projections, so a fresh UNet's blocks add nothing and
    merging could not change an output: give those layers small random weights."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        zero = [p for p in model.parameters() if p.dim() > 1 and not p.any()]
        for p in zero:
            p.normal_(0.0, 0.5 / p[0].numel() ** 0.5, generator=g)
    return model


def randomised(model: nn.Module, scale: float = 0.05) -> nn.Module:
    """Every weight of a model built from config drawn anew (seeded; ``scale`` times a
    normal), in eval mode: diffusers DiTs zero-initialise parts of themselves."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


class Wrapper(nn.Module):
    """What the WebUI hands over: a model with ``.model.diffusion_model``."""

    def __init__(self, unet):
        super().__init__()
        self.model = nn.Module()
        self.model.diffusion_model = unet


def run(unet, x, t, c):
    """One forward of an ldm or diffusers UNet, as a tensor."""
    return unet(x, t, c) if hasattr(unet, "input_blocks") else unet(x, t, c).sample


def snapshot(module: nn.Module):
    """Everything a patch could leave behind: classes, hooks, instance attributes."""
    return [(n, type(m), len(m._forward_pre_hooks), len(m._forward_hooks), sorted(vars(m)))
            for n, m in module.named_modules()]

# SD1.5's UNet config (v1-inference.yaml) with narrower channels: same levels, same 16 blocks.
SD15 = dict(image_size=32, in_channels=4, out_channels=4, model_channels=320,
            attention_resolutions=[4, 2, 1], num_res_blocks=2, channel_mult=[1, 2, 4, 4],
            num_heads=8, use_spatial_transformer=True, transformer_depth=1, context_dim=768,
            use_checkpoint=False, legacy=False)
TINY_SD15 = {**SD15, "model_channels": 32, "num_heads": 2, "context_dim": 32}
# Two levels, one block each side (7 transformer blocks): what a compiled test traces in a
# fraction of the time (dynamo takes about a minute per graph of TINY_SD15 on a 2-core CPU).
SHALLOW_SD15 = {**TINY_SD15, "attention_resolutions": [2, 1], "num_res_blocks": 1,
                "channel_mult": [1, 2]}
# SDXL's layout (sd_xl_base.yaml): no attention at full resolution, depth 2 and 10 below.
TINY_SDXL = dict(image_size=32, in_channels=4, out_channels=4, model_channels=32,
                 attention_resolutions=[4, 2], num_res_blocks=2, channel_mult=[1, 2, 4],
                 num_head_channels=16, use_spatial_transformer=True, transformer_depth=1,
                 context_dim=32, use_checkpoint=False, legacy=False, use_linear_in_transformer=True)


def ldm_unet(config: dict = TINY_SD15, seed: int = 0) -> torch.nn.Module:
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    torch.manual_seed(seed)
    return wake(UNetModel(**config), seed).eval()


def diffusers_unet(kind: str = "sd15", seed: int = 0, width: int = 32):
    from diffusers import UNet2DConditionModel
    torch.manual_seed(seed)
    if kind == "sd15":
        cfg = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=2,
                   block_out_channels=(width, width * 2, width * 4, width * 4),
                   down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                   up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                   cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    elif kind == "sdxl":
        cfg = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=2,
                   block_out_channels=(width, width * 2, width * 4),
                   down_block_types=("DownBlock2D", "CrossAttnDownBlock2D",
                                     "CrossAttnDownBlock2D"),
                   up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                   transformer_layers_per_block=(1, 2, 2), cross_attention_dim=32,
                   attention_head_dim=8, norm_num_groups=8, use_linear_projection=True)
    else:
        raise ValueError(kind)
    return wake(UNet2DConditionModel(**cfg), seed).eval()


def ldm_inputs(batch=2, h=16, w=16, context_dim=32, seed=1, ctx_len=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, h, w, generator=g)
    t = torch.full((batch,), 500.0)
    ctx = torch.randn(batch, ctx_len, context_dim, generator=g)
    return x, t, ctx
