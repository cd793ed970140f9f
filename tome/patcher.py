"""ModelPatcher adapter for UNets: the same merge, applied through a UNet patcher instead of
hooks.

The contract it speaks is the one the Forge family (Forge, Forge Neo, reForge, Forge Classic)
and ComfyUI share (its helpers: ``modelpatcher.py``): a ``ModelPatcher`` (Forge:
``UnetPatcher``) whose ``clone()`` shares the modules, so hooks would leak into other passes;
the supported way is a clone with an ``attn1`` patch, called as ``(n, k, v, extra_options) ->
(n, k, v)`` right before self-attention, and an ``attn1`` output patch ``(n, extra_options) ->
n`` right after it, with ``transformer_options`` (``original_shape``, ``block``, ``sigmas``) in
``extra_options``. The host rebuilds the patched UNet before every sampling pass from its
patcher.

The step is known only by its k-diffusion sigma (14.6 down to 0.03 on SD1.5), so the
``start``/``end`` window is converted once, at patch time, with the model's own
``percent_to_sigma`` (ComfyUI's ``model_sampling``, the Forge family's ``predictor``, looked up
by ``adapters.py``): ``modelpatcher.window_of``. DiTs behind a ModelPatcher are pooled per
call (``percall.py``, through ``override.py`` or ``swap.py``), not here.

Differences from the hook-based patch, both forced by what the patcher exposes:
- the similarity metric is the normalised block input ``norm1(x)`` (what ComfyUI's ToMe uses),
  not ``x`` itself, so results are close to, not equal to, the ldm patch;
- only self-attention can be merged (there is no patch point around the feed-forward layer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import layout as _layout
from .config import ToMeConfig
from .modelpatcher import MARK, Attn1Owner, attn1_replacements, window_of
from .plan import Call, Planner, Window
from .report import ATTN1_PATCH, PatchReport


class Attn1Patch(Attn1Owner):
    """The two patch functions for one sampling pass, sharing the plan of the current block.

    The contract has no hook at the start of a UNet call, so a call starts when the first
    block seen in this pass comes round again. The step's sigma stands in for the timestep (it
    stays on the device: the partition is hashed from it there).
    """

    def __init__(self, config: ToMeConfig, max_downsample: int, levels: list[int],
                 replacements: Callable[[], Mapping], measurer: Callable | None = None,
                 window: Window | None = None):
        self.config, self.max_downsample = config, max_downsample
        # The attn1 replacements of the patcher that samples (Forge keeps ``patches_replace``
        # out of ``extra_options``, and Self-Attention Guidance adds its own after us).
        self.replacements = replacements
        self.planner = Planner(config, max_downsample, measurer, levels, window=window)
        self.method = self.planner.method
        self.skipped: list[tuple[Any, str]] = []  # (block, reason), once per block, live
        self.plan: Any = None  # the plan of the block between attn1 and its output
        self.first: Any = None
        self.call: Call | None = None
        self.calls = 0  # attn1 calls received (a host whose blocks never call us: 0)

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

    SILENT = ("ToMe: this model's blocks never called the attn1 patch (another node replaced "
              "them), so nothing is merged")

    def __deepcopy__(self, memo: dict) -> Attn1Patch:
        """Shared, never copied: ComfyUI deep-copies ``model_options`` (and with it this
        instance's bound methods) on every clone; a patch is one function, like a closure."""
        return self

    def _retiled(self, block: Any, n: torch.Tensor, extra: dict) -> bool:
        """An attn1 patch before ours split the tokens into tiles (ComfyUI's HyperTile: the
        batch grows, each tile looks like a deeper level's grid): leave the block alone."""
        batch = extra["original_shape"][0]
        if n.shape[0] == batch:
            return False
        if not any(b == block for b, _ in self.skipped):
            self.skipped.append((block, "attn1 input split into tiles by another patch (e.g. "
                                        "HyperTile)"))
        return True

    def attn1(self, n: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict | None = None,
              **dit: Any):
        """The UNet call form ``(n, k, v, extra) -> (n, k, v)``. The DiT call form (ComfyUI's
        Flux/Qwen-Image blocks: ``(q, k, v, pe=, attn_mask=, extra_options=)`` returning a
        dict of what changed) gets an empty dict: DiTs are not merged."""
        self.plan = None
        self.calls += 1
        if extra is None:
            return {}
        if extra.get("original_shape") is None or n.dim() != 3:
            return n, k, v
        block = (*tuple(extra.get("block") or ()), extra.get("block_index", 0))
        self._begin(block, n, extra)
        # Only a block that would be merged can be "skipped" because another patch owns it.
        if self.call is None or not self.planner.merges(self.call, n.shape[1]) \
                or self._replaced(block, extra) or self._retiled(block, n, extra):
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


NOT_TIMED = ("this host's DiT blocks are not timed through its patch contract; the auto "
             "policy's token thresholds decide on DiTs")


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


def patch_unet(unet_patcher: Any, layout: _layout.Layout, config: ToMeConfig,
               sampling_patcher: Callable[[], Any] | None = None, measurer: Any = None,
               runner: Callable | None = None, sampling: Any = None
               ) -> tuple[Any, PatchReport]:
    """A clone of the ``ModelPatcher`` carrying the ToMe patches of its UNet (``layout``), and
    the report (``adapters.patch_model_patcher`` chooses this form).

    ``sampling_patcher`` returns the patcher that will actually sample (a host's current
    ``forge_objects.unet``: extensions that run after us clone ours and add their own patches);
    blocks whose attn1 it replaces are left alone (``report.skipped`` fills while sampling).
    Without it, our clone's are used. Settings that merge nothing are the report's
    ``nothing``, and the patcher is returned unchanged. ``measurer``: a
    ``measurements.Measurer``; with the ``auto`` policy it measures the patcher's UNet (through
    ``runner``, ``run_block``) at the first call of each size, where the host has moved it to
    its device. ``sampling``: the model's noise schedule (``modelpatcher.model_sampling``),
    whose ``percent_to_sigma`` places the start/end window.
    """
    diffusion_model = layout.root
    max_ds = layout.auto_level(config.max_downsample)
    levels = {lv: len(layout.at(lv)) for lv in layout.levels if lv <= max_ds}
    report = PatchReport.of(layout, config, ATTN1_PATCH, max_downsample=max_ds, levels=levels)
    if report.nothing:
        return unet_patcher, report
    unet = unet_patcher.clone()
    current = sampling_patcher or (lambda: unet)
    measured = measurer.for_model(diffusion_model, config, runner or run_block) \
        if measurer is not None else None
    patch = Attn1Patch(config, max_ds, sorted(levels), lambda: attn1_replacements(current()),
                       measured, window_of(sampling, config))
    report.skipped, report.planner = patch.skipped, patch.planner
    patch.report = report
    unet.set_model_attn1_patch(patch.attn1)
    unet.set_model_attn1_output_patch(patch.attn1_output)
    setattr(unet, MARK, patch)
    return unet, report
