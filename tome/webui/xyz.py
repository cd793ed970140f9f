"""Axes for the X/Y/Z plot script: compare ToMe settings in one grid.

Each axis stores its value on the plot cell's copy of ``p`` (``script_args.XYZ_ATTR``); the runner
lays those values over the script's arguments, so a ToMe axis turns ToMe on in every cell
unless the "[ToMe] Enabled" axis says otherwise. Values are validated when the grid starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import MAX_STRIDE, check_ratio, choices
from .script_args import PRESET_CHOICES, XYZ_ATTR, invalid, parse_args

PREFIX = "[ToMe] "
_BOOLS = ["True", "False"]


def _values(key: str, x: Any) -> dict[str, Any]:
    """The named settings one axis value stands for (a stride sets both sx and sy)."""
    return dict(zip(("sx", "sy"), parse_stride(x))) if key == "stride" else {key: x}


def set_value(key: str) -> Callable[[Any, Any, Any], None]:
    """An axis ``apply``: a new dict per cell, since the cells share everything else."""
    def apply(p: Any, x: Any, xs: Any) -> None:
        setattr(p, XYZ_ATTR, {**(getattr(p, XYZ_ATTR, None) or {}), **_values(key, x)})
    return apply


def parse_stride(text: Any) -> tuple[int, int]:
    """"2x2", "3x2" (sx x sy) or "2" (both)."""
    parts = str(text).lower().replace(" ", "").split("x")
    try:
        sx, sy = (int(parts[0]),) * 2 if len(parts) == 1 else map(int, parts)
    except ValueError:
        raise ValueError(f"ToMe: invalid stride {text!r}: expected SXxSY such as 2x2, or one "
                         "integer for both") from None
    return sx, sy


def confirm(name: str) -> Callable[[Any, list], None]:
    """Check every value of an axis on its own, as the request's own settings with that value
    laid over them would be checked, so an error names what the user sent. A ratio that only a
    larger stride allows passes here (a Stride axis may supply it); each cell's generation
    then checks it against the cell's stride."""
    def check(p: Any, xs: list) -> None:
        args = _request_args(p)
        for x in xs:
            try:
                values = _values(name, x)
                try:
                    parse_args(args, values)
                except ValueError:
                    if name not in ("ratio", "hr_ratio") or not _allowed_by_some_stride(x):
                        raise
            except ValueError as e:
                raise invalid(e) from None
    return check


def _request_args(p: Any) -> list:
    """The ToMe script's arguments in the request that the grid runs (empty if not found)."""
    runner = getattr(p, "scripts", None)
    script = next((s for s in getattr(runner, "alwayson_scripts", None) or ()
                   if getattr(s, "title", lambda: "")() == "ToMe"), None)
    args = getattr(p, "script_args", None)
    if script is None or args is None:
        return []
    return list(args[script.args_from:script.args_to])


def _allowed_by_some_stride(x: Any) -> bool:
    try:
        check_ratio("ratio", float(x), MAX_STRIDE, MAX_STRIDE)
    except (TypeError, ValueError):
        return False
    return True


def axes(xyz: Any) -> list[Any]:
    A = xyz.AxisOption
    return [
        A(PREFIX + "Enabled", str, set_value("enabled"), confirm=confirm("enabled"),
          choices=lambda: _BOOLS),
        A(PREFIX + "Preset", str, set_value("preset"), confirm=confirm("preset"),
          choices=lambda: list(PRESET_CHOICES)),
        A(PREFIX + "Policy", str, set_value("policy"), confirm=confirm("policy"),
          choices=lambda: list(choices("policy"))),
        A(PREFIX + "Ratio", float, set_value("ratio"), confirm=confirm("ratio")),
        A(PREFIX + "Hires ratio", float, set_value("hr_ratio"), confirm=confirm("hr_ratio")),
        A(PREFIX + "Stride", str, set_value("stride"), confirm=confirm("stride"),
          choices=lambda: ["2x2", "2x1", "1x2", "3x2", "2x3", "3x3", "4x2", "2x4", "4x4"]),
        A(PREFIX + "Max downsample", str, set_value("max_downsample"),
          confirm=confirm("max_downsample"),
          choices=lambda: list(choices("max_downsample"))),
        A(PREFIX + "Method", str, set_value("method"), confirm=confirm("method"),
          choices=lambda: list(choices("method"))),
        A(PREFIX + "Downsample factor", int, set_value("downsample_factor"),
          confirm=confirm("downsample_factor")),
        A(PREFIX + "Matching", str, set_value("matching"), confirm=confirm("matching"),
          choices=lambda: list(choices("matching"))),
        A(PREFIX + "Plan sharing", str, set_value("share"), confirm=confirm("share"),
          choices=lambda: list(choices("share"))),
        A(PREFIX + "Start", float, set_value("start"), confirm=confirm("start")),
        A(PREFIX + "End", float, set_value("end"), confirm=confirm("end")),
        A(PREFIX + "Hires only", str, set_value("hires_only"), confirm=confirm("hires_only"),
          choices=lambda: _BOOLS),
    ]


def add_axes() -> None:
    """``on_before_ui`` callback: the XYZ script reads its axis list when it builds its UI."""
    from modules import scripts

    module = next((s.module for s in scripts.scripts_data
                   if s.script_class.__module__ == "xyz_grid.py"), None)
    if module is None:  # the built-in XYZ script is disabled
        return
    known = {opt.label for opt in module.axis_options}
    module.axis_options.extend(a for a in axes(module) if a.label not in known)
