"""The node pack: "ToMe (Token Merging)" (MODEL -> MODEL) and "ToMe Measure" (MODEL -> the
measured speed-ups as a table and a plot), declared in ComfyUI's classic node API
(``INPUT_TYPES``, ``RETURN_TYPES``, ``FUNCTION``, ``CATEGORY``); ``v3.py`` builds their V3 form
from it, which a ComfyUI with ``comfy_api.latest`` loads instead.

The patch node asks ``tome.adapters`` for a patched ModelPatcher clone: the input MODEL
is never changed, and a node that fails leaves no patch. What it says goes to the console, one
line per event (``host.console``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from .. import adapters, dits, graphs, policy
from ..config import ToMeConfig
from ..layout import UnsupportedModelError, read
from . import host, inputs, measure_node

CATEGORY = "model_patches/unet"
# ComfyUI's WrappersMP kinds (around a model call, outside a compiled UNet; around a whole
# sampling), read from the loaded ComfyUI at use (``adapters.comfy_name``): a renamed kind
# cannot drop our wrappers. DIFFUSION_MODEL: where older versions of the node put the guard.
APPLY_MODEL, OUTER_SAMPLE = ("WrappersMP", "APPLY_MODEL"), ("WrappersMP", "OUTER_SAMPLE")
DIFFUSION_MODEL = ("WrappersMP", "DIFFUSION_MODEL")
GUARD_KEY = "tome"
COMPILE_KEY = "torch.compile"  # the apply_model wrapper of ComfyUI's TorchCompileModel
# TorchCompileModel before the node: ComfyUI's compile does not see patches added after it
RECOMPILED = ("ToMe: the compiled model ran graphs traced before this ToMe node was added "
              "(TorchCompileModel before ToMe); they are dropped and traced again with it")
STALE = ("ToMe: the compiled model never called the attn1 patch, so nothing is merged: "
         "another node replaced its blocks, or its graphs could not be traced again; put "
         "TorchCompileModel after the ToMe node")
PASSES = "the model passes through unchanged"
IGNORED = ("merge_crossattn", "merge_mlp")  # the patcher reaches only self-attention


class SamplingGuard:
    """A ComfyUI ``apply_model`` wrapper on our clone (clones made after ours inherit it):
    at every UNet call it sees the patches of the patcher that actually samples. It drops the
    patches of another token merging added after ours (ComfyUI's built-in ``TomePatchModel``),
    so tokens are never merged twice, and keeps ``view`` (what the attn1 patch reads
    as the sampling patcher) current, so blocks whose attn1 another node replaces (Self-Attention
    Guidance, PAG) are left alone. It starts each UNet call on the host (``PatchHandle.start``:
    the size, the window, a measurement) before the model runs: ``apply_model`` wrappers run
    outside the module TorchCompileModel compiles (``diffusion_model``), so nothing here is
    traced."""

    def __init__(self, say: Callable[[str], Any]):
        self.say, self.told = say, False
        self.view = SimpleNamespace(model_options={"transformer_options": {}})
        self.patch: Any = None  # our UNet patch's handle: its calls started here, checked
        self.silent_told = False
        self.check = True  # whether the next call is checked: a sampling's first (AfterSampling)
        self.window: Any = None  # the patch's ``plan.Window`` when start/end cut the pass
        self._first_sigma: float | None = None  # the sigma of the pass's first step, told

    def __deepcopy__(self, memo: dict) -> SamplingGuard:
        return self  # one guard per node run, whatever copies the options it sits in

    def __call__(self, executor: Any, *args: Any, **kwargs: Any) -> Any:
        args = list(args)
        # transformer_options: a keyword, or the last positional dict (after ``control``, a
        # dict too): apply_model (x, sigma, c_concat, c_crossattn, control, to)
        at = None
        for i, a in enumerate(args):
            if isinstance(a, dict):
                at = i
        options = kwargs.get("transformer_options") if at is None else args[at]
        if isinstance(options, dict):
            self.tell_window(options)
            options = self._without_tomesd(options)
            self.view.model_options = {"transformer_options": options}
            if at is not None:
                args[at] = options
            else:
                kwargs["transformer_options"] = options
        # a sampling's first call: did it reach the patch? (later calls may skip it: a
        # step cache returns an earlier step's output without running the blocks)
        check, self.check = self.check, False
        out = self._call(executor, args, kwargs, options, check)
        if self.patch is None or not check or self.silent_told or not self.patch.missed():
            return out
        # a compiled graph traced before this node (ComfyUI's guard filter hides patches from
        # dynamo): dropped and the call run again, traced with the patch
        if _compiled(options) and graphs.forget_graphs(getattr(executor.class_obj,
                                                               "diffusion_model", None)):
            self.say(RECOMPILED)
            out = self._call(executor, args, kwargs, options, True)
            if not self.patch.missed():
                return out
        self.silent_told = True
        self.say(STALE if _compiled(options) else self.patch.silent)
        return out

    def _call(self, executor: Any, args: list, kwargs: dict, options: Any, check: bool
              ) -> Any:
        """The model call, started on the host for our UNet patch (``PatchHandle.start``);
        ``check``: its marks cleared first, to be read after (``PatchHandle.missed``)."""
        patch = self.patch
        if patch is None:
            return executor(*args, **kwargs)
        started = None
        if check:
            patch.since()
        if args and hasattr(args[0], "shape"):
            sigmas = options.get("sigmas") if isinstance(options, dict) else None
            started = patch.start(args[0], sigmas if sigmas is not None
                                  else (args[1] if len(args) > 1 else None), options)
        try:
            out = executor(*args, **kwargs)
        finally:
            patch.finish(started)
        return out

    def tell_window(self, options: dict) -> None:
        """At a pass's first step, one line: which of its steps the start/end window merges
        (from the sampler's schedule, ``sample_sigmas``)."""
        schedule, sigma = options.get("sample_sigmas"), options.get("sigmas")
        if self.window is None or schedule is None or sigma is None or len(schedule) < 2:
            return
        first, now = float(schedule[0]), float(sigma.reshape(-1)[0])
        if now != first:
            self._first_sigma = None
            return
        if self._first_sigma == first:  # the same step again (cond and uncond apart)
            return
        self._first_sigma = first
        inside, steps = self.window.count(schedule)
        self.say(f"ToMe: steps {self.window.start:g}-{self.window.end:g} "
                 f"({self.window.sigma_text()}): merging in {inside} of {steps} steps")

    def _without_tomesd(self, options: dict) -> dict:
        kept = adapters.without_tomesd(options)
        if kept is None:
            return options
        if not self.told:
            self.told = True
            self.say("ToMe: another token merging (ComfyUI's built-in TomePatchModel) was "
                     "added after this ToMe node; it is ignored so tokens are never merged "
                     "twice")
        return kept


def _compiled(options: Any) -> bool:
    """Whether TorchCompileModel's wrapper runs this model call."""
    wrappers = (options.get("wrappers") or {}) if isinstance(options, dict) else {}
    return COMPILE_KEY in (wrappers.get(adapters.comfy_name(*APPLY_MODEL)) or {})


class AfterSampling:
    """A ComfyUI ``outer_sample`` wrapper on our clone: after each sampling, one line: where
    the patch did nothing, why; else how many attention calls it pooled and what the rest
    were (``PatchHandle.after``); a report of what happened, not of what was installed (the
    node's line at graph time says what was installed). The patch counts its calls on the
    host (Python ints, no tensor read; calls replayed by a compiled graph are named, not
    counted). An interrupted sampling says nothing."""

    def __init__(self, patch: adapters.PatchHandle, guard: SamplingGuard,
                 say: Callable[[str], Any]):
        self.patch, self.guard, self.say = patch, guard, say

    def __deepcopy__(self, memo: dict) -> AfterSampling:
        return self

    def __call__(self, executor: Any, *args: Any, **kwargs: Any) -> Any:
        since = self.patch.since()
        self.guard.check = True
        out = executor(*args, **kwargs)
        line = self.patch.after(since, told_silent=self.guard.silent_told)
        if line and not self.patch.per_call:
            self.guard.silent_told = True  # the guard tells it at a call where it runs
        if line:
            self.say(line)
        return out


def apply(model: Any, config: ToMeConfig, say: Callable[[str], Any] | None = None) -> Any:
    """``model`` (a ComfyUI ``ModelPatcher``) with token merging: a patched clone, or
    ``model`` itself where nothing is merged (a model it cannot read, merge on a DiT, settings
    that merge nothing), with one console line saying why. Token merging already on the model
    (an earlier ToMe node, or ComfyUI's built-in ``TomePatchModel``) is taken over: removed
    from the clone, with a line."""
    say = say or host.console
    ignored = [name for name in IGNORED if getattr(config, name)]
    if ignored:
        say(f"ToMe: {', '.join(ignored)} do nothing in ComfyUI (its patch points reach only "
            "self-attention)")
    base = model
    ours, foreign = adapters.carried(model)
    if ours or foreign:
        base = model.clone()
        adapters.strip_merging(base)
        if hasattr(base, "remove_wrappers_with_key"):  # its guard and report: ours replace them
            for kind in (APPLY_MODEL, DIFFUSION_MODEL, OUTER_SAMPLE):
                base.remove_wrappers_with_key(adapters.comfy_name(*kind), GUARD_KEY)
        what = "an earlier ToMe node's patch" if ours else ""
        if foreign:
            what += (" and " if what else "") + "ComfyUI's built-in TomePatchModel"
        say(f"ToMe: the model already carried {what}; this node replaces it, so tokens are "
            "never merged twice")
    guard = SamplingGuard(say)
    service = host.measuring_service() if config.policy == "auto" else None
    # the host's callbacks, handed to the patch (the override's apply_model wrapper runs
    # outside a compiled model: it tells the window; other overrides chained, said)
    callbacks = adapters.Callbacks(say=say, on_call=guard.tell_window, leave=host.leaves)
    try:
        clone, report = adapters.patch_model_patcher(base, config, lambda: guard.view, service,
                                                     callbacks)
    except UnsupportedModelError as e:
        say(f"{e}; {PASSES}")
        return model
    if report.nothing:
        say(f"{report.nothing}; {PASSES}")
        return model
    patch = adapters.handle(clone)
    if patch is not None and patch.per_call:
        if not host.attention_override():
            say(f"ToMe: this ComfyUI has no attention override (added in 0.3.60), so DiTs are "
                f"not pooled; update ComfyUI; {PASSES}")
            return model
    else:
        guard.patch = patch
    if not report.planner.window.full:
        guard.window = report.planner.window
    if (patch is None or not patch.per_call) and hasattr(clone, "add_wrapper_with_key"):
        clone.add_wrapper_with_key(adapters.comfy_name(*APPLY_MODEL), GUARD_KEY, guard)
    if patch is not None and hasattr(clone, "add_wrapper_with_key"):
        clone.add_wrapper_with_key(adapters.comfy_name(*OUTER_SAMPLE), GUARD_KEY,
                                   AfterSampling(patch, guard, say))
    if config.policy == "auto":
        report.planner.on_decided = lambda size, decisions: say(
            f"ToMe auto: {policy.summary(decisions, size)}")
    say(report.summary())
    # a DiT's: what the settings resolved to here
    text = report.facts.describe(patch.applied if patch is not None and patch.per_call
                                 else None)
    if text:
        limits = patch.limits
        say(f"ToMe DiT: {text}"
            + (f" (this ComfyUI form cannot apply: {', '.join(limits)})" if limits else ""))
    return clone


class ToMePatch:
    """MODEL -> MODEL with token merging (ToMe) or ToDo in the UNet's self-attention."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    DESCRIPTION = ("Token Merging (ToMe) and ToDo: each step is faster, the image changes a "
                   "little; the input model is not changed. SD1.x, SD2.x and SDXL UNets merge "
                   "tokens (method merge) or pool keys/values (downsample). DiTs pool the image "
                   "keys/values (downsample) through ComfyUI's attention override: Flux, "
                   "Chroma, Flux 2, Qwen-Image, Wan, SD3/SD3.5, AuraFlow, HunyuanVideo, "
                   "HunyuanImage, Lumina 2, Z-Image, LTX-Video, Cosmos, Kandinsky 5, "
                   "CogVideoX, HiDream, Mochi, OmniGen2 (docs/comfyui.md). Preset recommended: "
                   "balanced on a UNet, quality on a DiT; an input changed on the node applies "
                   "over the preset. start/end are fractions of the sampling, read in the "
                   "model's own sigmas. To merge only in a second (hires) sampler, put this "
                   "node only on that sampler's model.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        return inputs.input_types()

    def patch(self, model: Any, **values: Any) -> tuple[Any]:
        kind = model_kind(model)
        config = inputs.config(values, kind)
        line = inputs.preset_line(values, kind)
        if line:
            host.console(line)
        return (apply(model, config),)


def model_kind(model: Any) -> str:
    """``"video"`` (a video DiT family), ``"dit"`` or ``"unet"`` (also for a model the library
    cannot read: ``apply`` says so)."""
    try:
        lay = read(getattr(model, "model", None))
    except UnsupportedModelError:
        return "unet"
    if lay.dit is None:
        return "unet"
    return "video" if dits.of(lay).video else "dit"


class ToMeMeasure:
    """MODEL -> how much faster each level runs merged, per method and size: a table (STRING)
    and a plot (IMAGE). The results are the auto policy's cache: generations reuse them."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING", "IMAGE")
    RETURN_NAMES = ("table", "plot")
    FUNCTION = "measure"
    OUTPUT_NODE = True
    DESCRIPTION = ("Times each UNet level merged and unmerged on this machine, at the given "
                   "square image sizes, with each method; the auto policy merges a level from "
                   f"{1 + policy.MARGIN:.2f}x.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        return {"required": {
            "model": ("MODEL", {"tooltip": "The model to time (its UNet, on its device)."}),
            "sizes": ("STRING", {"default": measure_node.SIZES, "tooltip": (
                "Square image sizes in px, comma-separated (multiples of 8).")}),
        }, "optional": {"remeasure": measure_node.REMEASURE}}

    @classmethod
    def IS_CHANGED(cls, remeasure: bool = False, **_: Any) -> Any:  # noqa: N802 (ComfyUI's)
        """Re-measuring runs every time it is queued (NaN never equals itself), not once."""
        return float("nan") if remeasure else False

    def measure(self, model: Any, sizes: str, remeasure: bool = False) -> dict:
        text, image = measure_node.run(model, measure_node.parse_sizes(sizes),
                                       host.measuring_service(), host.load_for_sampling,
                                       remeasure)
        return {"ui": {"text": [text]}, "result": (text, image)}


NODE_CLASS_MAPPINGS = {"ToMeTokenMerging": ToMePatch, "ToMeMeasure": ToMeMeasure}
NODE_DISPLAY_NAME_MAPPINGS = {"ToMeTokenMerging": "ToMe (Token Merging)",
                              "ToMeMeasure": "ToMe Measure"}
