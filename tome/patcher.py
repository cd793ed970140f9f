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

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import graphs
from . import layout as _layout
from .config import ToMeConfig
from .modelpatcher import MARK, Attn1Owner, attn1_replacements, window_of
from .plan import Call, Planner, Window
from .report import ATTN1_PATCH, PatchReport


class Live(threading.local):
    """The UNet call now running in this thread, as the blocks read it: the patch, its
    ``plan.Call`` (None outside the start/end window), the attn1 replacements of the patcher
    that samples, and the plan of the block between attn1 and its output. Per thread: a
    host's worker threads (ComfyUI's MultiGPU, one per device) run calls of one patch at
    once.

    Each model call is started on the host (``Attn1Patch.start``: from ComfyUI's node's
    ``apply_model`` wrapper, from the Forge family's ``FunctionStart``), outside the module a
    host compiles, into the module's ``LIVE``; a compiled graph reads it through that
    global, whose guards hold. Read through the patch function instead, it would be a
    constant: ComfyUI's TorchCompileModel and Forge Neo's compile drop every guard whose
    source names ``transformer_options``, where the patch functions sit, so a graph would
    replay the window state, the call and even the settings it was traced with. Where no
    wrapper started the call (another extension took Forge's single wrapper slot), the
    patch's own is begun at the call's first block."""

    def __init__(self) -> None:  # run in each thread at its first use
        self.patch: Attn1Patch | None = None
        self.call: Call | None = None
        self.replaced: frozenset = frozenset()
        self.plan: Any = None

    def swap(self, patch: Attn1Patch | None, call: Call | None, replaced: frozenset
             ) -> tuple:
        saved = (self.patch, self.call, self.replaced)
        self.patch, self.call, self.replaced = patch, call, replaced
        return saved


LIVE = Live()  # the UNet call each thread runs


class Attn1Patch(Attn1Owner):
    """The two patch functions for one sampling pass, sharing the plan of the current block.

    A call is started on the host before the model runs (``start``, ``finish``: ``Live``);
    failing that, the contract's first block starts it (a call starts when the first block
    seen in this pass comes round again). The step's sigma stands in for the
    timestep (it stays on the device: the partition is hashed from it there).
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
        self.first: Any = None
        self.own = Live()  # the call begun at its first block (hosts without ``start``)
        self.calls = 0  # attn1 calls counted on the host (eager calls)
        # Set by every attn1 call (``touched``) and by a block at a level that merges
        # (``met``), cleared by the host (``since``): constant stores, so a compiled graph's
        # replay sets them too, where it runs no Python to count.
        self.touched = self.met = False
        self.expected = False  # the call started last has levels to merge (host side)

    def start(self, x: torch.Tensor, sigmas: Any, options: Mapping | None = None) -> tuple:
        """Host side, before a model call on the latent ``x`` ([B, C, H, W]) at ``sigmas``
        (the step's, on the device): begin the call (measuring a new size first, the window,
        the decisions' line) and make it the one the blocks read. Hand the result to
        ``finish`` after the call."""
        if LIVE.patch is self:  # started already (the Forge family's wrapper, then the node's)
            return None
        size = tuple(x.shape[-2:])
        call = self.planner.begin(size, x.device, sigmas, x.shape[0])
        self.expected = call is not None and \
            any(d.merged for d in self.planner.decided(size, call.kind))
        return LIVE.swap(self, call, self._replacing(options))

    def finish(self, saved: tuple | None) -> None:
        if saved is not None:
            LIVE.swap(*saved)

    def since(self) -> int:
        """Before a sampling or a call: clear the marks; what was counted so far."""
        self.touched = self.met = False
        return self.calls

    def reached_since(self, since: int) -> bool:
        return self.touched or self.calls > since

    def missed(self) -> bool:
        """The call started last had levels to merge, and no block at them reached the patch
        since ``since``: another node dropped or replaced the blocks' patches, or a compiled
        graph traced without the patch replayed."""
        return self.expected and not self.met

    def _replacing(self, options: Mapping | None) -> frozenset:
        """The blocks whose attn1 another patch replaces (Self-Attention Guidance records the
        middle block's attention map this way), as ``(name, number, index)`` or ``(name,
        number)``: the call's own ``patches_replace``, else the sampling patcher's (Forge
        keeps them out of ``extra_options``)."""
        replace = ((options or {}).get("patches_replace") or {}).get("attn1") \
            or self.replacements()
        return frozenset(replace)

    def _live(self, block: Any, n: torch.Tensor, extra: dict) -> Live:
        if LIVE.patch is not None:
            return LIVE
        own = self.own
        if self.first is None:
            self.first = block
        if block == self.first or own.call is None:
            size = tuple(extra["original_shape"][-2:])
            own.swap(self, self.planner.begin(size, n.device, extra.get("sigmas"), n.shape[0]),
                     self._replacing(extra))
        return own

    def _skip(self, block: Any, reason: str) -> None:
        """Record a block left alone (eager calls: a graph would replay the append)."""
        if not graphs.compiling() and not any(b == block for b, _ in self.skipped):
            self.skipped.append((block, reason))

    SILENT = ("ToMe: this model's blocks never called the attn1 patch (another node replaced "
              "them), so nothing is merged")

    def __deepcopy__(self, memo: dict) -> Attn1Patch:
        """Shared, never copied: ComfyUI deep-copies ``model_options`` (and with it this
        instance's bound methods) on every clone; a patch is one function, like a closure."""
        return self

    def attn1(self, n: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict | None = None,
              **dit: Any):
        """The UNet call form ``(n, k, v, extra) -> (n, k, v)``. The DiT call form (ComfyUI's
        Flux/Qwen-Image blocks: ``(q, k, v, pe=, attn_mask=, extra_options=)`` returning a
        dict of what changed) gets an empty dict: DiTs are not merged.

        Everything per call is read from ``Live`` (the module's global where the host started
        the call), never from ``self``: in a compiled graph under ComfyUI's guard filter
        ``self`` is the patch the graph was traced with."""
        patch = LIVE.patch or self
        patch.touched = True
        if not graphs.compiling():
            patch.calls += 1
        if extra is None:
            return {}
        if extra.get("original_shape") is None or n.dim() != 3:
            return n, k, v
        block = (*tuple(extra.get("block") or ()), extra.get("block_index", 0))
        live = patch._live(block, n, extra)
        live.plan = None
        call, planner, method, config = live.call, patch.planner, patch.method, patch.config
        # Only a block that would be merged can be "skipped" because another patch owns it.
        if call is None or not planner.merges(call, n.shape[1]):
            return n, k, v
        patch.met = True
        if block in live.replaced or block[:2] in live.replaced:
            patch._skip(block, "attn1 replaced by another patch (e.g. Self-Attention Guidance)")
            return n, k, v
        if n.shape[0] != extra["original_shape"][0]:  # an attn1 patch before ours split the
            # tokens into tiles (ComfyUI's HyperTile: the batch grows, each tile looks like a
            # deeper level's grid)
            patch._skip(block, "attn1 input split into tiles by another patch (e.g. HyperTile)")
            return n, k, v
        self_attention = k is n and v is n
        if "attn1" not in method.sub_layers(config) \
                or (method.self_attention_only and not self_attention):
            return n, k, v
        plan = planner.plan(call, n, decoder=block[0] == "output")
        if plan is None:
            return n, k, v
        if method.unmerges:
            live.plan = plan
        return reduce_attn1(method, plan, n, k, v, self_attention)

    def attn1_output(self, n: torch.Tensor, extra: dict) -> torch.Tensor:
        patch, live = (LIVE.patch, LIVE) if LIVE.patch is not None else (self, self.own)
        plan, live.plan = live.plan, None
        return n if plan is None else patch.method.restore(plan, n)


class FunctionStart:
    """The Forge family's ``model_function_wrapper`` on our clone: starts each model call on
    the host (``Attn1Patch.start``) around the model's ``apply_model``, which Forge Neo's
    compile script swaps a compiled ``diffusion_model`` into, so the call's state reaches a
    compiled graph through ``LIVE`` there too. The wrapper the patcher had (a single slot) is
    called inside ours; an extension that later replaces ours leaves the patch starting its
    calls at their first block (eager)."""

    def __init__(self, patch: Attn1Patch, previous: Callable | None):
        self.patch, self.previous = patch, previous

    def __deepcopy__(self, memo: dict) -> FunctionStart:
        return self

    def __call__(self, apply_model: Callable, params: dict) -> Any:
        c = params.get("c") or {}
        options = c.get("transformer_options")
        sigmas = options.get("sigmas") if isinstance(options, dict) else None
        saved = self.patch.start(params["input"], params["timestep"] if sigmas is None
                                 else sigmas, options)
        try:
            if self.previous is not None:
                return self.previous(apply_model, params)
            return apply_model(params["input"], params["timestep"], **c)
        finally:
            self.patch.finish(saved)


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
    if not hasattr(unet, "add_wrapper_with_key") and \
            hasattr(unet, "set_model_unet_function_wrapper"):  # the Forge family (ComfyUI:
        # the node's apply_model wrapper starts the call)
        options = getattr(unet, "model_options", None) or {}
        unet.set_model_unet_function_wrapper(
            FunctionStart(patch, options.get("model_function_wrapper")))
    setattr(unet, MARK, patch)
    return unet, report
