"""``comfy.model_base.BaseModel.apply_model`` as ComfyUI 0.8.0 behaves (written from its
observed behaviour): ``apply_model(x, t, c_concat, c_crossattn, control, transformer_options,
**kwargs)`` runs the ``apply_model`` wrappers (``executor.class_obj`` is the model base;
every argument positional, the extra conditions as keywords: ``ref_latents``, ``clip_fea``,
``reference_latent``, ``time_dim_concat``, ...) around ``_apply_model``, which scales the
latent for the schedule, turns the sigma into the model's timestep and calls
``diffusion_model(xc, t, context=c_crossattn, control=control,
transformer_options=transformer_options, **kwargs)``; the output becomes the denoised
latent. ``x`` is ``[B, C, H, W]``, or ``[B, C, T, H, W]`` for Wan and Qwen-Image. Inside
``_apply_model`` (after the wrappers, which see the sampler's float32 latent) the latent, the
context and every extra condition that is a tensor of neither int32 nor int64 (alone or in
a list) are cast to the dtype the model computes in: ``manual_cast_dtype`` where the model
config set one (fp8 weights computed in bf16), else ``get_dtype()``, the diffusion model's
``dtype`` (here: that attribute, else its parameters'); the output is made float32 again."""

import torch

from comfy.patcher_extension import WrapperExecutor, WrappersMP, get_all_wrappers


class BaseModel(torch.nn.Module):
    def __init__(self, diffusion_model, model_sampling, manual_cast_dtype=None):
        super().__init__()
        self.diffusion_model, self.model_sampling = diffusion_model, model_sampling
        self.manual_cast_dtype = manual_cast_dtype

    def get_dtype(self):
        dtype = getattr(self.diffusion_model, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
        return next((p.dtype for p in self.diffusion_model.parameters()), torch.float32)

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
            xc = torch.cat([xc, c_concat.to(xc.dtype)], dim=1)
        dtype = self.get_dtype() if self.manual_cast_dtype is None else self.manual_cast_dtype
        xc = xc.to(dtype)
        context = None if c_crossattn is None else c_crossattn.to(dtype)
        kwargs = {k: [_cast(e, dtype) for e in v] if isinstance(v, list) else _cast(v, dtype)
                  for k, v in kwargs.items()}
        t = self.model_sampling.timestep(t).float()
        out = self.diffusion_model(xc, t, context=context, control=control,
                                   transformer_options=transformer_options, **kwargs)
        return self.model_sampling.calculate_denoised(sigma, out.float(), x)


def _cast(extra, dtype):
    """An extra condition as the model base hands it on: tensors other than int32/int64 in
    the compute dtype."""
    if isinstance(extra, torch.Tensor) and extra.dtype not in (torch.int32, torch.int64):
        return extra.to(dtype)
    return extra


class Flux(BaseModel):
    pass


class WAN21(BaseModel):
    pass


class QwenImage(BaseModel):
    pass
