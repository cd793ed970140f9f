"""ToMe (Token Merging) for the AUTOMATIC1111 WebUI: only its entry points; the work is done in
``tome/webui/``. The WebUI puts the extension's folder first on ``sys.path`` while it runs this
file, so ``import tome`` finds the package next to it, unless one of that name was imported
earlier (checked below)."""

import os

from modules import script_callbacks, scripts, shared

import tome

_here = os.path.realpath(scripts.basedir())
_found = os.path.realpath(os.path.dirname(os.path.dirname(tome.__file__)))
if _found != _here:
    raise ImportError(
        f"ToMe: the Python package 'tome' was imported from {_found}, not from this extension "
        f"({_here}). Another extension or a pip package named 'tome' was loaded first: "
        "disable that extension or run 'pip uninstall tome' in the WebUI's environment.")

from tome.webui import check_torch, default_ratio, register_callbacks, runner, ui  # noqa: E402

check_torch()

DISABLED = bool(getattr(shared.cmd_opts, "tome_disable", False))
# WebUI < 1.10 has no hook right before each sampler call: patch per batch and before hires.
LEGACY = not hasattr(scripts.Script, "process_before_every_sampling")
DEFAULT_RATIO = default_ratio(getattr(shared.cmd_opts, "tome_default_ratio", None))


class ToMeScript(scripts.Script):
    """The ``ToMe`` accordion. Its title is the API's ``alwayson_scripts`` key: never change it."""

    section = "accordions"
    create_group = False
    sorting_priority = 15  # Forge: order among the accordions

    def title(self):
        return "ToMe"

    def show(self, is_img2img):
        return False if DISABLED else scripts.AlwaysVisible

    def ui(self, is_img2img):
        return ui.build(self, is_img2img, DEFAULT_RATIO)

    def before_process(self, p, *args):
        runner.before_process(p, args, img2img=self.is_img2img)

    def process(self, p, *args):
        runner.process(p, args, img2img=self.is_img2img)

    def process_before_every_sampling(self, p, *args, **kwargs):
        runner.before_sampling(p, kwargs.get("x"))

    def process_batch(self, p, *args, **kwargs):
        if LEGACY:
            runner.before_sampling(p)

    def before_hr(self, p, *args):
        if LEGACY:
            runner.before_sampling(p)

    def postprocess_batch(self, p, *args, **kwargs):
        runner.after_batch(p)

    def postprocess(self, p, processed, *args):
        runner.after_generation(p)


# Registered from here: "Reload UI" clears callbacks and re-runs this file only.
if DISABLED:
    print("ToMe: disabled for this launch (--tome-disable)")
else:
    register_callbacks()
script_callbacks.on_script_unloaded(runner.restore_all)
