"""Per-generation patching: the right patch on the loaded model before every sampling pass.

The WebUI can swap the model object mid-generation (hires checkpoint, refiner, per-batch weight
reloads) and skips ``postprocess`` when a generation fails, so nothing here trusts that a
previous step ran: every sampling pass re-applies the patch for that pass to whichever model
is current, unpatches every other model this module patched (a ``WeakSet``), and each new
generation, model load, UI reload and ``p.close()`` clears what is left.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import apply_patch, is_patched, patch_report, remove_patch
from .. import patch as _patch
from . import infotext
from .settings import ScriptSettings, check_ratio, parse_args

PLAN_ATTR = "_tome_plan"
XYZ_ATTR = "_tome_xyz"  # {setting: value} set on a plot cell's copy of ``p`` by the XYZ axes
BUILTIN_KEYS = ("token_merging_ratio", "token_merging_ratio_hr", "token_merging_ratio_img2img")

_patched: weakref.WeakSet = weakref.WeakSet()
_said_builtin = False


@dataclass
class Plan:
    """One generation's settings after the XYZ cell and the WebUI settings were applied."""

    settings: ScriptSettings
    img2img: bool
    hires: bool                    # a hires-fix pass will follow the first pass
    announced: bool = False
    skipped: str | None = None
    last_model: Any = field(default=None, repr=False)  # weakref to the model handled last

    def config(self, p: Any):
        cfg = self.settings.pass_config(hires=bool(getattr(p, "is_hr_pass", False)),
                                        img2img=self.img2img)
        return None if cfg is None else cfg.replace(seed=seed_of(p))

    def passes(self) -> str:
        s = self.settings

        def what(cfg) -> str:
            if cfg is None:
                return "off"
            return f"ratio {cfg.ratio:g}" if cfg.method == "merge" \
                else f"downsample x{cfg.downsample_factor}"
        if self.img2img:
            return f"img2img {what(s.pass_config(hires=False, img2img=True))}"
        first = f"first pass {what(s.pass_config(hires=False))}"
        return f"{first}, hires pass {what(s.pass_config(hires=True))}" if self.hires else first


# ----------------------------------------------------------------------------- hooks

def before_process(p: Any, args: Sequence[Any]) -> None:
    """Clear stale patches, validate early, keep the built-in token merging out of the way."""
    restore_all()
    model = _current_model(p)
    if model is not None and is_patched(model):  # patched by an earlier instance of this code
        remove_patch(model)
    try:
        settings = parse_args(args, getattr(p, XYZ_ATTR, None))
    except ValueError as e:
        _fail_generation(p, e)
        return
    if settings.enabled:
        _guard_close(p)
        _disable_builtin(p)


def process(p: Any, args: Sequence[Any], *, img2img: bool) -> None:
    """Read the WebUI settings (overrides are applied by now), plan the passes, write infotext."""
    _strip_infotext(p)
    setattr(p, PLAN_ATTR, None)
    xyz = getattr(p, XYZ_ATTR, None) or {}
    try:
        settings = parse_args(args, xyz)
        if not settings.enabled:
            return
        opts = _opts()
        hires_only = settings.hires_only if "hires_only" in xyz else \
            settings.hires_only or bool(getattr(opts, "tome_hires_only", False))
        hr_ratio = settings.hr_ratio or float(getattr(opts, "tome_hr_ratio", 0.0) or 0.0)
        check_ratio("hr_ratio (setting tome_hr_ratio)", hr_ratio, settings.config)
        settings = ScriptSettings(True, settings.config, hires_only, hr_ratio,
                                  settings.img2img_ratio)
    except ValueError as e:
        _fail_generation(p, e)
        return
    hires = not img2img and bool(getattr(p, "enable_hr", False))
    plan = Plan(settings, img2img=img2img, hires=hires)
    if not img2img and settings.hires_only and not hires:
        print("ToMe: 'Only in hires fix' is on but hires fix is off: nothing is merged")
    p.extra_generation_params.update(infotext.build(settings, img2img=img2img, hires=hires))
    setattr(p, PLAN_ATTR, plan)


def before_sampling(p: Any) -> None:
    """Right before a sampler runs: patch the current model for this pass, unpatch the rest."""
    plan: Plan | None = getattr(p, PLAN_ATTR, None)
    model = _current_model(p)
    for m in list(_patched):
        if m is not model:
            _unpatch(m)
    if plan is None or model is None:
        if model is not None and model in _patched:
            _unpatch(model)
        return
    plan.last_model = weakref.ref(model)
    cfg = plan.config(p)
    if cfg is None:
        _unpatch(model)
        return
    if hasattr(model, "forge_objects"):
        _patch_forge(model, plan, cfg)
        return
    reason = _unsupported(model)
    if reason is None:
        try:
            apply_patch(model, config=cfg)
        except _patch.UnsupportedModelError as e:
            reason = str(e).removeprefix("ToMe: ")
    if reason is not None:
        _skip(p, plan, reason)
        return
    _patched.add(model)
    report = patch_report(model)
    if report.skipped:
        p.extra_generation_params[infotext.SKIPPED] = (
            f"{len(report.skipped)} block(s): {report.skipped[0][1]}")
    if not plan.announced:
        plan.announced = True
        print(describe(model, report, plan, cfg.seed))


def after_generation(p: Any) -> None:
    setattr(p, PLAN_ATTR, None)
    restore_all()


def on_cfg_denoiser(params: Any) -> None:
    """Every step: patch a model switched in mid-sampling (the refiner), once per model."""
    p = getattr(getattr(params, "denoiser", None), "p", None)
    plan: Plan | None = getattr(p, PLAN_ATTR, None)
    if plan is None or plan.skipped is not None:
        return
    model = _current_model(p)
    last = plan.last_model() if plan.last_model is not None else None
    if model is not None and model is not last:
        before_sampling(p)


def on_model_loaded(sd_model: Any) -> None:
    """A load can reuse the same model object, so a stale patch would carry over: drop it."""
    restore_all()
    _unpatch(sd_model)


def restore_all() -> None:
    """Remove every patch this module made (UI reload, model load, end of a generation)."""
    for m in list(_patched):
        _unpatch(m)


# ----------------------------------------------------------------------------- helpers

def describe(model: Any, report: Any, plan: Plan, seed: int) -> str:
    """The one console line per generation that shows ToMe is working."""
    kind = next((k for k, flag in (("SDXL", "is_sdxl"), ("SD2", "is_sd2"), ("SD1", "is_sd1"))
                 if getattr(model, flag, False)), "")
    levels = ", ".join(f"ds{d}: {n}" for d, n in sorted(report.levels.items())) or "none"
    line = (f"ToMe: {kind + ' ' if kind else ''}({report.family}) {plan.passes()}; "
            f"{report.patched_blocks}/{report.total_blocks} blocks patched at downsample <= "
            f"{report.max_downsample} ({levels})")
    c = report.config
    if c.start > 0 or c.end < 1:
        line += f", steps {c.start:g}-{c.end:g}"
    if report.skipped:
        line += f"; {len(report.skipped)} block(s) skipped: {report.skipped[0][1]}"
    if c.method == "merge" and c.use_rand:
        line += f"; seed {seed}"
    return line


def seed_of(p: Any) -> int:
    """The seed of the current batch's first image, so a batch reproduces on its own."""
    for seeds in (getattr(p, "seeds", None), getattr(p, "all_seeds", None)):
        if seeds:
            return int(seeds[0])
    return int(getattr(p, "seed", 0) or 0)


def _unpatch(model: Any) -> None:
    _patched.discard(model)
    try:
        remove_patch(model)
    except _patch.UnsupportedModelError:
        pass


def _current_model(p: Any) -> Any:
    return getattr(p, "sd_model", None)


def _unsupported(model: Any) -> str | None:
    """Models the library can patch but whose blocks would never run, or that are not UNets."""
    try:
        from modules import sd_unet
        unet = getattr(sd_unet, "current_unet", None)
    except ImportError:
        unet = None
    if unet is not None:
        name = getattr(getattr(unet, "option", None), "label", None) or type(unet).__name__
        return f"an SD Unet replacement ({name}) runs instead of the PyTorch UNet"
    if getattr(model, "is_sd3", False):
        return "SD3 has no UNet transformer blocks (MMDiT)"
    return None


def _patch_forge(model: Any, plan: Plan, cfg: Any) -> None:
    """Forge rebuilds its UNet patcher before every pass: add our patches to that pass's clone."""
    from .. import forge
    unet, patch = forge.patch_unet(model.forge_objects.unet, cfg)
    model.forge_objects.unet = unet
    if patch is not None and not plan.announced:
        plan.announced = True
        what = f"ratio {cfg.ratio:g}" if cfg.method == "merge" \
            else f"downsample x{cfg.downsample_factor}"
        print(f"ToMe: Forge UNet (attn1 patch), {plan.passes()}; {what} at downsample <= "
              f"{patch.max_downsample}; seed {cfg.seed}")


def _skip(p: Any, plan: Plan, reason: str) -> None:
    if plan.skipped is None:
        plan.skipped = reason
        print(f"ToMe: skipped, the image is generated without merging: {reason}")
    p.extra_generation_params[infotext.SKIPPED] = reason


def _opts() -> Any:
    from modules import shared
    return shared.opts


def _disable_builtin(p: Any) -> None:
    """The WebUI's own token merging (tomesd) would patch the same model: set it to 0.

    Through ``override_settings``, which the WebUI applies after ``before_process`` and restores
    afterwards. If the request asks not to restore them, the ratio getter is shadowed instead,
    so the user's saved settings are never overwritten.
    """
    global _said_builtin
    opts = _opts()
    overrides = getattr(p, "override_settings", None)
    if overrides is None:
        return
    on = {k: v for k in BUILTIN_KEYS if (v := overrides.get(k, getattr(opts, k, 0)))}
    if not on:
        return
    if getattr(p, "override_settings_restore_afterwards", True):
        p.override_settings = {**overrides, **{k: 0.0 for k in BUILTIN_KEYS}}
    else:
        p.get_token_merging_ratio = lambda for_hr=False: 0.0
    if not _said_builtin:
        _said_builtin = True
        was = ", ".join(f"{k}={v}" for k, v in on.items())
        print(f"ToMe: the WebUI's built-in token merging ({was}) is off while ToMe is enabled, "
              "so the model is never merged twice")


def _strip_infotext(p: Any) -> None:
    """XYZ cells share one dict (shallow copies of ``p``): never leave another cell's keys."""
    params = p.extra_generation_params
    if any(k in params for k in infotext.ALL_KEYS):
        p.extra_generation_params = {k: v for k, v in params.items()
                                     if k not in infotext.ALL_KEYS}


def _fail_generation(p: Any, error: Exception) -> None:
    """Stop the generation with ``error`` as its message.

    The WebUI catches and only prints exceptions from script hooks, so an invalid setting
    would silently generate an unmerged image. Instead the next method the WebUI calls on
    ``p`` after ``before_process`` (the built-in ratio getter) or after ``process`` (``init``)
    raises, which fails the request (API: HTTP 500 naming the setting) before any sampling.
    """
    def fail(*args: Any, **kwargs: Any) -> None:
        raise error

    p.get_token_merging_ratio = fail
    p.init = fail


def _guard_close(p: Any) -> None:
    """Unpatch in ``p.close()``, which the WebUI calls even when the generation raised."""
    if "close" in vars(p):
        return
    close = p.close

    def close_and_restore() -> None:
        try:
            restore_all()
        finally:
            close()

    p.close = close_and_restore
