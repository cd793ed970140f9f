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
              f"[0, {ToMeConfig().max_ratio:g}] (for the default 2x2 stride)")
        return None


def check_torch() -> None:
    """Refuse to load on a torch older than ``requirements.MIN_TORCH``."""
    import torch

    from ..requirements import torch_problem
    problem = torch_problem(torch.__version__)
    if problem:
        raise ImportError(problem)
