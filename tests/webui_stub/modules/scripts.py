"""Script loading, the ``Script`` base class and the runner that calls script hooks.

As in the WebUI: a file in an extension's ``scripts/`` is executed as a module named after its
basename with the extension root first on ``sys.path`` (and never put in ``sys.modules``);
every ``Script`` subclass in it is registered; callbacks are cleared before loading; hook errors
are reported, not raised; each hook gets ``p.script_args[args_from:args_to]``.
"""

import importlib.util
import os
import re
import sys
from collections import namedtuple

from modules import errors, script_callbacks

AlwaysVisible = object()
ScriptClassData = namedtuple("ScriptClassData", ["script_class", "path", "basedir", "module"])
scripts_data = []
_current_basedir = None


def basedir():
    return _current_basedir


class Script:
    name = None
    section = None
    filename = None
    args_from = None
    args_to = None
    alwayson = False
    is_txt2img = False
    is_img2img = False
    tabname = None
    group = None
    create_group = True
    infotext_fields = None
    paste_field_names = None
    api_info = None
    setup_for_ui_only = False
    controls = None
    sorting_priority = 0

    def title(self):
        raise NotImplementedError

    def ui(self, is_img2img):
        pass

    def show(self, is_img2img):
        return True

    def elem_id(self, item_id):
        both_tabs = self.show(True) == self.show(False)
        tab = (("img2img" if self.is_img2img else "txt2img") + "_") if both_tabs else ""
        title = re.sub(r"[^a-z_0-9]", "", re.sub(r"\s", "_", self.title().lower()))
        return f"script_{tab}{title}_{item_id}"

    # hooks: the base versions do nothing; the runner skips scripts that do not override one
    def setup(self, p, *args): pass
    def before_process(self, p, *args): pass
    def process(self, p, *args): pass
    def before_process_batch(self, p, *args, **kwargs): pass
    def process_batch(self, p, *args, **kwargs): pass
    def process_before_every_sampling(self, p, *args, **kwargs): pass
    def before_hr(self, p, *args): pass
    def postprocess_batch(self, p, *args, **kwargs): pass
    def postprocess(self, p, processed, *args): pass


HOOKS = ("setup", "before_process", "process", "before_process_batch", "process_batch",
         "process_before_every_sampling", "before_hr", "postprocess_batch")


def load_scripts(extension_roots, extra=()):
    """Load every ``scripts/*.py`` of the given extension roots; ``extra``: prepared entries."""
    global _current_basedir
    script_callbacks.clear_callbacks()
    scripts_data.clear()
    scripts_data.extend(extra)
    for root in extension_roots:
        folder = os.path.join(root, "scripts")
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if not name.endswith(".py") or not os.path.isfile(path):
                continue
            saved = sys.path
            sys.path = [root] + sys.path
            _current_basedir = root
            try:
                spec = importlib.util.spec_from_file_location(os.path.basename(path), path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                for obj in vars(module).values():
                    if isinstance(obj, type) and issubclass(obj, Script):
                        scripts_data.append(ScriptClassData(obj, path, root, module))
            except Exception:  # noqa: BLE001 (the WebUI reports hook errors, never raises)
                errors.report(f"Error loading script: {name}", exc_info=True)
            finally:
                sys.path = saved
                _current_basedir = None


class ScriptRunner:
    def __init__(self):
        self.scripts, self.alwayson_scripts = [], []
        self.inputs = [None]
        self.paste_field_names = []
        self.infotext_fields = []

    def initialize_scripts(self, is_img2img):
        for data in scripts_data:
            if data.script_class is Script or not issubclass(data.script_class, Script):
                continue
            script = data.script_class()
            script.filename = data.path
            script.is_txt2img, script.is_img2img = not is_img2img, is_img2img
            script.tabname = "img2img" if is_img2img else "txt2img"
            visibility = script.show(is_img2img)
            if visibility is AlwaysVisible:
                script.alwayson = True
                self.scripts.append(script)
                self.alwayson_scripts.append(script)
            elif visibility:
                self.scripts.append(script)

    def setup_ui(self):
        """Call every ``ui()`` once (inside the caller's ``gr.Blocks``) and lay out the args."""
        for script in self.scripts:
            script.name = script.title().lower()
            script.args_from = len(self.inputs)
            controls = script.ui(script.is_img2img) or []
            script.controls = controls
            self.inputs += controls
            script.args_to = len(self.inputs)
            if script.infotext_fields is not None:
                self.infotext_fields += script.infotext_fields
            if script.paste_field_names is not None:
                self.paste_field_names += script.paste_field_names

    def _call(self, hook, p, *extra, **kwargs):
        for script in self.alwayson_scripts:
            if getattr(type(script), hook) is getattr(Script, hook, None) \
                    or not hasattr(Script, hook):  # a hook this WebUI version does not have
                continue
            try:
                args = p.script_args[script.args_from:script.args_to]
                if hook == "postprocess":
                    script.postprocess(p, extra[0], *args)
                else:
                    getattr(script, hook)(p, *args, **kwargs)
            except Exception:  # noqa: BLE001 (the WebUI reports hook errors, never raises)
                errors.report(f"Error running {hook}: {script.filename}", exc_info=True)

    def setup_scrips(self, p, *, is_ui=True):
        self._call("setup", p)

    def before_process(self, p): self._call("before_process", p)
    def process(self, p): self._call("process", p)
    def before_process_batch(self, p, **kw): self._call("before_process_batch", p, **kw)
    def process_batch(self, p, **kw): self._call("process_batch", p, **kw)
    def before_hr(self, p): self._call("before_hr", p)
    def postprocess_batch(self, p, images, **kw):
        self._call("postprocess_batch", p, images=images, **kw)
    def postprocess(self, p, processed): self._call("postprocess", p, processed)

    def process_before_every_sampling(self, p, **kw):
        self._call("process_before_every_sampling", p, **kw)

    def run(self, p, *args):
        return None  # no dropdown script selected
