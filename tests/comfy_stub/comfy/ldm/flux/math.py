"""``comfy.ldm.flux.math`` as ComfyUI 0.8.0 behaves: RoPE as one 2x2 rotation matrix per
channel pair (``[..., S, D/2, 2, 2]``), applied to queries and keys *before* the attention
call, which goes through ``optimized_attention(q, k, v, heads, skip_reshape=True, mask=mask,
transformer_options=...)`` with ``[B, heads, S, D]`` tensors (the name bound at import)."""

import torch

from comfy.ldm.modules.attention import optimized_attention


def rope(pos, dim, theta=10000):
    scale = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    omega = 1.0 / theta ** scale
    out = pos.double()[..., None] * omega
    out = torch.stack([out.cos(), -out.sin(), out.sin(), out.cos()], -1)
    return out.unflatten(-1, (2, 2)).float()


def apply_rope1(x, freqs_cis):
    x_ = x.to(freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    out = freqs_cis[..., 0] * x_[..., 0] + freqs_cis[..., 1] * x_[..., 1]
    return out.reshape(*x.shape).type_as(x)


def apply_rope(xq, xk, freqs_cis):
    return apply_rope1(xq, freqs_cis), apply_rope1(xk, freqs_cis)


def attention(q, k, v, pe, mask=None, transformer_options={}):  # noqa: B006 (as ComfyUI)
    if pe is not None:
        q, k = apply_rope(q, k, pe)
    heads = q.shape[1]
    return optimized_attention(q, k, v, heads, skip_reshape=True, mask=mask,
                               transformer_options=transformer_options)


class EmbedND(torch.nn.Module):
    """Positions ``[B, S, axes]`` -> ``[B, 1, S, D/2, 2, 2]``."""

    def __init__(self, axes_dim, theta=10000):
        super().__init__()
        self.axes_dim, self.theta = list(axes_dim), theta

    def forward(self, ids):
        emb = torch.cat([rope(ids[..., i], d, self.theta) for i, d in enumerate(self.axes_dim)],
                        dim=-3)
        return emb.unsqueeze(1)


def timestep_embedding(t, dim, max_period=10000, time_factor=1000.0):
    t = time_factor * t.float()
    half = dim // 2
    freqs = torch.exp(-torch.log(torch.tensor(float(max_period))) * torch.arange(half) / half)
    args = t[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)
