"""``shared``: options, command-line flags, the loaded model and the job state."""

import argparse


class OptionInfo:
    def __init__(self, default=None, label="", component=None, component_args=None,
                 onchange=None, section=None, refresh=None, comment_before="", comment_after="",
                 infotext=None, restrict_api=False, category_id=None):
        self.default, self.label, self.component = default, label, component
        self.component_args, self.section, self.infotext = component_args, section, infotext
        self.do_not_save = False

    def info(self, text):
        self.comment_after = text
        return self


class OptionHTML(OptionInfo):
    """Static HTML in the settings page (WebUI >= 1.6): its text is the default, shown in a
    ``gr.HTML`` of class ``settings-info``, never saved."""

    def __init__(self, text):
        super().__init__(str(text).strip(), label="", component=_html)
        self.do_not_save = True


def _html(**kwargs):
    import gradio as gr
    return gr.HTML(elem_classes="settings-info", **kwargs)


class Options:
    def __init__(self):
        object.__setattr__(self, "data", {})
        object.__setattr__(self, "data_labels", {})

    def add_option(self, key, info):
        assert info.section is not None, f"option {key} has no section"
        self.data_labels[key] = info

    def get_default(self, key):
        return self.data_labels[key].default

    def __getattr__(self, key):
        if key in self.data:
            return self.data[key]
        if key in self.data_labels:
            return self.data_labels[key].default
        raise AttributeError(key)

    def __setattr__(self, key, value):
        self.data[key] = value

    def set(self, key, value, is_api=False, run_callbacks=True):
        if key not in self.data_labels or self.data_labels[key].do_not_save:
            return False
        self.data[key] = value
        return True


class State:
    interrupted = False
    job = ""


def reset():
    global opts, cmd_opts, sd_model, state, demo
    opts = Options()
    for key in ("token_merging_ratio", "token_merging_ratio_img2img", "token_merging_ratio_hr"):
        opts.add_option(key, OptionInfo(0.0, key, section=("optimizations", "Optimizations")))
    cmd_opts = argparse.Namespace()
    sd_model = None
    state = State()
    demo = None  # the UI's gr.Blocks, once built


reset()
