"""diffusers' HunyuanVideo (``HunyuanVideoTransformer3DModel``), a video DiT with joint
attention: double-stream ``transformer_blocks`` then ``single_transformer_blocks``, both over
[video, text] (video first, frame-major), RoPE on the video tokens only, a text mask on every
call; timesteps 0..1000; called with the latent itself (``[B, C, F, H, W]``). The video's
keys/values are pooled by cells within each frame; the text keys and the mask on them are
kept. Its image-to-video form (``image_condition_type="token_replace"``) puts the clean
conditioning image in the first frame's tokens: those keep their keys (the pooled span starts
after them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import attend
from ..dit import DitPlan
from .family import Call, Family, arg
from .wan import VideoDit, diffusers_class

PROCESSORS = ("HunyuanVideoAttnProcessor2_0",)
TEXT_TOKENS = 256  # its pipelines' Llama prompt length (max_sequence_length)


def read(model: nn.Module) -> tuple[VideoDit, Any, Any]:
    cfg = model.config
    return (VideoDit(int(cfg.patch_size), False, TEXT_TOKENS, 1.0, True,
                     int(cfg.patch_size_t), TEXT_TOKENS,
                     cfg.image_condition_type == "token_replace"),
            model.transformer_blocks, model.single_transformer_blocks)


def call(facts: VideoDit, args: tuple, kwargs: dict, memo: dict) -> Call | None:
    """The grid from the latent's shape; ``Call.text``: where the pooled span starts in the
    video (0, or after the first frame's tokens in image-to-video)."""
    x = arg(args, kwargs, "hidden_states", 0)
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None
    frames, height, width = x.shape[2] // facts.frame_patch, x.shape[3], x.shape[4]
    start = 0
    if facts.keep_first:
        if frames < 2:
            return None
        start, frames = -(-height // facts.patch) * -(-width // facts.patch), frames - 1
    return Call(x, (frames, height, width) if frames > 1 else (height, width), start,
                arg(args, kwargs, "timestep", 1))


def rotate(x: torch.Tensor, emb: Any) -> torch.Tensor:
    from diffusers.models.embeddings import apply_rotary_emb
    return apply_rotary_emb(x, emb, sequence_dim=1)


def maths(wrapper: Any, attn: nn.Module, plan: DitPlan, hs: torch.Tensor,
          ehs: torch.Tensor | None, emb: Any, attention_mask: Any = None, **other: Any) -> Any:
    """diffusers' ``HunyuanVideoAttnProcessor2_0`` with the video keys/values pooled: the
    projections, norms and rotation as it does them (the unpooled ones keep their bits), the
    video keys with their positions per ``plan.rope``, then [video, text] through the
    processor's dispatcher, the text mask kept (pooled video keys all valid)."""
    if ehs is None or other or emb is None:
        return NotImplemented
    start, t = wrapper.source.text, ehs.shape[1]
    single = attn.add_q_proj is None
    x = torch.cat([hs, ehs], dim=1) if single else hs
    q, k, v = (p(x).unflatten(2, (attn.heads, -1)) for p in (attn.to_q, attn.to_k, attn.to_v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    n = hs.shape[1]
    if start + plan.tokens != n:  # not the sequence the plan was made for
        return NotImplemented
    if single:
        q = torch.cat([rotate(q[:, :-t], emb), q[:, -t:]], dim=1)
        kv, ek, ev, v = k[:, :-t], k[:, -t:], v[:, -t:], v[:, :-t]
    else:
        q = rotate(q, emb)
        kv = k
        eq, ek, ev = (p(ehs).unflatten(2, (attn.heads, -1))
                      for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        q = torch.cat([q, eq], dim=1)
    kp = plan.keys(kv, start, 1, emb, rotate, lambda e: plan.cos_sin(e, start))
    jk, jv = torch.cat([kp, ek], dim=1), torch.cat([plan.pool(v, start, 1), ev], dim=1)
    kernel = _kernel(wrapper.original, attention_mask, n)
    out = kernel(q, jk, jv, plan.bias(start, n + t, q.device))
    out = wrapper.source.reuse.around(
        (wrapper, plan.factor), out,
        lambda rows=None: kernel(q if rows is None else q[:, :rows],
                                 torch.cat([rotate(kv, emb), ek], 1), torch.cat([v, ev], 1), None),
        1, (start, n))
    out = out.flatten(2, 3).to(q.dtype)
    out, ctx = out[:, :-t], out[:, -t:]
    if getattr(attn, "to_out", None) is not None:
        out = attn.to_out[1](attn.to_out[0](out))
    if getattr(attn, "to_add_out", None) is not None:
        ctx = attn.to_add_out(ctx)
    return out, ctx


def _kernel(original: Any, mask: Any, n: int):
    """The processor's kernel on [B, S, heads, D] with its [B, 1, 1, video + text] boolean
    mask cut to the pooled keys (the video's all valid), the bias added where there is one;
    without a mask ``attend.dispatch``."""
    if mask is None:
        return attend.dispatch(original)

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any) -> torch.Tensor:
        m = mask
        if k.shape[1] != m.shape[-1]:
            text = m[..., n:]
            m = torch.cat([text.new_ones(()).expand(*text.shape[:-1], k.shape[1] - text.shape[-1]),
                           text], -1)
        return attend.masked(original, q, k, v, m, bias)
    return kernel


def inputs(layout: Any, x: torch.Tensor, size: tuple[int, ...]) -> tuple[tuple, dict]:
    """A block's call: a text of ``TEXT_TOKENS`` (all valid), a time embedding and the model's
    own RoPE of the video grid (``rope`` reads only the latent's shape)."""
    b, n, c = x.shape
    g = torch.Generator().manual_seed(n)
    t = layout.dit.context_tokens
    text = torch.randn(b, t, c, generator=g).to(x.device, x.dtype)
    temb = torch.randn(b, c, generator=g).to(x.device, x.dtype)
    frames, height, width = size if len(size) == 3 else (1, *size)
    emb = layout.root.rope(x.new_empty(b, 0, frames * layout.dit.frame_patch, height, width))
    mask = torch.ones(b, 1, 1, n + t, dtype=torch.bool, device=x.device)
    if layout.dit.keep_first:  # token_replace blocks: the condition frame's embedding, tokens
        first = -(-height // layout.dit.patch) * -(-width // layout.dit.patch)
        return (x, text, temb, mask, emb, temb, first), {}
    return (x, text, temb, mask, emb), {}


FAMILY = Family("diffusers hunyuan-video", diffusers_class("HunyuanVideoTransformer3DModel"),
                read, call, dict.fromkeys(PROCESSORS, maths), inputs=inputs, video=True)
