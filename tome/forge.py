"""Forge adapter: the same merge, applied through Forge's UNet patcher instead of hooks.

Forge runs its own UNet (``IntegratedUNet2DConditionModel``) and rebuilds the patched UNet
before every sampling pass from ``forge_objects.unet``, a ``UnetPatcher``. Modules are shared
between patcher clones, so hooks would leak into other passes; the supported way is a clone
with an ``attn1`` patch, called as ``(n, k, v, extra_options) -> (n, k, v)`` right before
self-attention, and an ``attn1`` output patch ``(n, extra_options) -> n`` right after it.

Differences from the hook-based patch, both forced by what the patcher exposes:
- the similarity metric is the normalised block input ``norm1(x)`` (what ComfyUI's ToMe uses),
  not ``x`` itself, so results are close to, not equal to, the ldm patch;
- only self-attention can be merged (there is no patch point around the feed-forward layer).
"""

from __future__ import annotations

from typing import Any

import torch

from . import merge
from .config import ToMeConfig
from .patch import block_levels, grid_of, seeded_partition

MARK = "_tome_sd_forge"  # set on a patcher clone that carries our patches


class ForgePatch:
    """The two patch functions for one sampling pass, sharing the plan of the current block."""

    def __init__(self, config: ToMeConfig, max_downsample: int):
        self.config, self.max_downsample = config, max_downsample
        self.plan: Any = None  # the plan of the block between attn1 patch and output patch
        self.partitions: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tokens: dict[int, tuple[int, int]] = {}

    def _partition(self, h: int, w: int, extra: dict, device: torch.device):
        """Seeded like the hook-based patch, by the step's sigma in place of the timestep."""
        c = self.config
        sigmas = extra.get("sigmas")
        t = round(float(sigmas.reshape(-1)[0]) * 1000) \
            if c.use_rand and isinstance(sigmas, torch.Tensor) else -1
        key = (t, h, w, str(device))
        if key not in self.partitions:
            if len(self.partitions) > 64:  # one entry per step and level is all that is reused
                self.partitions.clear()
            self.partitions[key] = seeded_partition(c, t, 0, h, w, device)
        return self.partitions[key]

    def attn1(self, n: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict):
        c, self.plan = self.config, None
        shape = extra.get("original_shape")
        grid = None if shape is None or n.dim() != 3 else \
            grid_of(n.shape[1], tuple(shape[-2:]), self.max_downsample)
        if grid is None:
            return n, k, v
        ds, h, w = grid
        self_attention = k is n and v is n
        if c.method == "downsample":
            if not self_attention:
                return n, k, v
            kv = merge.downsample_tokens(n, h, w, c.downsample_factor)
            self.tokens[ds] = (n.shape[1], n.shape[1] - kv.shape[1])
            return n, kv, kv
        r = int(n.shape[1] * c.ratio)
        if r <= 0 or not c.merge_attn:
            return n, k, v
        src_idx, dst_idx = self._partition(h, w, extra, n.device)
        self.plan = merge.Plan(n, src_idx, dst_idx, r,
                               merge.matcher(c.matching, h, w, c.sx, c.sy))
        self.tokens[ds] = (n.shape[1], self.plan.r)
        merged = self.plan.merge(n)
        # Self-attention: keys and values are ``n`` too, so they merge the same way. A
        # cross-attention attn1 (disable_self_attn) keeps its context: only queries merge.
        return (merged, merged, merged) if self_attention else (merged, k, v)

    def attn1_output(self, n: torch.Tensor, extra: dict) -> torch.Tensor:
        plan, self.plan = self.plan, None
        return n if plan is None else plan.unmerge(n)


def patch_unet(unet_patcher: Any, config: ToMeConfig) -> tuple[Any, ForgePatch | None]:
    """A clone of Forge's ``UnetPatcher`` carrying the ToMe patches, and the patch object.

    Idempotent: Forge may call ``process_before_every_sampling`` twice for one pass, and a
    patcher that already carries our patches is returned unchanged.
    """
    if getattr(unet_patcher, MARK, None) is not None:
        return unet_patcher, getattr(unet_patcher, MARK)
    if not config.active:
        return unet_patcher, None
    diffusion_model = getattr(getattr(unet_patcher, "model", None), "diffusion_model", None)
    known = sorted({d for d in block_levels(diffusion_model).values() if d > 0}) \
        if diffusion_model is not None else []
    max_ds = config.max_downsample or (known[0] if known else 1)
    patch = ForgePatch(config, max_ds)
    unet = unet_patcher.clone()
    unet.set_model_attn1_patch(patch.attn1)
    unet.set_model_attn1_output_patch(patch.attn1_output)
    setattr(unet, MARK, patch)
    return unet, patch
