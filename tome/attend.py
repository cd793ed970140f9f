"""Attention over pooled image keys, for every DiT adapter: the proportional-attention bias
on each kernel path, and residual reuse.

- The bias (``dit.key_bias``: ``log(cell size)`` on pooled image keys, 0 elsewhere) goes to
  PyTorch's SDPA as an additive ``[1, 1, 1, S]`` mask (``sdpa``), or, for kernels that take
  no mask (flash-attn and the like behind diffusers' dispatcher, a host's own joint
  attention), as one extra query/key channel (``count_channel``).
  ``python -m tome.lab.dit_bias_bench`` times both (docs/quality.md#dit).
- ``Reuse``: every N steps a pooled block also runs unpooled and keeps ``full - pooled``,
  added to the pooled output on the steps between.

``attend`` puts pooling, positions, bias and reuse together around any kernel
``kernel(q, k, v, bias)``; ``dispatch`` is diffusers' kernel per backend. The DiT families'
maths (``tome/dits/``) call these; none of them is here.
"""

from __future__ import annotations

import math
from typing import Any

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


class Reuse:
    """Residual reuse (``reuse`` = N, DiTFastAttn's residual sharing on pooled keys): on every
    Nth step of a generation a pooled block's attention also runs unpooled and keeps
    ``r = full - pooled``; the steps between add ``r`` to the pooled output, extrapolated
    linearly from the last two refreshes once there are two (``r + (r - r_prev) * steps /
    N``; measured 1.5 dB closer than the plain residual at the same speed,
    docs/quality.md#dit). Steps are told apart by the call's progress (a host calling cond and
    uncond apart gets its own residuals per call of a step); progress going back starts a new
    generation. Memory: two attention outputs per pooled block and call of a step (up to 4
    calls), kept until the next generation or the patch's removal. Host-side
    state per step: not applied inside a ``torch.compile`` graph (the block pools there)."""

    def __init__(self, every: int, extrapolate: bool = True):
        self.every, self.extrapolate, self.kept = every, extrapolate, {}
        self.step, self.sub, self.last = 0, 0, None

    def begin(self, p: float) -> None:
        if not self.every:
            return
        if p == self.last and self.sub < 3:
            self.sub += 1
        else:  # a new step; or a 5th call at one noise level: a new generation (bounded memory)
            if self.last is None or p <= self.last:
                self.step, self.kept = -1, {}
            self.step, self.sub, self.last = self.step + 1, 0, p

    def apply(self, key: tuple, out: torch.Tensor, full: Any) -> torch.Tensor:
        """The output of a pooled block: ``out`` plus its kept residual, or (refresh steps, or
        nothing kept yet) ``full()``, keeping ``full - out``."""
        key = key + (self.sub,)
        kept = self.kept.get(key)
        if kept is not None and kept[0].shape != out.shape:
            kept = None
        if kept is not None and self.step % self.every:
            r, slope, at = kept
            return out + r if slope is None else out + r + slope * float(self.step - at)
        f = full()
        r = f - out
        slope = None
        if kept is not None and self.extrapolate and self.step > kept[2]:
            slope = (r - kept[0]) / float(self.step - kept[2])
        self.kept[key] = (r, slope, self.step)
        return f


def attend(wrapper: Any, kernel: Any, plan: dit.DitPlan, q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor, start: int, dim: int, emb: Any = None,
            rotate: Any = None, positions: Any = None) -> torch.Tensor:
    """Attention with the image keys/values pooled (``kernel(q, k, v, bias)``), the
    proportional bias where the plan has it, and the residual reuse where the patch has it.
    Queries are rotated by ``emb``; keys get their positions per ``plan.rope``
    (``DitPlan.keys``); ``positions(emb)``: the pooled embedding (default: diffusers'
    ``(cos, sin)`` of ``[S, D]``, pooled on the plan's grid)."""
    n = k.shape[dim]
    if emb is not None:
        q = rotate(q, emb)
        kp = plan.keys(k, start, dim, emb, rotate,
                       positions or (lambda e: plan.cos_sin(e, start)))
        # the full keys, rotated, only where reuse runs the unpooled attention
        k = None if wrapper is None or not wrapper.source.reuse.every else rotate(k, emb)
    else:
        kp = plan.pool(k, start, dim)
    out = kernel(q, kp, plan.pool(v, start, dim), plan.bias(start, n, q.device))
    if wrapper is None or not wrapper.source.reuse.every or wrapper.source.p is None \
            or merge.compiling():
        return out
    reuse = wrapper.source.reuse
    return reuse.apply((wrapper.index, id(wrapper), plan.factor), out,
                       lambda: kernel(q, k, v, None))


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
    if name not in _BACKENDS:
        from diffusers.models.attention_dispatch import (
            AttentionBackendName,
            _AttentionBackendRegistry,
        )
        b = AttentionBackendName(name)
        args = _AttentionBackendRegistry._supported_arg_names.get(b, ())
        _BACKENDS[name] = (b.value in MASK_BACKENDS, "scale" in args)
    return _BACKENDS[name]


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
