"""Patching UNets: forward hooks around each transformer block's sub-layers.

One mechanism serves ldm (SD1/SD2), sgm (SDXL) and diffusers: the block's input is caught by
a pre-hook on the block, and the sub-layers (``attn1``, ``attn2``, ``ff``) get pre-hooks that
merge their input and hooks that unmerge their output. Nothing about the block's own forward
is copied or replaced, so new block features in diffusers, attention-kernel swaps in the
WebUI (which replace ``CrossAttention.forward`` at class level) and ``_forward`` overrides all
keep working, and removal is exact: the hooks go, one attribute on the UNet goes, and no
class or weight was ever touched.

Per UNet call a pre-hook on the UNet starts a ``plan.Call`` (latent size, timestep); the
block pre-hook asks the shared ``plan.Planner`` for the block's plan, and the sub-layer hooks
apply it through the method (``methods.py``: which sub-layers, what they receive, whether
their output is restored). Which blocks merge, how destinations are drawn and when matching
runs are decided in ``plan.py``, shared with the ModelPatcher adapter (``patcher.py``); the
UNet's structure is read in ``layout.py``. Both adapters answer with ``report.PatchReport``.
DiTs have no such blocks: ``adapters.py`` hands them to ``processors.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from . import graphs, methods
from . import layout as _layout
from . import plan as _plan
from .config import ToMeConfig
from .layout import Layout, UnsupportedModelError, unusable
from .report import HOOKS, STATE_ATTR, PatchReport


class _State:
    def __init__(self, config: ToMeConfig, report: PatchReport, layout: Layout):
        self.config, self.report = config, report
        self.decoder = {b.module for b in layout.blocks if b.decoder}  # upsampling side
        self.context_keyword = layout.context_keyword
        self.planner = report.planner
        self.handles: list[Any] = []
        self.call: _plan.Call | None = None
        self.warned: set[str] = set()
        # id(block) -> the plan for the block's current call. Kept here, not on the blocks, so
        # removal leaves nothing behind.
        self.plans: dict[int, Any] = {}
        self.hooks: _Hooks | None = None
        self.removed = False

    def warn_once(self, msg: str) -> None:
        if msg not in self.warned:
            self.warned.add(msg)
            warnings.warn(msg, stacklevel=3)


# ----------------------------------------------------------------------------- blocks

def _block_problem(block: nn.Module, config: ToMeConfig, method: methods.Method
                   ) -> str | None:
    """Why a block cannot be patched safely, or None: it is unusable, or another patch
    observes a sub-layer's full token sequence through hooks, or the method refuses it."""
    subs = method.sub_layers(config)
    problem = unusable(block, subs)
    if problem:
        return problem
    for name in subs:
        sub = getattr(block, name)
        if sub._forward_hooks or sub._forward_pre_hooks:
            return f"{name} is observed by another patch's hooks"
        processor = getattr(sub, "processor", None)
        if hasattr(processor, "_tome_info") or "TokenMerge" in type(processor).__name__:
            return (f"{name} runs another token merging's attention processor "
                    f"({type(processor).__name__}, e.g. SD.Next's ToDo)")
    return method.refuse(block, config)


# ----------------------------------------------------------------------------- tomesd

def _tomesd_info(module: nn.Module) -> dict | None:
    """tomesd's ``_tome_info`` on ``module``: its args name ``max_downsample``. Other token
    merging keeps a dict of that name too (SD.Next's ToDo: ``merge_tokens``, its own attention
    processors), which is not ours to remove."""
    info = vars(module).get("_tome_info")
    args = info.get("args") if isinstance(info, dict) else None
    if not isinstance(args, dict) or "max_downsample" not in args or "merge_tokens" in args:
        return None
    return info


def remove_tomesd(model: Any) -> bool:
    """Undo a tomesd patch in place (what ``tomesd.remove_patch`` does), without importing it."""
    root = _layout.uncompiled(model) if isinstance(model, nn.Module) else \
        _layout.find_unet(model)
    found = False
    for m in root.modules():
        info = _tomesd_info(m)
        if info is not None:
            for h in info.get("hooks", []):
                h.remove()
            info["hooks"] = []
            found = True
        if type(m).__name__ == "ToMeBlock" and hasattr(m, "_parent"):
            m.__class__ = m._parent
            found = True
    return found


def _tomesd_patched(unet: nn.Module) -> bool:
    """tomesd swaps block classes and adds a hook; its remove_patch leaves ``_tome_info`` behind,
    so only a live class swap or live hooks count."""
    return any(type(m).__name__ == "ToMeBlock" or (_tomesd_info(m) or {}).get("hooks")
               for m in unet.modules())


# ----------------------------------------------------------------------------- hooks

def _first(args: tuple, kwargs: dict, names: tuple[str, ...], pos: int) -> Any:
    if len(args) > pos:
        return args[pos]
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return None


def _set_first(args: tuple, kwargs: dict, names: tuple[str, ...], value: Any):
    if args:
        return (value, *args[1:]), kwargs
    for n in names:
        if n in kwargs:
            return args, {**kwargs, n: value}
    raise RuntimeError("ToMe: could not find the hidden states argument")


_X_NAMES = ("x", "hidden_states", "sample")
_T_NAMES = ("timesteps", "timestep", "t")


def reduce_args(method: methods.Method, plan: Any, args: tuple, kwargs: dict,
                kv_name: str) -> tuple[tuple, dict]:
    """A sub-layer's arguments with ``plan`` applied: the method's queries as its hidden
    states, its keys/values (if any) under ``kv_name``."""
    hidden = _first(args, kwargs, _X_NAMES, 0)
    queries, kv = method.reduce(plan, hidden)
    if queries is not hidden:
        args, kwargs = _set_first(args, kwargs, _X_NAMES, queries)
    return (args, kwargs) if kv is None else (args, {**kwargs, kv_name: kv})


def restore_output(method: methods.Method, plan: Any, out: Any) -> Any:
    """A sub-layer's output restored by the method (unmerged)."""
    if isinstance(out, tuple):  # some attention processors return (hidden, extra)
        return (method.restore(plan, out[0]), *out[1:])
    return method.restore(plan, out)


class _Hooks:
    """The hook functions for one patched UNet, closing over its state. Each hook does one
    thing; the method says what a sub-layer receives and whether its output is restored."""

    def __init__(self, state: _State):
        self.state = state
        self.method = state.planner.method

    # UNet ---------------------------------------------------------------
    # Both run eagerly in a model compiled whole (``graphs.host_side``): the call's latent size
    # reaches the blocks as ``Call.grid``'s shape, dynamic in the graph, instead of Python
    # ints the graph would guard on (a graph per image size).
    @graphs.host_side
    def call_pre(self, module: nn.Module | None, args: tuple, kwargs: dict) -> None:
        if self.state.removed:  # removed while torch held this call's hooks (adapters.remove)
            return
        x = _first(args, kwargs, _X_NAMES, 0)
        t = _first(args, kwargs, _T_NAMES, 1)
        self.state.call = self.state.planner.begin(tuple(x.shape[-2:]), x.device, t,
                                                   x.shape[0]) \
            if isinstance(x, torch.Tensor) else None

    @graphs.host_side
    def unet_post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self.state.call = None

    # Block --------------------------------------------------------------
    def block_pre(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        st = self.state
        st.plans.pop(id(block), None)
        if st.call is None:
            return
        if type(block).__name__ == "ToMeBlock":  # tomesd re-patched it behind our back
            st.warn_once("ToMe: a block was patched by tomesd after ours; skipping it so it is "
                         "never merged twice")
            return
        x = _first(args, kwargs, _X_NAMES, 0)
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            plan = st.planner.plan(st.call, x, block in st.decoder)
            if plan is not None:
                st.plans[id(block)] = plan

    def block_post(self, block: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self.state.plans.pop(id(block), None)

    # Sub-layers ---------------------------------------------------------
    def reduce(self, block: nn.Module):
        """Give the sub-layer what the method says: merged hidden states, pooled keys and
        values in its context keyword (ldm/sgm ``context``, diffusers
        ``encoder_hidden_states``)."""
        plans, key, method = self.state.plans, id(block), self.method
        kv_name = self.state.context_keyword

        def hook(module: nn.Module, args: tuple, kwargs: dict):
            plan = plans.get(key)
            if plan is None:
                return None
            if "forward" in module.__dict__:  # replaced after patching (SAG's dynamic target)
                plans.pop(key)                  # this block runs unmerged this time
                self.state.warn_once(f"ToMe: skipped a block whose {type(module).__name__} "
                                     "forward another extension replaced (e.g. Self-Attention "
                                     "Guidance); it needs every token")
                return None
            return reduce_args(method, plan, args, kwargs, kv_name)
        return hook

    def restore(self, block: nn.Module):
        """Restore the sub-layer's output (unmerge)."""
        plans, key, method = self.state.plans, id(block), self.method

        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any):
            plan = plans.get(key)
            return None if plan is None else restore_output(method, plan, out)
        return hook


# ----------------------------------------------------------------------------- one block

def run_block(block: nn.Module, x: torch.Tensor, context: torch.Tensor | None,
              planner: _plan.Planner, plan: Any) -> Any:
    """Run ``block`` on ``x`` with ``plan`` applied (None: unmerged), as a patched block runs:
    the method's sub-layers get the same argument plumbing, on temporary hooks removed on
    exit. The measurement's runner for this adapter (``patcher.run_block`` is its twin)."""
    method, kv_name, handles = planner.method, _layout.context_keyword(block), []
    kw = {} if context is None else {kv_name: context}
    try:
        for name in method.sub_layers(planner.config) if plan is not None else ():
            sub = getattr(block, name)
            handles.append(sub.register_forward_pre_hook(
                lambda m, a, k: reduce_args(method, plan, a, k, kv_name), with_kwargs=True))
            if method.unmerges:
                handles.append(sub.register_forward_hook(
                    lambda m, a, k, out: restore_output(method, plan, out), with_kwargs=True))
        return block(x, **kw)
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- public API

def apply(model: Any, config: ToMeConfig, measurer: Any = None,
          layout: _layout.Layout | None = None) -> PatchReport:
    """Hook ``model``'s UNet (``layout``, read if not given; ``adapters.apply`` chooses this
    adapter) with ``config`` and say what was done. Atomic: on any error the model is left as
    it was. Settings that merge no block are the report's ``nothing`` (settings that change
    nothing, e.g. ratio 0, leave the model unhooked, as the attn1 patch does; a level the
    model lacks leaves hooks that change nothing).

    ``measurer``: for the ``auto`` policy, the measuring service
    (``measurements.Measurer``); the planner asks it at the first call of each latent size,
    through ``run_block``.
    """
    layout = layout or _layout.read(model)
    remove(layout.root)
    unet, method = layout.root, methods.get(config.method)
    replaced = _tomesd_patched(unet)
    if replaced:
        remove_tomesd(unet)
    max_ds = layout.auto_level(config.max_downsample)
    report = PatchReport.of(layout, config, HOOKS, max_downsample=max_ds,
                            replaced_tomesd=replaced)
    if not config.active:  # as the attn1 patch answers: nothing to hook
        return report
    targets = []
    for b in layout.blocks:
        if b.level > max_ds:  # never merged: whatever else patches it is no concern of ours
            continue
        problem = _block_problem(b.module, config, method)
        if problem:
            report.skipped.append((b.name, problem))
            continue
        targets.append(b.module)
        if b.level:
            report.levels[b.level] = report.levels.get(b.level, 0) + 1
    measured = measurer.for_model(model, config, run_block) if measurer is not None else None
    report.planner = _plan.Planner(config, max_ds, measured, sorted(report.levels))
    state = _State(config, report, layout)
    hooks = state.hooks = _Hooks(state)
    try:
        h = state.handles
        h.append(unet.register_forward_pre_hook(hooks.call_pre, with_kwargs=True))
        h.append(unet.register_forward_hook(hooks.unet_post, with_kwargs=True))
        for b in targets:
            h.append(b.register_forward_pre_hook(hooks.block_pre, with_kwargs=True))
            h.append(b.register_forward_hook(hooks.block_post, with_kwargs=True))
            for name in method.sub_layers(config):
                sub = getattr(b, name)
                h.append(sub.register_forward_pre_hook(hooks.reduce(b), with_kwargs=True))
                if method.unmerges:
                    h.append(sub.register_forward_hook(hooks.restore(b), with_kwargs=True))
        setattr(unet, STATE_ATTR, state)
    except BaseException:
        for handle in state.handles:
            handle.remove()
        vars(unet).pop(STATE_ATTR, None)
        raise
    return report


def remove(model: Any) -> Any:
    """Remove our patch: hooks and attributes go; a tomesd patch, if any, is left alone. The
    state is marked removed, so a hook torch still holds for a running call does nothing."""
    unet = patched_root(model)
    state = vars(unet).pop(STATE_ATTR, None)
    if state is not None:
        state.removed, state.call = True, None
        for handle in state.handles:
            handle.remove()
    return model


def patched_root(model: Any) -> nn.Module:
    """The module that carries our state: ``model`` itself if it does, else its UNet."""
    model = _layout.uncompiled(model)
    return model if hasattr(model, STATE_ATTR) else _layout.find_unet(model)


def state_of(model: Any) -> _State | None:
    """The patch's state on ``model``, or None (the library's ``is_patched``, ``patch_report``)."""
    try:
        return getattr(patched_root(model), STATE_ATTR, None)
    except UnsupportedModelError:
        return None
