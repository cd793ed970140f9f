"""What the ComfyUI tests share: the node's values as a fresh node in the graph editor has
them."""

from __future__ import annotations

from typing import Any

from tome.comfy import inputs


def defaults(**changes: Any) -> dict[str, Any]:
    """The node's default values with preset custom (the inputs as set) unless ``changes``
    name one."""
    spec = inputs.input_types()
    values = {name: opts.get("default") for part in spec.values()
              for name, (_, opts) in part.items() if name != "model"}
    return {**values, "preset": inputs.CUSTOM, **changes}
