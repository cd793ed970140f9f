"""DiT key/value pooling through an attention override: ComfyUI's
``transformer_options["optimized_attention_override"]`` (0.8.0 and later).

Every ComfyUI attention backend is wrapped so that, when a call's ``transformer_options``
hold that key, the backend call ``backend(q, k, v, heads, mask, **kw)`` becomes
``override(backend, q, k, v, heads, mask, **kw)``; every DiT family calls attention this way
(Flux, Kontext, Chroma, Qwen-Image, Wan, HunyuanVideo, SD3, Lumina), with queries and keys
already rotated and no token grid. So the grid comes from outside: once per model call the
host's wrapper reads the latent, the text length and any reference latents (``Spans``:
text, image frames x rows x columns, tokens before and after the image), and the patch turns
them, the step's sigma and the settings into a ``CallState``; the override (``KvPool``, one
stable object per patch) then tells each attention call apart by its lengths:

- queries and keys of one length = text + image (+ references): joint attention (Flux,
  Qwen-Image): the image span of the keys and values is pooled;
- one length = the image (+ references): image-only self-attention (Wan): pooled alike;
- anything else (cross-attention: keys as long as the text; a mask it cannot pool along the
  keys; a length it does not know) runs as without it.

Queries and text stay whole, so every token keeps its output. An override already in the
call (a SageAttention node's) is chained: called with the pooled tensors, never replaced.
Proportional attention (``log(cell size)`` on pooled keys) goes in as the mask where the
backend takes one, else as ``attend.count_channel``'s extra query/key channel (kernels that
drop masks: Sage, an unknown chained override).

``torch.compile``: the override is traced with the model. ComfyUI's TorchCompileModel drops
every guard on ``transformer_options``, so a state read from there would keep one step's
graph for the next (pooled outside the window, or the other way round). The call's state is
therefore the module slot ``_active`` (plain ints, set around the call by the host's wrapper:
``activate``/``restore``), which the compiled graph guards on: one graph per grid and
pooled/unpooled state, i.e. at most one recompile per resolution and window edge.

Pure torch: nothing here imports ComfyUI (the host's wrapper is ``OverridePatch.wrapper``,
which speaks ComfyUI's ``apply_model`` wrapper convention as ``patcher.py`` speaks its attn1
patch convention).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from . import attend, dit, merge, patcher, plan
from .config import ToMeConfig, without_reuse
from .layout import Layout
from .report import PatchReport

OVERRIDE = "optimized_attention_override"  # ComfyUI's key in transformer_options
SPANS_KEY = "tome_dit"  # the call's ``Spans`` in its transformer_options (for other nodes)
APPLY_MODEL, WRAPPER_KEY = "apply_model", "tome"  # ComfyUI's wrapper type; our key in it
ADAPTER = "attention override"  # ``PatchReport.adapter``
# ComfyUI's backends that add a float mask to the scores (broadcast over queries); Sage hands
# it to a kernel that ignores it, flash attention refuses it, sage3 falls back with it.
# Where ComfyUI keeps the attention backend it chose at start-up (what a DiT's blocks call).
COMFY_KERNEL = ("comfy.ldm.modules.attention", "optimized_attention")
MASK_BACKENDS = ("attention_basic", "attention_pytorch", "attention_split",
                 "attention_sub_quad", "attention_xformers")


class Spans(NamedTuple):
    """Where one model call's image tokens sit (plain ints, from the latent's shape)."""

    text: int          # text tokens in joint attention (0: the family has none)
    text_first: bool   # the joint order is [text, image] (else [image, text])
    before: int        # other tokens before the image (Wan's reference latent): unpooled
    frames: int        # the image grid in tokens, frame-major
    h: int
    w: int
    after: int = 0     # tokens after the image (Kontext / Qwen-Image edit references): unpooled

    @property
    def image(self) -> int:
        return self.frames * self.h * self.w

    def start(self, length: int) -> int | None:
        """Where the image starts in a self-attention call of ``length`` tokens (joint or
        image-only), or None where the call is not one of this model call's sequences."""
        core = self.before + self.image + self.after
        if self.text and length == self.text + core:
            return self.before + (self.text if self.text_first else 0)
        return self.before if length == core else None


class CallState(NamedTuple):
    """What one model call pools: its spans, the factor of each block (in the model's order,
    double-stream blocks first; 0 or 1: unpooled) and whether pooled keys get the bias."""

    spans: Spans
    factors: tuple[int, ...]
    doubles: int
    proportional: bool

    def factor(self, block_type: Any, index: Any) -> int:
        """The factor of the block ``transformer_options`` names (``block_type`` "double" or
        "single", ``block_index``); without block information, the factor all blocks share
        (0 where they differ)."""
        if isinstance(index, int):
            pos = index + (self.doubles if block_type == "single" else 0)
            return self.factors[pos] if 0 <= pos < len(self.factors) else 0
        return self.factors[0] if len(set(self.factors)) == 1 else 0


_active: tuple[Any, CallState | None, Any] | None = None  # (override, state, chained override)


def activate(pool: KvPool, state: CallState | None, prev: Any) -> Any:
    """Make ``state`` the current call's (what ``pool`` reads); returns what to restore."""
    global _active
    before, _active = _active, (pool, state, prev)
    return before


def restore(before: Any) -> None:
    global _active
    _active = before


class KvPool:
    """The override: ``pool(func, q, k, v, heads, mask=None, **kwargs)`` as ComfyUI calls it.

    One per patch, never copied (ComfyUI deep-copies options on every clone). ``flags``
    records that a call reached it (``fired``) and that one was pooled (``pooled``): dict
    writes of constants, replayed by a compiled graph, no tensor read; the host's wrapper
    clears them before each model call and counts them after. ``skipped`` names blocks left
    unpooled and why (eager calls only)."""

    def __init__(self) -> None:
        self.flags: dict[str, bool] = {}
        self.skipped: list[tuple[Any, str]] = []
        self._plans: dict[tuple, dit.DitPlan] = {}  # eager: one per grid and factor

    def __deepcopy__(self, memo: dict) -> KvPool:
        return self

    def __call__(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        self.flags["fired"] = True
        active = _active
        state, prev = (active[1], active[2]) if active is not None and active[0] is self \
            else (None, None)
        if state is not None:
            out = self._pooled(state, prev, func, args, kwargs)
            if out is not None:
                return out
        return _call(prev, func, args, kwargs)

    def _pooled(self, state: CallState, prev: Any, func: Callable, args: tuple,
                kwargs: dict) -> Any:
        q, k, v = args[0], args[1], args[2]
        dim = 2 if kwargs.get("skip_reshape") else 1
        n = k.shape[dim]
        if q.shape[dim] != n:  # cross-attention: keys of the text (or of an image prompt)
            return None
        start = state.spans.start(n)
        options = kwargs.get("transformer_options") or {}
        f = state.factor(options.get("block_type"), options.get("block_index"))
        if start is None or f <= 1:
            return None
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if mask is not None:
            self._skip(options, "an attention mask (pooling would misalign it)")
            return None
        p = cached_plan(self._plans, state.spans, f, "before", state.proportional)
        self.flags["pooled"] = True
        kp, vp = p.pool(k, start, dim), p.pool(v, start, dim)
        bias = p.bias(start, n, k.device)
        if bias is None:
            return _call(prev, func, (q, kp, vp, *args[3:]), kwargs)
        if prev is None and getattr(func, "__name__", "") in MASK_BACKENDS:
            m = bias.to(q.dtype).view(1, 1, 1, -1)
            if len(args) > 4:
                return _call(prev, func, (q, kp, vp, args[3], m, *args[5:]), kwargs)
            return _call(prev, func, (q, kp, vp, *args[3:]), {**kwargs, "mask": m})
        return _channel(prev, func, q, kp, vp, bias, dim, args, kwargs)

    def _skip(self, options: dict, why: str) -> None:
        if merge.compiling():
            return
        block = (options.get("block_type"), options.get("block_index"))
        if not any(b == block for b, _ in self.skipped):
            self.skipped.append((block, why))


def cached_plan(cache: dict, s: Spans, f: int, rope: str, proportional: bool) -> dit.DitPlan:
    """The plan of a call's grid at factor ``f``, kept in ``cache`` in eager mode (its pooled
    positions and bias are built once; at most 32 kept), built in the graph while compiling
    (a dict read would add guards)."""
    if merge.compiling():
        return dit.DitPlan(s.h, s.w, f, rope, proportional, s.frames)
    key = (s.frames, s.h, s.w, f, rope, proportional)
    if key not in cache:
        if len(cache) > 32:
            cache.clear()
        cache[key] = dit.DitPlan(s.h, s.w, f, rope, proportional, s.frames)
    return cache[key]


def _call(prev: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
    """The backend, or the override this one chains, with these (pooled) tensors."""
    if prev is not None:
        return prev(func, *args, **kwargs)
    return func(*args, **kwargs)


def _channel(prev: Any, func: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             bias: torch.Tensor, dim: int, args: tuple, kwargs: dict) -> torch.Tensor:
    """The bias as one extra query/key channel per head (``attend.count_channel``) for a
    kernel that takes no mask; the kernel scales by its own (wider) head dim, which
    ``count_channel`` corrects; the extra channels are cut from the output."""
    heads = args[3] if len(args) > 3 else kwargs["heads"]
    if dim == 1:  # [B, S, heads * D]
        q, k, v = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
    d = q.shape[-1]
    q, k, v = attend.count_channel(q, k, v, bias, dim, attend.channel_width(d) ** -0.5)
    if dim == 1:
        q, k, v = (t.flatten(-2) for t in (q, k, v))
    out = _call(prev, func, (q, k, v, *args[3:]), kwargs)
    if kwargs.get("skip_output_reshape"):  # [B, heads, S, D']
        return out[..., :d]
    return out.unflatten(-1, (heads, -1))[..., :d].flatten(-2)


# ----------------------------------------------------------------------------- measuring

def runner(kernel: tuple[str, str] = COMFY_KERNEL) -> Callable:
    """``measure``'s runner for a DiT whose attention is reached per call (this override,
    Forge Neo's swap: ``kernel`` names the host's backend, torch's SDPA where it is not
    loaded): a block's token-wise work (each of its linear layers on the image tokens) and
    its self-attention over them, unpooled, or through a ``KvPool`` with the state of
    ``plan``'s grid (a video's frames too), as a pooled generation runs it. Errs low:
    per-sample layers (modulation) are counted per token."""
    pool = KvPool()

    def run(block: nn.Module, x: torch.Tensor, context: Any, planner: Any, p: Any) -> Any:
        func = getattr(sys.modules.get(kernel[0]), kernel[1], None) or _sdpa
        for m in block.modules():
            if isinstance(m, nn.Linear):
                m(x if m.in_features == x.shape[-1] else x.new_zeros(*x.shape[:-1],
                                                                    m.in_features))
        heads = heads_of(block, x.shape[-1])
        if p is None:
            return func(x, x, x, heads)
        spans = Spans(0, True, 0, p.frames, p.h, p.w)
        before = activate(pool, CallState(spans, (p.factor,), 0, bool(p.proportional)), None)
        try:
            return pool(func, x, x, x, heads)
        finally:
            restore(before)
    run.video = True  # a video's grid runs as the generation pools it (``Measurer.get``)
    return run


def heads_of(block: nn.Module, width: int) -> int:
    """The block's attention heads (an attribute the hosts' blocks or their attention
    modules carry), else heads of 128 channels (Flux, Qwen-Image, Wan)."""
    for m in (block, *block.children()):
        for name in ("heads", "num_heads", "n_heads"):
            n = getattr(m, name, None)
            if isinstance(n, int) and n > 0 and width % n == 0:
                return n
    return max(1, width // 128)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: Any = None,
          **kwargs: Any) -> torch.Tensor:
    """ComfyUI's backend form ``(q, k, v, heads, mask)`` on ``[B, S, heads * D]``."""
    q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).flatten(2)


# ----------------------------------------------------------------------------- the patch

class OverridePatch:
    """One patched model: the settings as this form applies them, the planner (step window,
    policy), the override and ComfyUI's ``apply_model`` wrapper (``wrapper``).

    ``spans_of(model, x, context, kwargs)`` is the family's reading of a model call
    (``Spans`` or None: not a call it knows; ``adapters.py`` picks it). Keys arrive rotated
    (``rotated``; Forge Neo's swap hands Flux's keys before RoPE), so ``rope="pooled"`` is
    applied as "before"; residual reuse is left out (its presets become their points without
    reuse); both are named in ``limits``."""

    NEVER_CALLED = ("the attention override was installed but never called (a node after this "
                    "ToMe node replaced ComfyUI's optimized_attention_override without calling "
                    "it)")
    SILENT = f"ToMe: {NEVER_CALLED}, so nothing was pooled"

    def __init__(self, config: ToMeConfig, layout: Layout, spans_of: Callable,
                 percent_to_sigma: Callable[[float], float] | None = None,
                 rotated: bool = True):
        self.layout, self.spans_of = layout, spans_of
        rope = layout.dit.rope and rotated
        self.applied = without_reuse(config).replace(rope="before") if rope \
            else without_reuse(config)
        self.limits = [x for x, on in (
            ("rope pooled (keys arrive rotated: pooled as rope before)",
             rope and config.rope == "pooled"),
            ("residual reuse", config.reuse)) if on]
        self.schedule = dit.schedule_of(self.applied)
        self.kinds = [b.kind for b in layout.blocks]
        self.factors = tuple(self.schedule.factor(i, kind, len(self.kinds), None)
                             for i, kind in enumerate(self.kinds))
        self.chosen = {i for i, f in enumerate(self.factors) if f > 1}
        self.doubles = self.kinds.count("double")
        start, end = self.schedule.window()
        convert = percent_to_sigma or plan.flow_percent_to_sigma
        self.convert = convert
        window = None if start <= 0 and end >= 1 else plan.Window.sigmas(start, end, convert)
        p = layout.dit.patch
        self.planner = plan.Planner(self.applied, p, None, [p],
                                    method=dit.method_for(self.applied), window=window)
        self.pool = KvPool()
        self.skipped = self.pool.skipped
        self.calls = self.fired = 0  # model calls with the override installed / reached
        self.placed = self.active = self.pooled = 0  # ... placed by the family / pooling by
        # the settings at their step / that pooled at least one attention call (``counts``)
        self.on_silent: Callable[[], Any] | None = None  # told once: installed, never reached
        self.on_call: Callable[[dict], Any] | None = None  # the host's look at each call's options
        self.report: Any = None

    def __deepcopy__(self, memo: dict) -> OverridePatch:
        return self

    def report_as(self, adapter: str) -> PatchReport:
        """The report of this patch made through ``adapter`` (this one, or Forge Neo's swap,
        which shares its state), its ``nothing`` set where the settings pool no block."""
        layout, p = self.layout, self.layout.dit.patch
        report = PatchReport.of(layout, self.applied, adapter, max_downsample=p,
                                levels={p: len(self.chosen)} if self.chosen and
                                self.planner.method else {})
        if report.unmergeable is None and not self.chosen:  # named, but each at x1
            report.unmergeable = "ToMe: these settings change nothing (every block at x1)"
        report.skipped, report.planner = self.skipped, self.planner
        self.report = report
        return report

    def begin(self, spans: Spans, sigmas: Any, device: Any, batch: int) -> CallState | None:
        """This call's state, or None where it pools nothing (outside the step window, the
        policy, no block pooled at this step). Reads the sigma on the host once, only where a
        window or a per-step schedule needs it (``Planner.begin``)."""
        p = self.layout.dit.patch
        call = self.planner.begin((spans.frames, spans.h * p, spans.w * p), device, sigmas,
                                  batch)
        if call is None:
            return None
        tokens = spans.image
        if not self.planner.decision(p, tokens, call.kind, call.measured.get(p)).merged:
            return None
        factors = self.factors
        if self.schedule.varies() and isinstance(sigmas, torch.Tensor) and sigmas.numel():
            progress = progress_of(float(sigmas.reshape(-1)[0]), self.convert)
            factors = tuple(self.schedule.factor(i, kind, len(self.kinds), progress)
                            for i, kind in enumerate(self.kinds))
        if not any(f > 1 for f in factors):
            return None
        top = max(factors)
        self.planner.record(p, tokens, tokens - dit.pooled_tokens(spans.h, spans.w, top,
                                                                  spans.frames))
        return CallState(spans, factors, self.doubles, bool(self.applied.proportional))

    def counts(self) -> tuple[int, int, int, int, int]:
        """The model calls so far: run with the override installed, reaching it, placed by
        the family (``spans_of``), pooling at their step by the settings, that pooled."""
        return self.calls, self.fired, self.placed, self.active, self.pooled

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
        spans = self.spans_of(self.layout.root, x, context, kwargs)
        state = None if spans is None else \
            self.begin(spans, options.get("sigmas"), x.device, x.shape[0])
        prev = options.get(OVERRIDE)
        if prev is self.pool:
            prev = None
        new = {**options, OVERRIDE: self.pool}
        if spans is not None:
            new[SPANS_KEY] = spans
        if at is not None:
            args[at] = new
        else:
            kwargs["transformer_options"] = new
        self.pool.flags.clear()
        before = activate(self.pool, state, prev)
        try:
            return executor(*args, **kwargs)
        finally:
            restore(before)
            self.calls += 1
            self.placed += spans is not None
            self.active += state is not None
            self.pooled += bool(self.pool.flags.get("pooled"))
            if self.pool.flags.get("fired"):
                self.fired += 1
            elif not self.fired and self.calls == 1 and self.on_silent is not None:
                self.on_silent()


def patch(unet_patcher: Any, layout: Layout, config: ToMeConfig, spans_of: Callable,
          percent_to_sigma: Callable[[float], float] | None = None) -> tuple[Any, PatchReport]:
    """A clone of ComfyUI's ``ModelPatcher`` whose ``apply_model`` wrapper (key ``"tome"``)
    installs the override per call, and the report (``adapters.patch_model_patcher`` chooses
    this form); settings that pool nothing: the patcher itself, with the report's
    ``nothing``."""
    ours = OverridePatch(config, layout, spans_of, percent_to_sigma)
    report = ours.report_as(ADAPTER)
    if report.nothing:
        return unet_patcher, report
    clone = unet_patcher.clone()
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, ours.wrapper)
    setattr(clone, patcher.MARK, ours)
    return clone, report


def carried(unet_patcher: Any) -> bool:
    """Whether a patcher carries our ``apply_model`` wrapper (an earlier ToMe node's)."""
    wrappers = getattr(unet_patcher, "wrappers", None) or {}
    return bool((wrappers.get(APPLY_MODEL) or {}).get(WRAPPER_KEY))


def strip(unet_patcher: Any) -> None:
    """Remove our ``apply_model`` wrapper from ``unet_patcher`` (a clone)."""
    (getattr(unet_patcher, "wrappers", None) or {}).get(APPLY_MODEL, {}).pop(WRAPPER_KEY, None)
    if isinstance(getattr(unet_patcher, patcher.MARK, None), OverridePatch):
        delattr(unet_patcher, patcher.MARK)


def progress_of(sigma: float, percent_to_sigma: Callable[[float], float]) -> float:
    """The sampling progress (0 = first step) at ``sigma``: ``percent_to_sigma`` inverted by
    bisection (it falls from the largest sigma at 0 to 0 at 1); host floats only."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if float(percent_to_sigma(mid)) > sigma:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
