"""Stand-in of ComfyUI's V3 node API (``comfy_api.latest``, as in 0.8.0 and v0.30.0), only what
the pack touches: ``ComfyExtension`` (``on_load``, which v0.30.0's loader awaits and 0.8.0's
does not, and the abstract ``get_node_list``) and ``io`` (``_io.py``)."""

from abc import ABC, abstractmethod

from . import _io as io

__all__ = ["ComfyExtension", "io"]


class ComfyExtension(ABC):
    async def on_load(self) -> None:  # noqa: B027 (optional for an extension)
        """Called by the loader before ``get_node_list`` (v0.30.0 and later)."""

    @abstractmethod
    async def get_node_list(self) -> list:
        """The extension's ``io.ComfyNode`` classes."""
