"""The noise schedules ComfyUI 0.8.0's models carry (``model.model_sampling``), as they behave
(written from their public behaviour, not from ComfyUI's code):

- ``ModelSamplingDiscrete``: SD1/SD2/SDXL's 1000-step schedule (scaled-linear betas 0.00085 to
  0.012); a sigma for every training timestep, 14.61 at t=999 down to 0.0292 at t=0;
  ``sigma(t)`` interpolates log-sigma, ``timestep(sigma)`` is the nearest t;
  ``percent_to_sigma(p)`` is the sigma at t = (1 - p) * 999 (a huge number at 0, 0 at 1);
- ``ModelSamplingFlux``: a flow-matching schedule with Flux's time shift
  ``e^shift / (e^shift + 1/t - 1)``; ``percent_to_sigma(p)`` is the shifted ``1 - p``; the
  model's timestep is the sigma itself (Flux, Qwen-Image: shift 1.15);
- ``ModelSamplingDiscreteFlow``: Wan's flow schedule, ``shift * t / (1 + (shift - 1) * t)``
  over 1000 steps (shift 8 for Wan 2.1), the model's timestep ``sigma * 1000``;
- flow models (``CONST``): the model sees the latent as it is and predicts the velocity, the
  denoised latent is ``x - sigma * out``.

``normal_sigmas`` and ``simple_sigmas`` are the schedules the "normal" and "simple"
schedulers hand a KSampler (the sampler's sigmas, ending with 0).
"""

import math

import torch


class ModelSamplingDiscrete(torch.nn.Module):
    def __init__(self, linear_start=0.00085, linear_end=0.012, timesteps=1000):
        super().__init__()
        betas = torch.linspace(linear_start ** 0.5, linear_end ** 0.5, timesteps,
                               dtype=torch.float64) ** 2
        cumprod = torch.cumprod(1.0 - betas, dim=0)
        sigmas = ((1 - cumprod) / cumprod) ** 0.5
        self.register_buffer("sigmas", sigmas.float())
        self.register_buffer("log_sigmas", sigmas.log().float())

    @property
    def sigma_min(self):
        return self.sigmas[0]

    @property
    def sigma_max(self):
        return self.sigmas[-1]

    def timestep(self, sigma):
        return (sigma.log() - self.log_sigmas[:, None]).abs().argmin(dim=0).view(sigma.shape)

    def sigma(self, timestep):
        t = timestep.float().clamp(0, len(self.sigmas) - 1)
        lo, hi = t.floor().long(), t.ceil().long()
        w = t.frac()
        return ((1 - w) * self.log_sigmas[lo] + w * self.log_sigmas[hi]).exp()

    def percent_to_sigma(self, percent):
        if percent <= 0.0:
            return 999999999.9
        if percent >= 1.0:
            return 0.0
        return self.sigma(torch.tensor((1.0 - percent) * 999.0)).item()


class CONST:
    def calculate_input(self, sigma, noise):
        return noise

    def calculate_denoised(self, sigma, model_output, model_input):
        sigma = sigma.reshape(sigma.shape + (1,) * (model_output.ndim - 1))
        return model_input - model_output * sigma


class ModelSamplingFlux(torch.nn.Module, CONST):
    def __init__(self, shift=1.15):
        super().__init__()
        self.shift = shift

    def timestep(self, sigma):
        return sigma

    def sigma(self, t):
        return math.exp(self.shift) / (math.exp(self.shift) + (1 / t - 1))

    def percent_to_sigma(self, percent):
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return self.sigma(1.0 - percent)


class ModelSamplingDiscreteFlow(torch.nn.Module, CONST):
    def __init__(self, shift=8.0, multiplier=1000):
        super().__init__()
        self.shift, self.multiplier = shift, multiplier
        self.register_buffer("sigmas", self.sigma(torch.arange(1, 1001) / 1000 * multiplier))

    def timestep(self, sigma):
        return sigma * self.multiplier

    def sigma(self, timestep):
        t = timestep / self.multiplier
        return self.shift * t / (1 + (self.shift - 1) * t)

    def percent_to_sigma(self, percent):
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return float(self.sigma(torch.tensor((1.0 - percent) * self.multiplier)))


def normal_sigmas(sampling, steps):
    """The "normal" scheduler: timesteps evenly from the largest sigma's to the smallest's."""
    start = float(sampling.timestep(sampling.sigma_max))
    end = float(sampling.timestep(sampling.sigma_min))
    ts = torch.linspace(start, end, steps)
    return torch.tensor([float(sampling.sigma(t)) for t in ts] + [0.0])


def simple_sigmas(sampling, steps):
    """A flow model's "simple" schedule: shifted times 1, 1 - 1/steps, ..., then 0 (every
    ``1000/steps``-th entry of the model's sigma table, from the top, where it has one)."""
    if hasattr(sampling, "sigmas"):
        table = sampling.sigmas
        return torch.tensor([float(table[-(1 + int(x * len(table) / steps))])
                             for x in range(steps)] + [0.0])
    return torch.tensor([sampling.sigma(1 - i / steps) for i in range(steps)] + [0.0])
