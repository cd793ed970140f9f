"""Stand-in of ComfyUI's V3 schema (``comfy_api.latest.io``) as v0.30.0 has it, written from its
public behaviour: inputs and outputs of a type (``io.Int.Input(id, ...)``), each input's
options as the frontend and ``/prompt`` read them (``as_dict``: the keyword options not None,
then ``extra_dict``'s merged over them; ``advanced`` a keyword since 0.8.0's successors, only
through ``extra_dict`` in 0.8.0); a ``Schema``; ``ComfyNode`` (``define_schema`` and
``execute`` classmethods, ``GET_SCHEMA``; ``INPUT_TYPES``: the classic form ComfyUI serves as
``/object_info``, a combo as ``("COMBO", {"options": [...]})``); ``NodeOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _pruned(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


class Input:
    def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                 tooltip: str | None = None, lazy: bool | None = None,
                 extra_dict: dict | None = None, raw_link: bool | None = None,
                 advanced: bool | None = None):
        self.id, self.display_name, self.optional = id, display_name, optional
        self.tooltip, self.lazy, self.extra_dict = tooltip, lazy, extra_dict or {}
        self.raw_link, self.advanced = raw_link, advanced

    def as_dict(self) -> dict:
        return _pruned({"display_name": self.display_name, "optional": self.optional,
                        "tooltip": self.tooltip, "lazy": self.lazy, "rawLink": self.raw_link,
                        "advanced": self.advanced}) | _pruned(self.extra_dict)


class WidgetInput(Input):
    def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                 tooltip: str | None = None, lazy: bool | None = None, default: Any = None,
                 extra_dict: dict | None = None, advanced: bool | None = None, **own: Any):
        super().__init__(id, display_name, optional, tooltip, lazy, extra_dict,
                         advanced=advanced)
        self.default, self.own = default, own

    def as_dict(self) -> dict:
        return (super().as_dict() | _pruned({"default": self.default}) | _pruned(self.own)
                | _pruned(self.extra_dict))


class Output:
    def __init__(self, id: str | None = None, display_name: str | None = None,
                 tooltip: str | None = None, is_output_list: bool = False):
        self.id, self.display_name, self.tooltip = id, display_name or id, tooltip


class Model:
    class Input(Input):
        io_type = "MODEL"

    class Output(Output):
        io_type = "MODEL"


class Image:
    class Output(Output):
        io_type = "IMAGE"


class String:
    class Input(WidgetInput):
        io_type = "STRING"

        def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None,
                     multiline: bool = False, placeholder: str | None = None,
                     default: str | None = None, extra_dict: dict | None = None,
                     advanced: bool | None = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, extra_dict,
                             advanced, multiline=multiline, placeholder=placeholder)

    class Output(Output):
        io_type = "STRING"


class Boolean:
    class Input(WidgetInput):
        io_type = "BOOLEAN"

        def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None,
                     default: bool | None = None, extra_dict: dict | None = None,
                     advanced: bool | None = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, extra_dict,
                             advanced)


class Int:
    class Input(WidgetInput):
        io_type = "INT"

        def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None,
                     default: int | None = None, min: int | None = None,
                     max: int | None = None, step: int | None = None,
                     control_after_generate: bool | None = None,
                     extra_dict: dict | None = None, advanced: bool | None = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, extra_dict,
                             advanced, min=min, max=max, step=step,
                             control_after_generate=control_after_generate)


class Float:
    class Input(WidgetInput):
        io_type = "FLOAT"

        def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None,
                     default: float | None = None, min: float | None = None,
                     max: float | None = None, step: float | None = None,
                     round: float | None = None,
                     extra_dict: dict | None = None, advanced: bool | None = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, extra_dict,
                             advanced, min=min, max=max, step=step, round=round)


class Combo:
    class Input(WidgetInput):
        io_type = "COMBO"

        def __init__(self, id: str, options: list | None = None,
                     display_name: str | None = None, optional: bool = False,
                     tooltip: str | None = None, lazy: bool | None = None,
                     default: Any = None, control_after_generate: bool | None = None,
                     extra_dict: dict | None = None, advanced: bool | None = None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, extra_dict,
                             advanced, multiselect=False, options=options,
                             control_after_generate=control_after_generate)


@dataclass
class Schema:
    node_id: str
    display_name: str | None = None
    category: str = "sd"
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    description: str = ""
    is_output_node: bool = False

    def validate(self) -> None:
        ids = [i.id for i in self.inputs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Input ids must be unique: {ids}")
        for i, output in enumerate(self.outputs):  # as ComfyUI's finalize
            if output.id is None:
                output.id = f"_{i}_{output.io_type}_"


@dataclass
class NodeOutput:
    args: tuple
    ui: Any = None

    def __init__(self, *args: Any, ui: Any = None):
        self.args, self.ui = args, ui

    @property
    def result(self) -> tuple | None:
        return self.args or None


class ComfyNode:
    """A V3 node: ComfyUI calls ``GET_SCHEMA`` when it loads the node and ``execute`` (a
    classmethod, the inputs by name) to run it, ``fingerprint_inputs`` as ``IS_CHANGED``."""

    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs: Any) -> NodeOutput:
        raise NotImplementedError

    @classmethod
    def GET_SCHEMA(cls) -> Schema:  # noqa: N802 (ComfyUI's name)
        if cls.define_schema.__func__ is ComfyNode.define_schema.__func__ or \
                cls.execute.__func__ is ComfyNode.execute.__func__:
            raise TypeError(f"{cls.__name__} must override define_schema and execute")
        schema = cls.define_schema()
        schema.validate()
        return schema

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        out: dict[str, dict] = {}
        for i in cls.GET_SCHEMA().inputs:
            options = i.as_dict()
            options.pop("optional", None)
            out.setdefault("optional" if i.optional else "required", {})[i.id] = (
                i.io_type, options)
        return out
