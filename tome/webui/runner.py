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

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import adapters, is_patched, methods, policy, remove_patch
from ..config import ToMeConfig
from ..layout import UnsupportedModelError
from ..report import PatchReport
from . import host, infotext, narrate
from . import script_args as A

GEN_ATTR = "_tome_generation"

_patched: weakref.WeakSet = weakref.WeakSet()


@dataclass
class Generation:
    """One generation's settings after the XYZ cell and the WebUI settings were applied, the
    config of each sampling pass (``passes``, derived once in ``process``), and what was
    said so far (``voice``)."""

    settings: A.ScriptSettings | None  # None: invalid settings; the generation is failed
    img2img: bool
    hires: bool = False                # a hires-fix pass follows the first pass
    passes: dict[str, ToMeConfig | None] = field(default_factory=dict)
    ready: bool = False                # ``process`` ran: ``passes`` and the infotext are set
    voice: narrate.Voice = field(default_factory=narrate.Voice)
    # The passes' patch reports: the ModelPatcher adapter learns skipped blocks while sampling.
    reports: list[PatchReport] = field(default_factory=list, repr=False)
    windows: dict[str, Any] = field(default_factory=dict, repr=False)  # pass -> plan.Window
    routed: dict[int, str] = field(default_factory=dict, repr=False)  # SD.Next: UNet -> pass
    last_model: Any = field(default=None, repr=False)   # weakref to the model handled last
    # The per-call core's patches of the passes sampling now (Forge Neo's swap): (pass, patch,
    # its counts and tallies at the pass's start), told when the pass ends (``_tally``).
    tallied: list[tuple[str, Any, Any]] = field(default_factory=list, repr=False)

    def pass_name(self, p: Any) -> str:
        if self.img2img:
            return "img2img"
        if getattr(p, "is_refiner_pass", False):  # SD.Next: a refiner pass after the others
            return "hires" if self.hires else "first"
        return "hires" if getattr(p, "is_hr_pass", False) else "first"


# ----------------------------------------------------------------------------- hooks

def before_process(p: Any, args: Sequence[Any], *, img2img: bool) -> None:
    """Clear stale patches, parse the arguments (the only time), keep the built-in token
    merging out of the way."""
    restore_all()
    model = host.current_model(p)
    if model is not None and is_patched(model):  # patched by an earlier instance of this code
        remove_patch(model)
    gen = _parse(p, args, img2img)
    if gen.settings is not None and gen.settings.enabled:
        host.on_close(p, restore_all)
        narrate.builtin_off(host.disable_builtin(p))


def process(p: Any, args: Sequence[Any], *, img2img: bool) -> None:
    """Complete the generation with the WebUI settings (overrides are applied by now), derive
    each pass's config, write the infotext."""
    host.strip_infotext(p)
    gen = getattr(p, GEN_ATTR, None)
    if not isinstance(gen, Generation):  # a host that skipped before_process
        gen = _parse(p, args, img2img)
    if gen.settings is None or not gen.settings.enabled:
        return
    xyz = getattr(p, A.XYZ_ATTR, None) or {}
    try:
        gen.settings = _with_options(gen.settings, xyz)
    except ValueError as e:
        gen.settings = None
        _fail(p, e)
        return
    gen.hires = not img2img and bool(getattr(p, "enable_hr", False))
    gen.passes = gen.settings.passes(img2img=img2img, hires=gen.hires)
    gen.ready = True
    if not img2img and gen.settings.hires_only and not gen.hires:
        narrate.hires_only_without_hires()
    p.extra_generation_params.update(infotext.build(gen.settings, gen.passes,
                                                    host.denoiser_facts(host.current_model(p)).ignores))


def before_sampling(p: Any, x: Any = None) -> None:
    """Right before a sampler runs: patch the current model for this pass, unpatch the rest.

    ``x``: the latent the sampler starts from (the hook's keyword argument), which gives the
    pass's exact size and compute device; without it (WebUI < 1.10) they come from ``p``.
    """
    gen: Generation | None = getattr(p, GEN_ATTR, None)
    if host.sdnext():
        route(p)
        return
    model = host.current_model(p)
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
    _patch(p, model, gen, cfg.replace(seed=host.seed_of(p)), name, x)
    patch = host.patch_of(model) if model in _patched else None
    if patch is not None:  # a pass's start: nothing kept, reuse paced to the pass's steps
        patch.reset(host.sampled_steps(p, name))


def after_batch(p: Any) -> None:
    """After each batch's sampling, before its images' infotext: blocks skipped meanwhile."""
    gen: Generation | None = getattr(p, GEN_ATTR, None)
    if gen is not None:
        _tally(gen)
        _skips(p, gen)
        gen.voice.window_steps(p, gen.windows)


def after_generation(p: Any) -> None:
    setattr(p, GEN_ATTR, None)
    restore_all()


def on_cfg_denoiser(params: Any) -> None:
    """Every step: patch a model switched in mid-sampling (the refiner), once per model."""
    p = getattr(getattr(params, "denoiser", None), "p", None)
    gen: Generation | None = getattr(p, GEN_ATTR, None)
    if gen is None or not gen.ready or gen.voice.skipped is not None:
        return
    _skips(p, gen)
    model = host.current_model(p)
    last = gen.last_model() if gen.last_model is not None else None
    if model is not None and model is not last:
        before_sampling(p, getattr(params, "x", None))


def on_model_loaded(sd_model: Any) -> None:
    """A load can reuse the same model object, so a stale patch would carry over: drop it."""
    restore_all()
    _unpatch(sd_model)


def restore_all() -> None:
    """Remove every patch and router this module made (UI reload, model load, end of a
    generation)."""
    while _routers:
        _routers.pop().remove()
    for m in list(_patched):
        _unpatch(m)
    adapters.flush()


# SD.Next: the routers' hook handles, one per UNet, for the generation.
_routers: list[Any] = []


def route(p: Any) -> None:
    """SD.Next: no hook runs between its passes, so each UNet (base and refiner) gets a router
    that, at the first call of each pass (``p.is_hr_pass``, ``p.is_refiner_pass``), patches
    it with that pass's setting, or unpatches it where the pass merges nothing."""
    gen: Generation | None = getattr(p, GEN_ATTR, None)
    if gen is None or not gen.ready:
        return
    for unet in host.denoisers(p):
        if any(getattr(h, "unet", None) is unet for h in _routers):
            continue
        handle = unet.register_forward_pre_hook(
            lambda module, args, kwargs: _routed(p, module, args, kwargs), with_kwargs=True,
            prepend=True)
        handle.unet = unet
        _routers.append(handle)


def _routed(p: Any, unet: Any, args: tuple, kwargs: dict) -> None:
    gen: Generation | None = getattr(p, GEN_ATTR, None)
    if gen is None or not gen.ready:
        return
    name = gen.pass_name(p)
    if gen.routed.get(id(unet)) == name:
        return
    gen.routed[id(unet)] = name
    _patched.discard(unet)
    adapters.remove(unet, during_call=True)
    cfg = gen.passes.get(name)
    if cfg is None:
        return
    x = args[0] if args else kwargs.get("sample")
    _patch(p, unet, gen, cfg.replace(seed=host.seed_of(p)), name, x,
           host.model_kind(host.current_model(p)))
    adapters.begin_call(unet, args, kwargs)  # torch holds the call's old hooks: start ours


# ----------------------------------------------------------------------------- helpers

def _parse(p: Any, args: Sequence[Any], img2img: bool) -> Generation:
    """The one parse of a generation's arguments, stored on ``p``."""
    try:
        settings = A.parse_args(args, getattr(p, A.XYZ_ATTR, None))
    except ValueError as e:
        settings = None
        _fail(p, e)
    gen = Generation(settings, img2img)
    setattr(p, GEN_ATTR, gen)
    return gen


def _fail(p: Any, error: ValueError) -> None:
    narrate.stopped(host.fail_generation(p, error))


def _with_options(settings: A.ScriptSettings, xyz: dict[str, Any]) -> A.ScriptSettings:
    """The Settings-tab options (per request through ``override_settings``)."""
    opts = host.opts()
    hires_only = settings.hires_only if "hires_only" in xyz else \
        settings.hires_only or bool(getattr(opts, "tome_hires_only", False))
    hr_ratio = settings.hr_ratio or float(getattr(opts, "tome_hr_ratio", 0.0) or 0.0)
    A.check_extra_ratio("hr_ratio (setting tome_hr_ratio)", hr_ratio, settings.config)
    return settings.replace(hires_only=hires_only, hr_ratio=hr_ratio)


def _skips(p: Any, gen: Generation) -> None:
    """Blocks left alone in this generation; the ModelPatcher adapter learns them while
    sampling (another patch replaces their attn1)."""
    skipped = {(str(b), why): (b, why) for r in gen.reports for b, why in r.skipped}
    gen.voice.skipped_blocks(p, list(skipped.values()))


def _track(gen: Generation, name: str, patch: Any) -> None:
    """A pass of a DiT patch, which counts its attention calls (Forge Neo's swap, A1111's
    SD3 processors): the pass before it has ended, so its line is told now."""
    if patch is None or not patch.per_call or any(m == patch for _, m, _ in gen.tallied):
        return
    _tally(gen)
    gen.tallied.append((name, patch, patch.since()))


def _tally(gen: Generation) -> None:
    """After a pass: the line ComfyUI's node prints after each sampling, once per pass: why
    nothing was pooled (a never-reached swap said so at its first call), or how many
    attention calls were pooled and what the rest were. An interrupted pass says nothing."""
    while gen.tallied:
        name, patch, since = gen.tallied.pop(0)
        whole = patch.reached(since) or not patch.said_silent()
        gen.voice.tally(name, patch.after(since) if whole else patch.tally(since))


def _unpatch(model: Any) -> None:
    _patched.discard(model)
    try:
        remove_patch(model)
    except UnsupportedModelError:
        pass


def _patch(p: Any, model: Any, gen: Generation, cfg: ToMeConfig, name: str, x: Any,
           kind: str | None = None) -> None:
    """Patch the current model for this pass (``host.patch_model``: the adapter this host
    speaks), then say what was done: one summary line, or why nothing is merged."""
    reason = host.unsupported(model)
    report = None
    # a never-reached patch is said at its first call (Forge Neo's swap)
    callbacks = adapters.Callbacks(on_silent=lambda: gen.voice.say(
        host.patch_of(model).silent))
    if reason is None:
        try:
            report = host.patch_model(model, cfg, host.measurer(cfg), callbacks)
        except UnsupportedModelError as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 (one console line, never a failed generation)
            _unpatch(model)
            reason = f"patching failed ({type(e).__name__}: {e})"
    if report is not None and report.nothing:  # e.g. max_downsample 1 on SDXL: claim no merge
        _unpatch(model)
        reason = report.nothing
    if reason is not None:
        gen.voice.skip_model(p, reason.removeprefix("ToMe: "))
        return
    _patched.add(model)
    if report not in gen.reports:
        gen.reports.append(report)
    if not report.planner.window.full:
        gen.windows[name] = report.planner.window
    _skips(p, gen)
    _track(gen, name, host.patch_of(model))
    seeded = methods.get(cfg.method).seeded(cfg)
    kind = host.model_kind(model) if kind is None else kind  # SD.Next: the pipeline's flags
    gen.voice.summary(narrate.head(kind, report), gen.passes, report.coverage(),
                      report.skipped, cfg.seed if seeded else None,
                      getattr(report.facts, "runs", None))
    for note in report.notes():
        gen.voice.say(note)
    text = report.facts.describe(report.config)  # a DiT's: what a preset resolved to on it
    if text:
        gen.voice.dit_resolved(p, name, text)
        patch = host.patch_of(model)
        if patch is not None and patch.limits:
            gen.voice.say(f"ToMe DiT: not applied on this host: {', '.join(patch.limits)}")
    if cfg.policy == "auto":  # the planner tells its decisions as soon as it knows them
        planner = report.planner
        planner.on_decided = lambda size, decisions: gen.voice.auto_choice(
            p, name, cfg, size, decisions)
        planner.announce(host.latent_size(p, name, x),
                         policy.device_kind(host.compute_device(model, x)))
