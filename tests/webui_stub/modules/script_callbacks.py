"""Callback registries (``on_*``) and the functions the host calls to run them."""

from collections import defaultdict

from modules import errors

callbacks = defaultdict(list)


class CFGDenoiserParams:
    def __init__(self, x, image_cond, sigma, sampling_step, total_sampling_steps, text_cond,
                 text_uncond, denoiser=None):
        self.x, self.image_cond, self.sigma = x, image_cond, sigma
        self.sampling_step, self.total_sampling_steps = sampling_step, total_sampling_steps
        self.text_cond, self.text_uncond, self.denoiser = text_cond, text_uncond, denoiser


def clear_callbacks():
    callbacks.clear()


def _add(kind, fn, name=None):
    callbacks[kind].append(fn)


def _run(kind, *args):
    for fn in list(callbacks[kind]):
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 (the WebUI reports hook errors, never raises)
            errors.report(f"Error executing callback {kind}", exc_info=True)


def on_model_loaded(fn, *, name=None): _add("model_loaded", fn, name)
def on_ui_settings(fn, *, name=None): _add("ui_settings", fn, name)
def on_cfg_denoiser(fn, *, name=None): _add("cfg_denoiser", fn, name)
def on_script_unloaded(fn, *, name=None): _add("script_unloaded", fn, name)
def on_before_ui(fn, *, name=None): _add("before_ui", fn, name)
def on_infotext_pasted(fn, *, name=None): _add("infotext_pasted", fn, name)
def on_app_started(fn, *, name=None): _add("app_started", fn, name)


def model_loaded_callback(sd_model): _run("model_loaded", sd_model)
def ui_settings_callback(): _run("ui_settings")
def cfg_denoiser_callback(params): _run("cfg_denoiser", params)
def before_ui_callback(): _run("before_ui")
def app_started_callback(demo, app): _run("app_started", demo, app)


def script_unloaded_callback():
    for fn in reversed(list(callbacks["script_unloaded"])):
        try:
            fn()
        except Exception:  # noqa: BLE001 (the WebUI reports hook errors, never raises)
            errors.report("Error executing callback script_unloaded", exc_info=True)
