"""The per-call forms' measuring runner: how the auto policy times a DiT block where the host
hands us attention calls (ComfyUI's override, Forge Neo's swap): the block's token-wise work
and its self-attention through the host's own kernel, unpooled or pooled by the per-call
core (``kv.pool_call``), as a generation runs it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import attend, dit
from .kv import CallState, Spans, pool_call
from .percall import MASK_BACKENDS


class _Timed:
    """The owner of the measuring runner's calls (``runner``)."""

    def __init__(self) -> None:
        self.flags: dict[str, bool] = {}
        self.plans: dict[tuple, dit.DitPlan] = {}


def runner(kernel: tuple[str, str], reuse: Any = 0) -> Callable:
    """``measure``'s runner for a DiT whose attention is reached per call (ComfyUI's override,
    Forge Neo's swap: ``kernel`` names the host's backend ``(q, k, v, heads, mask)``, torch's
    SDPA where it is not loaded): a block's token-wise work (each of its linear layers on the
    image tokens) and its self-attention over them, unpooled, or through ``pool_call`` with the
    state of ``plan``'s grid (a video's frames too), as a pooled generation runs it. Errs low:
    per-sample layers (modulation) are counted per token. ``reuse`` (the settings' N): a
    pooled run also costs what residual reuse adds per step (the refresh's share: the
    unpooled attention on 1/N of the queries; the residual added), so the auto policy
    weighs what the generation will run; a callable gives the period then (``period``)."""
    timed = _Timed()
    period = reuse if callable(reuse) else (lambda: reuse)

    def run(block: nn.Module, x: torch.Tensor, context: Any, planner: Any, p: Any) -> Any:
        func = getattr(sys.modules.get(kernel[0]), kernel[1], None) or _sdpa
        for m in block.modules():
            if isinstance(m, nn.Linear):
                m(x if m.in_features == x.shape[-1] else x.new_zeros(*x.shape[:-1],
                                                                    m.in_features))
        heads = heads_of(block, x.shape[-1])
        every = period()
        share = (attend.Refresh(every), (object(),)) if every else (None, ())
        state = None if p is None else CallState(Spans(0, True, 0, p.frames, p.h, p.w),
                                                 (p.factor,), 0, bool(p.proportional),
                                                 *share)
        n = x.shape[1]
        if state is None or p.factor <= 1 or state.start(n, n) is None:
            return func(x, x, x, heads)
        bias = "mask" if getattr(func, "__name__", "") in MASK_BACKENDS else "channel"
        return pool_call(state, p.factor, 0, x, x, x, 1,
                         lambda q, k, v, m: func(q, k, v, heads, mask=m) if m is not None
                         else func(q, k, v, heads), timed.plans, bias=bias, heads=heads,
                         part=state.part(None, 0))
    run.video = True  # a video's grid runs as the generation pools it (``Measurer.get``)
    run.period = period  # the measurement's key names it (``Measurer.for_model``)
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
    """The hosts' backend form ``(q, k, v, heads, mask)`` on ``[B, S, heads * D]``."""
    q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).flatten(2)
