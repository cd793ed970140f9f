"""ldm's attention with PyTorch's fused ``scaled_dot_product_attention``.

The ``ldm`` package on PyPI ships the stock ``CrossAttention.forward``, which materialises the
whole score matrix with einsum; the WebUI replaces it at class level with SDPA (its default
"sdp" optimisation). Benchmarks and the shipped tiny model use the same kernel, so speed-ups
are measured against the attention people actually run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def sdpa_forward(self: nn.Module, x: torch.Tensor, context: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """ldm ``CrossAttention.forward`` with PyTorch's fused ``scaled_dot_product_attention``
    (what the WebUI's "sdp" cross-attention optimisation does for SD1/SD2)."""
    heads = self.heads
    context = x if context is None else context
    q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
    B, N, _ = q.shape
    q, k, v = (t.view(B, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        mask = mask.reshape(B, 1, 1, -1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return self.to_out(out.transpose(1, 2).reshape(B, N, -1))


@contextlib.contextmanager
def ldm_sdpa():
    """Install ``sdpa_forward`` on ldm's CrossAttention class for the duration."""
    try:
        from ldm.modules import attention
    except ImportError:
        yield
        return
    old = attention.CrossAttention.forward
    attention.CrossAttention.forward = sdpa_forward
    try:
        yield
    finally:
        attention.CrossAttention.forward = old
