"""``backend.modules.k_model``: ``KModel``, what Neo's ``UnetPatcher.model`` is: the
diffusion model (``diffusion_model``) and its schedule (``predictor``), and ``apply_model``,
which the ``model_function_wrapper`` receives as the function to call."""

import torch


class KModel(torch.nn.Module):
    def __init__(self, diffusion_model, predictor):
        super().__init__()
        self.diffusion_model, self.predictor = diffusion_model, predictor

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None,
                    transformer_options={}, **kwargs):  # noqa: B006 (as Neo)
        xc = self.predictor.calculate_input(t, x)
        out = self.diffusion_model(xc, self.predictor.timestep(t).float(), context=c_crossattn,
                                   control=control, transformer_options=transformer_options,
                                   **kwargs).float()
        return self.predictor.calculate_denoised(t, out, x)
