"""The AUTOMATIC1111 WebUI layer. Only this package imports ``modules.*``, always lazily."""

from __future__ import annotations

from typing import Any

from ..config import ToMeConfig


def default_ratio(value: Any) -> float | None:
    """The ``--tome-default-ratio`` flag, checked once at load with a clear message."""
    if value is None:
        return None
    try:
        return ToMeConfig(ratio=float(value)).ratio
    except (TypeError, ValueError):
        print(f"ToMe: ignoring --tome-default-ratio {value}: it must be a number in "
              f"[0, {ToMeConfig().max_ratio:g}]")
        return None


def check_torch() -> None:
    """Hooks with keyword arguments (how blocks are patched) need torch 2.0."""
    import torch
    major, minor = (int("".join(c for c in x if c.isdigit()) or 0)
                    for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 0):
        raise ImportError(f"ToMe needs torch >= 2.0; this WebUI runs torch {torch.__version__}. "
                          "Update the WebUI (v1.6+ ships torch 2.x) or start it once with "
                          "--reinstall-torch.")
