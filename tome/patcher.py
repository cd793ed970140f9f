"""ModelPatcher adapter: the same merge, applied through a UNet patcher instead of hooks.

The contract it speaks is the one the Forge family (Forge, Forge Neo, reForge, Forge Classic)
and ComfyUI share: a ``ModelPatcher`` (Forge: ``UnetPatcher``) whose ``clone()`` shares the
modules, so hooks would leak into other passes; the supported way is a clone with an
``attn1`` patch, called as ``(n, k, v, extra_options) -> (n, k, v)`` right before
self-attention, and an ``attn1`` output patch ``(n, extra_options) -> n`` right after it, with
``transformer_options`` (``original_shape``, ``block``, ``sigmas``) in ``extra_options``. The
host rebuilds the patched UNet before every sampling pass from its patcher.

Differences from the hook-based patch, both forced by what the patcher exposes:
- the similarity metric is the normalised block input ``norm1(x)`` (what ComfyUI's ToMe uses),
  not ``x`` itself, so results are close to, not equal to, the ldm patch;
- only self-attention can be merged (there is no patch point around the feed-forward layer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .config import ToMeConfig
from .plan import Call, Planner
from .unet import UnsupportedModelError, auto_level, known_levels, nothing_to_merge

MARK = "_tome_sd_forge"  # set on a patcher clone that carries our patches


class ForgePatch:
    """The two patch functions for one sampling pass, sharing the plan of the current block.

    Forge has no hook at the start of a UNet call, so a call starts when the first block seen
    in this pass comes round again. The step's sigma stands in for the timestep (it stays on
    the device: the partition is hashed from it there).
    """

    def __init__(self, config: ToMeConfig, max_downsample: int, levels: list[int],
                 replacements: Callable[[], Mapping], measurer: Callable | None = None):
        self.config, self.max_downsample = config, max_downsample
        self.levels = levels  # the UNet levels with transformer blocks that may be merged
        # The attn1 replacements of the patcher that samples (Forge keeps ``patches_replace``
        # out of ``extra_options``, and Self-Attention Guidance adds its own after us).
        self.replacements = replacements
        self.planner = Planner(config, max_downsample, measurer)
        self.method = self.planner.method
        self.tokens = self.planner.tokens
        self.skipped: list[tuple[str, str]] = []  # (block, reason), once per block
        self.plan: Any = None  # the plan of the block between attn1 and its output
        self.first: Any = None
        self.call: Call | None = None

    def _begin(self, block: Any, n: torch.Tensor, extra: dict) -> None:
        if self.first is None:
            self.first = block
        if block == self.first or self.call is None:
            size = tuple(extra["original_shape"][-2:])
            self.call = self.planner.begin(size, n.device, extra.get("sigmas"), n.shape[0])

    def _replaced(self, block: Any, extra: dict) -> bool:
        """Another patch replaces this block's attn1 (Self-Attention Guidance records the middle
        block's attention map this way): it must see every token, so leave the block alone.
        Forge looks a replacement up by ``(name, number, index)``, then by ``(name, number)``."""
        replace = (extra.get("patches_replace") or {}).get("attn1") or self.replacements()
        if block not in replace and block[:2] not in replace:
            return False
        if not any(b == block for b, _ in self.skipped):
            self.skipped.append((block, "attn1 replaced by another patch (e.g. Self-Attention "
                                        "Guidance)"))
        return True

    def attn1(self, n: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict):
        self.plan = None
        if extra.get("original_shape") is None or n.dim() != 3:
            return n, k, v
        block = (*tuple(extra.get("block") or ()), extra.get("block_index", 0))
        self._begin(block, n, extra)
        # Only a block that would be merged can be "skipped" because another patch owns it.
        if self.call is None or not self.planner.merges(self.call, n.shape[1]) \
                or self._replaced(block, extra):
            return n, k, v
        self_attention = k is n and v is n
        if "attn1" not in self.method.sub_layers(self.config) \
                or (self.method.self_attention_only and not self_attention):
            return n, k, v
        plan = self.planner.plan(self.call, n, decoder=block[0] == "output")
        if plan is None:
            return n, k, v
        if self.method.unmerges:
            self.plan = plan
        return reduce_attn1(self.method, plan, n, k, v, self_attention)

    def attn1_output(self, n: torch.Tensor, extra: dict) -> torch.Tensor:
        plan, self.plan = self.plan, None
        return n if plan is None else self.method.restore(plan, n)


def reduce_attn1(method: Any, plan: Any, n: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 self_attention: bool):
    """What attn1 gets under ``plan``: the method's queries; its keys and values where it has
    them, else (self-attention) the queries again, or (a cross-attention attn1, i.e.
    disable_self_attn) the context unchanged."""
    queries, kv = method.reduce(plan, n)
    if kv is not None:
        return queries, kv, kv
    return (queries, queries, queries) if self_attention else (queries, k, v)


def run_block(block: Any, x: torch.Tensor, context: torch.Tensor | None, planner: Planner,
              plan: Any, where: tuple = ("input", 1)) -> Any:
    """Run a Forge ``BasicTransformerBlock`` with ``plan`` applied through its patcher
    contract (``transformer_options["patches"]``), or unmerged when ``plan`` is None: how
    ``measure`` times Forge's blocks, whose attn1 gets keys and values as arguments."""
    method, held = planner.method, []

    def attn1(n, k, v, extra):
        held.append(plan if method.unmerges else None)
        return reduce_attn1(method, plan, n, k, v, k is n and v is n)

    def attn1_output(n, extra):
        p = held.pop() if held else None
        return n if p is None else method.restore(p, n)

    options: dict[str, Any] = {"block": where, "block_index": 0}
    if plan is not None:
        options["patches"] = {"attn1_patch": [attn1], "attn1_output_patch": [attn1_output]}
    return block(x, context=context, transformer_options=options)


def attn1_replacements(unet_patcher: Any) -> Mapping:
    """``{(block, number, index): fn}``: the attn1 replacements a patcher carries."""
    options = getattr(unet_patcher, "model_options", None) or {}
    return ((options.get("transformer_options") or {}).get("patches_replace") or {}).get(
        "attn1") or {}


def patch_unet(unet_patcher: Any, config: ToMeConfig,
               sampling_patcher: Callable[[], Any] | None = None, measurer: Any = None
               ) -> tuple[Any, ForgePatch | None]:
    """A clone of Forge's ``UnetPatcher`` carrying the ToMe patches, and the patch object.

    ``sampling_patcher`` returns the patcher that will actually sample (a host's current
    ``forge_objects.unet``: extensions that run after us clone ours and add their own patches);
    blocks whose attn1 it replaces are left alone. Without it, our clone's are used.
    Idempotent: Forge may call ``process_before_every_sampling`` twice for one pass, and a
    patcher that already carries our patches is returned unchanged. A model without a UNet
    (a DiT) raises ``UnsupportedModelError`` and is left alone. ``measurer``: a
    ``measure.Measurer``; with the ``auto`` policy it measures the patcher's UNet (through
    ``run_block``) at the first call of each size, where Forge has moved it to its device.
    """
    if getattr(unet_patcher, MARK, None) is not None:
        return unet_patcher, getattr(unet_patcher, MARK)
    if not config.active:
        return unet_patcher, None
    diffusion_model = getattr(getattr(unet_patcher, "model", None), "diffusion_model", None)
    known = known_levels(diffusion_model)
    if not known:
        # Flux, Chroma, Qwen-Image, Lumina, Wan, Z-Image...: DiTs whose blocks never call the
        # attn1 patches. Patching them would claim a merge that never happens.
        name = type(diffusion_model).__name__ if diffusion_model is not None else "no model"
        raise UnsupportedModelError(
            f"ToMe: {name} is not a UNet with transformer blocks (a DiT such as Flux, Chroma, "
            "Qwen-Image, Lumina, Wan or Z-Image); ToMe merges SD1, SD2 and SDXL UNets")
    nothing = nothing_to_merge(config.max_downsample, known)
    if nothing:
        raise UnsupportedModelError(nothing)
    max_ds = auto_level(config.max_downsample, known)
    unet = unet_patcher.clone()
    current = sampling_patcher or (lambda: unet)
    measured = measurer.for_model(diffusion_model, config, run_block) \
        if measurer is not None else None
    patch = ForgePatch(config, max_ds, [d for d in known if d <= max_ds],
                       lambda: attn1_replacements(current()), measured)
    unet.set_model_attn1_patch(patch.attn1)
    unet.set_model_attn1_output_patch(patch.attn1_output)
    setattr(unet, MARK, patch)
    return unet, patch
