"""The extension's entries in Settings > ToMe (readable per request through override_settings).

(The script's own arguments, the accordion's values, are in ``script_args.py``.)
"""

from __future__ import annotations

from ..config import MAX_STRIDE, RATIO_RULE, ratio_limit

SECTION = ("tome", "ToMe")


def html_options() -> bool:
    """The host shows HTML and buttons in Settings (A1111 >= 1.6, every Forge: it has
    ``OptionHTML``); SD.Next does not, so the accordion carries Measure now there instead
    (``ui.build``)."""
    try:
        from modules import shared
    except ImportError:
        return True
    return hasattr(shared, "OptionHTML")


def register() -> None:
    """``on_ui_settings`` callback."""
    import gradio as gr
    from modules import shared

    options = {
        "tome_measure": shared.OptionInfo(
            True, "Auto policy: measure on this device at each new image size").info(
            "the first generation at a new size times each level merged and unmerged (about "
            "one step, once: the results are cached) and merges only where that is faster; "
            "off: fixed token thresholds per device kind decide"),
        "tome_hires_only": shared.OptionInfo(
            False, "Merge only in the hires-fix pass, in every txt2img generation").info(
            "on when this or the accordion's 'Only in hires fix' is on; the first pass then "
            "stays exact and only the large hires pass is merged"),
        "tome_hr_ratio": shared.OptionInfo(
            0.0, "Hires-fix pass ratio when the accordion's Hires ratio is 0", gr.Slider,
            {"minimum": 0.0, "maximum": round(ratio_limit(MAX_STRIDE, MAX_STRIDE), 2),
             "step": 0.01}).info(f"0 = same as the first pass; must not exceed {RATIO_RULE}"),
    }
    if html_options():  # WebUI >= 1.6 and every Forge
        from . import measure_now
        # The button, its help text and its answer (a gradio event: the host's login and queue
        # apply); the option's own value, the help text, is never saved.
        button = shared.OptionInfo(measure_now.HELP, "", component=measure_now.settings_component)
        button.do_not_save = True
        options["tome_measure_now"] = button
    for key, info in options.items():
        info.section = SECTION
        shared.opts.add_option(key, info)
        if getattr(info, "do_not_save", False):  # the button's text, not a setting
            continue
        # The WebUI restores a request's override_settings afterwards only for keys present in
        # its config data; without this a per-request value would stick until the next restart.
        shared.opts.data.setdefault(key, info.default)
