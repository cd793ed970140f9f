"""Whether a timed block run fits in memory, checked before it runs.

Measuring times a block *unmerged* at the size being measured, even where the generation
itself would merge it and fit. With an attention that materialises the whole score matrix (the
basic one: Forge Neo's and ComfyUI's CPU default, stock ldm, diffusers' ``AttnProcessor``),
one top-level SD1.5 block at 1024 px, batch 2, holds 2 x 8 x 16384^2 fp32 scores (16 GiB) and
their softmax: on a CPU the kernel's out-of-memory killer ends the host, which no ``except``
catches; on a GPU it is an exception at best. So ``measure`` asks ``check`` first, and a size
that does not fit is skipped with one line (the token thresholds decide for it).

The estimate is deliberately simple and errs high: activations (input, norms, q/k/v, the
feed-forward's 4x GEGLU) as 16 copies of the block input, plus, for a full-score attention,
two fp32 score matrices (scores and softmax) for self- and cross-attention; memory-efficient
kernels (SDPA, xFormers, sub-quadratic, sliced or split attention) add nothing per token pair.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import console, dit, dits, merge, policy
from .attend import Keep
from .config import without_reuse
from .layout import UnsupportedModelError, attention, channels

ACTIVATION_COPIES = 16   # copies of the block input alive at once, at most (feed-forward: 4x2)
SCORE_COPIES = 2         # the score matrix and its softmax
MARGIN = 1.2             # estimate x this + HEADROOM must be available
HEADROOM = 512 << 20
# Attention kernels that never hold a token-by-token matrix (by name, lower case): PyTorch's
# SDPA (unless only its math back-end is enabled), xFormers, flash, Sage, sub-quadratic, and
# the split/sliced kernels that chunk the scores to fit (A1111's InvokeAI and Doggettx, Forge's
# and ComfyUI's attention_split, diffusers' SlicedAttnProcessor), and diffusers' processors that
# call its ``dispatch_attention_fn`` (SDPA by default; its math back-ends are caught below).
EFFICIENT = ("sdp", "scaled_dot_product", "attnprocessor2_0", "attention_pytorch", "xformers",
             "flash", "sage", "sub_quad", "split", "invokeai", "slice",
             "dispatch_attention_fn:native")


class NotEnoughMemoryError(Exception):
    """A timed run would need more memory than the device has free."""

    def __init__(self, need: int, available: int, full: bool, backend: str):
        self.need, self.available, self.full, self.backend = need, available, full, backend
        kind = "a full attention score matrix" if full else "memory-efficient attention"
        super().__init__(f"timing the unmerged block needs about {gib(need)} ({kind}: "
                         f"{backend}), {gib(available)} of memory is available")


def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def amount(n: int) -> str:
    """``3.0 GiB``, ``4.5 MiB``, ``96.0 KiB``: bytes in the unit that reads."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def kernel(attn: nn.Module) -> str:
    """The function that computes attention where the host swaps it at module level rather
    than on the class: Forge and Forge Neo (``backend.attention.attention_function``),
    reForge, Forge Classic and ComfyUI (``optimized_attention``); '' elsewhere."""
    module = sys.modules.get(type(attn).__module__)
    for name in ("attention_function", "optimized_attention"):
        fn = getattr(module, name, None)
        if callable(fn):
            return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', name)}"
    return ""


def full_scores(backend: str) -> bool:
    """Whether the attention named by ``measure.attention_backend`` holds the whole score
    matrix. Unknown kernels count as full: a wrong guess skips a measurement, never the
    host."""
    name, _, flags = backend.lower().partition(" sdp:")
    if flags and set(flags.split(",")) <= {"math", ""}:
        return True  # SDPA with only its math back-end materialises the scores
    if "dispatch_attention_fn:" in name and "math" in name:
        return True  # diffusers' "_native_math" back-end
    return not any(k in name for k in EFFICIENT)


def block_bytes(block: nn.Module, tokens: int, batch: int, channels: int, full: bool,
                context_tokens: int = 77) -> int:
    """Peak bytes of one unmerged run of ``block`` on ``tokens`` tokens (see the module
    docstring), plus the matching chunk of a plan build."""
    p = next(block.parameters())
    elem = p.element_size()
    try:
        heads = int(getattr(attention(block), "heads", 0) or max(1, channels // 64))
    except UnsupportedModelError:  # a host's DiT block without ``attn`` (ComfyUI's Flux)
        heads = max(1, channels // 64)
    need = batch * tokens * channels * elem * ACTIVATION_COPIES
    if full:
        score = max(elem, 4) * SCORE_COPIES * batch * heads * tokens
        need += score * (tokens + context_tokens)
    return need + merge.chunk_budget(p.device)


def available(device: torch.device) -> int | None:
    """Bytes free for a run on ``device``: the system's available memory for the CPU
    (``psutil``, else ``/proc/meminfo``); on CUDA the driver's free memory plus what PyTorch's
    allocator holds unused; on MPS the recommended limit less what is allocated; None where
    unknown (then nothing is skipped)."""
    try:
        if device.type == "cpu":
            return _cpu_available()
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free + torch.cuda.memory_reserved(device)
                       - torch.cuda.memory_allocated(device))
        if device.type == "mps":
            return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    except Exception:  # noqa: BLE001 (an old torch or driver: unknown)
        return None
    return None


def _cpu_available() -> int | None:
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check(runs: list[tuple[nn.Module, int, int]], batch: int, backend: str) -> None:
    """Raise ``NotEnoughMemoryError`` unless the largest ``block_bytes`` of the ``(block,
    tokens, channels)`` runs (x ``MARGIN``, + ``HEADROOM``) fits on their device."""
    full = full_scores(backend)
    need = max(block_bytes(b, n, batch, c, full) for b, n, c in runs)
    free = available(next(runs[0][0].parameters()).device)
    if free is not None and need * MARGIN + HEADROOM > free:
        raise NotEnoughMemoryError(need, free, full, backend)


# ----------------------------------------------------------------------------- residual reuse
#
# ``attend.Reuse`` keeps, per pooled attention, call identity (cond/uncond, batch rows) and
# schedule factor, the residual ``full - pooled`` of its output, and from the second refresh
# its slope: two attention outputs each. At 1024 px Flux-dev that is 57 blocks x 4608 rows x
# 3072 x bf16 x 2 = 3.0 GiB, Wan 14B at 720p x 81 frames with CFG 115 GiB: so what it will keep
# is estimated (``reuse_bytes``) and checked before it keeps anything (``ReuseBudget``), and
# where it does not fit it keeps less, in the steps of ``ladder`` (measured on the tiny DiT:
# docs/quality.md#dit-reuse-memory), down to the settings' point without reuse.


@dataclass(frozen=True)
class Part:
    """One pooled attention as reuse keeps it: per call identity and factor, a ``[rows,
    width]`` output per batch row (the residual; the slope doubles it)."""

    block: int        # the block's index (``Keep.blocks`` keeps the first pooled blocks)
    rows: int         # its output's rows: text + image where the attention is joint
    image: int        # the pooled image span's rows (``Keep.image_only``)
    width: int        # its output's width (heads x head dim)
    factors: int = 1  # the schedule's factors for this block (each keeps its own)


def reuse_bytes(parts: Sequence[Part], batch_rows: int, dtype: torch.dtype, keep: Keep,
                order: Sequence[int] | None = None) -> int:
    """Bytes reuse keeps under ``keep`` once every refresh has run twice: per pooled block
    kept (the first ``keep.blocks`` of ``order``, the pooled blocks' indices), call identity
    (``batch_rows``: their batch rows added up) and factor, one output of ``dtype`` (or
    ``keep.dtype``) per tensor kept (residual, slope). Exactly what ``Reuse.held_bytes`` then
    says."""
    if keep.blocks == 0 or batch_rows <= 0:
        return 0
    if keep.blocks is None:
        kept = None
    else:
        kept = set((order or sorted({p.block for p in parts}))[:keep.blocks])
    elem = _elem(keep.dtype or dtype)
    tensors = 2 if keep.slope else 1
    return sum(tensors * elem * batch_rows * p.factors * (p.image if keep.image_only else p.rows)
               * p.width for p in parts if kept is None or p.block in kept)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


#: Kept residuals in 16 bits where the output is float32 (lossless on the tiny DiT).
HALF = torch.bfloat16
#: Then in 8 bits (e4m3: clamped to +-448 before the cast, ``attend.kept_as``; lossless on the
#: tiny DiT), where torch has it.
EIGHT = getattr(torch, "float8_e4m3fn", None)


def ladder(dtype: torch.dtype, device: str = "cuda") -> list[Keep]:
    """What reuse keeps, most first: each step frees the most bytes for the fidelity it
    costs (the tiny DiT, quality preset: 16 and 8 bits and the image rows cost nothing
    measurable, the slope 2.9 dB; docs/quality.md#dit-reuse-memory). Keeping fewer blocks is
    not a step: half the blocks cost 10 dB, worse than the settings' point without reuse,
    which comes after these (``fit``). 8 bits on CUDA and CPUs only (``device``: its type)."""
    steps = [Keep()]
    if dtype == torch.float32:
        steps.append(Keep(dtype=HALF))
    low = steps[-1].dtype
    steps.append(Keep(dtype=low, image_only=True))
    if EIGHT is not None and device in ("cuda", "cpu"):
        low = EIGHT
        steps.append(Keep(dtype=low, image_only=True))
    steps.append(Keep(slope=False, dtype=low, image_only=True))
    return steps


def fits(need: int, reserve: int, free: int | None) -> bool:
    """``need`` kept bytes and ``reserve`` (the forward's own activations), with
    ``memory.check``'s margin, within ``free`` (None: unknown, fits)."""
    return free is None or (need + reserve) * MARGIN + HEADROOM <= free


def fit(parts: Sequence[Part], batch_rows: int, dtype: torch.dtype, free: int | None,
        reserve: int = 0, order: Sequence[int] | None = None, device: str = "cuda"
        ) -> tuple[Keep, int]:
    """The first ``ladder`` step whose ``reuse_bytes`` fits in ``free``, else ``Keep(blocks=0)``
    (no reuse); with the bytes it keeps."""
    for keep in ladder(dtype, device):
        need = reuse_bytes(parts, batch_rows, dtype, keep, order)
        if fits(need, reserve, free):
            return keep, need
    return Keep(blocks=0), 0


def factors(schedule: dit.Schedule, index: int, kind: str, count: int) -> int:
    """How many distinct factors the schedule gives block ``index`` over sampling (each keeps
    its own residuals)."""
    edges = sorted({e for _, _, lo, hi in schedule.items for e in (lo, hi)} | {0.0, 1.0})
    points = edges + [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    return len({f for p in points if (f := schedule.factor(index, kind, count, p))})


def attention_parts(layout: Any, blocks: Sequence[int], config: Any) -> list[tuple]:
    """Per pooled attention of ``blocks`` (indices into ``layout.blocks``): (block index,
    joint, width, factors). Joint: its output has the text's rows too (single-stream
    blocks, attentions with text projections, the shadows' joint attention); width: the
    module's ``inner_dim`` (heads x head dim), else the block's."""
    family = dits.of(layout)
    schedule, count = dit.schedule_of(config), len(layout.blocks)
    out = []
    for i in blocks:
        b = layout.blocks[i]
        n = factors(schedule, i, b.kind, count)
        for a in family.attentions(b.module):
            joint = b.kind == "single" or getattr(a, "add_k_proj", None) is not None \
                or family.shadow is not None
            width = getattr(a, "inner_dim", None)
            if not isinstance(width, int):
                width = _width(a, b.module)
            out.append((i, joint, int(width), n))
    return out


def _width(attn: nn.Module, block: nn.Module) -> int:
    """An attention's output width without ``inner_dim``: its query projection's, else the
    block's, else its widest linear (errs high)."""
    q = getattr(attn, "to_q", None)
    if isinstance(q, nn.Linear):
        return q.out_features
    try:
        return channels(block)
    except (UnsupportedModelError, AttributeError):
        return max((m.out_features for m in block.modules() if isinstance(m, nn.Linear)),
                   default=1)


def call_parts(specs: Sequence[tuple], layout: Any, x: torch.Tensor, size: tuple[int, ...],
               text: int) -> list[Part]:
    """``Part``s of one model call (``x``, the latent ``size`` and ``text`` as the family's
    ``call`` read them): image rows are the pooled span; the rest of a call's sequence
    (references, a video's kept first frame) stays in every attention's rows, and a joint
    attention adds the text (a video DiT's call gives its kept first frame where an image
    DiT gives its text length)."""
    image = policy.level_tokens(size, layout.dit.patch)
    if x.dim() == 5:  # a video: ``text`` is its kept first frame; a joint text the facts'
        seq = image + text
        words = int(getattr(layout.dit, "context_tokens", 0)) if layout.dit.text_tokens else 0
    else:  # packed tokens (image and references) or a latent
        seq, words = (x.shape[1] if x.dim() == 3 else image), text
    return [Part(i, seq + (words if joint else 0), image, width, n)
            for i, joint, width, n in specs]


def compute_dtype(model: Any) -> torch.dtype | None:
    """The dtype a host's model base casts the latent to inside its call, where the shim
    (``apply_model`` wrapper, ``model_function_wrapper``) still sees the sampler's float32:
    ComfyUI's ``get_dtype_inference()`` (before it: ``manual_cast_dtype``, else
    ``get_dtype()``), Forge's and Forge Neo's ``computation_dtype``; None where it says none."""
    try:
        if callable(getattr(model, "get_dtype_inference", None)):
            dtype = model.get_dtype_inference()
        elif callable(getattr(model, "get_dtype", None)):
            dtype = getattr(model, "manual_cast_dtype", None) or model.get_dtype()
        else:
            dtype = getattr(model, "computation_dtype", None)
    except Exception:  # noqa: BLE001 (a model base that cannot say: the call's dtype)
        return None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


class ReuseBudget:
    """Residual reuse's memory for one patched DiT (``processors.py`` asks at every call
    that reuses, right after ``Reuse.begin``). At a generation's first call, and at each call
    identity the generation had not seen (true CFG's second call, a batch that drops its
    uncond), it estimates what reuse will keep with the identities so far (``call_parts``,
    ``reuse_bytes``) before anything of theirs is kept, and checks it against the free memory
    of the device the outputs live on (what it holds itself counts as free; the forward's
    activations are reserved, with ``check``'s margin; in the dtype the model computes in,
    ``compute``): the first ``ladder`` step that fits,
    or at the bottom the settings' point without reuse (``config.without_reuse``: a preset's
    schedule changes too). One console line where that is not everything, and again when it
    changes; ``report.memory`` says what it keeps. A generation on a grid whose last one had
    more identities (true CFG's uncond) is budgeted for them from its first call, while its
    own are among them. ``partner``: a pipeline's other expert
    (Wan 2.2 A14B), whose residuals are freed when this one's generation starts."""

    def __init__(self, layout: Any, config: Any, blocks: Sequence[int], reuse: Any,
                 report: Any = None, say: Any = console.line):
        self.layout, self.reuse, self.report, self.say = layout, reuse, report, say
        self.every = config.reuse
        self.schedule = dit.schedule_of(config)
        self.fallback = dit.schedule_of(without_reuse(config, [b.kind for b in layout.blocks]))
        self.order = tuple(blocks)
        self.specs = attention_parts(layout, blocks, config) if config.reuse else []
        self.partner: ReuseBudget | None = None
        self.grid: tuple | None = None
        self.last: float | None = None
        self.calls: dict[Any, int] = {}   # this generation's call identities -> batch rows
        self.had: dict[tuple, dict] = {}  # grid -> the identities its last generation had
        self.said: Keep | None = None     # the step the last console line named
        self.keep, self.need = Keep(), 0
        self.fixed: Keep | None = None    # keep this whatever memory says (the lab's ladder)
        # The dtype the model computes in where the host casts the latent to it inside the
        # call, after the shim saw it (``compute_dtype``: ComfyUI, Forge); None: the call's.
        self.compute: torch.dtype | None = None

    def release(self) -> None:
        """Free what reuse keeps (the other expert's generation starts)."""
        self.reuse.reset()

    def _dtype(self, x: torch.Tensor) -> torch.dtype:
        """The attention outputs' dtype: autocast's where it is on, else the one the host
        computes in (``compute``), else the call's (a quantised model's weights say nothing
        about it)."""
        try:  # torch >= 2.4 (older: no autocast dtype per device type; the call's)
            if torch.is_autocast_enabled(x.device.type):
                return torch.get_autocast_dtype(x.device.type)
        except (AttributeError, TypeError, RuntimeError):
            pass
        if self.compute is not None:
            return self.compute
        return x.dtype if x.is_floating_point() else torch.float32

    def begin(self, x: torch.Tensor, size: tuple[int, ...], text: int, p: float
              ) -> dit.Schedule:
        """Decide (where this call needs it) what reuse keeps; the schedule to run."""
        if not self.every or not self.specs:
            return self.schedule
        r, grid = self.reuse, tuple(size)
        first = r.who is not None and r.step == 0 and len(r.at) == 1 and r.refresh
        new = first or grid != self.grid or self.last is None or p < self.last
        if new and self.calls and self.grid is not None:
            self.had.pop(self.grid, None)  # the newest last (at most 8 grids remembered)
            self.had = {**dict(list(self.had.items())[-7:]), self.grid: self.calls}
        self.grid, self.last = grid, p
        if new:
            self.calls = {}
            if self.partner is not None:
                self.partner.release()
            if r.who is None:  # reuse is off (``Reuse.begin`` did not count this call)
                r.reset()
        elif r.who is None or r.who in self.calls:  # off for this generation, or counted
            return self.fallback if self.keep.blocks == 0 else self.schedule
        who = r.who if r.who is not None else ("call", x.shape[0])
        self.calls[who] = int(x.shape[0])
        if new or who not in self._expected():  # else budgeted for from the first call
            self._decide(x, size, text, p)
        if r.who is not None and who != r.who:  # reuse back on at this call: its identity
            self.calls[r.who] = self.calls.pop(who)
        return self.fallback if self.keep.blocks == 0 else self.schedule

    def _expected(self) -> dict:
        """The identities this generation will have, as far as known: those the last one on
        its grid had, while this one's so far are among them (true CFG's uncond then counts
        from the cond's first call), else none."""
        had = self.had.get(self.grid, {})
        return had if all(had.get(w) == n for w, n in self.calls.items()) else {}

    def _decide(self, x: torch.Tensor, size: tuple[int, ...], text: int, p: float) -> None:
        r, dtype = self.reuse, self._dtype(x)
        parts = call_parts(self.specs, self.layout, x, size, text)
        rows = sum({**self._expected(), **self.calls}.values())
        free = available(x.device)
        if free is not None:
            free += r.held_bytes()  # what it keeps now is freed if it keeps less
        widest = max(q.width for q in parts)
        reserve = ACTIVATION_COPIES * x.shape[0] * max(q.rows for q in parts) * widest \
            * _elem(dtype)
        if self.fixed is not None:
            keep = self.fixed
            need = reuse_bytes(parts, rows, dtype, keep, self.order)
        else:
            keep, need = fit(parts, rows, dtype, free, reserve, self.order, x.device.type)
        full = reuse_bytes(parts, rows, dtype, Keep(), self.order)
        if keep != r.keep:
            r.set_keep(keep)
            if r.who is None and keep.blocks != 0:  # back from no reuse: this call reuses
                r.begin(p, int(x.shape[0]), tuple(size))
        self.keep, self.need = keep, need
        if self.report is not None:
            self.report.memory = self.words()
        if self.fixed is None and keep != Keep() and keep != self.said:
            self.say(f"ToMe: residual reuse would keep {amount(full)} with "
                     f"{amount(free or 0)} free on {x.device.type}: "
                     + (f"it keeps {keep.words()} ({amount(need)})" if keep.blocks != 0 else
                        f"it is off, {self.fallback.describe()} runs (the settings' "
                        "point without reuse)"))
        self.said = keep if keep != Keep() else None

    def words(self) -> str:
        """``reuse keeps 3.0 GiB (residual + slope)``; ``reuse off (not enough memory): x2 in
        single blocks, steps 0.3-1`` (what runs instead)."""
        if self.keep.blocks == 0:
            return f"reuse off (not enough memory): {self.fallback.describe()}"
        return f"reuse keeps {amount(self.need)} ({self.keep.words()})"
