"""The swap adapter: DiT pooling where a host binds its attention function by name (Forge Neo).

Forge Neo has no attention hook: each DiT module binds its attention function when it is
imported (Flux's ``attention(q, k, v, pe, ...)``, Wan's ``attention``, Qwen-Image's and
Lumina's ``attention_function``), and its blocks look that name up in their module at every
call. A family file (``tome/dits/neo_*.py``) names those globals and how each is called
(``Point``: the sequence axis, where a pre-RoPE embedding and a mask are passed) and how a
model call places its tokens (``Form.spans``: ``override.Spans`` from the latent and the
conditioning, plain ints).

This module is the mechanism and names no family. A ``Swap`` is the ``model_function_wrapper``
of one UnetPatcher clone. For each model call it reads the spans, starts the call's state
(step window, policy, each block's factor: ``override.OverridePatch.begin``, shared with
ComfyUI's override), puts one stable pooling callable per point (``Pooled``) into its module,
calls the model (through the wrapper that was there before: chained, never dropped), and puts
every original back in ``finally``, also when the model raises or the user interrupts: no
other call, model or generation sees the swap. (Neo's own Radial Attention extension assigns
``wan.attention`` and never restores it: the pitfall avoided here.)

A ``Pooled`` callable pools a call only where its queries and keys are one sequence holding
the whole call (``text + image + tokens after it``, e.g. Kontext references or padding, which
stay whole; for a family without text in its self-attention, the image alone), counted as the
next block where the host names none; a cross-attention, text-only or refiner call, or one
with a mask, goes to the original untouched. It passes the original function its own call with
pooled keys and values, so whichever kernel the host picked runs the shorter keys. Where the
host rotates inside the function (Flux's ``pe``), keys are rotated here first (``rope``
"before") or pooled and rotated by their cells' mean positions ("pooled"), and no embedding is
passed on. Proportional attention goes in as the mask where the host's kernel adds one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from . import dit, merge, override, patcher
from .config import ToMeConfig
from .report import PatchReport

SWAP = "attention swap"  # how this adapter reaches the blocks (``PatchReport.adapter``)
KERNEL = ("backend.attention", "attention_function")  # the kernel Neo picked at import


class Point(NamedTuple):
    """One module-global attention function and its call form.

    ``dim``: the sequence axis of q, k, v (2 for ``[B, heads, S, D]``, 1 for ``[B, S, heads *
    D]``). ``pe``: ``(position after q, k, v; keyword)`` of a pre-RoPE rotation embedding the
    function applies itself (``[..., S, D/2, 2, 2]`` matrices), None where keys arrive rotated.
    ``mask``: where an attention mask is passed."""

    module: str
    name: str
    dim: int
    pe: tuple[int, str] | None = None
    mask: tuple[int, str] = (1, "mask")


class Form(NamedTuple):
    """What a family gives this adapter (its ``POINTS`` and ``spans``, plain data in its
    file): the points, and ``spans(diffusion_model, x, c)`` (``x`` the latent the model is
    called with, ``c`` its keyword arguments: ``c_crossattn``, ...) giving ``override.Spans``'
    fields, or None where a call cannot be read."""

    points: tuple[Point, ...]
    spans: Callable[[Any, torch.Tensor, dict], tuple | None]

    @classmethod
    def of(cls, points: tuple[tuple, ...], spans: Callable) -> Form:
        return cls(tuple(Point(*p) for p in points), spans)

    @property
    def rotates(self) -> bool:
        """Keys reach a point before RoPE: both ``rope`` options apply."""
        return any(p.pe is not None for p in self.points)


def _arg(where: tuple[int, str], args: tuple, kwargs: dict) -> Any:
    pos, key = where
    return kwargs[key] if key in kwargs else args[pos] if len(args) > pos else None


def _with(where: tuple[int, str], args: tuple, kwargs: dict, value: Any) -> tuple[tuple, dict]:
    pos, key = where
    if key in kwargs or len(args) <= pos:
        return args, {**kwargs, key: value}
    return (*args[:pos], value, *args[pos + 1:]), kwargs


# The current model call, read by the pooling callables: plain values only (a compiled model
# guards on what it reads here: one graph per grid and pooled state, never one per patch);
# ``run`` fills it around the call and puts back what was there.
_call: dict[str, Any] = {"state": None, "rope": "before", "masks": False, "block": 0,
                         "fired": False, "skip": None}


class Pooled:
    """The pooling stand-in for one point: one object per point for the process (a compiled
    model guards on the global's identity), holding the function it replaced in the current
    call; what to pool comes from ``_call``."""

    def __init__(self, point: Point):
        self.point, self.original = point, None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:
        point, original, call = self.point, self.original, _call
        call["fired"] = True
        found = plan_for(call, q, k, point.dim, kwargs.get("transformer_options"))
        if found is None:
            return original(q, k, v, *args, **kwargs)
        plan, start = found
        n = k.shape[point.dim]
        if _arg(point.mask, args, kwargs) is not None:
            call["skip"]("an attention mask (pooling would misalign it)")
            return original(q, k, v, *args, **kwargs)
        pe = _arg(point.pe, args, kwargs) if point.pe is not None else None
        if pe is not None:  # the host rotates inside: rotate here, pass no embedding on
            k = plan.keys(k, start, point.dim, pe, dit.rotate,
                          lambda e: plan.rotations(e, start))
            q = dit.rotate(q, pe)
            args, kwargs = _with(point.pe, args, kwargs, None)
        else:
            k = plan.pool(k, start, point.dim)
        bias = plan.bias(start, n, k.device) if call["masks"] else None
        if bias is not None:
            args, kwargs = _with(point.mask, args, kwargs, bias.to(q.dtype).view(1, 1, 1, -1))
        return original(q, k, plan.pool(v, start, point.dim), *args, **kwargs)


_POOLED: dict[Point, Pooled] = {}


def pooled(point: Point) -> Pooled:
    """The process's one pooling callable for ``point``."""
    if point not in _POOLED:
        _POOLED[point] = Pooled(point)
    return _POOLED[point]


def plan_for(call: dict, q: torch.Tensor, k: torch.Tensor, dim: int, options: Any
             ) -> tuple[dit.DitPlan, int] | None:
    """``(plan, image start)`` for one attention call of the current model call, or None: not
    the call's whole sequence, a block the schedule leaves out at this step."""
    state = call["state"]
    if state is None:
        return None
    s, n = state.spans, q.shape[dim]
    if n != k.shape[dim] or n != s.text + s.before + s.image + s.after:
        return None
    index = options.get("block_index") if isinstance(options, dict) else None
    kind = options.get("block_type") if isinstance(options, dict) else None
    if not isinstance(index, int):  # the host names no block: count them
        kind, index = "double", call["block"]
    call["block"] += 1
    f = state.factor(kind, index)
    if f <= 1:
        return None
    start = s.before + (s.text if s.text_first else 0)
    return override.cached_plan(_PLANS, s, f, call["rope"], state.proportional), start


# The current model call's plans (``Swap.run`` clears it: a plan caches the call's embedding
# by identity, so it never outlives its call).
_PLANS: dict[tuple, dit.DitPlan] = {}


class Swap:
    """The ``model_function_wrapper`` of one patched UnetPatcher clone (see the module
    docstring). ``previous``: the wrapper the patcher had, called around ours."""

    SILENT = ("ToMe: the attention functions were swapped but never called (another "
              "extension replaced them, or the model runs its own kernels), so nothing was "
              "pooled")

    def __init__(self, config: ToMeConfig, layout: Any, form: Form,
                 percent_to_sigma: Callable[[float], float] | None = None,
                 previous: Callable | None = None):
        self.form, self.previous, self.model = form, previous, layout.root
        self.core = override.OverridePatch(config, layout, form.spans, percent_to_sigma,
                                           rotated=not form.rotates)
        kernel = getattr(sys.modules.get(KERNEL[0]), KERNEL[1], None)
        self.masks = getattr(kernel, "__name__", "") in override.MASK_BACKENDS
        if self.core.applied.proportional and not self.masks:
            self.core.limits.append("proportional attention (the host's attention kernel "
                                    "takes no mask)")
        self.applied, self.limits = self.core.applied, self.core.limits
        self.skipped = self.core.skipped
        self.calls = self.reached = 0  # model calls run swapped / that reached our functions
        self.on_silent: Callable[[], Any] | None = None  # told once: swapped, never reached

    def __deepcopy__(self, memo: dict) -> Swap:
        return self  # shared by clones: a wrapper is one function, like a closure

    @property
    def report(self) -> PatchReport | None:
        return self.core.report

    def __call__(self, apply_model: Callable, params: dict) -> Any:
        run = partial(self.run, apply_model)
        if self.previous is not None:
            return self.previous(run, params)
        return run(params["input"], params["timestep"], **params["c"])

    def run(self, apply_model: Callable, x: torch.Tensor, t: Any, **c: Any) -> Any:
        """One model call with our functions in place of the points' globals, put back in
        ``finally`` whatever happens."""
        found = self.form.spans(self.model, x, c)
        state = None if found is None else \
            self.core.begin(override.Spans(*found), t, x.device, x.shape[0])
        if state is None:
            return apply_model(x, t, **c)
        before, saved = dict(_call), []
        _PLANS.clear()
        _call.update(state=state, rope=self.applied.rope, masks=self.masks, block=0,
                     fired=False, skip=self.skip)
        try:
            for point in self.form.points:
                module, ours = sys.modules.get(point.module), pooled(point)
                current = getattr(module, point.name, None)
                if current is None or current is ours:  # not loaded, or a nested call
                    continue
                ours.original = current
                saved.append((module, point.name, current))
                setattr(module, point.name, ours)
            return apply_model(x, t, **c)
        finally:
            for module, name, original in reversed(saved):
                setattr(module, name, original)
            fired = _call["fired"]
            _call.update(before)
            _PLANS.clear()
            self.calls += 1
            self.reached += fired
            if not self.reached and self.calls == 1 and self.on_silent is not None:
                self.on_silent()

    def skip(self, why: str) -> None:
        if not merge.compiling() and not any(w == why for _, w in self.skipped):
            self.skipped.append((("attention", _call["block"] - 1), why))


def wrapper_of(unet_patcher: Any) -> Callable | None:
    """The patcher's ``model_function_wrapper`` (a single slot), or None."""
    return (getattr(unet_patcher, "model_options", None) or {}).get("model_function_wrapper")


def patch(unet_patcher: Any, layout: Any, form: Form, config: ToMeConfig
          ) -> tuple[Any, PatchReport]:
    """A clone of ``unet_patcher`` whose ``model_function_wrapper`` is a ``Swap`` chaining the
    one it had, and the report (``adapters.patch_model_patcher`` chooses this form). Settings
    that pool nothing return the patcher unchanged with the report's ``nothing``."""
    sampling = patcher.model_sampling(unet_patcher)
    swap = Swap(config, layout, form, getattr(sampling, "percent_to_sigma", None),
                wrapper_of(unet_patcher))
    report = swap.core.report_as(SWAP)
    if report.nothing:
        return unet_patcher, report
    unet = unet_patcher.clone()
    unet.set_model_unet_function_wrapper(swap)
    setattr(unet, patcher.MARK, swap)
    return unet, report
