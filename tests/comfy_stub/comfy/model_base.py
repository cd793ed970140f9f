"""``comfy.model_base.BaseModel.apply_model`` as ComfyUI 0.8.0 behaves (written from its
observed behaviour): ``apply_model(x, t, c_concat, c_crossattn, control, transformer_options,
**kwargs)`` runs the ``apply_model`` wrappers (``executor.class_obj`` is the model base;
every argument positional, the extra conditions as keywords: ``ref_latents``, ``clip_fea``,
``reference_latent``, ``time_dim_concat``, ...) around ``_apply_model``, which scales the
latent for the schedule, turns the sigma into the model's timestep and calls
``diffusion_model(xc, t, context=c_crossattn, control=control,
transformer_options=transformer_options, **kwargs)``; the output becomes the denoised
latent. ``x`` is ``[B, C, H, W]``, or ``[B, C, T, H, W]`` for Wan and Qwen-Image."""

import torch

from comfy.patcher_extension import WrapperExecutor, WrappersMP, get_all_wrappers


class BaseModel(torch.nn.Module):
    def __init__(self, diffusion_model, model_sampling):
        super().__init__()
        self.diffusion_model, self.model_sampling = diffusion_model, model_sampling

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None,
                    transformer_options={}, **kwargs):  # noqa: B006 (as ComfyUI)
        return WrapperExecutor.new_class_executor(
            self._apply_model, self, get_all_wrappers(WrappersMP.APPLY_MODEL, transformer_options)
        ).execute(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    def _apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None,
                     transformer_options={}, **kwargs):  # noqa: B006
        sigma = t
        xc = self.model_sampling.calculate_input(sigma, x)
        if c_concat is not None:
            xc = torch.cat([xc, c_concat], dim=1)
        t = self.model_sampling.timestep(t).float()
        out = self.diffusion_model(xc, t, context=c_crossattn, control=control,
                                   transformer_options=transformer_options, **kwargs)
        return self.model_sampling.calculate_denoised(sigma, out.float(), x)


class Flux(BaseModel):
    pass


class WAN21(BaseModel):
    pass


class QwenImage(BaseModel):
    pass
