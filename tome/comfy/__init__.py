"""The ComfyUI layer: the node pack's nodes (``nodes.py``; in ComfyUI's V3 schema: ``v3.py``),
their inputs generated from ``ToMeConfig`` (``inputs.py``), the measure node's table and plot
(``measure_node.py``), and the only module that touches ComfyUI (``host.py``, lazily). The
repository's root ``__init__.py`` is the entry point ComfyUI imports; it defines what
``entry_points`` answers."""

from __future__ import annotations

from typing import Any

from . import host, v3
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "entry_points"]


def entry_points() -> dict[str, Any]:
    """The names the pack's module defines for the ComfyUI importing it: ``comfy_entrypoint``
    (the V3 nodes) where it has the V3 schema, else the classic mappings. Never both: ComfyUI's
    loader (``load_custom_node``, read in 0.8.0, v0.30.0 and Comfy-Org/ComfyUI@02217e36) takes
    ``NODE_CLASS_MAPPINGS`` whenever a module defines it and reads ``comfy_entrypoint`` only
    otherwise."""
    api = host.node_api()
    if api is None:
        return {"NODE_CLASS_MAPPINGS": NODE_CLASS_MAPPINGS,
                "NODE_DISPLAY_NAME_MAPPINGS": NODE_DISPLAY_NAME_MAPPINGS}

    async def comfy_entrypoint() -> Any:
        return v3.extension(*api)

    return {"comfy_entrypoint": comfy_entrypoint}
