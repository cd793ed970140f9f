"""ComfyUI's DiTs pooled through its attention override,
``transformer_options["optimized_attention_override"]`` (0.3.60 and later): a shim that hands
each attention call's tensors to the per-call core (``percall.py``).

Every ComfyUI attention backend is wrapped so that, when a call's ``transformer_options``
hold that key, the backend call ``backend(q, k, v, heads, mask, **kw)`` becomes
``override(backend, q, k, v, heads, mask, **kw)``; every DiT family calls attention this way
(Flux, Kontext, Chroma, Qwen-Image, Wan, HunyuanVideo, SD3, Lumina), with queries and keys
already rotated. Once per model call ComfyUI's ``apply_model`` wrapper (``OverridePatch.
wrapper``) reads the call's ``Spans`` through the family, starts the call's state, and puts the
override (``KvPool``, one stable object per patch) into that call's own ``transformer_options``
(a copy); an override already there (a SageAttention node's) is chained: called with the
pooled tensors, never replaced. ``KvPool`` tells the call's block (``block_type``,
``block_index``) and layout (``skip_reshape``: ``[B, heads, S, D]``, else ``[B, S, heads *
D]``) and gives ``kv.pool_call`` a kernel that calls the backend (or the chained override):
the bias as its mask where the backend adds one, else as an extra channel.

ComfyUI's TorchCompileModel drops every guard on ``transformer_options``, so the call's state
is ``percall``'s module slot, set by the wrapper around the call (outside the compiled
model). A chained override that declines pooled keys (block-sparse attention: the host's
``KvPool.leave``) gets the calls it takes whole. Each call's sampler step (``step_of``: its
sigma's place in ``sample_sigmas``) keys residual reuse, so steps a cache (EasyCache,
LazyCache) skipped count, and tells the steps it skipped after the sampling (``sampling``).
Pure torch: nothing here imports ComfyUI.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from . import budget, dit, graphs, kv, percall
from . import percall_calls as calls
from .config import ToMeConfig
from .kv import Spans
from .layout import Layout
from .modelpatcher import MARK, comfy_name
from .report import PatchReport, Unread

OVERRIDE = "optimized_attention_override"  # ComfyUI's key in transformer_options
# ComfyUI's CallbacksMP (around each sampling run, on the patcher that samples: our clone)
# and WrappersMP kind, read from ComfyUI at use (``modelpatcher.comfy_name``)
PRE_RUN, CLEANUP = ("CallbacksMP", "ON_PRE_RUN"), ("CallbacksMP", "ON_CLEANUP")
SPANS_KEY = "tome_dit"  # the call's ``Spans`` in its transformer_options (for other nodes)
APPLY_MODEL, WRAPPER_KEY = ("WrappersMP", "APPLY_MODEL"), "tome"  # the wrapper kind; our key
# Our override's identity (``KvPool.tome_override``, its ``__module__``/``__qualname__``): what
# a pack that checks which attention ran (ComfyUI's ``attention_backend_history_v1``) reads.
# It never claims ``attention_preprocess_v1`` (a shape-preserving q/k/v transform): it changes
# the keys' and values' length.
IDENTITY = "tome.override.KvPool/1"
ADAPTER = "attention override"  # ``PatchReport.adapter``
# Where ComfyUI keeps the attention backend it chose at start-up (what a DiT's blocks call).
COMFY_KERNEL = ("comfy.ldm.modules.attention", "optimized_attention")


class KvPool(percall.Flags):
    """The override: ``pool(func, q, k, v, heads, mask=None, **kwargs)`` as ComfyUI calls it.

    One per patch, never copied (ComfyUI deep-copies options on every clone). ``flags``
    records that a call reached it (``fired``) and that one was pooled (``pooled``): dict
    writes of constants, replayed by a compiled graph, no tensor read; ``Core.running``
    clears them before each model call and counts them after. ``skipped`` names blocks left
    unpooled and why (eager calls only)."""

    tome_override = IDENTITY  # a stable, documented identity (no ``container_function``:
    # ComfyUI then hands us q, k, v as tensors, never in its attention containers)

    def __init__(self, skipped: list | None = None, tally: Counter | None = None) -> None:
        super().__init__()
        self.__qualname__ = type(self).__qualname__  # what callable-identity readers name
        self.skipped: list[tuple[Any, str]] = [] if skipped is None else skipped
        self.tally = Counter() if tally is None else tally  # ``percall_calls.count``
        self.plans: dict[tuple, dit.DitPlan] = {}  # eager: one per grid and factor
        # The host's ``leave(prev, args, kwargs)``: the name of a chained override that takes
        # this call only with its full keys (ComfyUI's block-sparse attention), else None;
        # ``say`` tells once per name that its calls are left to it.
        self.leave: Callable[[Any, tuple, dict], str | None] | None = None
        self.say: Callable[[str], Any] | None = None
        self.told: set[str] = set()

    def __deepcopy__(self, memo: dict) -> KvPool:
        return self

    def __call__(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        self.flags["fired"] = True
        state, prev = percall.current(self)
        if state is not None:
            out = self._pooled(state, prev, func, args, kwargs)
            if out is not None:
                return out
        else:
            calls.count(self.tally, calls.OUTSIDE)
        return _call(prev, func, args, kwargs)

    def _pooled(self, state: kv.CallState, prev: Any, func: Callable, args: tuple,
                kwargs: dict) -> Any:
        q, k, v = args[0], args[1], args[2]
        dim = 2 if kwargs.get("skip_reshape") else 1
        start = state.start(q.shape[dim], k.shape[dim])
        options = kwargs.get("transformer_options") or {}
        block = (options.get("block_type"), options.get("block_index"))
        state.note(block)
        f = state.factor(*block)
        if start is None or f <= 1:
            calls.count(self.tally, calls.CROSS if start is None else calls.X1)
            return None
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if mask is not None and mask.shape[-1] != k.shape[dim]:
            percall.note(self.skipped, block, percall.MASK)
            calls.count(self.tally, calls.MASKED)
            return None
        if prev is not None and self.leave is not None:
            name = self.leave(prev, args, kwargs)
            if name:  # it declines pooled keys: its calls go to it whole
                calls.count(self.tally, calls.LEFT)
                if name not in self.told and self.say is not None and not graphs.compiling():
                    self.told.add(name)
                    self.say(f"ToMe: attention calls that {name} takes are left to it "
                             "unpooled (it declines pooled keys); the others are pooled")
                return None
        self.flags["pooled"] = True
        calls.count(self.tally, calls.POOLED)

        def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Any:
            if mask is None and len(args) <= 4:
                return _call(prev, func, (q, k, v, *args[3:]), kwargs)
            if len(args) > 4:
                return _call(prev, func, (q, k, v, args[3], mask, *args[5:]), kwargs)
            return _call(prev, func, (q, k, v, *args[3:]), {**kwargs, "mask": mask})

        masks = prev is None and getattr(func, "__name__", "") in percall.MASK_BACKENDS
        return kv.pool_call(state, f, start, q, k, v, dim, kernel, self.plans,
                                 bias="mask" if masks else "channel",
                                 heads=args[3] if len(args) > 3 else kwargs.get("heads"),
                                 flat=not kwargs.get("skip_output_reshape"),
                                 part=state.part(*block), mask=mask)


def _call(prev: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
    """The backend, or the override this one chains, with these (pooled) tensors."""
    if prev is not None:
        return prev(func, *args, **kwargs)
    return func(*args, **kwargs)


class OverridePatch(percall.Core):
    """One patched model (``percall.Core``) with ComfyUI's ``apply_model`` wrapper
    (``wrapper``) and the override it installs (``pool``). ``reuses``: the host calls
    ``reset`` at each run's start and end (``patch`` adds it to ComfyUI's run callbacks), so
    residual reuse applies, keyed by the call's ``cond_or_uncond``."""

    NEVER_CALLED = ("the attention override was installed but never called (a node after this "
                    "ToMe node replaced ComfyUI's optimized_attention_override without calling "
                    "it)")
    SILENT = f"ToMe: {NEVER_CALLED}, so nothing was pooled"

    def __init__(self, config: ToMeConfig, layout: Layout, spans_of: Callable,
                 percent_to_sigma: Callable[[float], float] | None = None,
                 reuses: bool = False):
        super().__init__(config, layout, spans_of, percent_to_sigma, reuses=reuses)
        self.pool = KvPool(self.skipped, self.tally)
        self.on_call: Callable[[dict], Any] | None = None  # the host's look at each call's options
        self.steps: dict[int, list[int]] = {}  # this sampling: step -> [model calls, reaching us]
        self.last_chained: Any = None  # the other override last told (``_tell_chained``)
        self.read = Unread(layout.family)  # the family's ``spans``: raising passes through

    def _tell_chained(self, prev: Any) -> None:
        """One line per other override chained (another node's, before or after ours)."""
        if prev is self.last_chained:
            return
        self.last_chained = prev
        module = re.split(r"[\\/]", getattr(prev, "__module__", None) or "?")[-1]
        name = f"{module}.{getattr(prev, '__qualname__', type(prev).__name__)}"  # no path
        if name not in self.pool.told and self.pool.say is not None:
            self.pool.told.add(name)
            self.pool.say(f"ToMe: another attention override is installed ({name}); ToMe "
                          "calls it with the pooled keys and values")

    def run_start(self, *_: Any) -> None:
        """A sampling run starts (ComfyUI's ``on_pre_run``): reuse reset, steps counted anew."""
        self.run(True)
        self.steps.clear()
        self.forget_steps()

    def run_end(self, *_: Any) -> None:
        """A sampling run ends (ComfyUI's ``on_cleanup``, also after an error or interrupt)."""
        self.run(False)

    def sampling(self) -> calls.Steps | None:
        """This sampling's steps (``percall_calls.Steps``): those a cache answered without our
        attention (no model call, or model calls that reached no attention) and those whose
        calls refreshed residual reuse; None where the sampler's schedule was not seen or no
        step reached the attention."""
        steps = len(self.sigmas[1]) - 1
        if steps < 1 or not any(fired for _, fired in self.steps.values()):
            return None
        inside = sorted(i for i, (_, fired) in self.steps.items() if not fired)
        return calls.Steps(steps, tuple(i for i in range(steps) if i not in self.steps),
                           tuple(inside), sum(self.steps[i][0] for i in inside),
                           tuple(sorted(self.refreshed)), (), tuple(sorted(self.moved)))

    def wrapper(self, executor: Callable, *args: Any, **kwargs: Any) -> Any:
        """ComfyUI's ``apply_model`` wrapper: ``(executor, x, t, c_concat, c_crossattn,
        control, transformer_options, **conds)``. Installs the override in this call's own
        ``transformer_options`` (a copy: nothing outlives the call), chaining one already
        there, with the call's spans under ``SPANS_KEY``; the state is active for the call."""
        args = list(args)
        at = 5 if len(args) > 5 else None
        options = args[5] if at is not None else kwargs.get("transformer_options")
        x = args[0] if args else kwargs.get("x")
        if not isinstance(options, dict) or not isinstance(x, torch.Tensor):
            return executor(*args, **kwargs)
        if self.on_call is not None:
            self.on_call(options)
        context = args[3] if len(args) > 3 else kwargs.get("c_crossattn")
        spans = self.read(self.spans_of, self.layout.root, x, context, kwargs)
        who, sigma = options.get("cond_or_uncond"), options.get("sigmas")
        if isinstance(sigma, torch.Tensor) and sigma.numel():
            sigma = float(sigma.reshape(-1)[0])  # this call's one read of its sigma
        step = self.step_of(options, sigma)
        state = None if spans is None else self.begin(
            spans, sigma, x.device, x.shape[0],
            tuple(who) if isinstance(who, (list, tuple)) else None, x, step,
            len(self.sigmas[1]) - 1 if step is not None else None)
        prev = options.get(OVERRIDE)
        if prev is self.pool:
            prev = None
        elif prev is not None:
            self._tell_chained(prev)
        new = {**options, OVERRIDE: self.pool}
        if spans is not None:
            new[SPANS_KEY] = spans
        if at is not None:
            args[at] = new
        else:
            kwargs["transformer_options"] = new
        with self.running(self.pool, spans, state, prev):
            out = executor(*args, **kwargs)
        if step is not None:
            seen = self.steps.setdefault(step, [0, 0])
            seen[0] += 1
            seen[1] += bool(self.pool.flags.get("fired"))
        return out


def patch(unet_patcher: Any, layout: Layout, config: ToMeConfig, spans_of: Callable,
          percent_to_sigma: Callable[[float], float] | None = None) -> tuple[Any, PatchReport]:
    """A clone of ComfyUI's ``ModelPatcher`` whose ``apply_model`` wrapper (key ``"tome"``)
    installs the override per call, and the report (``adapters.patch_model_patcher`` chooses
    this form); settings that pool nothing: the patcher itself, with the report's
    ``nothing``. Where the patcher has run callbacks (``add_callback_with_key``), residual
    reuse applies, reset at each sampling run's start (``on_pre_run``) and end
    (``on_cleanup``, also after an error or an interrupt)."""
    reuses = hasattr(unet_patcher, "add_callback_with_key")
    ours = OverridePatch(config, layout, spans_of, percent_to_sigma, reuses)
    if ours.budget is not None:  # the model base casts the latent inside the call (issue 47)
        ours.budget.compute = budget.compute_dtype(getattr(unet_patcher, "model", None))
    report = ours.report_as(ADAPTER)
    if report.nothing:
        return unet_patcher, report
    clone = unet_patcher.clone()
    clone.add_wrapper_with_key(comfy_name(*APPLY_MODEL), WRAPPER_KEY, ours.wrapper)
    if reuses:
        clone.add_callback_with_key(comfy_name(*PRE_RUN), WRAPPER_KEY, ours.run_start)
        clone.add_callback_with_key(comfy_name(*CLEANUP), WRAPPER_KEY, ours.run_end)
    setattr(clone, MARK, ours)
    return clone, report


def spans_of(read: Callable) -> Callable:
    """A family's reading of a ComfyUI model call (its ``spans``) as ``Spans``."""
    def spans(model: Any, x: Any, context: Any, conds: dict) -> Spans | None:
        found = read(model, x, context, conds)
        return None if found is None else Spans(*found)
    return spans


def carried(unet_patcher: Any) -> bool:
    """Whether a patcher carries our ``apply_model`` wrapper (an earlier ToMe node's)."""
    wrappers = getattr(unet_patcher, "wrappers", None) or {}
    return bool((wrappers.get(comfy_name(*APPLY_MODEL)) or {}).get(WRAPPER_KEY))


def strip(unet_patcher: Any) -> None:
    """Remove our ``apply_model`` wrapper from ``unet_patcher`` (a clone)."""
    wrappers = getattr(unet_patcher, "wrappers", None) or {}
    wrappers.get(comfy_name(*APPLY_MODEL), {}).pop(WRAPPER_KEY, None)
    if hasattr(unet_patcher, "remove_callbacks_with_key"):
        for kind in (PRE_RUN, CLEANUP):
            unet_patcher.remove_callbacks_with_key(comfy_name(*kind), WRAPPER_KEY)
    if isinstance(getattr(unet_patcher, MARK, None), OverridePatch):
        delattr(unet_patcher, MARK)
