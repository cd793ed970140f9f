"""Attention over pooled image keys, for every DiT adapter: the proportional-attention bias
on each kernel path, and residual reuse.

- The bias (``dit.key_bias``: ``log(cell size)`` on pooled image keys, 0 elsewhere) goes to
  PyTorch's SDPA as an additive ``[1, 1, 1, S]`` mask (``sdpa``), or, for kernels that take
  no mask (flash-attn and the like behind diffusers' dispatcher, a host's own joint
  attention), as one extra query/key channel (``count_channel``).
  ``python -m tome_lab.dit_bias_bench`` times both (docs/quality.md#dit).
- ``Reuse`` (``reuse.py``): every N steps a pooled block also runs unpooled and keeps
  ``full - pooled``, added to the pooled output on the steps between.

``attend`` puts pooling, positions, bias and reuse together around any kernel
``kernel(q, k, v, bias)``; ``dispatch`` is diffusers' kernel per backend. The DiT families'
maths (``tome/dits/``) call these; none of them is here.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from . import dit, graphs
from .reuse import Keep, Reuse  # noqa: F401 (the adapters' and families' names for them)


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
    queries against all keys (``full(rows)``). ``every`` may be fractional: the period in the
    steps a step cache leaves to compute (``Counts.refresh_period``)."""

    def __init__(self, every: float):
        self.every = every

    def around(self, key: tuple, out: torch.Tensor, full: Any, dim: int = 1,
               span: Any = None) -> torch.Tensor:
        full(math.ceil(out.shape[dim] / self.every))
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
    if graphs.compiling():  # not filled while tracing: the graph would guard on the cache
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
