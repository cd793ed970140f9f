"""``backend.modules.k_prediction``: the flow-matching noise schedules of Neo's DiTs.

``PredictionFlux`` (Flux, Chroma): ``sigma(t) = e^shift / (e^shift + 1/t - 1)`` with shift 1.15,
the model called with the sigma itself; ``PredictionDiscreteFlow`` (Wan, Qwen-Image, Z-Image):
``shift * t / (1 + (shift - 1) * t)``, the model called with ``sigma * 1000``. Both answer
``percent_to_sigma`` (1 at 0, 0 at 1) and the k-diffusion ``calculate_input`` /
``calculate_denoised`` of a flow model. Written from their behaviour.
"""

import math

import torch


class _Flow(torch.nn.Module):
    def calculate_input(self, sigma, x):
        return x

    def calculate_denoised(self, sigma, out, x):
        return x - out * sigma.view(-1, *[1] * (out.ndim - 1))

    def percent_to_sigma(self, percent):
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return self.sigma(1.0 - percent)

    def simple_sigmas(self, steps):
        """Neo's "Simple" scheduler: ``sigma(1 - i / steps)`` per step, then 0."""
        return torch.tensor([self.sigma(1.0 - i / steps) for i in range(steps)] + [0.0])


class PredictionFlux(_Flow):
    def __init__(self, shift=1.15):
        super().__init__()
        self.shift = shift

    def sigma(self, t):
        return math.exp(self.shift) / (math.exp(self.shift) + (1 / t - 1))

    def timestep(self, sigma):
        return sigma


class PredictionDiscreteFlow(_Flow):
    def __init__(self, shift=1.0, multiplier=1000):
        super().__init__()
        self.shift, self.multiplier = shift, multiplier

    def sigma(self, t):
        return self.shift * t / (1 + (self.shift - 1) * t)

    def timestep(self, sigma):
        return sigma * self.multiplier
