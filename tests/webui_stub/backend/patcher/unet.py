"""``backend.patcher.unet``: Neo's ``UnetPatcher`` as the ToMe swap adapter meets it.

``clone()`` shares the model and copies ``model_options`` the way Neo's ``deepcopy_`` does
(dicts and lists copied, every other object, e.g. a wrapper function, shared);
``set_model_unet_function_wrapper`` fills the **single** ``model_function_wrapper`` slot
(a later extension's wrapper replaces an earlier one unless it chains it). Written from its
observed behaviour.
"""


def deepcopy_(obj):
    if isinstance(obj, dict):
        return {k: deepcopy_(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [deepcopy_(v) for v in obj]
    return obj


class UnetPatcher:
    def __init__(self, model):
        self.model = model  # a KModel
        self.model_options = {"transformer_options": {}}

    def clone(self):
        n = UnetPatcher(self.model)
        n.model_options = deepcopy_(self.model_options)
        return n

    def set_model_unet_function_wrapper(self, fn):
        self.model_options["model_function_wrapper"] = fn

    def get_model_object(self, name):
        return getattr(self.model, name)

    def set_model_attn1_patch(self, fn):  # Neo keeps the UNet's attn1 patches (unused by DiTs)
        to = self.model_options["transformer_options"]
        to.setdefault("patches", {}).setdefault("attn1_patch", []).append(fn)

    def set_model_attn1_output_patch(self, fn):
        to = self.model_options["transformer_options"]
        to.setdefault("patches", {}).setdefault("attn1_output_patch", []).append(fn)
