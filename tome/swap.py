"""The swap adapter: DiT pooling where a host binds its attention function by name (Forge Neo),
a shim that hands each attention call's tensors to the per-call core (``percall.py``).

Forge Neo has no attention hook: each DiT module binds its attention function when it is
imported (Flux's ``attention(q, k, v, pe, ...)``, Wan's ``attention``, Qwen-Image's and
Lumina's ``attention_function``), and its blocks look that name up in their module at every
call. A family file (``tome/dits/neo_*.py``) names those globals and how each is called
(``Point``: the sequence axis, where a pre-RoPE embedding and a mask are passed) and how a
model call places its tokens (``Form.spans``: ``kv.Spans`` from the latent and the
conditioning, plain ints).

This module is the mechanism and names no family. A ``Swap`` is the ``model_function_wrapper``
of one UnetPatcher clone. For each model call it reads the spans, starts the call's state
(``percall.Core``: step window, policy, each block's factor), and inside the core's bracket
(``Core.running``) puts one stable pooling callable per point (``Pooled``) into its module,
calls the model (through the wrapper that was there before: chained, never dropped), and puts
every original back in ``finally``, also when the model raises or the user interrupts: no
other call, model or generation sees the swap. (Neo's own Radial Attention extension assigns
``wan.attention`` and never restores it: the pitfall avoided here.)

A ``Pooled`` callable pools a call only where its queries and keys are one sequence of the
call (``kv.CallState.start``), counted as the next block where the host names none; a
cross-attention, text-only or refiner call, or one with a mask, goes to the original
untouched. It passes the original function its own call with pooled keys and values, so
whichever kernel the host picked runs the shorter keys. Where the host rotates inside the
function (Flux's ``pe``), the core rotates first and no embedding is passed on. Proportional
attention goes in as the mask where the host's kernel adds one.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from . import budget, kv, percall
from . import percall_calls as calls
from .config import ToMeConfig
from .modelpatcher import MARK
from .report import STATE_ATTR, PatchReport, Unread

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
    always_rotates: bool = False  # takes no ``pe=None`` (InvokeAI): given the identity instead


class Form(NamedTuple):
    """What a family gives this adapter (its ``POINTS`` and ``spans``, plain data in its
    file): the points, and ``spans(diffusion_model, x, c)`` (``x`` the latent the model is
    called with, ``c`` its keyword arguments: ``c_crossattn``, ...) giving ``kv.Spans``'
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


class Pooled:
    """The pooling stand-in for one point: one object per point for the process (a compiled
    model guards on the global's identity), holding the function it replaced in the current
    call; what to pool comes from the current call's ``Swap`` (``percall.current``)."""

    def __init__(self, point: Point):
        self.point, self.original = point, None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:
        point, original = self.point, self.original
        swap, state, _ = percall.now()
        if state is None or not isinstance(swap, Swap):
            return original(q, k, v, *args, **kwargs)
        swap.flags["fired"] = True
        start = state.start(q.shape[point.dim], k.shape[point.dim], whole=True)
        if start is None:
            calls.count(swap.tally, calls.CROSS)
            return original(q, k, v, *args, **kwargs)
        options = kwargs.get("transformer_options")
        index = options.get("block_index") if isinstance(options, dict) else None
        kind = options.get("block_type") if isinstance(options, dict) else None
        if not isinstance(index, int):  # the host names no block: count them
            kind, index = "double", swap.block
        swap.block += 1
        f = state.factor(kind, index)
        if f <= 1:
            calls.count(swap.tally, calls.X1)
            return original(q, k, v, *args, **kwargs)
        mask = _arg(point.mask, args, kwargs)
        if mask is not None and mask.shape[-1] != k.shape[point.dim]:
            percall.note(swap.skipped, ("attention", swap.block - 1), percall.MASK)
            calls.count(swap.tally, calls.MASKED)
            return original(q, k, v, *args, **kwargs)
        swap.flags["pooled"] = True
        calls.count(swap.tally, calls.POOLED)
        pe = _arg(point.pe, args, kwargs) if point.pe is not None else None
        if pe is not None:  # the host rotates inside: the core rotates, pass no embedding on
            args, kwargs = _with(point.pe, args, kwargs, identity(pe) if point.always_rotates
                                 else None)

        def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Any:
            a, kw = (args, kwargs) if mask is None and _arg(point.mask, args, kwargs) is None \
                else _with(point.mask, args, kwargs, mask)
            return original(q, k, v, *a, **kw)

        return kv.pool_call(state, f, start, q, k, v, point.dim, kernel, swap.plans,
                                 rope=swap.applied.rope, pe=pe,
                                 bias="mask" if swap.masks else None,
                                 part=state.part(kind, index), mask=mask)


def identity(pe: torch.Tensor) -> torch.Tensor:
    """The rotation that leaves every pair as it is, ``[..., 1, D/2, 2, 2]`` (one position:
    it broadcasts over the queries and the pooled keys alike), in ``pe``'s dtype."""
    eye = torch.eye(2, dtype=pe.dtype, device=pe.device)
    return eye.expand(*pe.shape[:-4], 1, pe.shape[-3], 2, 2)


_POOLED: dict[Point, Pooled] = {}


def pooled(point: Point) -> Pooled:
    """The process's one pooling callable for ``point``."""
    if point not in _POOLED:
        _POOLED[point] = Pooled(point)
    return _POOLED[point]


class Swap(percall.Core, percall.Flags):
    """The ``model_function_wrapper`` of one patched UnetPatcher clone (see the module
    docstring): the patch (``percall.Core``) and its per-call swap. ``previous``: the wrapper
    the patcher had, called around ours. Residual reuse applies, keyed by the call's
    ``cond_or_uncond``: the WebUI patches a fresh clone per generation (its run start) and
    ``adapters.remove`` resets it at the generation's end (``Core.reset``)."""

    NEVER_CALLED = ("the attention functions were swapped but never called (another "
                    "extension replaced them, or the model runs its own kernels)")
    SILENT = f"ToMe: {NEVER_CALLED}, so nothing was pooled"

    def __init__(self, config: ToMeConfig, layout: Any, form: Form,
                 percent_to_sigma: Callable[[float], float] | None = None,
                 previous: Callable | None = None):
        super().__init__(config, layout, form.spans, percent_to_sigma, rotated=not form.rotates,
                         reuses=True)
        self.form, self.previous, self.model = form, previous, layout.root
        kernel = getattr(sys.modules.get(KERNEL[0]), KERNEL[1], None)
        self.masks = getattr(kernel, "__name__", "") in percall.MASK_BACKENDS
        if self.applied.proportional and not self.masks:
            self.limits.append("proportional attention (the host's attention kernel takes no "
                               "mask)")
        percall.Flags.__init__(self)  # this call's: reached, pooled (``Core.running``)
        self.block = 0  # this call's attention calls counted where the host names no block
        # this call's plans (a plan caches the call's embedding by identity: cleared per call)
        self.plans: dict[tuple, Any] = {}
        self.read = Unread(layout.family)  # the family's ``spans``: raising passes through

    def __call__(self, apply_model: Callable, params: dict) -> Any:
        who = params.get("cond_or_uncond")
        run = partial(self.run, apply_model, who=tuple(who) if isinstance(who, list) else None)
        if self.previous is not None:
            return self.previous(run, params)
        return run(params["input"], params["timestep"], **params["c"])

    def run(self, apply_model: Callable, x: torch.Tensor, t: Any, who: Any = None, **c: Any
            ) -> Any:
        """One model call with our functions in place of the points' globals (where it pools
        at this step), put back in ``finally`` whatever happens; ``who``: its identity."""
        found = self.read(self.form.spans, self.model, x, c)
        spans = None if found is None else self.read(kv.Spans, *found)
        sigma, step, total = t, None, None
        options = c.get("transformer_options")
        if self.reuse is not None and isinstance(t, torch.Tensor) and t.numel() and \
                isinstance(options, dict) and "sample_sigmas" in options:
            sigma = float(t.reshape(-1)[0])  # this call's one read of its sigma
            step = self.step_of(options, sigma)  # the sampler's: steps a cache skipped count
            total = len(self.sigmas[1]) - 1 if step is not None else None
        state = None if spans is None else self.begin(spans, sigma, x.device, x.shape[0], who,
                                                      x, step, total)
        saved: list[tuple[Any, str, Any]] = []
        before = self.block
        self.block = 0
        self.plans.clear()
        try:
            with self.running(self, spans, state, installed=state is not None):
                if state is not None:
                    for point in self.form.points:
                        module, ours = sys.modules.get(point.module), pooled(point)
                        current = getattr(module, point.name, None)
                        if current is None or current is ours:  # not loaded, or nested
                            continue
                        ours.original = current
                        saved.append((module, point.name, current))
                        setattr(module, point.name, ours)
                return apply_model(x, t, **c)
        finally:
            for module, name, original in reversed(saved):
                setattr(module, name, original)
            self.block = before
            self.plans.clear()


def patch_module(model: nn.Module, layout: Any, form: Form, config: ToMeConfig,
                 latent: str = "img", timestep: str = "timesteps") -> PatchReport:
    """The same swap on a model held as a plain module whose blocks call a module-level
    attention function (InvokeAI's Flux): its bracket is the module's own ``forward``, shadowed
    on the instance (``unpatch_module`` deletes it), reading the ``latent`` and ``timestep``
    arguments by name; timesteps are flow sigmas (progress ``1 - t``). A family file and this
    choice of parts, no adapter of its own (``docs/development.md``, "Adding a host")."""
    swap = Swap(config, layout, form, lambda p: 1.0 - p)
    report = swap.report_as(SWAP)
    if report.nothing:
        return report
    forward = model.forward
    bind = inspect.signature(forward).bind

    def bracketed(*args: Any, **kwargs: Any) -> Any:
        c = dict(bind(*args, **kwargs).arguments)
        x, t = c.pop(latent), c.pop(timestep)
        return swap.run(lambda x, t, **c: forward(**{latent: x, timestep: t}, **c), x, t, **c)

    model.forward = bracketed
    setattr(model, STATE_ATTR, swap)
    return report


def unpatch_module(model: nn.Module) -> bool:
    """Remove ``patch_module``'s swap from ``model``; whether there was one."""
    if not isinstance(vars(model).get(STATE_ATTR), Swap):
        return False
    swap = vars(model).pop(STATE_ATTR)
    vars(model).pop("forward", None)
    swap.reset()
    return True


def wrapper_of(unet_patcher: Any) -> Callable | None:
    """The patcher's ``model_function_wrapper`` (a single slot), or None."""
    return (getattr(unet_patcher, "model_options", None) or {}).get("model_function_wrapper")


def patch(unet_patcher: Any, layout: Any, form: Form, config: ToMeConfig,
          percent_to_sigma: Callable[[float], float] | None = None) -> tuple[Any, PatchReport]:
    """A clone of ``unet_patcher`` whose ``model_function_wrapper`` is a ``Swap`` chaining the
    one it had, and the report (``adapters.patch_model_patcher`` chooses this form). Settings
    that pool nothing return the patcher unchanged with the report's ``nothing``."""
    swap = Swap(config, layout, form, percent_to_sigma, wrapper_of(unet_patcher))
    if swap.budget is not None:  # the KModel casts the latent inside the call (issue 47)
        swap.budget.compute = budget.compute_dtype(getattr(unet_patcher, "model", None))
    report = swap.report_as(SWAP)
    if report.nothing:
        return unet_patcher, report
    unet = unet_patcher.clone()
    unet.set_model_unet_function_wrapper(swap)
    setattr(unet, MARK, swap)
    return unet, report
