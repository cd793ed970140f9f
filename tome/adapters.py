"""The one choice of adapter: from what a model is (its ``Layout``) and what its host offers.

Five adapters reach a model's blocks: forward hooks on a UNet (``patch.py``), attention
processors on a diffusers or A1111 DiT (``processors.py``), the ModelPatcher's attn1 patch
of the Forge family and ComfyUI for UNets (``patcher.py``), and for DiTs behind a
ModelPatcher the per-call core (``percall.py``) through two shims: ComfyUI's attention
override (``override.py``, installed per model call by an ``apply_model`` wrapper) and Forge
Neo's attention functions swapped per model call (``swap.py``); a family of either host's
models names its patch point itself (``Family.host``: ``comfy_spans``, ``neo_form``). The
model's noise schedule (``modelpatcher.model_sampling``) is looked up here, once, and handed
down.
Which one patches a model, and how its blocks run merged when measured, is decided here and
nowhere else, from the layout and the host's contract: plain modules (A1111, SD.Next,
diffusers, the library) or a ModelPatcher. The library's ``apply_patch``, the WebUI's patching
and Measure now and the ComfyUI nodes all ask this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from . import (
    dits,
    modelpatcher,
    override,
    patch,
    patcher,
    percall,
    percall_runner,
    processors,
    swap,
)
from .config import ToMeConfig
from .dits.family import COMFYUI, FORGE_NEO, INVOKEAI
from .handle import Callbacks, PatchHandle
from .layout import Layout, read, uncompiled
from .report import STATE_ATTR, PatchReport

MODULES, MODEL_PATCHER = "modules", "model patcher"


def runner(layout: Layout, contract: str = MODULES, reuse: Any = 0) -> Callable | None:
    """How a block of this model runs merged for measuring under ``contract``: the hooks' or
    the processors' runner for plain modules, the patch contract's for a ModelPatcher's UNet,
    the per-call core's (``percall_runner``: ComfyUI's backend, or Forge Neo's kernel) for a
    DiT behind a ModelPatcher; None where the contract cannot time the model (a DiT family
    neither form knows: the auto policy's token thresholds decide there). ``reuse``: the
    settings' N (or a callable giving the period the generation will run,
    ``Counts.refresh_period``), whose refresh share a per-call runner times too."""
    if contract == MODEL_PATCHER:
        if layout.dit is None:
            return patcher.run_block
        if neo_form(layout.family) is not None:
            return percall_runner.runner(swap.KERNEL, reuse)
        if comfy_spans(layout.family) is not None:
            return percall_runner.runner(override.COMFY_KERNEL, reuse)
        return None
    return processors.runner(layout) if layout.dit is not None else patch.run_block


def apply(model: Any, config: ToMeConfig, measurer: Any = None) -> PatchReport:
    """Patch a model held as plain modules (anything ``layout.read`` reads) in place: hooks on
    a UNet, processors on a DiT; any earlier patch of ours is removed first. A pipeline's
    second transformer (``transformer_2``: Wan 2.2 A14B's low-noise expert, which runs the
    later steps) gets the same patch. Atomic: on any error nothing stays patched."""
    layout = read(model)
    second = _second(model)
    remove(layout.root)
    form = invoke_form(layout.family) if layout.dit is not None else None
    if form is not None:  # blocks calling a module-level attention: the swap, its own bracket
        report = swap.patch_module(layout.root, layout, form, config)
    elif layout.dit is not None:
        report = processors.apply(model, layout, config, measurer)
    else:
        report = patch.apply(model, config, measurer, layout)
    if second is not None:
        try:
            apply(second, config, measurer)
        except BaseException:
            remove(layout.root)
            raise
        _experts(layout.root, patch.patched_root(second))
    return report


def _experts(first: nn.Module, second: nn.Module) -> None:
    """Two experts of one pipeline take turns (Wan 2.2 A14B: the second runs the later
    steps): each one's residual reuse frees the other's residuals when its generation starts,
    so the two never hold theirs at once (``budget.ReuseBudget.partner``)."""
    a, b = (getattr(vars(m).get(STATE_ATTR), "budget", None) for m in (first, second))
    if a is not None and b is not None:
        a.partner, b.partner = b, a


def _second(model: Any) -> nn.Module | None:
    """A diffusers pipeline's second transformer, or None."""
    second = uncompiled(getattr(model, "transformer_2", None))
    return second if isinstance(second, nn.Module) and not isinstance(model, nn.Module) \
        else None


def remove(model: Any, during_call: bool = False) -> Any:
    """Remove our patch, whichever adapter on plain modules made it; the model's outputs are
    then bit-identical to never patched.

    ``during_call``: from inside the model's own forward pre-hooks (SD.Next switches the
    setting per pass at a call). torch holds that call's hooks and calls a keyword hook
    removed meanwhile without its keywords, so the patch's call hook (registered first) stays,
    inert, until ``flush`` after the generation."""
    if (second := _second(model)) is not None:
        remove(second, during_call)
    forge = getattr(getattr(getattr(model, "forge_objects", None), "unet", None),
                    modelpatcher.MARK, None)
    if isinstance(forge, percall.Core):  # a generation's end: what its reuse kept goes
        forge.reset()
    root = patch.patched_root(model)
    state = vars(root).get(STATE_ATTR)
    if during_call and getattr(state, "handles", None):
        _parked.append(state.handles.pop(0))
    if not processors.remove(root) and not swap.unpatch_module(root):
        patch.remove(root)
    return model


def reset(model: Any, steps: int | None = None) -> None:
    """Drop what our patch on ``model`` keeps across steps (a generation's start or end):
    a pipeline's transformers, a module, a ModelPatcher clone, a Forge model's pass patcher;
    ``steps``: the coming generation's step count, where known (``PatchHandle.reset``)."""
    for m in (model, _second(model),
              getattr(getattr(model, "forge_objects", None), "unet", None)):
        found = handle(m) if m is not None else None
        if found is not None:
            found.reset(steps)


_parked: list[Any] = []  # call hooks of patches removed during a call (``remove``)


def begin_call(model: Any, args: tuple, kwargs: dict) -> None:
    """Start the current call on a patch applied inside that call's own pre-hooks (torch runs
    the hooks it held when the call began, so the new patch's call hook would miss it)."""
    state = vars(patch.patched_root(model)).get(STATE_ATTR)
    if state is not None:
        state.hooks.call_pre(None, args, kwargs)


def flush() -> None:
    """Remove the inert call hooks that removals during a call left (after a generation)."""
    while _parked:
        _parked.pop().remove()


def patch_model_patcher(unet_patcher: Any, config: ToMeConfig,
                        sampling_patcher: Callable[[], Any] | None = None,
                        measurer: Any = None, callbacks: Callbacks | None = None
                        ) -> tuple[Any, PatchReport]:
    """A ModelPatcher clone carrying our patch, and the report: the attn1 patch
    (``patcher.py``) with its measuring runner on a UNet; on a DiT the per-call core through
    Forge Neo's swap or ComfyUI's override (a DiT neither reaches passes through with the
    report's ``nothing``). A patcher that already carries ours is returned with its report
    (Forge may patch one pass twice). ``callbacks``: the host's (``handle.Callbacks``),
    given to the patch; ``handle(clone)`` is what the host then drives it by."""
    done = getattr(unet_patcher, modelpatcher.MARK, None)
    if done is not None:
        return unet_patcher, done.report
    clone, report = _patch_model_patcher(unet_patcher, config, sampling_patcher, measurer)
    found = handle(clone)
    if callbacks is not None and found is not None and clone is not unet_patcher:
        found.attach(callbacks)
    return clone, report


def handle(model: Any) -> PatchHandle | None:
    """The handle of our patch (``PatchHandle``) on a ModelPatcher clone or on a model held
    as plain modules (a pipeline, a transformer, a UNet), or None."""
    mark = getattr(model, modelpatcher.MARK, None)
    if mark is not None and getattr(mark, "report", None) is not None:
        return PatchHandle(mark, mark.report, isinstance(mark, percall.Core))
    if model is None or mark is not None:
        return None
    state = patch.state_of(model)
    return None if state is None else PatchHandle(state, getattr(state, "report", None),
                                                  hasattr(state, "tallies"))


NOT_TIMED = patcher.NOT_TIMED  # why a host's DiT blocks are not timed (Measure now's line)
# ComfyUI's wrapper and callback kinds as the loaded ComfyUI names them (the host layer's too)
comfy_name, comfy_names_missing = modelpatcher.comfy_name, modelpatcher.comfy_names_missing


def carried(unet_patcher: Any) -> tuple[bool, bool]:
    """What token merging a ModelPatcher already carries: ours (an earlier ToMe node's attn1
    patch or apply_model wrapper), and another's (ComfyUI's built-in TomePatchModel)."""
    ours, foreign = modelpatcher.carried(unet_patcher)
    return bool(ours) or override.carried(unet_patcher), bool(foreign)


def strip_merging(unet_patcher: Any) -> None:
    """Remove every token merging from ``unet_patcher`` (a clone): ours and tomesd's attn1
    patches, our apply_model wrapper."""
    modelpatcher.strip(unet_patcher,
                       lambda f: modelpatcher.is_ours(f) or modelpatcher.is_tomesd(f))
    override.strip(unet_patcher)


def without_tomesd(options: dict) -> dict | None:
    """``transformer_options`` without another token merging's attn1 patches (ComfyUI's
    built-in TomePatchModel added after ours), or None where it has none."""
    patches = options.get("patches") or {}
    lists = {n: patches[n] for n in modelpatcher.ATTN1_LISTS if n in patches}
    if not any(modelpatcher.is_tomesd(fn) for fns in lists.values() for fn in fns):
        return None
    kept = {n: [fn for fn in fns if not modelpatcher.is_tomesd(fn)] for n, fns in lists.items()}
    return {**options, "patches": {**patches, **kept}}


def _patch_model_patcher(unet_patcher: Any, config: ToMeConfig,
                         sampling_patcher: Callable[[], Any] | None,
                         measurer: Any) -> tuple[Any, PatchReport]:
    layout = read(getattr(unet_patcher, "model", None))
    sampling = modelpatcher.model_sampling(unet_patcher)
    if layout.dit is not None:
        convert = modelpatcher.percent_to_sigma(sampling)
        form = neo_form(layout.family)
        if form is not None:
            done = swap.patch(unet_patcher, layout, form, config, convert)
            return _measured(done, layout, measurer)
        spans = comfy_spans(layout.family)
        if spans is not None and hasattr(unet_patcher, "add_wrapper_with_key"):
            done = override.patch(unet_patcher, layout, config, spans, convert)
            return _measured(done, layout, measurer)
        report = PatchReport.of(layout, config, override.ADAPTER)
        report.unmergeable = report.unmergeable or (
            f"ToMe: this host offers no per-call form for a {layout.family} DiT (ComfyUI "
            "0.3.60 or later, Forge Neo), so nothing is pooled")
        return unet_patcher, report
    return patcher.patch_unet(unet_patcher, layout, config, sampling_patcher, measurer,
                              runner(layout, MODEL_PATCHER), sampling)


def _measured(done: tuple[Any, PatchReport], layout: Layout, measurer: Any
              ) -> tuple[Any, PatchReport]:
    """A per-call DiT patch whose planner measures (``auto``) through ``runner``: once per
    size, at its first call, with the settings as the form applies them."""
    planner = done[1].planner
    if measurer is not None and planner is not None and not done[1].nothing \
            and planner.config.policy == "auto":
        core = getattr(done[0], modelpatcher.MARK, None)  # the period it will run
        period = core.refresh_period if planner.config.reuse and core is not None else 0
        planner.measurer = measurer.for_model(layout.root, planner.config,
                                              runner(layout, MODEL_PATCHER, period))
        planner.variant = period or None  # a new period measures again
    return done


# ----------------------------------------------------------------------------- host points

_forms: dict[Any, Any] = {}  # a family's HostPoint -> what its host's shim needs of it


def _form(host: str, family: str, make: Callable) -> Any:
    """What the host's shim needs of a registered family whose ``host`` point is ``host``
    (made once per point), or None: the family is not reached through that host's point."""
    found = dits.REGISTRY.get(family)
    point = getattr(found, "host", None)
    if point is None or point.host != host:
        return None
    if point not in _forms:
        _forms[point] = make(point)
    return _forms[point]


def comfy_spans(family: str) -> Callable | None:
    """A ComfyUI family's reading of a model call (``Spans``), or None."""
    return _form(COMFYUI, family, lambda p: override.spans_of(p.spans))


def neo_form(family: str) -> swap.Form | None:
    """A Forge Neo family's attention globals to swap and its call reading, or None."""
    return _form(FORGE_NEO, family, lambda p: swap.Form.of(p.points, p.spans))


def invoke_form(family: str) -> swap.Form | None:
    """An InvokeAI family's attention globals to swap and its call reading, or None."""
    return _form(INVOKEAI, family, lambda p: swap.Form.of(p.points, p.spans))
