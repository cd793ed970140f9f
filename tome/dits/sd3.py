"""diffusers' SD3 and SD3.5 (``SD3Transformer2DModel``): joint ``transformer_blocks``; joint
sequence [image, text]; no RoPE; timesteps 0..1000; called with the latent itself. Pooled by
wrapping ``JointAttnProcessor2_0`` (``joint``: its attention with pooled image keys/values,
PyTorch's SDPA as the processor calls it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import attend, kv
from ..dit import DitPlan
from .family import Dit, Family, by_class, latent_call, text_and_time

PROCESSORS = ("JointAttnProcessor2_0",)


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    patch = int(getattr(model.config, "patch_size", 2))
    return Dit(patch, False, 333, 1.0, False), model.transformer_blocks, ()


def joint(attn: nn.Module, plan: DitPlan, hs: torch.Tensor, ehs: torch.Tensor | None,
          wrapper: Any = None) -> Any:
    """diffusers' ``JointAttnProcessor2_0`` (SD3, SD3.5) with the image keys/values pooled.
    [B, heads, S, head_dim]; joint sequence [image, text]; no rotary positions; PyTorch's SDPA
    (what the processor calls), the bias as its mask."""
    b, n = hs.shape[0], hs.shape[1]
    q, k, v = attn.to_q(hs), attn.to_k(hs), attn.to_v(hs)
    hd = k.shape[-1] // attn.heads
    q, k, v = (t.view(b, -1, attn.heads, hd).transpose(1, 2) for t in (q, k, v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    if ehs is not None:
        eq, ek, ev = (p(ehs).view(b, -1, attn.heads, hd).transpose(1, 2)
                      for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        q, k, v = torch.cat([q, eq], 2), torch.cat([k, ek], 2), torch.cat([v, ev], 2)
    out = kv.attend_plan(wrapper, attend.sdpa, plan, q, k, v, 0, 2)
    out = out.transpose(1, 2).reshape(b, -1, attn.heads * hd).to(q.dtype)
    ehs_out = None
    if ehs is not None:
        out, ehs_out = out[:, :n], out[:, n:]
        if not attn.context_pre_only:
            ehs_out = attn.to_add_out(ehs_out)
    out = attn.to_out[1](attn.to_out[0](out))
    return out if ehs is None else (out, ehs_out)


def maths(wrapper: Any, attn: nn.Module, plan: DitPlan, hs: torch.Tensor,
          ehs: torch.Tensor | None, emb: Any) -> Any:
    return joint(attn, plan, hs, ehs, wrapper)


def inputs(layout: Any, x: torch.Tensor, size: tuple[int, ...]) -> tuple[tuple, dict]:
    text, temb = text_and_time(x, layout.dit.text_tokens)
    return (), {"hidden_states": x, "encoder_hidden_states": text, "temb": temb}


FAMILY = Family("diffusers sd3", by_class("SD3Transformer2DModel"), read,
                latent_call(("hidden_states", 0), ("encoder_hidden_states", 1), ("timestep", 3)),
                dict.fromkeys(PROCESSORS, maths), inputs=inputs)
