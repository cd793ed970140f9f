"""Patching DiTs held as plain modules (diffusers' DiTs, A1111's SD3: the families with
``Family.call``; ``adapters.py`` chooses): the image tokens' keys and values pooled inside
each chosen block's attention.

Pooling happens inside the attention processor call (projections, norms, text+image, RoPE,
kernel). Each chosen module's processor is wrapped (``PoolingProcessor``): a call with no plan
for its block (the schedule's window, the auto policy, another patch's state) goes to the
original untouched, so those calls and, after removal, every call are bit-identical to the
unpatched model. A call with a plan runs the DiT family's maths (``tome/dits/``: the
library's processor with the image keys/values pooled, the proportional-attention bias and
residual reuse from ``attend.py``); a processor the family does not reproduce (another
library's, e.g. IP-Adapter's) leaves its block unpooled and reported. A family without
processors (A1111's MMDiT) puts its own pooled path on the block (``Family.shadow``), and
measuring runs a block on the family's inputs (``runner``, ``Family.inputs``).

Per transformer call a pre-hook reads the call the family's way (``Family.call``: the latent
grid, the text length, the timestep); the shared ``plan.Planner`` says whether this call
pools, the schedule which factor each block gets. Nothing here names a family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import attend as _attend
from . import brackets, budget, dit, dits, percall, percall_calls, processors_calls
from . import plan as _plan
from .config import ToMeConfig
from .layout import Block, Layout
from .report import PROCESSORS, STATE_ATTR, PatchReport


class _State(percall_calls.Counts, percall.Flags):
    """One patched DiT: the planner, the current call's plan, progress and text length, the
    kept residuals of ``reuse``, and the counts of what its calls did (``Counts``: the same
    after-sampling line the per-call hosts print)."""

    NO_CALLS = "no transformer call ran"
    NEVER_CALLED = "the pooling processors were installed but never called"

    def __init__(self, config: ToMeConfig, report: PatchReport, layout: Layout):
        percall_calls.Counts.__init__(self, layout.family)
        percall.Flags.__init__(self)
        self.config, self.report, self.layout = config, report, layout
        self.family = dits.of(layout)
        self.planner: _plan.Planner = report.planner
        self.schedule = dit.schedule_of(config)
        self.count = len(layout.blocks)
        self.handles: list[Any] = []   # hook handles on the transformer
        self.wrapped: list[tuple[nn.Module, str, Any, Any]] = []  # (module, name, before, ours)
        self.plan: dit.DitPlan | None = None
        self.plans: dict[int, dit.DitPlan] = {}  # this call's plan per scheduled factor
        self.p: float | None = None    # this call's sampling progress, where read
        self.text = 0                  # text tokens in this call (single blocks' span start)
        self.memo: dict = {}           # the family's call reading keeps what it may reuse
        self.reuse = _attend.Reuse(config.reuse, paced=config.paced)
        self.budget: budget.ReuseBudget | None = None  # what reuse may keep (``apply``)
        self.hooks: processors_calls.Hooks | None = None
        self.removed = False           # removed while torch held its call hook
        self.parts: list[PoolingProcessor] = []  # the wrappers this state sets plans on
        self.joined: list[Any] = []    # the wrappers and shadows whose residuals reuse keeps

    def reset(self) -> None:
        """Drop what residual reuse keeps (a generation's start and end)."""
        self.reuse.reset()

    def push(self) -> None:
        """Set each wrapper's plan for this call (``PoolingProcessor.current``) on the host:
        a compiled block then reads its own attribute, and its graph guards on the plan, not
        on the block's index (one graph for every block, steps and identities alike)."""
        for part in self.parts:
            part.current = None if self.plan is None else self.plan_for(part.index, part.kind)
        if self.joined:  # this thread's slots of residual reuse, on our own wrappers
            slots = self.reuse.parts()
            for part in self.joined:
                part.reuse_slot = slots[part.reuse_pos]

    def plan_for(self, index: int, kind: str) -> dit.DitPlan | None:
        """Block ``index``'s plan in this call: the schedule's factor for it now, or None."""
        base = self.plan
        if base is None:
            return None
        f = self.schedule.factor(index, kind, self.count, self.p)
        if f == 0:
            return None
        if f == base.factor:
            return base
        if f not in self.plans:
            self.plans[f] = base.with_factor(f)
        return self.plans[f]


# ----------------------------------------------------------------------------- processors

def _maths_of(processor: Any) -> Any:
    name = type(processor).__name__
    return next((f.maths[name] for f in dits.families() if name in f.maths), None)


class PoolingProcessor:
    """Wraps one attention module's processor (not an ``nn.Module``: the model's modules and
    state dict stay as they were). ``source`` gives block ``index``'s plan (``plan_for``), the
    text length and the reuse state (a patch's state, or a fixed plan when measuring);
    ``maths`` (``dits.Family.maths``; default: the registered maths for the original's
    class) runs a pooled call with the encoder states and rotary embedding, and as keywords
    any other argument the original names that was given (e.g. a text mask). Every other
    call goes to the original exactly as it came. diffusers' ``Attention`` hands a processor
    only the keywords its signature names, so each wrapper shows its original's signature
    (a subclass per original class, ``_signed``)."""

    _names: tuple[str, ...] = ("encoder_hidden_states", "attention_mask", "image_rotary_emb")

    def __new__(cls, original: Any = None, *args: Any, **kwargs: Any) -> PoolingProcessor:
        signed = cls is PoolingProcessor and original is not None
        return super().__new__(_signed(type(original)) if signed else cls)

    def __init__(self, original: Any, source: Any, maths: Any = None, index: int = 0,
                 kind: str = "double"):
        self.original, self.source = original, source
        self.maths = maths if maths is not None else _maths_of(original)
        self.index, self.kind = index, kind
        self._extra = self.maths is not None and _takes_extra(self.maths)
        # a patch's state sets this call's plan on the wrapper (``_State.push``); other
        # sources (measuring) are asked
        self.pushed, self.current = False, None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:
        plan = self.current if self.pushed else self.source.plan_for(self.index, self.kind)
        if plan is not None and self.maths is not None:
            named = dict(zip(self._names, args), **kwargs)
            ehs = named.pop("encoder_hidden_states", None)
            emb = named.pop("image_rotary_emb", None)
            emb = named.pop("rotary_emb", None) if emb is None else emb
            extra = {k: v for k, v in named.items() if v is not None}
            if not extra or self._extra:
                out = self.maths(self, attn, plan, hidden_states, ehs, emb, **extra)
                if out is not NotImplemented:
                    percall_calls.record(self.source, percall_calls.POOLED)
                    return out
            percall_calls.record(self.source, percall_calls.CROSS)
        else:
            percall_calls.record(self.source, percall_calls.OUTSIDE if plan is None
                                 else percall_calls.X1)
        return self.original(attn, hidden_states, *args, **kwargs)


_SIGNED: dict[type, type] = {}


def _signed(original: type) -> type:
    """The ``PoolingProcessor`` subclass for processors of class ``original``: its call shows
    the original's signature (what diffusers filters a call's keywords by) and knows its
    parameter names after ``(attn, hidden_states)``; whether the maths take extra keywords
    (``_extra``) is read per instance."""
    import inspect

    cls = _SIGNED.get(original)
    if cls is None:
        try:
            sig = inspect.signature(original.__call__)
        except (TypeError, ValueError):
            sig = inspect.signature(PoolingProcessor.__call__)
        params = list(sig.parameters)

        def call(self: PoolingProcessor, attn: nn.Module, hidden_states: torch.Tensor,
                 *args: Any, **kwargs: Any) -> Any:
            return PoolingProcessor.__call__(self, attn, hidden_states, *args, **kwargs)
        call.__signature__ = sig  # type: ignore[attr-defined]
        cls = _SIGNED[original] = type("PoolingProcessor", (PoolingProcessor,), {
            "__call__": call, "__qualname__": "PoolingProcessor",
            "_names": tuple(p for p in params[3:] if p not in ("args", "kwargs"))})
    return cls


def _takes_extra(maths: Any) -> bool:
    import inspect
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(maths).parameters.values())
    except (TypeError, ValueError):
        return False


# ----------------------------------------------------------------------------- blocks

def block_problem(block: nn.Module, family: dits.Family) -> str | None:
    """Why a DiT block stays unpooled, or None: a processor its family does not reproduce
    (another extension's or library's, e.g. IP-Adapter), one wrapped by a patch of ours, or
    the family's own reason (``Family.check``)."""
    attns = family.attentions(block)
    if not attns:
        return f"unsupported block variant {type(block).__qualname__}: no attn"
    for a in attns:
        if family.shadow is None:
            processor = getattr(a, "processor", None)
            name = type(processor).__name__
            if isinstance(processor, PoolingProcessor):
                return "already pooled by another ToMe patch"
            if name not in family.maths:
                return (f"attention processor {name} is not one ToMe reproduces (e.g. "
                        "IP-Adapter's)")
        problem = family.check(a) if family.check is not None else None
        if problem:
            return problem
    return None


def _wrap(block: nn.Module, family: dits.Family, source: Any, index: int = 0,
          kind: str = "double") -> list[tuple[nn.Module, str, Any, Any]]:
    """Put the pooled path on ``block``: (module, attribute, before, ours) per change."""
    if family.shadow is not None:
        return family.shadow(block, source, index, kind)
    done = []
    for a in family.attentions(block):
        before = original = a.processor
        if isinstance(original, PoolingProcessor):  # measuring a patched block: one wrapper
            original = original.original
        ours = PoolingProcessor(original, source, family.maths.get(type(original).__name__),
                                index, kind)
        a.processor = ours
        done.append((a, "processor", before, ours))
    return done


def _unwrap(wrapped: list[tuple[nn.Module, str, Any, Any]]) -> None:
    """Put back what was there, where ours is still in place (an instance attribute that was
    not there is deleted)."""
    for module, name, before, ours in reversed(wrapped):
        if vars(module).get(name) is ours:
            if before is None:
                del vars(module)[name]
            else:
                setattr(module, name, before)
    wrapped.clear()


# ----------------------------------------------------------------------------- one block

class _Fixed:
    """A plan source (``attend.Source``) for one measured run: ``plan`` for every block, no
    reuse."""

    def __init__(self, plan: Any, text: int, reuse: Any = None):
        self.plan, self.text, self.p = plan, text, None
        self.reuse = reuse if reuse is not None else _attend.Reuse(0)

    def plan_for(self, index: int, kind: str) -> Any:
        return self.plan


def runner(layout: Layout, reuse: int = 0):
    """``run_block(block, x, context, planner, plan)`` for ``measure``: one DiT block on image
    tokens ``x`` with the inputs its family draws for it (``Family.inputs``: a text of the
    family's length, a time embedding, positions), pooled by ``plan`` (None: unpooled),
    through the same wrapper a patched block runs; the block is restored. ``reuse`` (the
    settings' N): a pooled run also costs what reuse adds per step (``attend.Refresh``), so the
    auto policy weighs what the generation will run."""
    family = dits.of(layout)
    refresh = _attend.Refresh(reuse) if reuse else None

    def run_block(block: nn.Module, x: torch.Tensor, context: Any, planner: _plan.Planner,
                  plan: Any) -> Any:
        args, kwargs = family.inputs(layout, x, planner.size)
        source = _Fixed(plan, layout.dit.text_tokens, refresh if plan is not None else None)
        wrapped = _wrap(block, family, source)
        try:
            return block(*args, **kwargs)
        finally:
            _unwrap(wrapped)
    # a video family's inputs build the video grid's positions: its grids are timed as the
    # generation pools them, per frame (``Measurer.get``), as the per-call hosts' runner
    run_block.video = getattr(layout.dit, "frame_patch", None) is not None
    return run_block


# ----------------------------------------------------------------------------- public API

def apply(model: Any, layout: Layout, config: ToMeConfig, measurer: Any = None) -> PatchReport:
    """Pool the DiT blocks ``config`` names (schedule, ``blocks``) and say what was done;
    atomic (on any error the blocks are back as they were). ``measurer``: the auto policy's
    measuring service, as for UNets."""
    root, d, family = layout.root, layout.dit, dits.of(layout)
    method = dit.method_for(config)
    report = PatchReport.of(layout, config, PROCESSORS, max_downsample=d.patch)
    # A schedule may pool where the plain factor is 1: only a method without a DiT form or
    # settings that name no block pool nothing (factor 1 runs the pooled maths, bit for bit
    # the library's). Then nothing is installed, as for settings that change nothing.
    report.unmergeable = layout.unmergeable(config)
    if report.unmergeable:
        return report
    targets: list[tuple[int, Block]] = []
    schedule = dit.schedule_of(config)
    for i, b in enumerate(layout.blocks):
        if not schedule.factor(i, b.kind, len(layout.blocks), None):
            continue
        problem = block_problem(b.module, family)
        if problem:
            report.skipped.append((b.name, problem))
            continue
        targets.append((i, b))
        report.levels[d.patch] = report.levels.get(d.patch, 0) + 1
    if not targets:  # every named block skipped (``report.nothing`` says why)
        return report
    measured = measurer.for_model(model, config, runner(layout, config.reuse)) \
        if measurer is not None else None
    lo, hi = schedule.window()  # the planner lets in the steps where any block pools
    report.planner = _plan.Planner(config.replace(start=lo, end=hi), d.patch, measured,
                                   sorted(report.levels), method=method)
    state = _State(config, report, layout)
    state.reuse.order = tuple(i for i, _ in targets)
    if config.reuse:
        state.budget = budget.ReuseBudget(layout, config, state.reuse.order, state.reuse, report)
    hooks = state.hooks = processors_calls.Hooks(state)
    try:
        state.handles.append(root.register_forward_pre_hook(hooks.call_pre, with_kwargs=True))
        state.handles.append(root.register_forward_hook(hooks.post, with_kwargs=True))
        for i, b in targets:
            state.wrapped += _wrap(b.module, family, state, i, b.kind)
        for *_, ours in state.wrapped:  # the parts that keep residuals (on themselves)
            if hasattr(ours, "index") and config.reuse:
                ours.reuse_pos = state.reuse.join(ours.index)
                state.joined.append(ours)
            if isinstance(ours, PoolingProcessor):
                ours.pushed = True
                state.parts.append(ours)
        state.wrapped += brackets.shadow(model, processors_calls.generation)
        setattr(root, STATE_ATTR, state)
    except BaseException:
        _remove(state)
        vars(root).pop(STATE_ATTR, None)
        raise
    return report


def _remove(state: _State) -> None:
    state.removed, state.plan = True, None  # a hook torch still holds for a call: inert
    state.reuse.reset()                     # nothing kept past removal
    for h in state.handles:
        h.remove()
    state.handles.clear()
    _unwrap(state.wrapped)


def remove(root: nn.Module) -> bool:
    """Remove a DiT patch from ``root``; whether there was one."""
    state = vars(root).get(STATE_ATTR)
    if not isinstance(state, _State):
        return False
    _remove(state)
    del vars(root)[STATE_ATTR]
    return True
