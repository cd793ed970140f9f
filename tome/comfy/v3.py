"""The pack's nodes in ComfyUI's V3 schema (``comfy_api.latest``: ``io.ComfyNode``,
``io.Schema``, a ``ComfyExtension`` from ``comfy_entrypoint``), built from their classic
declaration (``nodes.py``), so the two cannot drift: the same node ids, display names, input
names, types, order, defaults and options (a saved graph keeps its widget values by position,
and ``/prompt`` checks them against these), the same outputs; running one runs the classic
node. ``io`` is the host's module (``host.node_api``): this module imports no ComfyUI.

An option the host's input class takes as a keyword goes there (``advanced`` in v0.30.0),
any other into its ``extra_dict`` (``advanced`` in 0.8.0), which ComfyUI merges into the
input's options: both hand the frontend what the classic declaration does.
"""

from __future__ import annotations

import inspect
from typing import Any

from . import nodes

# a classic input or output type -> its class in ``io`` (a list of choices is a Combo)
TYPES = {"MODEL": "Model", "BOOLEAN": "Boolean", "INT": "Int", "FLOAT": "Float",
         "STRING": "String", "IMAGE": "Image"}


def v3_input(io: Any, name: str, spec: tuple, optional: bool) -> Any:
    """One classic input ``(TYPE or choices, options)`` as the host's V3 input."""
    kind, options = spec
    if isinstance(kind, (list, tuple)):
        cls, args = io.Combo.Input, {"options": list(kind)}
    else:
        cls, args = getattr(io, TYPES[kind]).Input, {}
    takes = inspect.signature(cls.__init__).parameters
    extra = {}
    for key, value in options.items():
        if key in takes and key not in ("id", "extra_dict", "optional"):
            args[key] = value
        else:
            extra[key] = value
    return cls(name, optional=optional, extra_dict=extra or None, **args)


def v3_outputs(io: Any, classic: type) -> list[Any]:
    names = getattr(classic, "RETURN_NAMES", None) or (None,) * len(classic.RETURN_TYPES)
    return [getattr(io, TYPES[kind]).Output(name, display_name=name)
            for kind, name in zip(classic.RETURN_TYPES, names)]


def node(io: Any, node_id: str, classic: type, display_name: str) -> type:
    """The V3 node of one classic node class."""

    def define_schema(cls: type) -> Any:
        spec = classic.INPUT_TYPES()
        inputs = [v3_input(io, name, one, part == "optional")
                  for part in ("required", "optional") for name, one in spec.get(part, {}).items()]
        return io.Schema(node_id=node_id, display_name=display_name, category=classic.CATEGORY,
                         description=classic.DESCRIPTION, inputs=inputs,
                         outputs=v3_outputs(io, classic),
                         is_output_node=getattr(classic, "OUTPUT_NODE", False))

    def execute(cls: type, **values: Any) -> Any:
        out = getattr(classic(), classic.FUNCTION)(**values)
        if isinstance(out, dict):  # {"ui": ..., "result": (...)}
            return io.NodeOutput(*out["result"], ui=out.get("ui"))
        return io.NodeOutput(*out)

    namespace = {"__doc__": classic.__doc__, "__module__": __name__,
                 "define_schema": classmethod(define_schema), "execute": classmethod(execute)}
    if hasattr(classic, "IS_CHANGED"):
        namespace["fingerprint_inputs"] = classmethod(
            lambda cls, **values: classic.IS_CHANGED(**values))
    return type(classic.__name__, (io.ComfyNode,), namespace)


def extension(io: Any, base: type) -> Any:
    """The pack's ``ComfyExtension`` (``base``: the host's class): every node of
    ``nodes.NODE_CLASS_MAPPINGS`` under its id."""
    listed = [node(io, node_id, classic, nodes.NODE_DISPLAY_NAME_MAPPINGS[node_id])
              for node_id, classic in nodes.NODE_CLASS_MAPPINGS.items()]

    class ToMeExtension(base):
        async def get_node_list(self) -> list[type]:
            return list(listed)

    return ToMeExtension()
