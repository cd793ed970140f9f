"""The per-call pooling core: DiT keys/values pooled one attention call at a time, for the
hosts that hand us attention calls rather than modules (ComfyUI's attention override,
``override.py``; Forge Neo's swapped attention functions, ``swap.py``).

Those hosts' DiT blocks call an attention function with queries and keys (rotated already,
or with a rotation embedding the function applies) and no token grid. So the grid comes
from outside: once per model call the host's shim reads the latent, the text length and any
reference latents (``Spans``: text, image frames x rows x columns, tokens before and after
the image), and ``Core`` (one per patch: the settings as applied, the step window, the
policy, each block's factor) turns them and the step's sigma into a ``CallState``. The shim
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
host's options would keep one step's graph for the next, so the call's state is the module
slot ``_active`` (plain ints, set around the call by ``Core.running``), which a compiled
graph guards on: one graph per grid and pooled/unpooled state.

Pure torch: nothing here imports a host.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn

from . import attend, dit, memory, merge, plan
from .config import ToMeConfig, without_reuse
from .layout import Layout
from .percall_calls import channel, key_start
from .report import PatchReport

# The hosts' backends that add a float mask to the scores (broadcast over queries): ComfyUI's
# and Forge Neo's by name (Sage hands a mask to a kernel that ignores it, flash refuses it).
MASK_BACKENDS = ("attention_basic", "attention_pytorch", "attention_split",
                 "attention_sub_quad", "attention_xformers")
MASK = "an attention mask whose keys are not the call's (pooling would misalign it)"


class Spans(NamedTuple):
    """Where one model call's image tokens sit (plain ints, from the latent's shape)."""

    text: int          # text tokens in joint attention (0: the family has none)
    text_first: bool   # the joint order is [text, image] (else [image, text])
    before: int        # other tokens before the image (Wan's reference latent): unpooled
    frames: int        # the image grid in tokens, frame-major
    h: int
    w: int
    after: int = 0     # tokens after the image (Kontext / Qwen-Image edit references): unpooled
    cross: tuple = ()  # cross-attention's key lengths (text, image prompt): never extra keys

    @property
    def image(self) -> int:
        return self.frames * self.h * self.w

    def start(self, length: int, whole: bool = False) -> int | None:
        """Where the image starts in a self-attention call of ``length`` tokens (joint or
        image-only), or None where the call is not one of this model call's sequences;
        ``whole``: joint calls only where the family has text (Forge Neo's Lumina runs
        refiner blocks over the image alone, which stay unpooled); an image-only call as long
        as the text is not placed (ComfyUI's Lumina refines the caption alone, then the image)."""
        core = self.before + self.image + self.after
        if self.text and length == self.text + core:
            return self.before + (self.text if self.text_first else 0)
        alone = length == core and not (self.text and (whole or length == self.text))
        return self.before if alone else None


class CallState(NamedTuple):
    """What one model call pools: its spans, the factor of each block (in the model's order,
    double-stream blocks first; 0 or 1: unpooled), whether pooled keys get the bias, and
    residual reuse (``attend.Reuse``, decided for this call on the host; None: none) with
    each block's part (what its residuals are kept on)."""

    spans: Spans
    factors: tuple[int, ...]
    doubles: int
    proportional: bool
    reuse: Any = None
    parts: tuple = ()
    grid: Any = None  # ``dit.grid_tensor`` of the spans' grid: its sizes symbolic in a graph

    def position(self, block_type: Any, index: Any) -> int | None:
        """The block the host names (``block_type`` "double" or "single", ``block_index``)
        in the model's order, or None (no block information, or not a block of the model)."""
        if not isinstance(index, int):
            return None
        pos = index + (self.doubles if block_type == "single" else 0)
        return pos if 0 <= pos < len(self.factors) else None

    def factor(self, block_type: Any, index: Any) -> int:
        """The factor of the block the host names; without block information, the factor
        all blocks share (0 where they differ)."""
        if isinstance(index, int):
            pos = self.position(block_type, index)
            return 0 if pos is None else self.factors[pos]
        return self.factors[0] if len(set(self.factors)) == 1 else 0

    def part(self, block_type: Any, index: Any) -> Any:
        """The named block's part for residual reuse, or None (no reuse in this call)."""
        pos = self.position(block_type, index) if self.reuse is not None else None
        return None if pos is None or pos >= len(self.parts) else self.parts[pos]

    def start(self, queries: int, keys: int, whole: bool = False) -> int | None:
        """Where the image keys start in an attention call of these lengths (keys as long as
        the queries, or longer: ``percall_calls.key_start``), or None: not a self-attention
        over this call's sequence (cross-attention: also keys as long as ``spans.cross``)."""
        cross = keys != queries and keys in self.spans.cross
        return None if cross else key_start(self.spans, queries, keys, whole)


# ----------------------------------------------------------------------------- the bracket

_active: tuple[Any, CallState | None, Any] | None = None  # (owner, state, chained callable)


def now() -> tuple[Any, CallState | None, Any]:
    """``(owner, state, chained)`` of the current model call (Nones outside one)."""
    active = _traced(_active)
    return active if active is not None else (None, None, None)


def current(owner: Any) -> tuple[CallState | None, Any]:
    """``(state, chained)`` of the current model call where ``owner`` made it current."""
    active = _traced(_active)
    if active is not None and active[0] is owner:
        return active[1], active[2]
    return None, None


def _traced(active: Any) -> Any:
    """``active`` as a compiled graph reads it: the grid's sizes from ``CallState.grid``'s
    shape, which dynamo makes dynamic as it does the model's own sizes (its ints would be
    guarded on: one graph per image size)."""
    state = None if active is None else active[1]
    if state is None or state.grid is None or not merge.compiling():
        return active
    s, (frames, h, w) = state.spans, state.grid.shape[:3]
    spans = Spans(s.text, s.text_first, s.before, frames, h, w, s.after, s.cross)
    return active[0], state._replace(spans=spans), active[2]


@contextmanager
def active(owner: Any, state: CallState | None, chained: Any = None) -> Iterator[None]:
    """``state`` is the current call's (what ``owner``'s attention calls read) inside."""
    global _active
    before, _active = _active, (owner, state, chained)
    try:
        yield
    finally:
        _active = before


def note(skipped: list, block: Any, why: str) -> None:
    """Record a block left unpooled and why, once per block (eager calls only)."""
    if not merge.compiling() and not any(b == block for b, _ in skipped):
        skipped.append((block, why))


# ----------------------------------------------------------------------------- one attention call

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], Any]


def pool_call(state: CallState, f: int, start: int, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, dim: int, kernel: Kernel, plans: dict, *, rope: str = "before",
              pe: Any = None, bias: str | None = "mask", heads: int | None = None,
              flat: bool = True, part: Any = None, mask: torch.Tensor | None = None) -> Any:
    """One pooled attention call: the image span of ``k`` and ``v`` (sequence axis ``dim``,
    from ``start``) pooled per cell of ``state``'s grid at factor ``f``, then ``kernel(q, k,
    v, mask)``. ``pe``: a rotation embedding the host applies inside its function: the
    queries and keys are rotated here (keys per ``rope``), and the kernel passes none on.
    ``bias``: the proportional bias ``"mask"`` (an additive ``[1, 1, 1, keys]`` mask),
    ``"channel"`` (``attend.count_channel``; ``heads`` splits ``[B, S, heads * D]``, ``flat``
    says the kernel answers in that layout) or None (left out). ``part``: the block's part
    where this call reuses residuals (``state.reuse``): on a refresh the unpooled attention
    runs too and ``full - pooled`` is kept, between refreshes it is added (``Reuse.around``;
    the output's sequence axis is 1 for ``[B, S, heads * D]``, 2 for ``[B, heads, S, D]``).
    ``mask``: the call's own attention mask (keys on its last axis: a text mask), pooled
    along the keys as they are (``key_mask``), the bias added to it."""
    n = k.shape[dim]
    p = dit.cached_plan(plans, state.spans, f, rope, state.proportional)
    if pe is not None:
        q = dit.rotate(q, pe)
        kp = p.keys(k, start, dim, pe, dit.rotate, lambda e: p.rotations(e, start))
    else:
        kp = p.pool(k, start, dim)
    vp = p.pool(v, start, dim)
    b = p.bias(start, n, k.device) if bias else None
    m = None if mask is None else key_mask(p, mask, start, q.dtype)
    if b is None:
        out = kernel(q, kp, vp, m)
    elif bias == "mask":
        b = b.to(q.dtype).view(1, 1, 1, -1)
        out = kernel(q, kp, vp, b if m is None else m + b)
    else:
        out = channel(kernel, q, kp, vp, b, dim, heads, flat, m)
    if part is None or state.reuse is None or q.shape[dim] != n:  # reuse: self-attention
        return out

    def full(rows: int | None = None) -> Any:  # the unpooled attention (keys rotated)
        return kernel(q if rows is None else q.narrow(dim, 0, rows),
                      k if pe is None else dit.rotate(k, pe), v, mask)
    return state.reuse.around((part, f), out, full, 1 if out.dim() == 3 else 2,
                              (start, start + p.tokens))


def key_mask(p: dit.DitPlan, mask: torch.Tensor, start: int, dtype: torch.dtype
             ) -> torch.Tensor:
    """A call's attention mask for its pooled keys: as an additive mask (a boolean one's
    False as ``-inf``) with ComfyUI's axes (``[Sq, Sk]``, ``[B, Sq, Sk]`` or 4-D), its image
    span along the keys pooled like the keys: a cell's entry is the mean of its keys' (0
    where they all attend, ``-inf`` where any is masked), the text part kept as it is."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, float("-inf"))
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[:, None]
    return p.pool(mask, start, mask.dim() - 1)


# ----------------------------------------------------------------------------- one patch

class Core:
    """One patched model: the settings as the per-call forms apply them, the planner (step
    window, policy), each block's factor, the counts of what its model calls did.

    ``spans_of(model, x, ...)`` is the family's reading of a model call (``Spans`` or None:
    not a call it knows; ``adapters.py`` picks it). Keys arrive rotated unless ``rotated``
    is False (Forge Neo's Flux hands them before RoPE), so ``rope="pooled"`` is applied as
    "before" there. Residual reuse (``reuses``: a host that resets it at its run start) is
    kept per block part, call identity and factor (``attend.Reuse``) under the memory budget
    (``memory.ReuseBudget``); without ``reuses`` a preset becomes its point without reuse.
    What is left out is named in ``limits``."""

    NEVER_CALLED = "the pooling attention was installed but never called"

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
        self.factors = tuple(self.schedule.factor(i, kind, len(self.kinds), None)
                             for i, kind in enumerate(self.kinds))
        self.chosen = {i for i, f in enumerate(self.factors) if f > 1}
        self.doubles = self.kinds.count("double")
        start, end = self.schedule.window()
        window = plan.Window.sigmas(start, end, percent_to_sigma or plan.flow_percent_to_sigma)
        p = layout.dit.patch
        self.planner = plan.Planner(self.applied, p, None, [p],
                                    method=dit.method_for(self.applied), window=window)
        self.reuse, self.budget, self.parts = self._reuse(layout)
        self.skipped: list[tuple[Any, str]] = []
        self.calls = self.fired = self.installed = 0  # model calls / that reached our
        # attention / that ran with it installed
        self.placed = self.active = self.pooled = 0  # ... placed by the family / pooling by
        # the settings at their step / that pooled at least one attention call (``counts``)
        self.tally: Counter = Counter()  # attention calls by outcome (``percall_calls``)
        self.refreshed: set[int] = set()  # steps whose calls refreshed reuse (host clears it)
        self.compiled = self.silent = 0  # model calls reaching it uncounted / not reaching it
        self.on_silent: Callable[[], Any] | None = None  # told once: installed, never reached
        self.report: Any = None

    def __deepcopy__(self, memo: dict) -> Core:
        return self  # shared by clones (ComfyUI deep-copies options): one patch

    def _reuse(self, layout: Layout) -> tuple[Any, Any, tuple]:
        """Residual reuse, its memory budget and one part per block (what its residuals are
        kept on), or Nones where the settings reuse nothing. The budget counts each pooled
        block's attention output over the call's whole sequence (text and references too)
        at the block's token width."""
        if not self.applied.reuse:
            return None, None, ()
        n = len(self.kinds)
        counts = [memory.factors(self.schedule, i, kind, n) for i, kind in enumerate(self.kinds)]
        reuse = attend.Reuse(self.applied.reuse)
        reuse.order = tuple(i for i, c in enumerate(counts) if c)
        parts = tuple(_Part(i) for i in range(n))
        for part in parts:
            reuse.join(part)
        budget = memory.ReuseBudget(layout, self.applied, reuse.order, reuse)
        budget.specs = [(i, True, _width(layout.blocks[i].module), counts[i])
                        for i in reuse.order]
        return reuse, budget, parts

    def reset(self, *_: Any) -> None:
        """Drop what residual reuse keeps (the host's run start and end: ComfyUI's
        ``ON_PRE_RUN``/``ON_CLEANUP`` callbacks on the patched clone)."""
        if self.reuse is not None:
            self.reuse.reset()

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

    def begin(self, spans: Spans, sigmas: Any, device: Any, batch: int, who: Any = None,
              x: torch.Tensor | None = None, step: int | None = None) -> CallState | None:
        """This call's state, or None where it pools nothing (window, policy, no block pooled
        at this step). A ``sigmas`` tensor is read on the host once, only where a window, a
        per-step schedule or reuse needs it (a float: read already). ``who``: the host's
        identity of the call (``cond_or_uncond``); ``x``: its latent (the memory budget
        reads it); ``step``: the sampler's step, where the host tells it (``Reuse.begin``)."""
        if isinstance(sigmas, torch.Tensor):
            use = self.reuse is not None or self.schedule.varies() or not self.planner.window.full
            sigmas = float(sigmas.reshape(-1)[0]) if use and sigmas.numel() else None
        p = self.layout.dit.patch
        size = (spans.frames, spans.h * p, spans.w * p)
        call = self.planner.begin(size, device, sigmas, batch)
        if call is None:
            return None
        tokens = spans.image
        if not self.planner.decision(p, tokens, call.kind, call.measured.get(p)).merged:
            return None
        factors, schedule, progress = self.factors, self.schedule, None
        if (schedule.varies() or self.reuse is not None) and sigmas is not None:
            progress = self.planner.window.progress(sigmas)
        reuse = None
        if self.reuse is not None and progress is not None:
            self.reuse.begin(progress, batch, (spans.frames, spans.h, spans.w), who, device, step)
            if x is not None:  # what reuse will keep, checked before it keeps it
                schedule = self.budget.begin(x, size, spans.text + spans.before + spans.after,
                                             progress)
            reuse = self.reuse if self.reuse.active else None
        if progress is not None and (schedule.varies() or schedule is not self.schedule):
            factors = tuple(schedule.factor(i, kind, len(self.kinds), progress)
                            for i, kind in enumerate(self.kinds))
        if not any(f > 1 for f in factors):
            return None
        top = max(factors)
        self.planner.record(p, tokens, tokens - dit.pooled_tokens(spans.h, spans.w, top,
                                                                  spans.frames))
        return CallState(spans, factors, self.doubles, bool(self.applied.proportional),
                         reuse, self.parts if reuse is not None else (),
                         dit.grid_tensor(spans.frames, spans.h, spans.w))

    @contextmanager
    def running(self, owner: Any, spans: Spans | None, state: CallState | None,
                chained: Any = None, installed: bool = True) -> Iterator[None]:
        """The bracket of one model call: ``state`` current for ``owner``'s attention calls
        (which set ``owner.flags["fired"]``, and ``["pooled"]`` where they pool), put back
        and counted whatever happens; ``on_silent`` told where the first call that ran with
        our attention ``installed`` never reached it."""
        owner.flags.clear()
        seen = self.tally.total()
        try:
            with active(owner, state, chained):
                yield
        finally:
            self.calls += 1
            self.installed += installed
            self.placed += spans is not None
            self.active += state is not None
            self.pooled += bool(owner.flags.get("pooled"))
            if state is not None and state.reuse is not None:
                if not owner.flags.get("pooled"):
                    state.reuse.missed()  # a cache answered it inside the model: refresh next
                elif state.reuse.refresh:
                    self.refreshed.add(state.reuse.step)
            if owner.flags.get("fired"):
                self.fired += 1
                self.compiled += self.tally.total() == seen  # replayed by a compiled graph
            elif installed:
                self.silent += 1
                if not self.fired and self.installed == 1 and self.on_silent is not None:
                    self.on_silent()

    def counts(self) -> tuple[int, int, int, int, int]:
        """The model calls so far: run, reaching our attention, placed by the family
        (``spans_of``), pooling at their step by the settings, that pooled."""
        return self.calls, self.fired, self.placed, self.active, self.pooled

    def tallies(self) -> tuple:
        """What ``percall_calls.line`` reads: attention calls by outcome, model calls replayed
        by a compiled graph, run without it installed, with it installed but not reaching it."""
        return Counter(self.tally), self.compiled, self.calls - self.installed, self.silent

    def not_pooled(self, since: tuple[int, ...] = (0, 0, 0, 0, 0)) -> str | None:
        """One line where no model call since ``since`` (``counts()`` then) pooled anything,
        saying why (what happened, not what was installed); None where one did."""
        calls, fired, placed, active, pooled = (a - b for a, b in zip(self.counts(), since))
        if pooled:
            return None
        if not calls:
            why = "no model call went through its apply_model wrapper"
        elif not fired:
            why = self.NEVER_CALLED
        elif not placed:
            why = (f"{self.layout.family} cannot place this model's tokens (its latent or text "
                   "is not laid out as that family's are)")
        elif not active:
            why = "no step was pooled by the settings (the step window or the auto policy)"
        elif self.skipped:
            why = "its attention calls carry a mask (pooling would misalign it)"
        else:
            why = "no attention call had the lengths of this model's text and image tokens"
        return f"ToMe: not pooled in this sampling ({calls} model calls): {why}"


class _Part:
    """One block's residuals under reuse (``attend.Reuse.join`` keeps them on it)."""

    def __init__(self, index: int):
        self.index = index


def _width(block: nn.Module) -> int:
    """A host DiT block's token width: the input width most of its linear layers share
    (ComfyUI's blocks have no ``norm1`` or ``attn`` to read it from)."""
    widths = [m.in_features for m in block.modules() if isinstance(m, nn.Linear)]
    return max(set(widths), key=widths.count) if widths else 1
