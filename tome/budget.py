"""Residual reuse's memory, checked before it keeps anything.

``reuse.Reuse`` keeps, per pooled attention, call identity (grid, cond/uncond, batch rows)
and schedule factor, the residual ``full - pooled`` of its output, and from the second
refresh its slope: two attention outputs each. At 1024 px Flux-dev that is 57 blocks x 4608
rows x 3072 x bf16 x 2 = 3.0 GiB, Wan 14B at 720p x 81 frames with CFG 115 GiB: so what it
will keep is estimated (``reuse_bytes``) and checked before it keeps anything
(``ReuseBudget``, against free memory with ``memory.check``'s margin), and where it does not
fit it keeps less, in the steps of ``ladder`` (measured on the tiny DiT:
docs/quality.md#dit-reuse-memory), down to the settings' point without reuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import console, dit, dits, memory, policy
from .config import without_reuse
from .layout import UnsupportedModelError, channels
from .memory import ACTIVATION_COPIES, HEADROOM, MARGIN, amount
from .reuse import Keep


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
#: Then in 8 bits (e4m3: clamped to +-448 before the cast, ``reuse.kept_as``; lossless on the
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
        self.calls: dict[Any, tuple] = {}  # this generation's identities -> (rows, parts)
        self.had: dict[Any, tuple] = {}    # the identities the last generation had
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
        # a new grid is a new call identity (two grids in one step), not a new generation
        new = first or self.last is None or p < self.last
        if new and self.calls:
            self.had = self.calls  # the last generation's identities (each names its grid)
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
        self.calls[who] = (int(x.shape[0]), call_parts(self.specs, self.layout, x, size, text))
        if new or who not in self._expected():  # else budgeted for from the first call
            self._decide(x, size, text, p)
        if r.who is not None and who != r.who:  # reuse back on at this call: its identity
            self.calls[r.who] = self.calls.pop(who)
        return self.fallback if self.keep.blocks == 0 else self.schedule

    def _expected(self) -> dict:
        """The identities this generation will have, as far as known: those the last one on
        its grid had, while this one's so far are among them (true CFG's uncond then counts
        from the cond's first call), else none."""
        had = self.had
        return had if all(w in had and had[w][0] == n for w, (n, _) in self.calls.items()) \
            else {}

    def _decide(self, x: torch.Tensor, size: tuple[int, ...], text: int, p: float) -> None:
        r, dtype = self.reuse, self._dtype(x)
        parts = call_parts(self.specs, self.layout, x, size, text)
        # per identity expected (this generation's and the last one's on the same grids):
        # its rows and its grid's parts
        groups = list({**self._expected(), **self.calls}.values())

        def need_of(keep: Keep) -> int:
            return sum(reuse_bytes(ps, rows, dtype, keep, self.order) for rows, ps in groups)
        free = memory.available(x.device)
        if free is not None:
            free += r.held_bytes()  # what it keeps now is freed if it keeps less
        widest = max(q.width for q in parts)
        reserve = ACTIVATION_COPIES * x.shape[0] * max(q.rows for q in parts) * widest \
            * _elem(dtype)
        if self.fixed is not None:
            keep = self.fixed
            need = need_of(keep)
        else:
            keep, need = Keep(blocks=0), 0
            for step in ladder(dtype, x.device.type):  # ``fit`` over every identity's grid
                if fits(n := need_of(step), reserve, free):
                    keep, need = step, n
                    break
        full = need_of(Keep())
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
