"""What the WebUI host is and does: probing it, the adapter it speaks, its measuring service,
and the workarounds its contract needs.

Probing: the current model, the pass's latent size, compute device and seed, and models whose
UNet we must not patch. Patching: A1111 gets the hook adapter (``patch.py``), the Forge family
the ModelPatcher adapter (``patcher.py``; Forge Neo's DiTs: the attention swap, ``swap.py``);
all answer with one ``PatchReport``. Measuring:
the process's one ``Measurer``, its cache in the WebUI's cache folder, its progress under the
progress bar. Workarounds: stopping a generation with a clear error before anything is
sampled, unpatching in ``p.close()``, keeping the built-in token merging off, and keeping
X/Y/Z cells from sharing infotext keys. The WebUI's ``modules.*`` are imported lazily, here
and in ``measure_now.py``, ``settings_tab.py`` and ``ui.py``, so the rest of the WebUI layer
is testable without a WebUI.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .. import adapters, policy, survey
from ..config import ToMeConfig
from ..layout import UNET, UnsupportedModelError, denoiser, find_unet, read
from ..measurements import Measurer
from ..report import PatchReport
from . import infotext, narrate
from . import script_args as A

BUILTIN_KEYS = ("token_merging_ratio", "token_merging_ratio_hr", "token_merging_ratio_img2img")


# ----------------------------------------------------------------------------- probing

def opts() -> Any:
    from modules import shared
    return shared.opts


def current_model(p: Any) -> Any:
    return getattr(p, "sd_model", None)


def sdnext() -> bool:
    """SD.Next (vladmandic/automatic): a diffusers WebUI with its own token merging options
    (``token_merging_method``). Its diffusers path calls no script hook between the passes
    (no ``process_before_every_sampling``, no ``before_hr``), so the setting is chosen per UNet
    call (``runner.route``)."""
    try:
        return "token_merging_method" in opts().data_labels
    except (ImportError, AttributeError):
        return False


def denoiser_facts(model: Any) -> Any:
    """What the current model's denoiser is to the library (``Layout.facts``; the Forge
    family's through its UNet patcher); a UNet's where it cannot be read."""
    target = getattr(getattr(model, "forge_objects", None), "unet", None)
    target = getattr(target, "model", None) if target is not None else model
    try:
        return read(target).facts
    except UnsupportedModelError:
        return UNET


def denoisers(p: Any) -> list[Any]:
    """SD.Next: the UNets (or DiTs) of the base pipeline and of the refiner, where set; the
    modules themselves, since SD.Next swaps pipeline objects around the same UNet between
    passes."""
    from modules import shared
    found = []
    for pipe in (getattr(p, "sd_model", None), getattr(shared, "sd_refiner", None)):
        try:
            net = find_unet(pipe) if pipe is not None else None
        except UnsupportedModelError:
            net = None
        if net is not None and net not in found:
            found.append(net)
    return found


def seed_of(p: Any) -> int:
    """The seed of the current batch's first image, so a batch reproduces on its own."""
    for seeds in (getattr(p, "seeds", None), getattr(p, "all_seeds", None)):
        if seeds:
            return int(seeds[0])
    return int(getattr(p, "seed", 0) or 0)


def sampled_steps(p: Any, name: str) -> int | None:
    """The steps the sampler runs in pass ``name`` (``first``, ``hires``, ``img2img``), by the
    WebUI's rule (``setup_img2img_steps``, which the Forge family keeps): txt2img's
    ``steps``; the hires pass's own steps, else ``steps``; img2img's ``steps`` times the
    denoising strength, plus one, unless the ``img2img_fix_steps`` option is on. The
    sampler tells no model call its step count (Forge Neo 2.26 hands no ``sample_sigmas``),
    so this paces residual reuse (``ToMeConfig.paced``). None where ``p`` has no steps."""
    try:
        steps = int(p.steps)
        if name == "hires":
            return int(getattr(p, "hr_second_pass_steps", 0) or steps)
        if name != "img2img" or getattr(opts(), "img2img_fix_steps", False):
            return steps
        return int(min(float(p.denoising_strength), 0.999) * steps) + 1
    except (AttributeError, TypeError, ValueError):
        return None


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
        return next(denoiser(model).parameters()).device
    except Exception:  # noqa: BLE001 (no parameters, or not a UNet: the safest kind)
        return policy.FALLBACK


def unsupported(model: Any) -> str | None:
    """Why the PyTorch UNet would not run at all (an SD Unet replacement such as TensorRT), or
    None. Models without UNet transformer blocks are the model reader's to name."""
    try:
        from modules import sd_unet
        unet = getattr(sd_unet, "current_unet", None)
    except ImportError:
        unet = None
    if unet is not None:
        name = getattr(getattr(unet, "option", None), "label", None) or type(unet).__name__
        return f"an SD Unet replacement ({name}) runs instead of the PyTorch UNet"
    return None


def cache_path() -> Any:
    """Where measurements are kept: ``$TOME_CACHE_DIR``, else the WebUI's cache folder
    (``<data dir>/cache/tome/measurements.json``; SD.Next without ``--data-dir``: its own
    folder's), else the library's default."""
    try:
        from modules import paths_internal
        # SD.Next's data path is empty unless --data-dir is given: its own folder then.
        base = paths_internal.data_path or getattr(paths_internal, "script_path", "")
    except (ImportError, AttributeError):
        base = ""
    return survey.cache_file(os.path.join(base, "cache", "tome") if base else None)


_shown: list[Any] = []


def show_progress(text: str | None) -> None:
    """Show ``text`` as the WebUI's progress text (under the progress bar); None puts back
    what was there before."""
    try:
        from modules import shared
        if text is None:
            shared.state.textinfo = _shown.pop() if _shown else None
        else:
            _shown[:] = [shared.state.textinfo]
            shared.state.textinfo = text
    except (ImportError, AttributeError):
        pass


_services: list[Measurer] = []


def measuring_service() -> Measurer:
    """The process's one measuring service: its results and cache file are shared by every
    generation and by Settings > ToMe > Measure now; it speaks through ``narrate``."""
    if not _services:
        _services.append(survey.service(cache_path().parent, narrate.console, show_progress))
    return _services[0]


def measurer(cfg: ToMeConfig) -> Measurer | None:
    """The measuring service, or None where the policy does not measure or the setting
    (Settings > ToMe) turned measuring off."""
    if cfg.policy != "auto" or not bool(getattr(opts(), "tome_measure", True)):
        return None
    return measuring_service()


def forge(model: Any) -> bool:
    """A Forge-family model: its UNet is sampled through a ModelPatcher it rebuilds per pass."""
    return hasattr(model, "forge_objects")


def patch_model(model: Any, cfg: ToMeConfig, service: Measurer | None,
                callbacks: adapters.Callbacks | None = None) -> PatchReport:
    """Patch the current model for one pass with the adapter this host speaks: the Forge
    family's pass clone of its ModelPatcher (``patcher.py``; extensions after us clone ours),
    A1111's UNet in place (``patch.py``). Raises ``UnsupportedModelError`` for a model
    without UNet transformer blocks; a report whose ``nothing`` is set changed nothing."""
    if not forge(model):
        return adapters.apply(model, cfg, service)
    unet, report = adapters.patch_model_patcher(model.forge_objects.unet, cfg,
                                                lambda: model.forge_objects.unet, service,
                                                callbacks)
    model.forge_objects.unet = unet
    return report


def patch_of(model: Any) -> adapters.PatchHandle | None:
    """The handle of our patch on the current model (the Forge family: on the pass's UNet
    patcher; a DiT's names ``limits``, what this host cannot apply), or None."""
    if forge(model):
        return adapters.handle(getattr(model.forge_objects, "unet", None))
    try:
        return adapters.handle(model)
    except Exception:  # noqa: BLE001 (a model the library cannot read carries no patch)
        return None


def measurable(model: Any) -> tuple[Any, Any]:
    """``(unet, run_block)``: the UNet to time and how its blocks run merged on this host (the
    hook adapter's way, or the Forge family's patcher contract, with the model moved to the
    sampling device first). Raises ``UnsupportedModelError`` naming a model there is nothing
    to measure in."""
    reason = unsupported(model)
    if reason is not None:
        raise UnsupportedModelError(f"ToMe: {reason}")
    if not forge(model):
        layout = read(model)
        return layout, adapters.runner(layout, adapters.MODULES)
    unet_patcher = model.forge_objects.unet
    layout = read(getattr(unet_patcher, "model", None))
    load_for_sampling(unet_patcher)
    return layout, adapters.runner(layout, adapters.MODEL_PATCHER)


def load_for_sampling(unet_patcher: Any) -> None:
    """Forge family: move a UNet patcher's model to its sampling device, as sampling would
    (Forge and Forge Neo: ``backend.memory_management``; reForge and Forge Classic:
    ``ldm_patched.modules.model_management``). Best effort: where none answers, measuring
    says the UNet is not on the device."""
    for name in ("backend.memory_management", "ldm_patched.modules.model_management"):
        try:
            module = __import__(name, fromlist=["load_models_gpu"])
            module.load_models_gpu([unet_patcher])
            return
        except Exception:  # noqa: BLE001,S112 (the next family, or not loaded: said later)
            continue


def loaded_model() -> tuple[Any, str | None]:
    """``(model, None)``: the model a generation would use now, loaded the way a generation
    loads it; ``(None, why)`` where there is none. The Forge family loads the selected
    checkpoint in ``sd_models.forge_model_reload()`` at the start of every generation (before
    the first one, Forge Neo's ``shared.sd_model`` is a ``FakeInitialModel``); A1111 loads it
    when ``shared.sd_model`` is first read."""
    from modules import sd_models, shared
    reload = getattr(sd_models, "forge_model_reload", None)
    if callable(reload):
        try:
            reload()
        except Exception as e:  # noqa: BLE001 (said to the user, nothing else to do)
            return None, ("no model is loaded, and loading the selected checkpoint failed "
                          f"({type(e).__name__}: {e})")
    model = shared.sd_model
    if model is None or type(model).__name__ == "FakeInitialModel":
        return None, "no model is loaded yet (select a checkpoint, or generate once)"
    return model, None


def model_kind(model: Any) -> str:
    """``SDXL``, ``SD3``, ``SD2``, ``SD1`` from the WebUI's model flags, or ''."""
    return next((k for k, flag in (("SDXL", "is_sdxl"), ("SD3", "is_sd3"), ("SD2", "is_sd2"),
                                   ("SD1", "is_sd1")) if getattr(model, flag, False)), "")


# ----------------------------------------------------------------------------- workarounds

def fail_generation(p: Any, error: ValueError) -> ValueError:
    """Stop the generation with ``error`` as its message, before anything is sampled; returns
    the error as raised.

    The WebUI catches and only prints exceptions from script hooks, so an invalid setting
    would silently generate an unmerged image. Instead the next method the WebUI calls on
    ``p`` after ``before_process`` (the built-in ratio getter) or after ``process`` (``init``)
    raises. The error is a ``script_args.invalid`` one: the API answers it with HTTP 422 and
    prints no traceback, so the caller's line (``narrate.stopped``) is the console's only one;
    the UI shows the message.
    """
    error = A.invalid(error)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise error

    p.get_token_merging_ratio = fail
    p.init = fail
    return error


def on_close(p: Any, restore: Callable[[], None]) -> None:
    """Run ``restore`` in ``p.close()``, which the WebUI calls even when the generation
    raised."""
    if "close" in vars(p):
        return
    close = p.close

    def close_and_restore() -> None:
        try:
            restore()
        finally:
            close()

    p.close = close_and_restore


def disable_builtin(p: Any) -> dict[str, Any]:
    """The WebUI's own token merging (tomesd) would patch the same model: set it to 0, and
    return what was on (empty when nothing was).

    Through ``override_settings``, which the WebUI applies after ``before_process`` and restores
    afterwards. If the request asks not to restore them, the ratio getter is shadowed instead,
    so the user's saved settings are never overwritten.
    """
    overrides = getattr(p, "override_settings", None)
    if overrides is None:
        return {}
    o = opts()
    if sdnext():
        return _sdnext_builtin_off(p, overrides, o)
    on = {k: v for k in BUILTIN_KEYS if (v := overrides.get(k, getattr(o, k, 0)))}
    if not on:
        return {}
    if getattr(p, "override_settings_restore_afterwards", True):
        p.override_settings = {**overrides, **{k: 0.0 for k in BUILTIN_KEYS}}
    else:
        p.get_token_merging_ratio = lambda for_hr=False: 0.0
    return on


SDNEXT_METHOD = "token_merging_method"  # "None", "ToMe" (tomesd) or "ToDo", with its ratio
SDNEXT_RATIOS = {"ToMe": "tome_ratio", "ToDo": "todo_ratio"}


def _sdnext_builtin_off(p: Any, overrides: dict, o: Any) -> dict[str, Any]:
    """SD.Next applies its own ToMe or ToDo after ``before_process``, from the options it has
    then (``override_settings`` applied, and restored afterwards unless the request says
    otherwise): the method is overridden to "None" for the generation."""
    method = str(overrides.get(SDNEXT_METHOD, getattr(o, SDNEXT_METHOD, "None")) or "None")
    ratios = {k: v for k in SDNEXT_RATIOS.values() if (v := overrides.get(k, getattr(o, k, 0)))}
    if not ratios:
        return {}
    # Its infotext writes "ToDo: <todo_ratio>" whenever the method is not ToMe, merged or not:
    # the ratios go to 0 too, so the infotext names only the merging that ran (ours).
    p.override_settings = {**overrides, SDNEXT_METHOD: "None", **dict.fromkeys(ratios, 0.0)}
    ratio_key = SDNEXT_RATIOS.get(method)
    return {SDNEXT_METHOD: method, ratio_key: ratios[ratio_key]} \
        if ratio_key in ratios else {}


def strip_infotext(p: Any) -> None:
    """XYZ cells share one dict (shallow copies of ``p``): never leave another cell's keys."""
    params = p.extra_generation_params
    if any(k in params for k in infotext.ALL_KEYS):
        p.extra_generation_params = {k: v for k, v in params.items()
                                     if k not in infotext.ALL_KEYS}
