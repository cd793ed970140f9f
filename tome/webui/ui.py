"""The accordion's gradio components, generated from ``ToMeConfig``'s field metadata.

``build`` returns the components in ``script_args.ARGS`` order, which is the API's positional
contract. Labels are the keys of users' saved defaults in ``ui-config.json``, so they stay
stable too. Tooltips live in ``javascript/tome.js``, rendered from ``HELP`` by ``tooltips_js``
(gradio 3.41 has no tooltip argument; a test keeps the file in sync).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from .. import methods
from ..config import DIT_FIELDS, FIELDS, PRESETS, choices, preset, ratio_limit
from . import infotext, settings_tab
from .script_args import (
    ARGS,
    CONFIG_KEYS,
    DEFAULT,
    LATER,
    PRESET_CHOICES,
    control_values,
    preset_key,
)

_DEFAULTS = control_values(DEFAULT)  # the controls' defaults: the library's, policy auto
# The settings only a DiT reads, in a group of their own with the line that says so.
DIT_GROUP = "Advanced (DiT)"
DIT_NOTE = ("Only for DiTs (Flux, SD3, Qwen-Image, Wan, HunyuanVideo) with method downsample; "
            "SD1.x, SD2.x and SDXL ignore them. The Quality and Fast presets set them.")


def _preset_summary(key: str) -> str:
    """E.g. "downsample x4, max downsample 2, auto policy", from the preset's own values."""
    values, cfg = PRESETS[key], preset(key)
    parts = [methods.get(cfg.method).describe(cfg)]
    shown = ("method", "policy", methods.get(cfg.method).value_field)
    parts += [f"{FIELDS[k].metadata['label'].lower()} {v}" for k, v in values.items()
              if k not in shown]
    return ", ".join(parts) + f", {cfg.policy} policy"


# Controls that are not config fields: (label, tooltip).
_EXTRA = {
    "enabled": ("ToMe", (
        "Token Merging: merge similar tokens in the UNet's transformer blocks so each step is "
        "faster. It changes the image a little; the gain grows with image size, so it pays most "
        "in the hires-fix pass and above 1024 px.")),
    "hires_only": ("Only in hires fix", (
        "Merge only in the hires-fix pass, where images are large and the speed-up is greatest; "
        "the first pass stays exact. Without hires fix nothing is merged. img2img always "
        "merges.")),
    "hr_ratio": ("Hires ratio", (
        "Ratio of the hires-fix pass (0 = same as Ratio). The hires pass usually tolerates more "
        "merging than the first pass.")),
    "preset": ("Preset", (
        "Named settings: " + "; ".join(f"{k.title()}: {_preset_summary(k)}" for k in PRESETS)
        + ". A preset sets every control of how tokens are merged (shown greyed out while it "
        "is chosen); Only in hires fix and Hires ratio stay yours. Custom: the controls as you "
        "set them, starting from the last preset's values.")),
}
LABELS = {**{n: f.metadata["label"] for n, f in FIELDS.items()},
          **{n: label for n, (label, _) in _EXTRA.items()}}
HELP = {n: (_EXTRA[n][1] if n in _EXTRA else FIELDS[n].metadata["help"]) for n in ARGS}


def build(script: Any, is_img2img: bool, default_ratio: float | None = None) -> list[Any]:
    """Create the controls (inside the caller's gradio context) and set the paste fields."""
    import gradio as gr

    ratio = _DEFAULTS["ratio"] if default_ratio is None else default_ratio
    c: dict[str, Any] = {}

    def slider(name: str, value: Any = None, maximum: float | None = None, scale: int = 1):
        meta = FIELDS[name].metadata if name in FIELDS else FIELDS["ratio"].metadata
        c[name] = gr.Slider(
            minimum=meta["minimum"], maximum=meta.get("maximum", maximum), step=meta["step"],
            value=_DEFAULTS[name] if value is None else value, label=LABELS[name],
            elem_id=script.elem_id(name), scale=scale)

    def radio(name: str, options: tuple | None = None, value: str | None = None,
              scale: int = 1) -> None:
        c[name] = gr.Radio(choices=list(options or choices(name)),
                           value=_DEFAULTS[name] if value is None else value,
                           label=LABELS[name], elem_id=script.elem_id(name), scale=scale)

    def checkbox(name: str, value: bool | None = None) -> None:
        c[name] = gr.Checkbox(value=_DEFAULTS[name] if value is None else value,
                              label=LABELS[name], elem_id=script.elem_id(name))

    def textbox(name: str) -> None:
        c[name] = gr.Textbox(value=_DEFAULTS[name], label=LABELS[name],
                             elem_id=script.elem_id(name), max_lines=1)

    def control(name: str) -> None:
        """The control a config field's metadata and default call for."""
        meta, default = FIELDS[name].metadata, _DEFAULTS[name]
        if "choices" in meta:
            radio(name)
        elif isinstance(default, bool):
            checkbox(name)
        elif isinstance(default, str):
            textbox(name)
        else:
            slider(name)

    # The layout is free to change; the returned order (ARGS) is not.
    with _input_accordion(LABELS["enabled"], script.elem_id("enabled")) as enabled:
        c["enabled"] = enabled
        with gr.Row():
            radio("preset", PRESET_CHOICES, PRESET_CHOICES[0], scale=3)
            radio("policy", scale=2)
        with gr.Row():
            slider("ratio", ratio, maximum=DEFAULT.max_ratio, scale=2)
            slider("sx")
            slider("sy")
        with gr.Row():
            radio("max_downsample", scale=3)
            radio("method", scale=2)
        with gr.Row():
            slider("start")
            slider("end")
            slider("downsample_factor")
        with gr.Row(visible=not is_img2img):  # img2img has no hires pass; kept for arg order
            checkbox("hires_only", False)
            slider("hr_ratio", 0.0, maximum=DEFAULT.max_ratio, scale=2)
        with gr.Accordion("Advanced", open=False):
            with gr.Row():
                for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp"):
                    checkbox(name)
            with gr.Row():
                radio("matching")
                radio("share")
            later = [name for name in LATER if name not in DIT_FIELDS]
            if later:
                with gr.Row():  # fields added later, each as its metadata says
                    for name in later:
                        control(name)
        with gr.Accordion(DIT_GROUP, open=False):
            gr.Markdown(DIT_NOTE)
            with gr.Row():
                radio("rope")
                textbox("blocks")
            with gr.Row():
                for name in LATER:
                    if name in DIT_FIELDS:
                        control(name)
        if not settings_tab.html_options():  # SD.Next: Settings shows no button
            _measure_now_here()

    def clamp_ratios(sx: float, sy: float, r: float, hr: float) -> tuple[Any, Any]:
        top = ratio_limit(max(1, int(sx)), max(1, int(sy)))
        return (gr.update(maximum=top, value=min(r, top)),
                gr.update(maximum=top, value=min(hr, top)))

    for name in ("sx", "sy"):
        c[name].change(clamp_ratios, inputs=[c["sx"], c["sy"], c["ratio"], c["hr_ratio"]],
                       outputs=[c["ratio"], c["hr_ratio"]], show_progress=False)

    def show_preset(choice: str) -> list[Any]:
        """A named preset shows its values in the (greyed) controls; Custom frees them."""
        try:
            key = preset_key(choice)
        except ValueError:
            key = None
        if key is None:
            return [gr.update(interactive=True) for _ in CONFIG_KEYS]
        values = control_values(preset(key))
        return [gr.update(value=values[n], interactive=False) for n in CONFIG_KEYS]

    c["preset"].change(show_preset, inputs=[c["preset"]], outputs=[c[n] for n in CONFIG_KEYS],
                       show_progress=False)

    script.infotext_fields = [(c[n], infotext.reader(n, c[n].value)) for n in ARGS]
    return [c[n] for n in ARGS]


def _measure_now_here() -> None:
    """Measure now inside the accordion, for a host whose Settings cannot show a button."""
    import gradio as gr

    from . import measure_now

    with gr.Accordion("Measure now", open=False):
        button = gr.Button("Measure now")
        out = gr.HTML(measure_now.HELP)
        button.click(lambda: measure_now.measure_loaded()["html"], outputs=[out])


def _input_accordion(label: str, elem_id: str):
    """The WebUI's checkbox-accordion (>= 1.7); a checkbox in an accordion elsewhere."""
    try:
        from modules.ui_components import InputAccordion
    except ImportError:
        return _checkbox_accordion(label, elem_id)
    return InputAccordion(False, label=label, elem_id=elem_id)


@contextlib.contextmanager
def _checkbox_accordion(label: str, elem_id: str):
    import gradio as gr
    with gr.Accordion(label, open=False):
        yield gr.Checkbox(False, label="Enable", elem_id=elem_id)


def tooltips_js() -> str:
    """The content of ``javascript/tome.js``: titles on the controls, looked up by elem_id."""
    texts = json.dumps(HELP, indent=4, ensure_ascii=False).replace("\n", "\n    ")
    return f"""// ToMe control tooltips, generated by tooltips_js() in tome/webui/ui.py: edit there.
(function () {{
    const HELP = {texts};

    onUiLoaded(function () {{
        for (const tab of ["txt2img", "img2img"]) {{
            for (const [name, text] of Object.entries(HELP)) {{
                const el = gradioApp().getElementById(`script_${{tab}}_tome_${{name}}`);
                if (!el) continue;
                // on the accordion, only its title row: its children have their own tooltips
                const target = name === "enabled" ? el.querySelector(".label-wrap") || el : el;
                target.title = text;
            }}
        }}
    }});
}})();
"""
