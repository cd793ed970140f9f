"""``comfy_api.torch_helpers.set_torch_compile_wrapper`` (what ComfyUI 0.8.0's
TorchCompileModel node runs) as it behaves: ``torch.compile`` of the model's
``diffusion_model`` once, and an ``apply_model`` wrapper (key ``"torch.compile"``) that puts
the compiled module in place of ``diffusion_model`` for the call and back after it. The node
passes ``options={"guard_filter_fn": ...}`` dropping every guard whose name mentions
``transformer_options``, so nothing read from them makes a compiled graph recompile."""

import torch

COMPILE_KEY = "torch.compile"


def skip_torch_compile_dict(guard_entries):
    return [("transformer_options" not in entry.name) for entry in guard_entries]


def set_torch_compile_wrapper(model, backend="inductor", options=None, fullgraph=False,
                              dynamic=None):
    model.remove_wrappers_with_key("apply_model", COMPILE_KEY)
    compiled = torch.compile(model=model.get_model_object("diffusion_model"), backend=backend,
                             options=options, fullgraph=fullgraph, dynamic=dynamic)

    def apply_torch_compile_wrapper(executor, *args, **kwargs):
        base = executor.class_obj
        original = base.diffusion_model
        try:
            base.diffusion_model = compiled
            return executor(*args, **kwargs)
        finally:
            base.diffusion_model = original

    model.add_wrapper_with_key("apply_model", COMPILE_KEY, apply_torch_compile_wrapper)
    return compiled


class TorchCompileModel:
    def execute(self, model, backend="inductor"):
        m = model.clone()
        set_torch_compile_wrapper(m, backend, options={"guard_filter_fn": skip_torch_compile_dict})
        return (m,)
