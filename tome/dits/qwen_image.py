"""diffusers' Qwen-Image (``QwenImageTransformer2DModel``): double-stream
``transformer_blocks`` only; joint sequence [text, image, reference images]; RoPE inside
attention as complex frequencies, the text's and the image's apart; timesteps in [0, 1].
The grid is the call's ``img_shapes`` (plain ints: no device read): its first entry is the
generated image, pooled; an edit's reference images (and Qwen-Image-Layered's further
layers) follow it and stay unpooled. The text mask (``encoder_hidden_states_mask``, batches
of prompts of different lengths) is kept on the text keys."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import attend
from ..dit import DitPlan
from .family import Call, Dit, Family, arg, grid_of, text_and_time, text_length
from .wan import diffusers_class

PROCESSORS = ("QwenDoubleStreamAttnProcessor2_0",)
# Measuring's text length: Qwen-Image's pipelines do not pad prompts (its template's own
# tokens are dropped), so a prompt of a few sentences is of this order.
TEXT_TOKENS = 128


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    patch = int(getattr(model.config, "patch_size", 2))  # 2x2 latent packing
    return Dit(patch, True, TEXT_TOKENS, 1000.0, True), model.transformer_blocks, ()


def first_shape(shapes: Any) -> tuple[int, int, int] | None:
    """The generated image's ``(frames, rows, columns)`` from ``img_shapes`` (per batch item a
    list of shapes, or, in older pipelines, one shape per item)."""
    while isinstance(shapes, (list, tuple)) and shapes and isinstance(shapes[0], (list, tuple)):
        shapes = shapes[0]
    if isinstance(shapes, (list, tuple)) and len(shapes) == 3 \
            and all(isinstance(s, int) for s in shapes):
        return int(shapes[0]), int(shapes[1]), int(shapes[2])
    return None


def call(facts: Dit, args: tuple, kwargs: dict, memo: dict) -> Call | None:
    x = arg(args, kwargs, "hidden_states", 0)
    shape = first_shape(arg(args, kwargs, "img_shapes", 4))
    if not isinstance(x, torch.Tensor) or shape is None:
        return None
    f, h, w = shape
    p = facts.patch
    return Call(x, (f, h * p, w * p) if f > 1 else (h * p, w * p),
                text_length(arg(args, kwargs, "encoder_hidden_states", 1)),
                arg(args, kwargs, "timestep", 3))


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's RoPE ([B, S, heads, D]; ``freqs`` complex [S, D/2]), its own function."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
    return apply_rotary_emb_qwen(x, freqs, use_real=False)


def pool_freqs(plan: DitPlan, freqs: torch.Tensor) -> torch.Tensor:
    """The image span's pooled positions (the first ``plan.tokens`` of ``freqs``): each cell's
    mean rotation, normalised (the plan's ``cos_sin`` on the real and imaginary parts)."""
    if plan.factor == 1 and plan.temporal == 1:
        return freqs
    r = torch.view_as_real(freqs)
    c, s = plan.cos_sin((r[..., 0], r[..., 1]), 0)
    return torch.complex(c.contiguous(), s.contiguous())


def maths(wrapper: Any, attn: nn.Module, plan: DitPlan, hs: torch.Tensor,
          ehs: torch.Tensor | None, emb: Any, encoder_hidden_states_mask: Any = None,
          **other: Any) -> Any:
    """diffusers' ``QwenDoubleStreamAttnProcessor2_0`` with the generated image's keys/values
    pooled: text and image projected, normed and rotated apart as it does (so the unpooled
    ones keep their bits), the image keys pooled per ``plan.rope``, then joint attention
    [text, image, references] through the processor's dispatcher, the text mask kept."""
    if ehs is None or other or not isinstance(emb, (tuple, list)):
        return NotImplemented
    if hs.shape[1] < plan.tokens:  # not the sequence the plan was made for
        return NotImplemented
    hd = attn.inner_dim // attn.heads
    q, k, v = (t.unflatten(-1, (-1, hd)) for t in (attn.to_q(hs), attn.to_k(hs), attn.to_v(hs)))
    eq, ek, ev = (t.unflatten(-1, (-1, hd)) for t in (
        attn.add_q_proj(ehs), attn.add_k_proj(ehs), attn.add_v_proj(ehs)))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    if attn.norm_added_q is not None:
        eq = attn.norm_added_q(eq)
    if attn.norm_added_k is not None:
        ek = attn.norm_added_k(ek)
    img, txt = emb
    q, eq, ek = rotate(q, img), rotate(eq, txt), rotate(ek, txt)
    t = ehs.shape[1]
    # the image keys with their positions (``plan.rope``), the references' kept after them
    kp = plan.keys(k, 0, 1, img, rotate, lambda e: pool_freqs(plan, e))
    jq = torch.cat([eq, q], 1)
    jk, jv = torch.cat([ek, kp], 1), torch.cat([ev, plan.pool(v, 0, 1)], 1)
    n = t + k.shape[1]
    kernel = _kernel(wrapper.original, encoder_hidden_states_mask)
    out = kernel(jq, jk, jv, plan.bias(t, n, q.device))
    out = wrapper.source.reuse.around(
        (wrapper, plan.factor), out,
        lambda rows=None: kernel(jq if rows is None else jq[:, :rows],
                                 torch.cat([ek, rotate(k, img)], 1), torch.cat([ev, v], 1), None),
        1, (t, t + plan.tokens))
    out = out.flatten(2, 3).to(jq.dtype)
    txt_out, img_out = out[:, :t], out[:, t:]
    img_out = attn.to_out[0](img_out.contiguous())
    if len(attn.to_out) > 1:
        img_out = attn.to_out[1](img_out)
    return img_out, attn.to_add_out(txt_out.contiguous())


def _kernel(original: Any, mask: Any):
    """The processor's kernel on [B, S, heads, D]: without a text mask ``attend.dispatch``
    (the bias as a mask or an extra channel); with one, the joint boolean mask it builds (the
    pooled keys all valid), the bias added where there is one."""
    if mask is None:
        return attend.dispatch(original)

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any) -> torch.Tensor:
        m = mask.to(torch.bool)
        m = torch.cat([m, m.new_ones(()).expand(m.shape[0], k.shape[1] - m.shape[1])], 1)
        m = m[:, None, None, :]
        return attend.masked(original, q, k, v, m, bias)
    return kernel


def inputs(layout: Any, x: torch.Tensor, size: tuple[int, ...]) -> tuple[tuple, dict]:
    """A block's call: a text of ``TEXT_TOKENS``, a time embedding and the model's own rotary
    embedding of the grid (``pos_embed``)."""
    t = layout.dit.text_tokens
    text, temb = text_and_time(x, t)
    frames = size[0] if len(size) == 3 else 1
    h, w = grid_of(size, layout.dit.patch)
    emb = layout.root.pos_embed([(frames, h, w)], max_txt_seq_len=t, device=x.device)
    return (), {"hidden_states": x, "encoder_hidden_states": text,
                "encoder_hidden_states_mask": None, "temb": temb, "image_rotary_emb": emb}


FAMILY = Family("diffusers qwen-image", diffusers_class("QwenImageTransformer2DModel"), read,
                call, dict.fromkeys(PROCESSORS, maths), inputs=inputs)
