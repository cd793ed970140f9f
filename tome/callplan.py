"""The one planner of a DiT model call, for every bracket: what the processors' forward
pre-hook (diffusers, A1111's SD3) and the per-call core (ComfyUI's ``apply_model`` wrapper,
Forge Neo's and InvokeAI's swap) ask at the start of each model call.

``Planned.plan_call`` turns the call (its latent size and token grid, its noise level,
batch rows, the host's identity of it, the sampler's step and step count) into the call's
plan: whether the window and the auto policy let it pool (``plan.Planner``), its sampling
progress, residual reuse begun for it (``reuse.Reuse.begin``), what the memory budget lets
reuse keep (``budget.ReuseBudget.begin``) and the schedule's factor for each block.

Where the hosts differ is an input, not a copy: the noise level's units are the planner's
window's (a 0-999 timestep, ``scale`` from the model's own, or a sigma: ``plan.Window``);
which block factors read the progress follows the window too (a timestep window's edges
are the progress's own, so every factor reads it; a sigma window's edges are widened, so
the progress is read where the schedule varies or the budget changed it). It runs on the
host (``graphs.host_side``): eager where a bracket runs inside a model compiled whole (the
processors' pre-hook), as the per-call hosts' brackets run outside it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import dit, graphs, plan


class CallPlan(NamedTuple):
    """One model call's plan: its ``plan.Call``, its sampling progress (None: not read), the
    schedule it runs (the memory budget's fallback where reuse keeps nothing), each block's
    factor in the model's order, and residual reuse where it is active in this call."""

    call: plan.Call
    progress: float | None
    schedule: dit.Schedule
    factors: tuple[int, ...]
    reuse: Any = None


class Planned:
    """A patch that plans its model calls: ``planner`` (window in the host's units, policy),
    ``schedule``, ``kinds`` (each block's kind, in the model's order), ``factors`` (each
    block's factor without reading the progress), ``reuse`` (``reuse.Reuse`` or None) and
    ``budget`` (``budget.ReuseBudget`` or None)."""

    planner: plan.Planner
    schedule: dit.Schedule
    kinds: list[str]
    factors: tuple[int, ...]
    reuse: Any
    budget: Any

    def static_factors(self) -> tuple[int, ...]:
        """Each block's factor where the call's progress is not read."""
        n = len(self.kinds)
        return tuple(self.schedule.factor(i, kind, n, None) for i, kind in enumerate(self.kinds))

    @graphs.host_side  # eager in a model compiled whole: its reads never guard a graph
    def plan_call(self, size: tuple[int, ...], tokens: int, device: Any, noise: Any,
                  batch: int, *, grid: tuple[int, ...], text: int, who: Any = None,
                  x: torch.Tensor | None = None, step: int | None = None,
                  total: int | None = None, scale: float | None = None) -> CallPlan | None:
        """The plan of a model call on a latent of ``size`` (frames, height, width in latent
        pixels) with ``tokens`` image tokens, or None where it pools nothing (the window, the
        policy). ``noise``: its timestep or sigma (a tensor is read on the host once, only
        where the window, a varying schedule or reuse needs it; ``scale`` multiplies a
        tensor first, in its dtype: a timestep in the model's own units); ``grid`` and
        ``who``: the call's identity for reuse (with its ``batch`` rows); ``text``: the
        tokens beside the image (the budget counts them); ``x``: the latent the budget
        reads (None: no budget); ``step``: the sampler's step where the host tells it;
        ``total``: its steps (reuse's refreshes paced to them)."""
        reuse = self.reuse if self.reuse is not None and self.reuse.every else None
        schedule = self.schedule
        if isinstance(noise, torch.Tensor):
            use = reuse is not None or schedule.varies() or not self.planner.window.full
            if use and noise.numel():
                first = noise.reshape(-1)[0]
                noise = float(first * scale if scale is not None else first)
            else:
                noise = None
        if reuse is not None and total:  # before a measurement: it times this period
            reuse.pace(total)
        call = self.planner.begin(size, device, noise, batch)
        if call is None or not self.planner.merges(call, tokens):
            return None
        progress = None
        if (schedule.varies() or reuse is not None) and noise is not None:
            progress = self.planner.window.progress(noise)
        active = None
        if reuse is not None and progress is not None:
            reuse.begin(progress, batch, grid, who, device, step)
            if x is not None and self.budget is not None:  # checked before reuse keeps it
                schedule = self.budget.begin(x, size, text, progress)
            active = reuse if reuse.active else None
        factors = self.factors
        every = self.planner.window.bounds is None  # a timestep window: every factor reads it
        if progress is not None and (every or schedule.varies() or schedule is not self.schedule):
            n = len(self.kinds)
            factors = tuple(schedule.factor(i, kind, n, progress)
                            for i, kind in enumerate(self.kinds))
        return CallPlan(call, progress, schedule, factors, active)
