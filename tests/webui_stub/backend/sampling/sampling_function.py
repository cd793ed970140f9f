"""``backend.sampling.sampling_function``: one batched model call as Neo makes it.

The per-call ``transformer_options`` is a shallow copy of the patcher's, with ``sigmas`` (the
batch's sigma), ``cond_or_uncond``; the conditioning dict ``c`` carries ``c_crossattn`` (and
``y``, ...) and ``transformer_options``; with a ``model_function_wrapper`` the model is
called as ``wrapper(model.apply_model, {"input", "timestep", "c", "cond_or_uncond"})``, else
``model.apply_model(input, timestep, **c)``."""

COND, UNCOND = 0, 1


def calc_batch(unet_patcher, x, sigma, conds, cond_or_uncond):
    options = unet_patcher.model_options
    transformer_options = dict(options.get("transformer_options", {}))
    transformer_options["cond_or_uncond"] = list(cond_or_uncond)
    transformer_options["sigmas"] = sigma
    c = dict(conds)
    c["transformer_options"] = transformer_options
    model = unet_patcher.model
    if "model_function_wrapper" in options:
        return options["model_function_wrapper"](model.apply_model, {
            "input": x, "timestep": sigma, "c": c, "cond_or_uncond": list(cond_or_uncond)})
    return model.apply_model(x, sigma, **c)
