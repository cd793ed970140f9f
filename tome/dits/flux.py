"""diffusers' Flux (``FluxTransformer2DModel``): double-stream ``transformer_blocks``, then
``single_transformer_blocks``; joint sequence [text, image]; RoPE inside attention; timesteps
in [0, 1]. Pooled by wrapping ``FluxAttnProcessor`` (``maths``: its attention with pooled
image keys/values); the grid comes from the call's ``img_ids``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import attend, kv
from ..dit import DitPlan
from .family import Call, Dit, Family, arg, by_class, grid_of, text_and_time, text_length

PROCESSORS = ("FluxAttnProcessor", "FluxAttnProcessor2_0")


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    cfg = getattr(model, "config", None)
    patch = 2 * int(getattr(cfg, "patch_size", 1) or 1)  # 2x2 latent packing by the pipeline
    return (Dit(patch, True, 512, 1000.0, True), model.transformer_blocks,
            model.single_transformer_blocks)


def grid(img_ids: torch.Tensor, memo: dict) -> tuple[int, int] | None:
    """The generated image's token grid from ``img_ids`` (rows, columns), once per ids
    tensor: pipelines pass the same one at every step. Reference images (Kontext) are appended
    with another first id and are left unpooled."""
    seen = memo.get("ids")
    if seen is not None and seen[0] is img_ids:
        return seen[1]
    ids = img_ids[0] if img_ids.dim() == 3 else img_ids  # older pipelines: [B, S, 3]
    gen = ids[ids[:, 0] == ids[0, 0]]
    lo, hi = gen[:, 1:3].amin(0), gen[:, 1:3].amax(0)
    h, w = (int(v) + 1 for v in (hi - lo).tolist())
    found = (h, w) if h * w == gen.shape[0] else None
    memo["ids"] = (img_ids, found)
    return found


def call(facts: Dit, args: tuple, kwargs: dict, memo: dict) -> Call | None:
    x = arg(args, kwargs, "hidden_states", 0)
    ids = arg(args, kwargs, "img_ids", 4)
    if not isinstance(x, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return None
    g = grid(ids, memo)
    if g is None:
        return None
    return Call(x, (g[0] * facts.patch, g[1] * facts.patch),
                text_length(arg(args, kwargs, "encoder_hidden_states", 1)),
                arg(args, kwargs, "timestep", 3))


def maths(wrapper: Any, attn: nn.Module, plan: DitPlan, hs: torch.Tensor,
          ehs: torch.Tensor | None, emb: Any) -> Any:
    """diffusers' ``FluxAttnProcessor`` with the image keys/values pooled. Sequence dim 1,
    [B, S, heads, head_dim]; joint sequence [text, image]."""
    from diffusers.models.embeddings import apply_rotary_emb

    joint = ehs is not None and attn.added_kv_proj_dim is not None
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hs).chunk(3, dim=-1)
        if joint:
            eq, ek, ev = attn.to_added_qkv(ehs).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hs), attn.to_k(hs), attn.to_v(hs)
        if joint:
            eq, ek, ev = attn.add_q_proj(ehs), attn.add_k_proj(ehs), attn.add_v_proj(ehs)
    q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))
    q, k = attn.norm_q(q), attn.norm_k(k)
    start = wrapper.source.text
    if joint:
        eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)) for t in (eq, ek, ev))
        eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
        q, k, v = torch.cat([eq, q], 1), torch.cat([ek, k], 1), torch.cat([ev, v], 1)
        start = ehs.shape[1]
    if start + plan.h * plan.w > k.shape[1]:  # not the sequence the plan was made for
        return NotImplemented
    out = kv.attend_plan(wrapper, attend.dispatch(wrapper.original), plan, q, k, v, start, 1,
                        emb, lambda x, e: apply_rotary_emb(x, e, sequence_dim=1))
    out = out.flatten(2, 3).to(q.dtype)
    if ehs is None:
        return out
    ehs_out, out = out.split_with_sizes([ehs.shape[1], out.shape[1] - ehs.shape[1]], dim=1)
    out = attn.to_out[1](attn.to_out[0](out.contiguous()))
    return out, attn.to_add_out(ehs_out.contiguous())


def check(attn: nn.Module) -> str | None:
    """``maths`` reproduces diffusers' Flux attention from 0.35 on ([B, S, heads, head_dim],
    ``attn.head_dim``, ``apply_rotary_emb(..., sequence_dim=1)``); older releases (SD.Next
    pins 0.33) lay it out otherwise: their blocks stay unpooled, never fail a generation."""
    import inspect

    import diffusers
    from diffusers.models.embeddings import apply_rotary_emb
    if hasattr(attn, "head_dim") and \
            "sequence_dim" in inspect.signature(apply_rotary_emb).parameters:
        return None
    return (f"diffusers {diffusers.__version__}'s Flux attention predates the one ToMe "
            "reproduces (diffusers 0.35 or later)")


def inputs(layout: Any, x: torch.Tensor, size: tuple[int, ...]) -> tuple[tuple, dict]:
    """A block's call: a text of the pipelines' length, a time embedding and the rotary
    embedding of the grid (the model's own ``pos_embed``)."""
    t = layout.dit.text_tokens
    text, temb = text_and_time(x, t)
    h, w = grid_of(size, layout.dit.patch)
    ids = torch.zeros(t + h * w, 3, device=x.device)
    ids[t:, 1] = torch.arange(h, device=x.device).repeat_interleave(w)
    ids[t:, 2] = torch.arange(w, device=x.device).repeat(h)
    return (), {"hidden_states": x, "encoder_hidden_states": text, "temb": temb,
                "image_rotary_emb": layout.root.pos_embed(ids)}


FAMILY = Family("diffusers flux", by_class("FluxTransformer2DModel"), read, call,
                dict.fromkeys(PROCESSORS, maths), check=check, inputs=inputs)
