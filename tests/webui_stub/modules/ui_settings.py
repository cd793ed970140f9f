"""The Settings page (A1111 1.10's contract): one tab per section, one component per option.

An option's component is its ``OptionInfo.component`` when it has one (``OptionHTML``'s makes
a ``gr.HTML``; an extension may pass any callable that builds components and returns one),
else one chosen by the default's type; it is called inside the section's column with the
option's ``label``, current ``value`` and ``elem_id="setting_<key>"`` (plus
``component_args``). The component it returns is what "Apply settings" reads back.
"""

import gradio as gr

from modules import shared

BY_TYPE = {bool: gr.Checkbox, int: gr.Number, float: gr.Number, str: gr.Textbox}


def create_setting_component(key):
    info = shared.opts.data_labels[key]
    comp = info.component or BY_TYPE[type(info.default)]
    args = info.component_args() if callable(info.component_args) else info.component_args
    return comp(label=info.label, value=getattr(shared.opts, key), elem_id=f"setting_{key}",
                **(args or {}))


def create_ui():
    """Inside the caller's Blocks: ``{key: component}`` for every option with a section."""
    sections = {}
    for key, info in shared.opts.data_labels.items():
        if info.section is not None and info.section[0] is not None:
            sections.setdefault(tuple(info.section), []).append(key)
    components = {}
    with gr.Tabs(elem_id="settings"):
        for (name, title), keys in sections.items():
            with gr.Tab(label=title, elem_id=f"settings_{name}"), gr.Column():
                for key in keys:
                    components[key] = create_setting_component(key)
    return components
