"""``backend.modules.k_model``: ``KModel``, what Neo's ``UnetPatcher.model`` is: the
diffusion model (``diffusion_model``) and its schedule (``predictor``), and ``apply_model``,
which the ``model_function_wrapper`` receives as the function to call. Inside it (after the
wrapper, which sees the sampler's float32 latent) the latent, the context and every extra
condition that is a tensor of neither int32 nor int64 are cast to ``computation_dtype`` (Neo
sets it from the model's config; here: the given one, else the diffusion model's parameters'),
and the output is made float32 again."""

import torch


class KModel(torch.nn.Module):
    def __init__(self, diffusion_model, predictor, computation_dtype=None):
        super().__init__()
        self.diffusion_model, self.predictor = diffusion_model, predictor
        self.computation_dtype = computation_dtype or next(
            (p.dtype for p in diffusion_model.parameters()), torch.float32)

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None,
                    transformer_options={}, **kwargs):  # noqa: B006 (as Neo)
        dtype = self.computation_dtype
        xc = self.predictor.calculate_input(t, x).to(dtype)
        context = None if c_crossattn is None else c_crossattn.to(dtype)
        kwargs = {k: v.to(dtype) if isinstance(v, torch.Tensor)
                  and v.dtype not in (torch.int32, torch.int64) else v for k, v in kwargs.items()}
        out = self.diffusion_model(xc, self.predictor.timestep(t).float(), context=context,
                                   control=control, transformer_options=transformer_options,
                                   **kwargs).float()
        return self.predictor.calculate_denoised(t, out, x)
