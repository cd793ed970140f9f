"""``InputAccordion``: a hidden checkbox that is the value of an accordion around controls."""

import gradio as gr


class InputAccordion(gr.Checkbox):
    def __init__(self, value, **kwargs):
        self.accordion_id = kwargs.get("elem_id") or "input-accordion"
        super().__init__(value, **{**kwargs, "elem_id": f"{self.accordion_id}-checkbox",
                                   "visible": False})
        self.accordion = gr.Accordion(label=kwargs.get("label", "Accordion"), open=value,
                                      elem_id=self.accordion_id, elem_classes=["input-accordion"])

    def __enter__(self):
        self.accordion.__enter__()
        return self

    def __exit__(self, *exc):
        self.accordion.__exit__(*exc)

    def get_block_name(self):
        return "checkbox"
