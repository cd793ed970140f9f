"""``invokeai.backend.flux.math``: the attention function InvokeAI's Flux layers bind by name."""

import torch
import torch.nn.functional as F


def rope(pos, dim, theta):
    """``[B, S]`` positions -> ``[B, S, dim/2, 2, 2]`` rotation matrices."""
    omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = pos.double()[..., None] * omega
    cos, sin = angle.cos(), angle.sin()
    return torch.stack([cos, -sin, sin, cos], -1).unflatten(-1, (2, 2)).float()


def apply_rope(q, k, pe):
    def one(x):
        pairs = x.to(pe.dtype).unflatten(-1, (-1, 1, 2))
        return (pe[..., 0] * pairs[..., 0] + pe[..., 1] * pairs[..., 1]).flatten(-2).type_as(x)
    return one(q), one(k)


def attention(q, k, v, pe, attn_mask=None):
    q, k = apply_rope(q, k, pe)
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return x.transpose(1, 2).flatten(2)  # [B, S, heads * D]
