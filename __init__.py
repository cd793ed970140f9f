"""ToMe (Token Merging) as a ComfyUI custom node pack: only its entry point; the nodes are in
``tome/comfy/``.

ComfyUI imports this folder as a module (``custom_nodes/<folder>/__init__.py``) without putting
it on ``sys.path``, so the package ``tome`` next to this file is loaded by its path (nothing
else of this repository becomes importable). A module named ``tome`` imported earlier from
elsewhere (another node pack, or a pip package) is refused with a clear message instead of
running someone else's code. The AUTOMATIC1111 WebUI never imports this file (its entry point is
``scripts/token_merging.py``); ComfyUI serves ``web/`` (``WEB_DIRECTORY``) to its frontend.
The nodes are ComfyUI V3 nodes where ComfyUI has that schema, classic ones elsewhere
(``tome.comfy.entry_points``).
"""

import importlib.util
import os
import sys


def _load_tome():
    here = os.path.join(os.path.dirname(os.path.realpath(__file__)), "tome")
    module = sys.modules.get("tome")
    if module is None:
        spec = importlib.util.spec_from_file_location(
            "tome", os.path.join(here, "__init__.py"), submodule_search_locations=[here])
        module = importlib.util.module_from_spec(spec)
        sys.modules["tome"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["tome"]
            raise
    found = os.path.realpath(os.path.dirname(getattr(module, "__file__", "") or ""))
    if found != here:
        raise ImportError(
            f"ToMe: the Python package 'tome' was imported from {found}, not from this node "
            f"pack ({here}). Another node pack or a pip package named 'tome' was loaded first: "
            "remove that node pack or run 'pip uninstall tome' in ComfyUI's environment.")
    return module


_load_tome()

from tome.comfy import entry_points  # noqa: E402

# The nodes: ``comfy_entrypoint`` (ComfyUI's V3 schema) where this ComfyUI has it, else the
# classic NODE_CLASS_MAPPINGS and NODE_DISPLAY_NAME_MAPPINGS (never both: the loader would take
# the classic ones). The same node ids and inputs either way.
_names = entry_points()
globals().update(_names)

# The frontend extension ComfyUI serves with the pack (web/tome.js: the node's advanced inputs
# folded in the classic canvas, a chosen preset filling the inputs).
WEB_DIRECTORY = "./web"

__all__ = [*_names, "WEB_DIRECTORY"]
