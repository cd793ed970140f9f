"""Stand-in of how ComfyUI's ``nodes.py`` loads a custom node pack (``load_custom_node``), from
its public source (read in 0.8.0, v0.30.0 and Comfy-Org/ComfyUI@02217e36; no code copied):
the folder's ``__init__.py`` is executed as a module; if it defines ``NODE_CLASS_MAPPINGS``
(not None) those classes are the pack's nodes (with ``NODE_DISPLAY_NAME_MAPPINGS``) and
nothing else is read; otherwise ``comfy_entrypoint`` (a function or a coroutine function)
must return a ``ComfyExtension``, whose ``on_load`` is awaited (v0.30.0 and later; 0.8.0 does
not call it) and whose ``get_node_list`` gives ``io.ComfyNode`` classes, each registered under
its schema's ``node_id``; neither: the pack is skipped."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import sys

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}


async def _load(module_path: str, on_load: bool) -> bool:
    name = module_path.replace(".", "_x_")
    spec = importlib.util.spec_from_file_location(name, os.path.join(module_path, "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if getattr(module, "NODE_CLASS_MAPPINGS", None) is not None:
        NODE_CLASS_MAPPINGS.update(module.NODE_CLASS_MAPPINGS)
        NODE_DISPLAY_NAME_MAPPINGS.update(getattr(module, "NODE_DISPLAY_NAME_MAPPINGS", None) or {})
        return True
    entry = getattr(module, "comfy_entrypoint", None)
    if not callable(entry):
        return False
    from comfy_api.latest import ComfyExtension
    extension = await entry() if inspect.iscoroutinefunction(entry) else entry()
    if not isinstance(extension, ComfyExtension):
        return False
    if on_load:
        await extension.on_load()
    for cls in await extension.get_node_list():
        schema = cls.GET_SCHEMA()
        NODE_CLASS_MAPPINGS[schema.node_id] = cls
        if schema.display_name is not None:
            NODE_DISPLAY_NAME_MAPPINGS[schema.node_id] = schema.display_name
    return True


def load_custom_node(module_path: str, version: str = "0.30.0") -> bool:
    """Load the pack at ``module_path`` as that ComfyUI version does."""
    return asyncio.run(_load(module_path, on_load=version != "0.8.0"))
