"""Per-generation patching: the right patch on the loaded model before every sampling pass.

One generation, one pass through this module: ``before_process`` parses the script arguments
once into a ``Generation``; ``process`` completes it with the WebUI settings (applied by then)
and derives each sampling pass's config once; the infotext, the console lines and the patching
all read that object.

The WebUI can swap the model object mid-generation (hires checkpoint, refiner, per-batch weight
reloads) and skips ``postprocess`` when a generation fails, so nothing here trusts that a
previous step ran: every sampling pass re-applies the patch for that pass to whichever model
is current, unpatches every other model this module patched (a ``WeakSet``), and each new
generation, model load, UI reload and ``p.close()`` clears what is left.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import apply_patch, is_patched, patch_report, policy, remove_patch
from .. import patch as _patch
from ..config import ToMeConfig
from . import infotext
from . import settings as S

GEN_ATTR = "_tome_generation"
XYZ_ATTR = "_tome_xyz"  # {setting: value} set on a plot cell's copy of ``p`` by the XYZ axes
BUILTIN_KEYS = ("token_merging_ratio", "token_merging_ratio_hr", "token_merging_ratio_img2img")
PASS_LABELS = {"first": "first pass", "hires": "hires pass", "img2img": "img2img"}

_patched: weakref.WeakSet = weakref.WeakSet()
_said_builtin = False


@dataclass
class Generation:
    """One generation's settings after the XYZ cell and the WebUI settings were applied, the
    config of each sampling pass (``passes``, derived once in ``process``), and what was
    reported so far."""

    settings: S.ScriptSettings | None  # None: invalid settings; the generation is failed
    img2img: bool
    hires: bool = False                # a hires-fix pass follows the first pass
    passes: dict[str, ToMeConfig | None] = field(default_factory=dict)
    ready: bool = False                # ``process`` ran: ``passes`` and the infotext are set
    announced: bool = False            # the one summary line was printed
    skipped: str | None = None         # why the model is not merged at all
    said: set[str] = field(default_factory=set)         # notes printed once per generation
    auto: dict[str, str] = field(default_factory=dict)  # pass -> what the auto policy chose
    forge_patches: list[Any] = field(default_factory=list, repr=False)
    last_model: Any = field(default=None, repr=False)   # weakref to the model handled last

    def pass_name(self, p: Any) -> str:
        if self.img2img:
            return "img2img"
        return "hires" if getattr(p, "is_hr_pass", False) else "first"

    def describe_passes(self) -> str:
        def what(cfg: ToMeConfig | None) -> str:
            if cfg is None:
                return "off"
            return f"ratio {cfg.ratio:g}" if cfg.method == "merge" \
                else f"downsample x{cfg.downsample_factor}"
        return ", ".join(f"{PASS_LABELS[name]} {what(cfg)}" for name, cfg in self.passes.items())


# ----------------------------------------------------------------------------- hooks

def before_process(p: Any, args: Sequence[Any], *, img2img: bool) -> None:
    """Clear stale patches, parse the arguments (the only time), keep the built-in token
    merging out of the way."""
    restore_all()
    model = _current_model(p)
    if model is not None and is_patched(model):  # patched by an earlier instance of this code
        remove_patch(model)
    gen = _parse(p, args, img2img)
    if gen.settings is not None and gen.settings.enabled:
        _guard_close(p)
        _disable_builtin(p)


def process(p: Any, args: Sequence[Any], *, img2img: bool) -> None:
    """Complete the generation with the WebUI settings (overrides are applied by now), derive
    each pass's config, write the infotext."""
    _strip_infotext(p)
    gen = getattr(p, GEN_ATTR, None)
    if not isinstance(gen, Generation):  # a host that skipped before_process
        gen = _parse(p, args, img2img)
    if gen.settings is None or not gen.settings.enabled:
        return
    xyz = getattr(p, XYZ_ATTR, None) or {}
    try:
        gen.settings = _with_options(gen.settings, xyz)
    except ValueError as e:
        gen.settings = None
        _fail_generation(p, e)
        return
    gen.hires = not img2img and bool(getattr(p, "enable_hr", False))
    gen.passes = gen.settings.passes(img2img=img2img, hires=gen.hires)
    gen.ready = True
    if not img2img and gen.settings.hires_only and not gen.hires:
        print("ToMe: 'Only in hires fix' is on but hires fix is off: nothing is merged")
    p.extra_generation_params.update(infotext.build(gen))


def before_sampling(p: Any, x: Any = None) -> None:
    """Right before a sampler runs: patch the current model for this pass, unpatch the rest.

    ``x``: the latent the sampler starts from (the hook's keyword argument), which gives the
    pass's exact size and compute device; without it (WebUI < 1.10) they come from ``p``.
    """
    gen: Generation | None = getattr(p, GEN_ATTR, None)
    model = _current_model(p)
    for m in list(_patched):
        if m is not model:
            _unpatch(m)
    if gen is None or not gen.ready or model is None:
        if model is not None and model in _patched:
            _unpatch(model)
        return
    gen.last_model = weakref.ref(model)
    name = gen.pass_name(p)
    cfg = gen.passes.get(name)
    if cfg is None:
        _unpatch(model)
        return
    cfg = cfg.replace(seed=seed_of(p))
    if hasattr(model, "forge_objects"):
        _patch_forge(p, model, gen, cfg, name, x)
        return
    reason = _unsupported(model)
    notes: list[str] = []
    if reason is None:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                apply_patch(model, config=cfg)
            notes = _library_notes(caught)
        except _patch.UnsupportedModelError as e:
            reason = str(e).removeprefix("ToMe: ")
        except Exception as e:  # noqa: BLE001 (one console line, never a failed generation)
            _unpatch(model)
            reason = f"patching failed ({type(e).__name__}: {e})"
    if reason is not None:
        _skip(p, gen, reason)
        return
    _patched.add(model)
    report = patch_report(model)
    if report.skipped:
        _note_skipped(p, gen, report.skipped)
    if not gen.announced:
        gen.announced = True
        print(describe(model, report, gen, cfg.seed))
    for note in notes:
        _say(gen, note)
    _auto_note(p, gen, name, cfg, sorted(report.levels), x, model)


def after_batch(p: Any) -> None:
    """After each batch's sampling, before its images' infotext: blocks Forge skipped."""
    gen: Generation | None = getattr(p, GEN_ATTR, None)
    if gen is not None:
        _note_forge_skips(p, gen)


def after_generation(p: Any) -> None:
    setattr(p, GEN_ATTR, None)
    restore_all()


def on_cfg_denoiser(params: Any) -> None:
    """Every step: patch a model switched in mid-sampling (the refiner), once per model."""
    p = getattr(getattr(params, "denoiser", None), "p", None)
    gen: Generation | None = getattr(p, GEN_ATTR, None)
    if gen is None or not gen.ready or gen.skipped is not None:
        return
    _note_forge_skips(p, gen)
    model = _current_model(p)
    last = gen.last_model() if gen.last_model is not None else None
    if model is not None and model is not last:
        before_sampling(p, getattr(params, "x", None))


def on_model_loaded(sd_model: Any) -> None:
    """A load can reuse the same model object, so a stale patch would carry over: drop it."""
    restore_all()
    _unpatch(sd_model)


def restore_all() -> None:
    """Remove every patch this module made (UI reload, model load, end of a generation)."""
    for m in list(_patched):
        _unpatch(m)


# ----------------------------------------------------------------------------- helpers

def describe(model: Any, report: Any, gen: Generation, seed: int) -> str:
    """The one console line per generation that shows ToMe is working."""
    kind = next((k for k, flag in (("SDXL", "is_sdxl"), ("SD2", "is_sd2"), ("SD1", "is_sd1"))
                 if getattr(model, flag, False)), "")
    levels = ", ".join(f"ds{d}: {n}" for d, n in sorted(report.levels.items())) or "none"
    line = (f"ToMe: {kind + ' ' if kind else ''}({report.family}) {gen.describe_passes()}; "
            f"{report.patched_blocks}/{report.total_blocks} blocks patched at downsample <= "
            f"{report.max_downsample} ({levels})")
    c = report.config
    if c.start > 0 or c.end < 1:
        line += f", steps {c.start:g}-{c.end:g}"
    if report.skipped:
        gen.said.add("skipped")
        line += f"; {_skipped_text(report.skipped)}"
    if c.method == "merge" and c.use_rand:
        line += f"; seed {seed}"
    return line


def seed_of(p: Any) -> int:
    """The seed of the current batch's first image, so a batch reproduces on its own."""
    for seeds in (getattr(p, "seeds", None), getattr(p, "all_seeds", None)):
        if seeds:
            return int(seeds[0])
    return int(getattr(p, "seed", 0) or 0)


def latent_size(p: Any, name: str, x: Any = None) -> tuple[int, int]:
    """(height, width) of the latent a pass samples: ``x``'s when given, else from ``p``."""
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) >= 2:
        return int(shape[-2]), int(shape[-1])
    w, h = int(getattr(p, "width", 512)), int(getattr(p, "height", 512))
    if name == "hires":
        w = int(getattr(p, "hr_upscale_to_x", 0) or w * getattr(p, "hr_scale", 1))
        h = int(getattr(p, "hr_upscale_to_y", 0) or h * getattr(p, "hr_scale", 1))
    return h // 8, w // 8


def compute_device(model: Any, x: Any = None) -> Any:
    """Where the pass runs: ``x``'s device, else the WebUI's device, else the UNet's (which may
    sit on the CPU between passes with --medvram or --lowvram)."""
    device = getattr(x, "device", None)
    if device is not None:
        return device
    try:
        from modules import devices
        return devices.device
    except (ImportError, AttributeError):
        pass
    try:
        return next(_patch.find_unet(model).parameters()).device
    except Exception:  # noqa: BLE001 (no parameters, or not a UNet: the safest kind)
        return policy.FALLBACK


def _parse(p: Any, args: Sequence[Any], img2img: bool) -> Generation:
    """The one parse of a generation's arguments, stored on ``p``."""
    try:
        settings = S.parse_args(args, getattr(p, XYZ_ATTR, None))
    except ValueError as e:
        settings = None
        _fail_generation(p, e)
    gen = Generation(settings, img2img)
    setattr(p, GEN_ATTR, gen)
    return gen


def _with_options(settings: S.ScriptSettings, xyz: dict[str, Any]) -> S.ScriptSettings:
    """The Settings-tab options (per request through ``override_settings``)."""
    opts = _opts()
    hires_only = settings.hires_only if "hires_only" in xyz else \
        settings.hires_only or bool(getattr(opts, "tome_hires_only", False))
    hr_ratio = settings.hr_ratio or float(getattr(opts, "tome_hr_ratio", 0.0) or 0.0)
    S.check_ratio("hr_ratio (setting tome_hr_ratio)", hr_ratio, settings.config)
    return settings.replace(hires_only=hires_only, hr_ratio=hr_ratio)


def _auto_note(p: Any, gen: Generation, name: str, cfg: ToMeConfig, levels: list[int],
               x: Any, model: Any) -> None:
    """Say once per pass what the auto policy will do and why (console and infotext)."""
    if cfg.policy != "auto" or name in gen.auto:
        return
    latent = latent_size(p, name, x)
    kind = policy.device_kind(compute_device(model, x))
    text = policy.summary(policy.decide(cfg, latent, levels, kind), latent)
    gen.auto[name] = f"{PASS_LABELS[name]} {text}"
    print(f"ToMe auto: {gen.auto[name]}")
    p.extra_generation_params[infotext.AUTO] = " | ".join(gen.auto.values())


def _library_notes(caught: list) -> list[str]:
    """The library's warnings while patching: its ToMe messages become console notes (skipped
    blocks are in the summary line already); any other warning is shown as usual."""
    notes = []
    for w in caught:
        text = str(w.message)
        if not text.startswith("ToMe:"):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elif not text.startswith("ToMe: skipped"):
            notes.append(text)
    return notes


def _say(gen: Generation, line: str) -> None:
    if line not in gen.said:
        gen.said.add(line)
        print(line)


def _skipped_text(skipped: list[tuple[Any, str]]) -> str:
    return f"{len(skipped)} block(s) skipped: {skipped[0][1]}"


def _note_skipped(p: Any, gen: Generation, skipped: list[tuple[Any, str]]) -> None:
    """Blocks another extension has taken over are left alone: one infotext note, and one
    console line unless the summary line already said it."""
    p.extra_generation_params[infotext.SKIPPED] = f"{len(skipped)} block(s): {skipped[0][1]}"
    if gen.announced and "skipped" not in gen.said:
        gen.said.add("skipped")
        print(f"ToMe: {_skipped_text(skipped)}; the other blocks are merged")


def _note_forge_skips(p: Any, gen: Generation) -> None:
    """Forge's patch learns while sampling which blocks another patch replaces."""
    skipped = [s for patch in gen.forge_patches for s in getattr(patch, "skipped", None) or ()]
    if skipped:
        _note_skipped(p, gen, skipped)


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


def _patch_forge(p: Any, model: Any, gen: Generation, cfg: ToMeConfig, name: str,
                 x: Any) -> None:
    """Forge rebuilds its UNet patcher before every pass: add our patches to that pass's clone."""
    from .. import forge
    original = model.forge_objects.unet
    try:
        unet, patch = forge.patch_unet(original, cfg, lambda: model.forge_objects.unet)
    except Exception as e:  # noqa: BLE001 (one console line, never a failed generation)
        _skip(p, gen, f"patching failed ({type(e).__name__}: {e})")
        return
    model.forge_objects.unet = unet
    if patch is None:
        return
    if patch not in gen.forge_patches:
        gen.forge_patches.append(patch)
    if not gen.announced:
        gen.announced = True
        what = f"ratio {cfg.ratio:g}" if cfg.method == "merge" \
            else f"downsample x{cfg.downsample_factor}"
        print(f"ToMe: Forge UNet (attn1 patch), {gen.describe_passes()}; {what} at downsample "
              f"<= {patch.max_downsample}; seed {cfg.seed}")
    _auto_note(p, gen, name, cfg, patch.levels, x, model)


def _skip(p: Any, gen: Generation, reason: str) -> None:
    if gen.skipped is None:
        gen.skipped = reason
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


def _fail_generation(p: Any, error: ValueError) -> None:
    """Stop the generation with ``error`` as its message, before anything is sampled.

    The WebUI catches and only prints exceptions from script hooks, so an invalid setting
    would silently generate an unmerged image. Instead the next method the WebUI calls on
    ``p`` after ``before_process`` (the built-in ratio getter) or after ``process`` (``init``)
    raises. The error is a ``settings.invalid`` one: the API answers it with HTTP 422 and
    prints no traceback, so the line printed here is the console's only one; the UI shows
    the message.
    """
    error = S.invalid(error)
    print(f"{error}; the generation is stopped")

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
