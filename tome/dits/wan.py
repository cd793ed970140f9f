"""diffusers' Wan 2.1 / 2.2 (``WanTransformer3DModel``), a video DiT: each of its ``blocks`` runs
self-attention over all ``frames x h x w`` video tokens (frame-major, RoPE inside attention),
then cross-attention to the text (and, for Wan 2.1 i2v, to the CLIP image tokens), then its
feed-forward. Only the self-attention (``attn1``) is pooled: its keys/values by cells within
each frame, so every query still sees every frame; the cross-attention is left alone. Called
with the latent itself (``[B, C, F, H, W]``: the grid is its shape, no device read);
timesteps 0..1000.

Wan 2.2 TI2V hands one timestep per token (``[B, tokens]``); in image-to-video its first
latent frame is the clean conditioning image. Such calls keep the first frame's keys/values
as they are (the pooled span starts after it; in text-to-video that costs one frame's worth
of saving); the window reads the last token's timestep (never the condition's 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import attend, kv
from ..dit import DitPlan
from .family import Call, Dit, Family, arg

PROCESSORS = ("WanAttnProcessor", "WanAttnProcessor2_0")
TEXT_TOKENS = 512  # umT5 prompts, padded to 512 by the pipelines


def diffusers_class(*names: str):
    """``recognise`` for diffusers' own class (ComfyUI's and Forge Neo's Wan have other
    families or none)."""
    return lambda m: any(c.__name__ in names and c.__module__.startswith("diffusers.")
                         for c in type(m).__mro__)


@dataclass(frozen=True)
class VideoDit(Dit):
    """A video DiT's facts: also its latent frames per token (Wan: 1), the text its blocks
    read (Wan's cross-attention; its self-attention, the pooled one, has none:
    ``text_tokens`` 0) and whether every call's first frame is a conditioning image whose
    keys stay whole (HunyuanVideo's image-to-video)."""

    frame_patch: int = 1
    context_tokens: int = TEXT_TOKENS
    keep_first: bool = False


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    p = tuple(getattr(model.config, "patch_size", (1, 2, 2)))
    return VideoDit(int(p[-1]), False, 0, 1.0, True, int(p[0])), model.blocks, ()


def attentions(block: nn.Module) -> list[nn.Module]:
    """The block's self-attention only (``attn2`` is the cross-attention to the text)."""
    a = getattr(block, "attn1", None)
    return [a] if isinstance(a, nn.Module) else []


def call(facts: Dit, args: tuple, kwargs: dict, memo: dict) -> Call | None:
    """The grid from the latent's shape (frames, height, width in latent pixels); a per-token
    timestep (Wan 2.2 TI2V) keeps the first frame whole: the span starts after it."""
    x = arg(args, kwargs, "hidden_states", 0)
    t = arg(args, kwargs, "timestep", 1)
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None
    frames, height, width = x.shape[2] // facts.frame_patch, x.shape[3], x.shape[4]
    start = 0
    if isinstance(t, torch.Tensor) and t.dim() == 2:
        if frames < 2:
            return None
        p = facts.patch
        start = -(-height // p) * -(-width // p)
        frames, t = frames - 1, t[:, -1]
    return Call(x, (frames, height, width), start, t)


def rotate(x: torch.Tensor, emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Wan's RoPE ([B, S, heads, D]; ``emb``: cos and sin [1, S, 1, D], pairs repeated), the
    same ops as ``WanAttnProcessor``'s, so unpooled keys keep their bits."""
    cos, sin = emb
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


def maths(wrapper: Any, attn: nn.Module, plan: DitPlan, hs: torch.Tensor,
          ehs: torch.Tensor | None, emb: Any) -> Any:
    """diffusers' ``WanAttnProcessor`` on self-attention with the video keys/values pooled
    per frame. [B, S, heads, head_dim]; the pooled span starts at the call's ``text`` (0, or
    one frame)."""
    if ehs is not None:  # cross-attention: never pooled
        return NotImplemented
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hs).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hs), attn.to_k(hs), attn.to_v(hs)
    q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
    start = wrapper.source.text
    if start + plan.tokens != k.shape[1]:  # not the sequence the plan was made for
        return NotImplemented
    out = kv.attend_plan(wrapper, attend.dispatch(wrapper.original), plan, q, k, v, start, 1,
                        emb, rotate if emb is not None else None,
                        lambda e: plan.cos_sin(e, start, 1))
    out = out.flatten(2, 3).type_as(q)
    return attn.to_out[1](attn.to_out[0](out))


def inputs(layout: Any, x: torch.Tensor, size: tuple[int, ...]) -> tuple[tuple, dict]:
    """A block's call: the text as its cross-attention sees it (512 tokens of the model's
    width), the time projection ([B, 6, width]) and the rotary embedding of the video grid
    (the model's own ``rope``, which reads only the latent's shape)."""
    b, n, c = x.shape
    g = torch.Generator().manual_seed(n)
    text = torch.randn(b, layout.dit.context_tokens, c, generator=g).to(x.device, x.dtype)
    temb = torch.randn(b, 6, c, generator=g).to(x.device, torch.float32)
    frames, height, width = size if len(size) == 3 else (1, *size)
    emb = layout.root.rope(x.new_empty(b, 0, frames * layout.dit.frame_patch, height, width))
    return (x, text, temb, emb), {}


FAMILY = Family("diffusers wan", diffusers_class("WanTransformer3DModel"), read, call,
                dict.fromkeys(PROCESSORS, maths), attentions, inputs=inputs, video=True)
