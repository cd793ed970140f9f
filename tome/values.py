"""Loosely typed values (API JSON, infotext strings, gradio numbers) to a setting's type, and
the words for what a setting accepts: per ``dataclasses.Field`` with ``config``'s metadata
(``minimum``, ``maximum``, ``choices``), so every host's errors read alike. Apart from
``config`` so the settings themselves have room there."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .ratio import RATIO_RULE

AUTO = "auto"  # in the UI / API; None in the library


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (an error quotes what it refuses, not a
    megabyte of it)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"


def in_range(f: dataclasses.Field, value: Any) -> bool:
    """Whether ``value`` is of the field's kind (an integer, or a finite number) and within
    its metadata's ``minimum``-``maximum``: the one range check, on the range UIs show."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(f.default, int) and not isinstance(value, int):
        return False
    return math.isfinite(value) and f.metadata["minimum"] <= value <= f.metadata["maximum"]


def range_text(f: dataclasses.Field) -> str:
    """``a positive integer in [1, 8]``, ``a number in [0, 1]``: the field's metadata range."""
    lo, hi = f.metadata["minimum"], f.metadata["maximum"]
    if not isinstance(f.default, int):
        return f"a number in [{lo:g}, {hi:g}]"
    kind = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, "an integer")
    return f"{kind} in [{lo}, {hi}]"


def coerce(f: dataclasses.Field, value: Any) -> Any:
    """Coerce one loosely typed value to the field's type, with an error naming the field."""
    name, default = f.name, f.default
    try:
        if name == "max_downsample":
            if value is None or (isinstance(value, str) and value.strip().lower() in (AUTO, "")):
                return None
            return _to_int(value)
        if isinstance(default, bool):
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("true", "1", "yes", "on"):
                    return True
                if low in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if isinstance(value, (int, float)) and value in (0, 1):
                return bool(value)
            return value
        if isinstance(default, int):
            return _to_int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if isinstance(default, str):
            return str(value).strip().lower()
    except (TypeError, ValueError):
        raise ValueError(f"ToMe: invalid {name}={value!r}: expected {describe(f)}") from None
    return value


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, float) or isinstance(value, str):
        x = float(value)
        if not x.is_integer():
            raise ValueError
        return int(x)
    return int(value)


def describe(f: dataclasses.Field) -> str:
    m = f.metadata
    if "choices" in m:
        return "one of " + ", ".join(map(str, tuple(m["choices"])))
    if isinstance(f.default, bool):
        return "true or false"
    if f.name.endswith("ratio"):  # ratio, and the WebUI's hr_ratio and img2img_ratio
        return f"a number in [0, {RATIO_RULE}]"
    if "maximum" in m:
        return range_text(f)
    return type(f.default).__name__
