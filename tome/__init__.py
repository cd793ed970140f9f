"""Token Merging for Stable Diffusion: a drop-in for ``tomesd`` that is exact, reproducible and
works on SD1/SD2 (ldm), SDXL (sgm) and diffusers UNets, and pools image keys/values in the
transformers (DiTs) of the registered families (``tome.dits``: diffusers Flux, SD3,
Qwen-Image, Wan, HunyuanVideo).

    import tome
    tome.apply_patch(pipe, ratio=0.5)        # or an ldm/sgm model, or a bare UNet
    tome.apply_patch(pipe, config=tome.preset("balanced"))  # auto policy: never slower
    tome.apply_patch(flux_pipe, method="downsample")  # DiTs: image keys/values pooled x2
    print(tome.patch_report(pipe).summary())
    tome.remove_patch(pipe)                  # outputs are bit-identical to never patched
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import adapters as _adapters
from . import brackets as _brackets
from . import config as _config
from . import patch as _patch
from .config import PRESETS, ToMeConfig, preset
from .layout import UnsupportedModelError, find_unet
from .patch import remove_tomesd
from .report import PatchReport

__version__ = "0.1.0"
__all__ = ["ToMeConfig", "PRESETS", "preset", "PatchReport", "UnsupportedModelError",
           "apply_patch", "remove_patch", "is_patched", "patch_report", "find_unet",
           "remove_tomesd", "__version__"]


def apply_patch(model: Any, ratio: float = 0.5, max_downsample: int | None = None, sx: int = 2,
                sy: int = 2, use_rand: bool = True, merge_attn: bool = True,
                merge_crossattn: bool = False, merge_mlp: bool = False, *,
                config: ToMeConfig | None = None, measure: bool | Any = True,
                **extra: Any) -> Any:
    """Patch ``model`` in place with Token Merging and return it (as ``tomesd.apply_patch``).

    ``model``: an ldm/sgm model (``.model.diffusion_model``), a diffusers pipeline (``.unet``,
    or ``.transformer`` for a DiT, and ``.transformer_2`` where a pipeline has a second one),
    or a bare ldm or diffusers UNet or DiT. On a DiT
    only ``method="downsample"`` applies: the image tokens' keys and values are pooled by
    ``downsample_factor`` in the blocks ``blocks`` names ("all", "double", "a-b"), with
    ``rope`` ("pooled" or "before") saying how rotary positions meet pooled keys
    (``tome.dit``). ``max_downsample=None`` picks the highest-resolution level
    that has transformer blocks (1 on SD1/SD2, 2 on SDXL, which has none at full resolution).
    Extra keywords are other ``ToMeConfig`` fields: ``seed``, ``method`` ("merge" or
    "downsample"), ``downsample_factor``, ``matching``, ``share`` ("level": one plan per UNet
    level and call, the default; "block": tomesd's per-block matching), ``policy`` ("fixed",
    the default, or "auto": merge a level only where it pays on the device), ``start``,
    ``end``. Pass ``config`` (e.g. ``tome.preset("balanced")``) to use a prepared
    ``ToMeConfig``; keywords given beside it (tomesd's that differ from their defaults, and
    any other) replace its fields, never silently ignored.

    ``measure`` (``auto`` policy only): at the first call of each latent size (in eager mode,
    never inside a compiled graph), time each level merged and unmerged on the model's own
    device and merge only where that is faster (``tome.measure``; cached on disk, see
    ``tome.measurements.default_cache_path``). ``False``: the device kind's token thresholds
    decide. A ``tome.measurements.Measurer`` sets where results go.

    Patching again replaces the previous patch (ours or tomesd's). Bad settings (a mistyped
    keyword too) raise ``ValueError`` and an unsupported model ``UnsupportedModelError``
    before anything changes.
    """
    _config.check_names(extra, [*_config.FIELDS, "config", "measure"])
    if not isinstance(measure, bool) and not hasattr(measure, "for_model"):
        raise ValueError(f"ToMe: invalid measure={_config.shown(measure)}: must be True, False "
                         "or a measuring service (tome.measurements.Measurer)")
    if config is not None and not isinstance(config, ToMeConfig):
        raise ValueError(f"ToMe: invalid config={_config.shown(config)}: must be a ToMeConfig "
                         "(tome.preset(name) or tome.ToMeConfig(...))")
    tomesd = dict(ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy, use_rand=use_rand,
                  merge_attn=merge_attn, merge_crossattn=merge_crossattn, merge_mlp=merge_mlp)
    if config is None:
        config = ToMeConfig(**tomesd, **extra)
    else:  # tomesd's arguments given with ``config``: those that are not their defaults
        given = {k: v for k, v in tomesd.items() if not (type(v) is type(_TOMESD[k]) and
                                                         v == _TOMESD[k])}
        if given or extra:
            config = config.replace(**given, **extra)
    measurer = None
    if config.policy == "auto" and measure is not False:
        from .measurements import Measurer
        # A service: ``measurements.Measurer`` or anything with its ``for_model``.
        measurer = measure if hasattr(measure, "for_model") else Measurer()
    report = _adapters.apply(model, config, measurer)
    # Each once per message (``warnings``' default), so re-applying per pass does not spam.
    for note in report.notes():
        warnings.warn(note, stacklevel=2)
    if report.skipped:
        warnings.warn(f"ToMe: skipped {len(report.skipped)} of {report.total_blocks} block(s): "
                      f"{report.skipped[0][1]}", stacklevel=2)
    if report.unmergeable:
        warnings.warn(report.unmergeable, stacklevel=2)
    return model


# tomesd's arguments of ``apply_patch`` and their defaults.
_TOMESD = {name: p.default for name, p in inspect.signature(apply_patch).parameters.items()
           if p.kind is p.POSITIONAL_OR_KEYWORD and name != "model"}


def remove_patch(model: Any) -> Any:
    """Remove the patch; the model's outputs are then bit-identical to the unpatched model."""
    return _adapters.remove(model)


def patch_handle(model: Any) -> _adapters.PatchHandle | None:
    """The patch on ``model`` (a pipeline, a module, a ComfyUI/Forge ModelPatcher clone) as a
    host drives it: settings as applied, limits, reuse's memory; None where none."""
    return _adapters.handle(model)


@contextmanager
def generation(model: Any, steps: int | None = None) -> Iterator[Any]:
    """One generation on a patched ``model``: what the patch keeps across steps (residual
    reuse) is dropped on entering and on leaving, also on an error or an interrupt;
    ``steps``: its step count, which paces reuse's refreshes (``ToMeConfig.paced``). Every
    host bracket opens it (a diffusers pipeline's denoising loop, ComfyUI's run callbacks,
    the WebUI's generation); open it yourself around a hand-written sampling loop or an
    unknown host's. Without it a bare model cannot tell an interrupted generation from the
    next img2img at the same size (progress going back is its only sign). diffusers' step
    caches on it (FirstBlockCache, MagCache, TaylorSeer hooks) start anew too, patched or
    not: their state would carry one image's features into the next."""
    _adapters.reset(model, steps)
    _brackets.reset_caches(model)
    try:
        yield model
    finally:
        _adapters.reset(model)
        _brackets.reset_caches(model)


def is_patched(model: Any) -> bool:
    return _patch.state_of(model) is not None


def patch_report(model: Any) -> PatchReport | None:
    """What the current patch covers (family, blocks per level, skipped blocks), or None."""
    state = _patch.state_of(model)
    return None if state is None else state.report
