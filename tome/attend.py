"""Attention over pooled image keys, for every DiT adapter: the proportional-attention bias
on each kernel path, and residual reuse.

- The bias (``dit.key_bias``: ``log(cell size)`` on pooled image keys, 0 elsewhere) goes to
  PyTorch's SDPA as an additive ``[1, 1, 1, S]`` mask (``sdpa``), or, for kernels that take
  no mask (flash-attn and the like behind diffusers' dispatcher, a host's own joint
  attention), as one extra query/key channel (``count_channel``).
  ``python -m tome_lab.dit_bias_bench`` times both (docs/quality.md#dit).
- ``Reuse``: every N steps a pooled block also runs unpooled and keeps ``full - pooled``,
  added to the pooled output on the steps between.

``attend`` puts pooling, positions, bias and reuse together around any kernel
``kernel(q, k, v, bias)``; ``dispatch`` is diffusers' kernel per backend. The DiT families'
maths (``tome/dits/``) call these; none of them is here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from . import dit, merge


def channel_width(head_dim: int, multiple: int = 8) -> int:
    """Head width with one extra channel, padded to ``multiple`` (kernels' head-dim rule)."""
    return -(-(head_dim + 1) // multiple) * multiple


def count_channel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                  seq_dim: int, kernel_scale: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key bias without a mask: one more channel per head, 1 on queries, ``bias / scale``
    on keys, 0 on values, zero-padded to a multiple of 8; ``q . k`` then gains exactly
    ``bias`` after the kernel's scaling. ``kernel_scale``: the scale the kernel applies (None:
    the caller passes ``1/sqrt(head_dim)``, the model's); where the kernel scales by its own
    (wider) head dim, queries are rescaled to keep the model's. The output's extra channels
    are 0: slice them off (``[..., :head_dim]``)."""
    d = q.shape[-1]
    dp = channel_width(d)
    s = 1 / math.sqrt(d)
    if kernel_scale is not None and kernel_scale != s:
        q = q * (s / kernel_scale)
        s = kernel_scale
    shape = [1] * q.dim()
    shape[seq_dim] = bias.shape[0]
    kb = (bias / s).to(k.dtype).view(shape).expand(*k.shape[:-1], 1)
    one = q.new_ones(()).expand(*q.shape[:-1], 1)
    pad = dp - d - 1

    def wide(x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        parts = [x] + ([extra] if extra is not None else []) \
            + [x.new_zeros(()).expand(*x.shape[:-1], pad + (extra is None))]
        return torch.cat(parts, -1)

    return wide(q, one), wide(k, kb), wide(v, None)


@dataclass(frozen=True)
class Keep:
    """What residual reuse keeps per pooled block, call identity and factor: the memory
    budget's knobs (``tome.memory``), each a step that keeps the most quality per byte."""

    slope: bool = True                # the extrapolation slope too (a 2nd tensor); False: none
    dtype: torch.dtype | None = None  # None: the attention output's; e.g. float16 halves float32
    image_only: bool = False          # only the image span's rows (text rows get no residual)
    blocks: int | None = None         # only the first ``blocks`` pooled blocks (by index); 0: none

    def words(self) -> str:
        """``residual + slope``, ``, image rows``, ``, float16``, ``, first 4 blocks``."""
        if self.blocks == 0:
            return "nothing"
        parts = ["residual + slope" if self.slope else "residual"]
        if self.image_only:
            parts.append("image rows")
        if self.dtype is not None:
            parts.append(str(self.dtype).replace("torch.", ""))
        if self.blocks is not None:
            parts.append(f"first {self.blocks} pooled blocks")
        return ", ".join(parts)


class Reuse:
    """Residual reuse (``reuse`` = N, DiTFastAttn's residual sharing on pooled keys): a pooled
    block's attention also runs unpooled on a refresh and keeps ``r = full - pooled``; the
    calls between add ``r`` to the pooled output, extrapolated linearly from the last two
    refreshes (``r + slope * d``, ``d`` = steps since the refresh, at most N; the slope is 0
    until there are two; measured 1.5 dB closer than the plain residual at the same speed,
    docs/quality.md#dit).

    Kept per block part, factor and *call identity*: the host's own (cond/uncond) where it
    gives one, else the batch rows and the call's place among the calls of its noise level
    with the same rows (so a batch that drops its uncond on some steps, or Heun's extra
    calls, find their own residuals). An identity refreshes when it has nothing kept or its
    last refresh is N steps old (a step the host skipped is caught up). Tied to one
    generation and grid: ``reset`` at the host's run start (the adapters call it), and on a
    new grid or progress going back. ``keep`` (``Keep``) says what is kept; the adapters
    free it all at a generation's end, on errors and on removal. Memory: ``held_bytes``.

    Compiled blocks (``torch.compile``, fullgraph): everything a block reads is decided on
    the host before the call (``begin``: ``active``, ``refresh``, the step as a 0-dim tensor
    ``now`` on the call's device, each part's residuals for this identity in
    ``part.reuse_cur``), so a block's graph guards on a few flags only (nothing kept yet,
    refresh, reuse) and steps and identities do not recompile."""

    def __init__(self, every: int = 0, keep: Keep = Keep(), extrapolate: bool = True):
        self.every, self.keep, self.extrapolate = every, keep, extrapolate
        self.order: tuple[int, ...] = ()  # pooled blocks' indices (``Keep.blocks`` counts here)
        self.parts: list[Any] = []        # the block parts that keep residuals (``join``)
        self.reset()

    # ---------------------------------------------------------------- host side, per call

    def join(self, part: Any) -> None:
        """A block part (``part.index``: its block) whose calls go through ``around``: its
        residuals live on it (``reuse_kept``: identity -> factor -> (r, slope, at))."""
        part.reuse_kept, part.reuse_cur = {}, None
        part.reuse_on = self.keeps(part.index)
        self.parts.append(part)

    def reset(self) -> None:
        """Drop everything kept and start counting steps again (a host's run start, a
        generation's end, an error, removal)."""
        for part in self.parts:
            part.reuse_kept, part.reuse_cur = {}, None
        self.at: dict[tuple, int] = {}      # identity -> step of its last refresh
        self.seen: dict[tuple, int] = {}    # (rows, host identity) -> calls at this noise level
        self.step, self.last, self.grid = -1, None, None
        self.who: tuple | None = None       # this call's identity; None: no reuse in this call
        self.before: int | None = None      # its last refresh before this call (``missed``)
        self.active = self.refresh = False
        self.now = torch.zeros(())          # the step, a 0-dim tensor (a graph input)

    def set_keep(self, keep: Keep) -> None:
        """Keep ``keep`` from now on: drops what is kept, step counting intact (every identity
        refreshes at its next call; the current call too, where it reuses)."""
        self.keep, self.at = keep, {}
        for part in self.parts:
            part.reuse_kept = {}
            part.reuse_on = self.keeps(part.index)
            part.reuse_cur = None if self.who is None else part.reuse_kept.setdefault(self.who, {})
        self.refresh = self.who is not None
        self.active = self.active and keep.blocks != 0
        if self.who is not None:
            self.at[self.who] = self.step

    @property
    def kept(self) -> dict[tuple, tuple]:
        """What is kept now: (block index, part, factor, identity) -> (r, slope, at)."""
        return {(part.index, id(part), f, who): t for part in self.parts
                for who, by in part.reuse_kept.items() for f, t in by.items()}

    def held_bytes(self) -> int:
        """Bytes kept now (the residuals and slopes)."""
        return sum(t.nbytes for kept in self.kept.values() for t in kept[:2] if t is not None)

    def begin(self, p: float, rows: int, grid: tuple[int, ...], who: Any = None,
              device: Any = None, step: int | None = None) -> None:
        """One model call at sampling progress ``p`` (0 at the first step) with ``rows`` batch
        rows on latent ``grid`` (frames, h, w); ``who``: the host's identity of the call
        (e.g. ComfyUI's cond_or_uncond), where it gives one; ``device``: the call's (the
        step is filled there, a kernel argument: no copy from the host, no sync); ``step``:
        the sampler's own step number, where the host tells it (ComfyUI: the sigma's place
        in its schedule), so steps a cache answered without calling the model still count;
        else the noise levels seen are counted."""
        self.who, self.active = None, False
        if not self.every or self.keep.blocks == 0:
            return
        if grid != self.grid or (self.last is not None and p < self.last):
            self.reset()  # another image, or progress went back: another generation
            self.grid = grid
        if p != self.last:
            self.step = self.step + 1 if step is None else step
            self.last, self.seen = p, {}
            self.now = torch.full((), float(self.step), device=device)
        ident = (rows, who)
        n = self.seen[ident] = self.seen.get(ident, -1) + 1
        who = self.who = (rows, who, n)
        at = self.before = self.at.get(who)
        self.refresh = at is None or self.step - at >= self.every
        if self.refresh:
            self.at[who] = self.step
        for part in self.parts:
            part.reuse_cur = part.reuse_kept.setdefault(who, {})
        self.active = True

    def missed(self) -> None:
        """This call was to refresh but ran no pooled attention (a cache answered it inside
        the model): its refresh is left to the identity's next call."""
        if self.refresh and self.who is not None:
            if self.before is None:
                self.at.pop(self.who, None)
            else:
                self.at[self.who] = self.before

    # ---------------------------------------------------------------- in the block

    def keeps(self, index: int) -> bool:
        n = self.keep.blocks
        return n is None or index in (self.order[:n] if self.order else range(n))

    def around(self, key: tuple, out: torch.Tensor, full: Any, dim: int = 1,
               span: tuple[int, int] | None = None) -> torch.Tensor:
        """The one guard of every family's maths: a pooled attention output ``out`` (the
        sequence on ``dim``; ``span``: the image rows, start and stop) plus its kept residual,
        or on a refresh (or with nothing kept for this part and factor) ``full()``, keeping
        ``full - out`` per ``keep``. ``full(rows=None)``: the unpooled attention (of the first
        ``rows`` query rows only, where given: the auto policy times a refresh's share with
        it). ``key``: (part, factor), the part ``join``ed. Outside a call with reuse: ``out``."""
        if not self.active:
            return out
        part, factor = key
        if getattr(part, "reuse_on", None) is None:  # a part no adapter joined (a test's)
            self.join(part)
            part.reuse_cur = part.reuse_kept.setdefault(self.who, {})
        if not part.reuse_on:
            return out
        cur = part.reuse_cur
        kept = cur.get(factor)
        image = span if self.keep.image_only and span is not None else None
        if kept is not None and kept[0].shape != (out.shape if image is None else out.narrow(
                dim, image[0], image[1] - image[0]).shape):
            kept = None  # another text length under the same identity: start again
        if kept is not None and not self.refresh:
            r, slope, at = kept
            add = r.to(out.dtype)
            if slope is not None:
                add = add + slope.to(out.dtype) * (self.now - at).clamp(max=self.every)
            if image is None:
                return out + add
            a, b = image
            return torch.cat([out.narrow(dim, 0, a), out.narrow(dim, a, b - a) + add,
                              out.narrow(dim, b, out.shape[dim] - b)], dim)
        f = full()
        r = f - out
        if image is not None:  # a copy: a view would hold all of ``full - out``
            r = r.narrow(dim, image[0], image[1] - image[0]).clone()
        slope = None
        if self.extrapolate and self.keep.slope:
            slope = torch.zeros_like(r) if kept is None else \
                (r - kept[0].to(r.dtype)) / (self.now - kept[2]).clamp(min=1)
        dt = self.keep.dtype
        cur[factor] = (r if dt is None else r.to(dt),
                       slope if slope is None or dt is None else slope.to(dt), self.now)
        return f


class Source(Protocol):
    """What a pooled call's maths read from their patch (``PoolingProcessor.source``,
    the shadows' ``source``): the processors' per-call state, or a measured run's fixed plan."""

    text: int            # text tokens in this call (where the image span starts in single blocks)
    p: float | None      # this call's sampling progress, where read
    reuse: Reuse         # residual reuse (``Reuse(0)``: none)

    def plan_for(self, index: int, kind: str) -> dit.DitPlan | None: ...


class Refresh:
    """What a pooled step costs with residual reuse every ``every`` steps, in one timed run
    (it stands in for ``Reuse`` in the DiT runners: ``processors``', ``percall_runner``'s):
    the pooled output plus a residual and its slope (the steps between refreshes; the output
    itself stands in for them: the same reads, nothing kept between runs), and the refresh's
    share: the unpooled attention, through the block's own kernel, on 1/``every`` of the
    queries against all keys (``full(rows)``)."""

    def __init__(self, every: int):
        self.every = every

    def around(self, key: tuple, out: torch.Tensor, full: Any, dim: int = 1,
               span: Any = None) -> torch.Tensor:
        full(-(-out.shape[dim] // self.every))
        return out + out + out * float(self.every - 1)


def attend(wrapper: Any, kernel: Any, plan: dit.DitPlan, q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor, start: int, dim: int, emb: Any = None,
            rotate: Any = None, positions: Any = None) -> torch.Tensor:
    """Attention with the image keys/values pooled (``kernel(q, k, v, bias)``), the
    proportional bias where the plan has it, and the residual reuse where the patch has it
    (``wrapper.source.reuse``, keyed by ``wrapper``'s block).
    Queries are rotated by ``emb``; keys get their positions per ``plan.rope``
    (``DitPlan.keys``); ``positions(emb)``: the pooled embedding (default: diffusers'
    ``(cos, sin)`` of ``[S, D]``, pooled on the plan's grid)."""
    n = k.shape[dim]
    if emb is not None:
        q = rotate(q, emb)
        kp = plan.keys(k, start, dim, emb, rotate,
                       positions or (lambda e: plan.cos_sin(e, start)))
    else:
        kp = plan.pool(k, start, dim)
    out = kernel(q, kp, plan.pool(v, start, dim), plan.bias(start, n, q.device))
    if wrapper is None:
        return out
    # the full keys (rotated) only where a refresh runs the unpooled attention
    return wrapper.source.reuse.around(
        (wrapper, plan.factor), out,
        lambda rows=None: kernel(q if rows is None else q.narrow(dim, 0, rows),
                                 k if emb is None else rotate(k, emb), v, None),
        dim, (start, start + plan.tokens))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
          ) -> torch.Tensor:
    """PyTorch's SDPA ([B, heads, S, D]) with the key bias as an additive [1, 1, 1, S] mask."""
    mask = None if bias is None else bias.to(q.dtype).view(1, 1, 1, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


_BACKENDS: dict[Any, tuple[bool, bool]] = {}  # backend -> (takes a mask, takes a scale)
# diffusers' backends that pass an additive float mask on to SDPA; the others raise on a mask
# (native flash, XLA), change it (NPU) or silently drop it (flash-attn, sage, xformers...).
MASK_BACKENDS = ("native", "_native_efficient", "_native_math", "_native_cudnn")


def _backend(name: Any) -> tuple[bool, bool]:
    """Whether diffusers' attention backend ``name`` takes the bias as a mask, and a scale."""
    if merge.compiling():  # not filled while tracing: the graph would guard on the cache
        return _backend_of(name)
    if name not in _BACKENDS:
        _BACKENDS[name] = _backend_of(name)
    return _BACKENDS[name]


def _backend_of(name: Any) -> tuple[bool, bool]:
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    b = AttentionBackendName(name)
    args = _AttentionBackendRegistry._supported_arg_names.get(b, ())
    return b.value in MASK_BACKENDS, "scale" in args


def dispatch(original: Any):
    """diffusers' dispatcher with ``original``'s backend ([B, S, heads, D]): the bias as a
    [1, 1, 1, S] mask where the backend takes one; otherwise (flash-attn, sage, xformers...)
    as ``count_channel``'s extra channel, which any kernel runs."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn
    backend = getattr(original, "_attention_backend", None)
    kw = {"backend": backend, "parallel_config": getattr(original, "_parallel_config", None)}

    def kernel(q, k, v, bias):
        if bias is None:
            return dispatch_attention_fn(q, k, v, **kw)
        masks, scaled = _backend(backend or _AttentionBackendRegistry.get_active_backend()[0])
        if masks:
            return dispatch_attention_fn(q, k, v, attn_mask=bias.to(q.dtype).view(1, 1, 1, -1),
                                         **kw)
        d = q.shape[-1]
        q, k, v = count_channel(q, k, v, bias, 1,
                                    None if scaled else channel_width(d) ** -0.5)
        extra = {"scale": d ** -0.5} if scaled else {}
        return dispatch_attention_fn(q, k, v, **extra, **kw)[..., :d]
    return kernel


def masked(original: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           keep: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """diffusers' dispatcher with ``original``'s backend and a boolean key mask ``keep``
    (broadcast to [B, heads, S, keys]; a text mask with the pooled keys all valid), the bias
    added to it as ``-inf``/0 plus ``log(cell size)`` where there is one."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    m = keep
    if bias is not None:
        m = torch.zeros((), dtype=q.dtype, device=q.device).expand(m.shape).masked_fill(
            ~m.to(torch.bool), float("-inf")) + bias.to(q.dtype).view(1, 1, 1, -1)
    return dispatch_attention_fn(q, k, v, attn_mask=m, dropout_p=0.0, is_causal=False,
                                 backend=getattr(original, "_attention_backend", None),
                                 parallel_config=getattr(original, "_parallel_config", None))
