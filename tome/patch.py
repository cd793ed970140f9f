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
runs are decided in ``plan.py``, shared with the Forge adapter; the UNet's structure is read
in ``unet.py``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import methods
from . import plan as _plan
from .config import ToMeConfig
from .unet import (
    BLOCK_CLASS,
    UnsupportedModelError,
    auto_level,
    block_levels,
    decoder_blocks,
    family,
    find_unet,
    is_block,
    nothing_to_merge,
    unusable,
)

STATE_ATTR = "_tome_sd_state"  # tomesd uses ``_tome_info`` and the class name ``ToMeBlock``.


@dataclass
class PatchReport:
    """What a patch did: a short, printable account for users and tests."""

    family: str
    config: ToMeConfig
    max_downsample: int
    levels: dict[int, int] = field(default_factory=dict)   # downsample -> blocks patched
    total_blocks: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (block name, reason)
    replaced_tomesd: bool = False
    # Filled in while running: downsample -> (tokens, tokens removed) of the latest call.
    tokens: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Filled in while running: the auto policy's decision per (level, tokens, device kind).
    decisions: dict[tuple[int, int, str], Any] = field(default_factory=dict)

    @property
    def patched_blocks(self) -> int:
        return sum(self.levels.values())

    def coverage(self) -> str:
        """``5/16 blocks patched at downsample <= 1 (ds1: 5)``, plus the step window."""
        levels = ", ".join(f"ds{d}: {n}" for d, n in sorted(self.levels.items())) or "none"
        text = (f"{self.patched_blocks}/{self.total_blocks} blocks patched at downsample <= "
                f"{self.max_downsample} ({levels})")
        c = self.config
        if c.start > 0 or c.end < 1:
            text += f", steps {c.start:g}-{c.end:g}"
        return text

    def summary(self) -> str:
        text = (f"ToMe: {self.family} UNet, {methods.get(self.config.method).describe(self.config)}"
                f"; {self.coverage()}")
        if self.skipped:
            text += f"; {len(self.skipped)} skipped ({self.skipped[0][1]})"
        return text


class _State:
    def __init__(self, config: ToMeConfig, report: PatchReport, decoder: set[nn.Module],
                 measurer: Any = None):
        self.config, self.report = config, report
        self.decoder = decoder  # blocks on the UNet's upsampling side
        self.planner = _plan.Planner(config, report.max_downsample, measurer)
        # The report shows the planner's live figures.
        report.tokens, report.decisions = self.planner.tokens, self.planner.decisions
        self.handles: list[Any] = []
        self.call: _plan.Call | None = None
        self.warned: set[str] = set()
        # id(block) -> the plan for the block's current call. Kept here, not on the blocks, so
        # removal leaves nothing behind.
        self.plans: dict[int, Any] = {}

    def warn_once(self, msg: str) -> None:
        if msg not in self.warned:
            self.warned.add(msg)
            warnings.warn(msg, stacklevel=3)


# ----------------------------------------------------------------------------- blocks

def _block_problem(block: nn.Module, config: ToMeConfig, method: methods.Method) -> str | None:
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
    return method.refuse(block, config)


# ----------------------------------------------------------------------------- tomesd

def remove_tomesd(model: Any) -> bool:
    """Undo a tomesd patch in place (what ``tomesd.remove_patch`` does), without importing it."""
    root = model if isinstance(model, nn.Module) else find_unet(model)
    found = False
    for m in root.modules():
        info = vars(m).get("_tome_info")
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
    return any(type(m).__name__ == "ToMeBlock" or vars(m).get("_tome_info", {}).get("hooks")
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


def context_keyword(block: nn.Module) -> str:
    """The sub-layers' keyword for the context (and ToDo's keys/values): ldm/sgm ``context``,
    diffusers ``encoder_hidden_states``."""
    return "context" if family(block) in ("ldm", "sgm") else "encoder_hidden_states"


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
    def unet_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = _first(args, kwargs, _X_NAMES, 0)
        t = _first(args, kwargs, _T_NAMES, 1)
        self.state.call = self.state.planner.begin(tuple(x.shape[-2:]), x.device, t,
                                                   x.shape[0]) \
            if isinstance(x, torch.Tensor) else None

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
        kv_name = context_keyword(block)

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
    method, kv_name, handles = planner.method, context_keyword(block), []
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

def apply(model: Any, config: ToMeConfig, measurer: Any = None) -> Any:
    """Patch ``model`` with ``config``. Atomic: on any error the model is left as it was.

    ``measurer``: for the ``auto`` policy, the measuring service
    (``measurements.Measurer``); the planner asks it at the first call of each latent size,
    through ``run_block``.
    """
    unet = find_unet(model)
    method = methods.get(config.method)
    named = [(n, m) for n, m in unet.named_modules() if is_block(m)]
    blocks = [m for _, m in named]
    if not blocks:
        raise UnsupportedModelError(
            f"ToMe: {type(unet).__name__} has no {BLOCK_CLASS}; SD3/MMDiT, Flux and compiled or "
            "replaced UNets (e.g. TensorRT) are not supported")
    remove(unet)
    replaced = False
    if _tomesd_patched(unet):
        remove_tomesd(unet)
        replaced = True
        warnings.warn("ToMe: the model was patched by tomesd (e.g. the WebUI's built-in token "
                      "merging); that patch was removed so tokens are never merged twice",
                      stacklevel=3)
    levels = block_levels(unet)
    known = sorted({d for d in levels.values() if d > 0})
    max_ds = auto_level(config.max_downsample, known)
    report = PatchReport(family=family(blocks[0]), config=config, max_downsample=max_ds,
                         total_blocks=len(blocks), replaced_tomesd=replaced)
    targets = []
    for name, b in named:
        ds = levels.get(b, 0)
        if ds > max_ds:  # never merged: whatever else patches it is no concern of ours
            continue
        problem = _block_problem(b, config, method)
        if problem:
            report.skipped.append((name, problem))
            continue
        targets.append(b)
        if ds:
            report.levels[ds] = report.levels.get(ds, 0) + 1
    if report.skipped:
        # warnings shows an identical message once, so hosts re-applying per pass do not spam.
        warnings.warn(f"ToMe: skipped {len(report.skipped)} of {len(blocks)} block(s): "
                      f"{report.skipped[0][1]}", stacklevel=3)
    nothing = nothing_to_merge(config.max_downsample, known)
    if nothing:
        warnings.warn(nothing, stacklevel=3)

    measured = measurer.for_model(model, config, run_block) if measurer is not None else None
    state = _State(config, report, decoder_blocks(unet), measured)
    hooks = _Hooks(state)
    try:
        h = state.handles
        h.append(unet.register_forward_pre_hook(hooks.unet_pre, with_kwargs=True))
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
    return model


def remove(model: Any) -> Any:
    """Remove our patch: hooks and attributes go; a tomesd patch, if any, is left alone."""
    unet = _patched_unet(model)
    state = vars(unet).pop(STATE_ATTR, None)
    if state is not None:
        for handle in state.handles:
            handle.remove()
    return model


def _patched_unet(model: Any) -> nn.Module:
    """The module that carries our state: ``model`` itself if it does, else its UNet."""
    return model if hasattr(model, STATE_ATTR) else find_unet(model)


def state_of(model: Any) -> _State | None:
    try:
        return getattr(_patched_unet(model), STATE_ATTR, None)
    except UnsupportedModelError:
        return None
