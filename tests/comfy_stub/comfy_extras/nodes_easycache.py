"""ComfyUI's core ``EasyCache`` and ``LazyCache`` nodes (``comfy_extras/nodes_easycache.py``,
in 0.8.0 and v0.30) as they behave, written from their observable behaviour (no ComfyUI
code): each skips whole model calls once the model's output is predicted to change little,
and answers them with the last computed change (``output - input``) added to the input.

- ``EasyCache``: a ``diffusion_model`` wrapper (inside ``apply_model``: an ``apply_model``
  wrapper around it still runs, but the model's blocks, and so the attention, do not), a
  ``calc_cond_batch`` wrapper (each step starts unskipped) and an ``outer_sample`` wrapper
  (a fresh holder per sampling in a copy of the guider's options; one log line at the end,
  "EasyCache - skipped N/M steps (Sx speedup)."). The first condition's call of a step
  decides; the other conditions of that step follow it. State: ``transformer_options["easycache"]``.
  A call is skipped only where each of its conditions has a kept change (else it is
  computed and the sum restarts), as v0.30's ``can_apply_cache_diff``. The real v0.30 nodes
  stacked with ours (docs/comfyui.md, issue 49) skip and log as this stand-in does.
- ``LazyCache``: a ``predict_noise`` wrapper: a skipped step never reaches ``apply_model``.

The decision: from ``start_percent`` (a sigma, ``model_sampling.percent_to_sigma``) until
``end_percent``, the mean absolute change of the (8x subsampled) input since the last
computed call, times the last ratio of output change to input change, over the last
output's mean magnitude, is summed over steps; below ``reuse_threshold`` the step is
skipped, else computed and the sum restarts. Random weights change their output a lot, so
the default threshold (0.2) skips nothing there. ``skipped``: the sigmas of the steps the
holder skipped (the stand-in's record for tests)."""

from __future__ import annotations

import logging

import torch

KEY = "easycache"


class Holder:
    def __init__(self, name, reuse_threshold, start_percent, end_percent, subsample=8):
        self.name, self.threshold = name, reuse_threshold
        self.start_percent, self.end_percent, self.factor = start_percent, end_percent, subsample
        self.start_sigma = self.end_sigma = 0.0
        self.rate = self.x_prev = self.out_prev = self.norm = None
        self.total, self.skip_now, self.first = 0.0, False, None
        self.diffs: dict = {}
        self.skipped: list[float] = []

    def fresh(self, model_sampling):
        h = Holder(self.name, self.threshold, self.start_percent, self.end_percent, self.factor)
        h.start_sigma = float(model_sampling.percent_to_sigma(self.start_percent))
        h.end_sigma = float(model_sampling.percent_to_sigma(self.end_percent))
        return h

    def sub(self, x):
        return x[..., ::self.factor, ::self.factor]

    def inside(self, sigma):
        """Whether this sigma is one the cache may skip (from start until end)."""
        return self.end_sigma < sigma <= self.start_sigma

    def decide(self, x, can=True):
        """Whether to skip this call (the first condition's); the input change. ``can``:
        every condition of the call has a kept change (EasyCache computes a call it cannot
        answer whole, and restarts the sum)."""
        change = None if self.x_prev is None else float((self.sub(x) - self.x_prev).abs().mean())
        if change is not None and self.rate is not None and self.norm:
            self.total += self.rate * change / self.norm
            if self.total < self.threshold and can:
                return True, change
            self.total = 0.0
        return False, change

    def keep(self, x, out, change):
        """After a computed call: the output's change rate, the last input and output."""
        if self.out_prev is not None and change:
            self.rate = float((self.sub(out) - self.out_prev).abs().mean()) / change
        self.x_prev, self.out_prev = self.sub(x).clone(), self.sub(out).clone()
        self.norm = float(out.abs().mean())


def _options(args, kwargs):
    """The model forward's ``transformer_options``: a keyword or the last positional dict."""
    if isinstance(kwargs.get("transformer_options"), dict):
        return kwargs["transformer_options"]
    return [a for a in args if isinstance(a, dict)][-1]


def easycache_forward(executor, *args, **kwargs):
    options = _options(args, kwargs)
    h: Holder = options[KEY]
    x, sigma, uuids = args[0], float(options["sigmas"].reshape(-1)[0]), options["uuids"]
    if not h.inside(sigma):
        return executor(*args, **kwargs)
    if h.first is None:
        h.first = uuids[0]
    decides, change = h.first in uuids, None
    can = all(u in h.diffs for u in uuids)
    if h.skip_now and can:
        return _cached(h, x, uuids)
    if decides:
        skip, change = h.decide(x, can)
        if skip:
            h.skip_now = True
            h.skipped.append(sigma)
            return _cached(h, x, uuids)
    out = executor(*args, **kwargs)
    rows = x.shape[0] // len(uuids)
    for i, u in enumerate(uuids):
        h.diffs[u] = (out - x)[i * rows:(i + 1) * rows]
    if decides:
        h.keep(x, out, change)
    return out


def _cached(h, x, uuids):
    rows = x.shape[0] // len(uuids)
    return torch.cat([x[i * rows:(i + 1) * rows] + h.diffs[u] for i, u in enumerate(uuids)])


def easycache_calc_cond_batch(executor, *args, **kwargs):
    args[-1]["transformer_options"][KEY].skip_now = False
    return executor(*args, **kwargs)


def lazycache_predict_noise(executor, x, sigma, model_options, seed=None):
    h: Holder = model_options["transformer_options"][KEY]
    s = float(sigma.reshape(-1)[0])
    change = None
    if h.inside(s):
        skip, change = h.decide(x)
        if skip:
            h.skipped.append(s)
            return x + h.diffs[None]
    out = executor(x, sigma, model_options, seed)
    h.diffs[None] = out - x
    h.keep(x, out, change)
    return out


def sample_wrapper(executor, *args, **kwargs):
    from comfy.patcher_extension import copy_nested_dicts
    guider = executor.class_obj
    before = guider.model_options
    guider.model_options = copy_nested_dicts(before)
    to = guider.model_options["transformer_options"]
    to[KEY] = h = to[KEY].fresh(guider.model_patcher.get_model_object("model_sampling"))
    sample_wrapper.last = h
    try:
        return executor(*args, **kwargs)
    finally:
        steps = len(args[3]) - 1
        speedup = steps / max(steps - len(h.skipped), 1)
        logging.info(f"{h.name} - skipped {len(h.skipped)}/{steps} steps ({speedup:.2f}x speedup).")
        guider.model_options = before


class EasyCache:
    def execute(self, model, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95):
        m = model.clone()
        m.model_options["transformer_options"][KEY] = Holder("EasyCache", reuse_threshold,
                                                             start_percent, end_percent)
        m.add_wrapper_with_key("outer_sample", "easycache", sample_wrapper)
        m.add_wrapper_with_key("calc_cond_batch", "easycache", easycache_calc_cond_batch)
        m.add_wrapper_with_key("diffusion_model", "easycache", easycache_forward)
        return (m,)


class LazyCache:
    def execute(self, model, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95):
        m = model.clone()
        m.model_options["transformer_options"][KEY] = Holder("LazyCache", reuse_threshold,
                                                             start_percent, end_percent)
        m.add_wrapper_with_key("outer_sample", "lazycache", sample_wrapper)
        m.add_wrapper_with_key("predict_noise", "lazycache", lazycache_predict_noise)
        return (m,)
