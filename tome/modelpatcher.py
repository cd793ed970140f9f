"""The ModelPatcher contract's helpers, shared by the adapters that patch through it
(``patcher.py``'s attn1 patch for UNets, ``override.py``'s ``apply_model`` wrapper and
``swap.py``'s ``model_function_wrapper`` for DiTs) and by the host layers: the mark our patch
leaves on a clone, the model's noise schedule (looked up once, by ``adapters.py``), the step
window in its sigmas, and the attn1 patch lists (ours, tomesd's, replacements).

The contract is the one the Forge family (Forge, Forge Neo, reForge, Forge Classic) and
ComfyUI share: a ``ModelPatcher`` (Forge: ``UnetPatcher``) whose ``clone()`` shares the
modules; patches live in ``model_options["transformer_options"]`` (ComfyUI, Forge Neo) or in
``patches`` (the Forge stand-in). Nothing here imports a host: ComfyUI's names for wrapper and
callback kinds (``WrappersMP``, ``CallbacksMP``) are read from its ``comfy.patcher_extension``
where the host has loaded it (``comfy_name``), 0.8.0's strings where it has not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from .config import ToMeConfig
from .plan import Window, discrete_percent_to_sigma

MARK = "_tome_sd_forge"  # set on a patcher clone that carries our patches (name kept: older
# clones in a running host still carry it)
ATTN1_LISTS = ("attn1_patch", "attn1_output_patch")


# ComfyUI's wrapper and callback kinds the pack registers under: (class, attribute) -> the
# string ComfyUI 0.8.0 and v0.30.0 use (what ``comfy_name`` answers without ComfyUI loaded).
COMFY_NAMES = {("WrappersMP", "APPLY_MODEL"): "apply_model",
               ("WrappersMP", "DIFFUSION_MODEL"): "diffusion_model",
               ("WrappersMP", "OUTER_SAMPLE"): "outer_sample",
               ("CallbacksMP", "ON_PRE_RUN"): "on_pre_run",
               ("CallbacksMP", "ON_CLEANUP"): "on_cleanup"}
PATCHER_EXTENSION = "comfy.patcher_extension"


def comfy_name(kind: str, attr: str) -> str:
    """ComfyUI's ``WrappersMP.APPLY_MODEL`` (``kind``, ``attr``) and the like, read at use
    from the host's ``comfy.patcher_extension`` where ComfyUI has loaded it (never imported
    here: the library imports no host), so a renamed value cannot leave our wrappers under a
    key ComfyUI no longer calls; 0.8.0's string (``COMFY_NAMES``) where ComfyUI is not loaded
    or lacks the name (``comfy_names_missing`` says which)."""
    found = getattr(getattr(sys.modules.get(PATCHER_EXTENSION), kind, None), attr, None)
    return found if isinstance(found, str) else COMFY_NAMES[(kind, attr)]


def comfy_names_missing() -> list[str]:
    """``WrappersMP.APPLY_MODEL``-style names the loaded ComfyUI lacks (empty where ComfyUI is
    not loaded): registered under 0.8.0's string, which that ComfyUI may never call."""
    module = sys.modules.get(PATCHER_EXTENSION)
    if module is None:
        return []
    return [f"{kind}.{attr}" for kind, attr in COMFY_NAMES
            if not isinstance(getattr(getattr(module, kind, None), attr, None), str)]


class Attn1Owner:
    """What owns our attn1 patch functions (``patcher.Attn1Patch``): told apart from
    others' patch functions by it (``is_ours``)."""


def model_sampling(unet_patcher: Any) -> Any:
    """The patched model's noise schedule object, or None: ComfyUI's ``model_sampling`` (through
    ``get_model_object``, so a ModelSampling node's shift before ours counts), the Forge
    family's ``predictor``."""
    get = getattr(unet_patcher, "get_model_object", None)
    if callable(get):
        try:
            found = get("model_sampling")
        except Exception:  # noqa: BLE001 (Forge's patcher has no such object)
            found = None
        if hasattr(found, "percent_to_sigma"):
            return found
    model = getattr(unet_patcher, "model", None)
    for name in ("model_sampling", "predictor"):
        found = getattr(model, name, None)
        if hasattr(found, "percent_to_sigma"):
            return found
    return None


def percent_to_sigma(sampling: Any) -> Callable[[float], float] | None:
    """``sampling``'s (``model_sampling``'s answer) conversion from progress to sigma."""
    return getattr(sampling, "percent_to_sigma", None)


def window_of(sampling: Any, config: ToMeConfig) -> Window | None:
    """``config``'s start/end window as the sigmas the host hands the patch, converted with the
    model's own ``percent_to_sigma`` (``sampling``, SD's discrete schedule where the model has
    none); None for the whole pass."""
    if config.start <= 0 and config.end >= 1:
        return None
    return Window.sigmas(config.start, config.end,
                         percent_to_sigma(sampling) or discrete_percent_to_sigma)


def attn1_patch_lists(unet_patcher: Any) -> list[list]:
    """The lists holding a patcher's attn1 and attn1 output patches, wherever the host keeps
    them: ComfyUI (and Forge Neo) in ``model_options["transformer_options"]["patches"]``, the
    Forge stand-in in ``patches``. Editing them edits the patcher (do it on a clone)."""
    options = getattr(unet_patcher, "model_options", None) or {}
    places = [(options.get("transformer_options") or {}).get("patches") or {},
              getattr(unet_patcher, "patches", None) or {}]
    return [place[name] for place in places if isinstance(place, dict)
            for name in ATTN1_LISTS if isinstance(place.get(name), list)]


def is_ours(fn: Any) -> bool:
    """A patch function of our attn1 adapter (a bound method of an ``Attn1Owner``)."""
    return isinstance(getattr(fn, "__self__", None), Attn1Owner)


def is_tomesd(fn: Any) -> bool:
    """A patch function of another token merging (tomesd, or ComfyUI's built-in
    ``TomePatchModel`` from ``comfy_extras.nodes_tomesd``): told by its module."""
    return not is_ours(fn) and "tomesd" in (getattr(fn, "__module__", None) or "")


def carried(unet_patcher: Any) -> tuple[list[Attn1Owner], int]:
    """What token merging a patcher already carries: our patches (each owner once) and how
    many foreign ToMe patch functions (``is_tomesd``)."""
    ours: list[Attn1Owner] = []
    foreign = 0
    for fns in attn1_patch_lists(unet_patcher):
        for fn in fns:
            if is_ours(fn) and fn.__self__ not in ours:
                ours.append(fn.__self__)
            foreign += is_tomesd(fn)
    return ours, foreign


def strip(unet_patcher: Any, which: Callable[[Any], bool]) -> int:
    """Remove the attn1 (output) patches ``which`` picks from ``unet_patcher`` (a clone: the
    lists are edited in place); how many were removed."""
    removed = 0
    for fns in attn1_patch_lists(unet_patcher):
        keep = [fn for fn in fns if not which(fn)]
        removed += len(fns) - len(keep)
        fns[:] = keep
    if removed and getattr(unet_patcher, MARK, None) is not None:
        delattr(unet_patcher, MARK)
    return removed


def attn1_replacements(unet_patcher: Any) -> Mapping:
    """``{(block, number, index): fn}``: the attn1 replacements a patcher carries."""
    options = getattr(unet_patcher, "model_options", None) or {}
    return ((options.get("transformer_options") or {}).get("patches_replace") or {}).get(
        "attn1") or {}
