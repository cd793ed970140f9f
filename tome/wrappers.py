"""The wrappers the processors adapter (``processors.py``) puts on a diffusers DiT's blocks:
``PoolingProcessor`` around each attention module's processor (or the family's shadows),
why a block stays unpooled (``block_problem``), putting them on and back (``wrap``,
``unwrap``), and one block run pooled for the auto policy's measuring (``runner``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from . import attend as _attend
from . import dits, graphs, parallel, percall_calls
from . import plan as _plan
from .layout import Layout

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
    _parallel_config = parallel.forwarded("_parallel_config")  # diffusers sets them here
    _attention_backend = parallel.forwarded("_attention_backend")

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
        # a block whose plan changes over sampling: its factors (``Schedule.factors``; set
        # where the patch is made), this call's plan for each and which one runs (``switch``)
        self.phases: tuple[int, ...] = ()
        self.variants: tuple[Any, ...] = ()
        self.phase = PHASES[0]

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:
        if self.variants and graphs.compiling():
            return switch(self, attn, hidden_states, args, kwargs)
        plan = self.current if self.pushed else self.source.plan_for(self.index, self.kind)
        return self.run(plan, attn, hidden_states, args, kwargs)

    def run(self, plan: Any, attn: nn.Module, hidden_states: torch.Tensor, args: tuple,
            kwargs: dict) -> Any:
        """One call with ``plan`` (None: the original's call, as it came)."""
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


#: ``PoolingProcessor.phase`` for a call running its block's variant ``i``: an empty tensor
#: of ``i + 2`` rows (2 and up: dynamo specialises sizes 0 and 1), dynamic from the first
#: compile, so a graph reads the variant from a size as it reads the model's own sizes.
PHASES = tuple(torch.empty(i + 2, 0) for i in range(8))
_dynamic = getattr(getattr(torch, "_dynamo", None), "maybe_mark_dynamic", None)
for _t in PHASES if _dynamic is not None else ():
    _dynamic(_t, 0)
#: Whether this torch switches in a graph (``torch.cond``: torch >= 2.4; the WebUI 1.10's
#: torch 2.1 guards on the plan, a graph per variant, as before).
SWITCHES = _dynamic is not None and hasattr(torch, "cond")


def _own(t: torch.Tensor) -> torch.Tensor:
    """A branch's output as ``torch.cond`` takes it: dense and aliasing nothing (SD3's
    processor returns the text and image slices of one joint output; cond refuses strided
    slices, and inductor outputs that alias each other)."""
    return t.clone(memory_format=torch.contiguous_format)


def _fixed(t: torch.Tensor) -> torch.Tensor:
    """An operand as ``torch.cond`` traced it, contiguous: inductor otherwise may lay it out
    its own way (layout optimisation where the graph has a convolution: Wan compiled whole,
    its patch embedding) and the branch's subgraph, which asserts the traced strides, raised
    ``AssertionError: expected ... stride``. Inductor's own op pins the layout (``pinning``;
    a copy in any other backend)."""
    t = t.contiguous()
    return t if _PIN is None else _PIN(t, t.stride())


_PIN: Any = None


def pinning() -> None:
    """Find inductor's stride-pinning op (``_fixed``) on the host, before anything traces:
    importing it inside a traced call would break the graph."""
    global _PIN
    if _PIN is None:
        try:
            import torch._inductor.inductor_prims  # noqa: F401  (registers the op)
            _PIN = torch.ops.prims.inductor_force_stride_order
        except (ImportError, AttributeError):
            pass


def switch(wrapper: PoolingProcessor, attn: nn.Module, hidden_states: torch.Tensor,
           args: tuple, kwargs: dict) -> Any:
    """A compiled call of a block whose plan changes over sampling (a step window, a schedule
    of factors, the auto policy): every variant (``wrapper.variants``: None unpooled, or a
    plan per factor) traced into one graph, ``torch.cond`` picking this call's by the size
    of ``wrapper.phase``. Guarding on the plan instead made a graph per variant for each
    size class of the block (a window's pooled and unpooled steps: dynamo's recompile limit
    of 8 came at the second image size with ``compile_repeated_blocks(fullgraph=True)``).
    The branches take the call's tensors as operands and return what the original returns,
    each tensor its own dense copy (``_own``)."""
    leaves, spec = pytree.tree_flatten((hidden_states, args, kwargs))
    at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]

    def branch(plan: Any) -> Any:
        def run(*tensors: torch.Tensor) -> Any:
            filled = list(leaves)
            for i, t in zip(at, tensors):
                filled[i] = t
            h, a, k = pytree.tree_unflatten(filled, spec)
            return pytree.tree_map_only(torch.Tensor, _own, wrapper.run(plan, attn, h, a, k))
        return run

    variants, n = wrapper.variants, wrapper.phase.shape[0]

    def pick(i: int) -> Any:
        if i == len(variants) - 1:
            return branch(variants[i])
        return lambda *t: torch.cond(n == i + 2, branch(variants[i]), pick(i + 1), t)
    return pick(0)(*(_fixed(leaves[i]) for i in at))


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


def wrap(block: nn.Module, family: dits.Family, source: Any, index: int = 0,
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


def unwrap(wrapped: list[tuple[nn.Module, str, Any, Any]]) -> None:
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

class Fixed:
    """A plan source (``attend.Source``) for one measured run: ``plan`` for every block, no
    reuse."""

    def __init__(self, plan: Any, text: int, reuse: Any = None):
        self.plan, self.text, self.p = plan, text, None
        self.reuse = reuse if reuse is not None else _attend.Reuse(0)

    def plan_for(self, index: int, kind: str) -> Any:
        return self.plan


def runner(layout: Layout, reuse: Any = 0):
    """``run_block(block, x, context, planner, plan)`` for ``measure``: one DiT block on image
    tokens ``x`` with the inputs its family draws for it (``Family.inputs``: a text of the
    family's length, a time embedding, positions), pooled by ``plan`` (None: unpooled),
    through the same wrapper a patched block runs; the block is restored. ``reuse`` (the
    settings' N, or a callable giving the period the generation will run: ``period``): a
    pooled run also costs what reuse adds per step (``attend.Refresh``), so the auto policy
    weighs what the generation will run."""
    family = dits.of(layout)
    period = reuse if callable(reuse) else (lambda: reuse)

    def run_block(block: nn.Module, x: torch.Tensor, context: Any, planner: _plan.Planner,
                  plan: Any) -> Any:
        args, kwargs = family.inputs(layout, x, planner.size)
        every = period()
        refresh = _attend.Refresh(every) if every and plan is not None else None
        source = Fixed(plan, layout.dit.text_tokens, refresh)
        wrapped = wrap(block, family, source)
        try:
            return block(*args, **kwargs)
        finally:
            unwrap(wrapped)
    # a video family's inputs build the video grid's positions: its grids are timed as the
    # generation pools them, per frame (``Measurer.get``), as the per-call hosts' runner
    run_block.video = getattr(layout.dit, "frame_patch", None) is not None
    run_block.period = period  # the measurement's key names it (``Measurer.for_model``)
    return run_block
