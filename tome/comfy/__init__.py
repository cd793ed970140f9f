"""The ComfyUI layer: the node pack's nodes (``nodes.py``), their inputs generated from
``ToMeConfig`` (``inputs.py``), the measure node's table and plot (``measure_node.py``), and
the only module that touches ComfyUI (``host.py``, lazily). The repository's root
``__init__.py`` is the entry point ComfyUI imports; it re-exports the mappings below."""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
