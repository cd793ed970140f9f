"""The extension's entries in Settings > ToMe (readable per request through override_settings).

(The script's own arguments, the accordion's values, are in ``script_args.py``.)
"""

from __future__ import annotations

from ..config import MAX_STRIDE, RATIO_RULE, ratio_limit

SECTION = ("tome", "ToMe")


def register() -> None:
    """``on_ui_settings`` callback."""
    import gradio as gr
    from modules import shared

    options = {
        "tome_hires_only": shared.OptionInfo(
            False, "Merge only in the hires-fix pass, in every txt2img generation").info(
            "on when this or the accordion's 'Only in hires fix' is on; the first pass then "
            "stays exact and only the large hires pass is merged"),
        "tome_hr_ratio": shared.OptionInfo(
            0.0, "Hires-fix pass ratio when the accordion's Hires ratio is 0", gr.Slider,
            {"minimum": 0.0, "maximum": round(ratio_limit(MAX_STRIDE, MAX_STRIDE), 2),
             "step": 0.01}).info(f"0 = same as the first pass; must not exceed {RATIO_RULE}"),
    }
    for key, info in options.items():
        info.section = SECTION
        shared.opts.add_option(key, info)
        # The WebUI restores a request's override_settings afterwards only for keys present in
        # its config data; without this a per-request value would stick until the next restart.
        shared.opts.data.setdefault(key, info.default)
