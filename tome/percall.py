"""The per-call pooling core: DiT keys/values pooled one attention call at a time, for the
hosts that hand us attention calls rather than modules (ComfyUI's attention override,
``override.py``; Forge Neo's swapped attention functions, ``swap.py``).

Those hosts' DiT blocks call an attention function with queries and keys (rotated already,
or with a rotation embedding the function applies) and no token grid. So the grid comes
from outside: once per model call the host's shim reads the latent, the text length and any
reference latents (``Spans``: text, image frames x rows x columns, tokens before and after
the image), and ``Core`` (one per patch: the settings as applied, the step window, the
policy, each block's factor) turns them and the step's sigma into a ``CallState``, the
call planned as every bracket plans it (``callplan.Planned.plan_call``). The shim
makes that state current for the call (``Core.running``, the one bracket: a module slot the
attention calls read, counted and put back in ``finally``), and at each attention call hands
its tensors to ``pool_call`` with a ``kernel(q, k, v, mask)`` that calls what the host would
have called (its backend, or an override/function already there: chained, never replaced).

- queries and keys of one length = text + image (+ references): joint attention (Flux,
  Qwen-Image): the image span of the keys and values is pooled, per frame;
- one length = the image (+ references): image-only self-attention (Wan): pooled alike;
- anything else (cross-attention, a length it does not know) runs as without it. A call's own
  mask (a text mask) is pooled along the keys with them (``key_mask``); one whose key axis
  is not the call's runs as without it (named in ``skipped``).

Queries and text stay whole, so every token keeps its output. Proportional attention
(``log(cell size)`` on pooled keys) goes in as the kernel's mask where it adds one, else as
``attend.count_channel``'s extra query/key channel (kernels that drop masks).

``torch.compile``: the attention calls are traced with the model. A state read from the
host's options would keep one step's graph for the next, so the call's state is a
thread-local slot (``active``: plain ints, set around the call by ``Core.running``), which a
compiled graph guards on: one graph per grid and pooled/unpooled state.

Pure torch: nothing here imports a host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from . import attend, budget, dit, graphs, plan
from .callplan import Planned
from .config import ToMeConfig, without_reuse
from .kv import CallState, Spans
from .layout import Layout
from .percall_calls import POOLED, Counts
from .report import PatchReport

# The hosts' backends that add a float mask to the scores (broadcast over queries): ComfyUI's
# and Forge Neo's by name (Sage hands a mask to a kernel that ignores it, flash refuses it).
MASK_BACKENDS = ("attention_basic", "attention_pytorch", "attention_split",
                 "attention_sub_quad", "attention_xformers")
MASK = "an attention mask whose keys are not the call's (pooling would misalign it)"


# ----------------------------------------------------------------------------- the bracket

_local = threading.local()  # .active: (owner, state, chained) of this thread's model call


def now() -> tuple[Any, CallState | None, Any]:
    """``(owner, state, chained)`` of the current model call (Nones outside one)."""
    active = _traced(getattr(_local, "active", None))
    return active if active is not None else (None, None, None)


def current(owner: Any) -> tuple[CallState | None, Any]:
    """``(state, chained)`` of the current model call where ``owner`` made it current."""
    active = _traced(getattr(_local, "active", None))
    if active is not None and active[0] is owner:
        return active[1], active[2]
    return None, None


def _traced(active: Any) -> Any:
    """``active`` as a compiled graph reads it: the grid's sizes from ``CallState.grid``'s
    shape, which dynamo makes dynamic as it does the model's own sizes (its ints would be
    guarded on: one graph per image size)."""
    state = None if active is None else active[1]
    if state is None or state.grid is None or not graphs.compiling():
        return active
    s, (frames, h, w) = state.spans, state.grid.shape[:3]
    spans = Spans(s.text, s.text_first, s.before, frames, h, w, s.after, s.cross)
    return active[0], state._replace(spans=spans), active[2]


@contextmanager
def active(owner: Any, state: CallState | None, chained: Any = None) -> Iterator[None]:
    """``state`` is the current call's (what ``owner``'s attention calls read) inside, in this
    thread only (ComfyUI's MultiGPU samples clones of one patch in worker threads at once)."""
    before = getattr(_local, "active", None)
    _local.active = (owner, state, chained)
    try:
        yield
    finally:
        _local.active = before


class Flags:
    """What a model call's attention calls record on their owner (``fired``, ``pooled``):
    a dict per thread (clones of one patch sample in worker threads at once)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def flags(self) -> dict[str, bool]:
        found = getattr(self._local, "flags", None)
        if found is None:
            found = self._local.flags = {}
        return found


def note(skipped: list, block: Any, why: str) -> None:
    """Record a block left unpooled and why, once per block (eager calls only)."""
    if not graphs.compiling() and not any(b == block for b, _ in skipped):
        skipped.append((block, why))


# ----------------------------------------------------------------------------- one patch

class Core(Counts, Planned):
    """One patched model: the settings as the per-call forms apply them, the planner (step
    window, policy), each block's factor, the counts of what its model calls did.

    ``spans_of(model, x, ...)`` is the family's reading of a model call (``Spans`` or None:
    not a call it knows; ``adapters.py`` picks it). Keys arrive rotated unless ``rotated``
    is False (Forge Neo's Flux hands them before RoPE), so ``rope="pooled"`` is applied as
    "before" there. Residual reuse (``reuses``: a host that resets it at its run start) is
    kept per block part, call identity and factor (``attend.Reuse``) under the memory budget
    (``budget.ReuseBudget``); without ``reuses`` a preset becomes its point without reuse.
    What is left out is named in ``limits``."""

    def __init__(self, config: ToMeConfig, layout: Layout, spans_of: Callable,
                 percent_to_sigma: Callable[[float], float] | None = None,
                 rotated: bool = True, reuses: bool = False):
        self.layout, self.spans_of = layout, spans_of
        rope = layout.dit.rope and rotated
        reuses = reuses and layout.dit.names_blocks  # reuse keeps residuals per named block
        applied = config if reuses else without_reuse(config, [b.kind for b in layout.blocks])
        self.applied = applied.replace(rope="before") if rope else applied
        self.limits = [x for x, on in (
            ("rope pooled (keys arrive rotated: pooled as rope before)",
             rope and config.rope == "pooled"),
            ("residual reuse", config.reuse and not reuses)) if on]
        self.schedule = dit.schedule_of(self.applied)
        self.kinds = [b.kind for b in layout.blocks]
        self.factors = self.static_factors()
        self.chosen = {i for i, f in enumerate(self.factors) if f > 1}
        self.doubles = self.kinds.count("double")
        start, end = self.schedule.window()
        window = plan.Window.sigmas(start, end, percent_to_sigma or plan.flow_percent_to_sigma)
        p = layout.dit.patch
        self.planner = plan.Planner(self.applied, p, None, [p],
                                    method=dit.method_for(self.applied), window=window)
        self.reuse, self.budget = self._reuse(layout)
        self.runs, self._runs_lock = 0, threading.Lock()  # sampling runs under way (``run``)
        self.sigmas: tuple[Any, list[float]] = (None, [])  # the sampler's sigmas, read once
        Counts.__init__(self, layout.family)
        self.report: Any = None

    def __deepcopy__(self, memo: dict) -> Core:
        return self  # shared by clones (ComfyUI deep-copies options): one patch

    def _reuse(self, layout: Layout) -> tuple[Any, Any]:
        """Residual reuse (one part per block: ``CallState.parts``, this thread's slots) and its
        memory budget, or Nones where the settings reuse nothing. The budget counts each pooled
        block's attention output over the call's whole sequence (text and references too)
        at the block's token width."""
        if not self.applied.reuse:
            return None, None
        n = len(self.kinds)
        counts = [budget.factors(self.schedule, i, kind, n) for i, kind in enumerate(self.kinds)]
        reuse = attend.Reuse(self.applied.reuse, paced=self.applied.paced)
        reuse.order = tuple(i for i, c in enumerate(counts) if c)
        for i in range(n):
            reuse.join(i)
        limit = budget.ReuseBudget(layout, self.applied, reuse.order, reuse)
        limit.specs = [(i, True, _width(layout.blocks[i].module), counts[i])
                       for i in reuse.order]
        return reuse, limit

    def reset(self, *_: Any) -> None:
        """Drop what residual reuse keeps, in every thread (a generation's end, removal)."""
        if self.reuse is not None:
            self.reuse.reset()

    def run(self, starts: bool) -> None:
        """A sampling run starts or ends in this thread (ComfyUI's ``ON_PRE_RUN`` and
        ``ON_CLEANUP`` on the patched clone). Its own lane starts and ends with nothing
        kept; every thread's (MultiGPU's workers, whose calls a run in the main thread
        makes) when no other run of this patch is under way, so two samplings of clones
        of one patch in two threads at once never drop each other's residuals."""
        with self._runs_lock:
            self.runs = self.runs + 1 if starts else max(0, self.runs - 1)
            alone = self.runs == (1 if starts else 0)
        if self.reuse is not None:
            self.reuse.reset() if alone else self.reuse.reset_lane()

    def report_as(self, adapter: str) -> PatchReport:
        """The report of this patch made through ``adapter``, its ``nothing`` set where the
        settings pool no block."""
        layout, p = self.layout, self.layout.dit.patch
        report = PatchReport.of(layout, self.applied, adapter, max_downsample=p,
                                levels={p: len(self.chosen)} if self.chosen and
                                self.planner.method else {})
        if report.unmergeable is None and not self.chosen:  # named, but each at x1
            report.unmergeable = "ToMe: these settings change nothing (every block at x1)"
        report.skipped, report.planner = self.skipped, self.planner
        if self.budget is not None:
            self.budget.report = report
        self.report = report
        return report

    def step_of(self, options: Any, sigma: Any) -> int | None:
        """The sampler's step of this call (``sigma``: its sigma, read on the host): how many
        of its sigmas (``sample_sigmas`` in the call's transformer options, read once per
        sampling) lie above it; None without them."""
        schedule = options.get("sample_sigmas") if isinstance(options, dict) else None
        if not isinstance(schedule, torch.Tensor) or not isinstance(sigma, float):
            return None
        if self.sigmas[0] is not schedule:
            self.sigmas = (schedule, schedule.reshape(-1).tolist())  # one read
        return sum(s > sigma * (1 + 1e-4) for s in self.sigmas[1])

    def begin(self, spans: Spans, sigmas: Any, device: Any, batch: int, who: Any = None,
              x: torch.Tensor | None = None, step: int | None = None,
              total: int | None = None) -> CallState | None:
        """This call's state, or None where it pools nothing (window, policy, no block pooled
        at this step): the call planned as every bracket plans it (``Planned.plan_call``:
        ``sigmas`` read on the host once where needed, a float: read already). ``who``: the
        host's identity of the call (``cond_or_uncond``); ``x``: its latent (the memory
        budget reads it); ``step``: the sampler's step, where the host tells it
        (``Reuse.begin``), and ``total`` its steps (reuse's refreshes paced to them)."""
        p = self.layout.dit.patch
        got = self.plan_call((spans.frames, spans.h * p, spans.w * p), spans.image, device,
                             sigmas, batch, grid=(spans.frames, spans.h, spans.w),
                             text=spans.text + spans.before + spans.after, who=who, x=x,
                             step=step, total=total)
        if got is None or not any(f > 1 for f in got.factors):
            return None
        tokens, top, deep = spans.image, max(got.factors), self.applied.temporal
        self.planner.record(p, tokens, tokens - dit.pooled_tokens(spans.h, spans.w, top,
                                                                  spans.frames, deep))
        reuse = got.reuse
        return CallState(spans, got.factors, self.doubles, bool(self.applied.proportional),
                         reuse, reuse.parts() if reuse is not None else (),
                         graphs.grid_tensor(spans.frames, spans.h, spans.w), deep, seen=[])

    @contextmanager
    def running(self, owner: Any, spans: Spans | None, state: CallState | None,
                chained: Any = None, installed: bool = True) -> Iterator[None]:
        """The bracket of one model call: ``state`` current for ``owner``'s attention calls
        (which set ``owner.flags["fired"]``, and ``["pooled"]`` where they pool), put back
        and counted whatever happens; ``on_silent`` told where the first call that ran with
        our attention ``installed`` never reached it."""
        owner.flags.clear()
        seen, before = self.tally.total(), self.tally[POOLED]
        try:
            with active(owner, state, chained):
                yield
        finally:
            if self.reuse is not None:
                self.reuse.end()  # a refreshing call's eager stance left (``reuse._Eager``)
            pooled = bool(owner.flags.get("pooled"))
            if state is not None and state.reuse is not None:
                if not pooled:
                    state.reuse.missed()  # a cache answered it inside the model: refresh next
                self.settled(state.reuse.settle(), self.tally[POOLED] - before)
            self.count_call(owner.flags, seen, spans is not None, state is not None, installed)


def _width(block: nn.Module) -> int:
    """A host DiT block's token width: the input width most of its linear layers share
    (ComfyUI's blocks have no ``norm1`` or ``attn`` to read it from)."""
    widths = [m.in_features for m in block.modules() if isinstance(m, nn.Linear)]
    return max(set(widths), key=widths.count) if widths else 1
