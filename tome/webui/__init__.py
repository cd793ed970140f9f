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


def register_callbacks() -> None:
    """The WebUI callbacks: settings, X/Y/Z axes, model loads, each sampling step, the Measure
    now route. The script file calls this at every load ("Reload UI" clears callbacks)."""
    from modules import script_callbacks

    from . import measure_now, runner, settings_tab, xyz
    script_callbacks.on_ui_settings(settings_tab.register)
    script_callbacks.on_before_ui(xyz.add_axes)
    script_callbacks.on_model_loaded(runner.on_model_loaded)
    script_callbacks.on_cfg_denoiser(runner.on_cfg_denoiser)
    script_callbacks.on_app_started(measure_now.register_api)
    after_process = getattr(script_callbacks, "on_after_process", None)
    if after_process is not None:  # SD.Next: runs on every exit, postprocess not when stopped
        after_process(runner.after_generation)
