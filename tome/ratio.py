"""The merge ratio's rule, in one place: every cell of an ``sx x sy`` stride keeps one
destination, so at most ``1 - 1/(sx*sy)`` of the tokens merge (``config.py`` validates with
it, the hosts' sliders read their maximum from it)."""

from __future__ import annotations

import math
from typing import Any

MAX_STRIDE = 8
RATIO_RULE = "1 - 1/(sx*sy) (0.75 for a 2x2 stride)"


def ratio_limit(sx: int, sy: int) -> float:
    """The real maximum ratio: every cell keeps one destination, so at most 1 - 1/(sx*sy) of the
    tokens merge. The one place this rule lives."""
    return 1.0 - 1.0 / (sx * sy)


def check_ratio(name: str, value: Any, sx: int, sy: int, note: str = "") -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is a ratio a ``sx x sy`` stride
    allows."""
    top = ratio_limit(sx, sy)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0.0 <= value <= top + 1e-9:
        raise ValueError(f"ToMe: invalid {name}={value!r}: must be in [0, {top:g}] for a "
                         f"{sx}x{sy} stride (1 - 1/(sx*sy)){note}")
