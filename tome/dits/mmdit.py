"""SD3 as A1111 1.10 runs it (``modules.models.sd3.mmdit.MMDiT``, Stability's reference code):
``joint_blocks``, each a context block and an image block (``x_block``) whose
``attn.pre_attention`` gives the tokens' q, k, v; [text, image]; called as ``(x, t,
context=, y=)`` with t = sigma * 1000. It has no attention processors: both blocks'
``attn.pre_attention`` and ``post_attention`` are shadowed on the instance (``PreAttention``,
``PostAttention``); removal deletes the instance attributes."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import percall_calls
from ..attend import channel_width, count_channel
from .family import Dit, Family, by_class, latent_call, text_and_time


def recognise(module: nn.Module) -> bool:
    """A1111's MMDiT by what the reader and the shadows use, not by its class name alone: a
    patch embedding with a patch size, joint blocks whose context and image blocks' attention
    has ``pre_attention``, and a forward without ``transformer_options``. Two ComfyUI models
    share the name ``MMDiT`` and are not this: AuraFlow's (none of that structure) and SD3's
    (the same reference code, but ComfyUI calls it with ``transformer_options`` and reaches its
    attention only through its dispatcher, which this family's forms do not use)."""
    blocks = getattr(module, "joint_blocks", None)
    if not by_class("MMDiT")(module) or not isinstance(blocks, nn.ModuleList) or not blocks \
            or getattr(getattr(module, "x_embedder", None), "patch_size", None) is None:
        return False
    if not all(hasattr(getattr(getattr(b, part, None), "attn", None), "pre_attention")
               for b in blocks for part in ("context_block", "x_block")):
        return False
    try:
        return "transformer_options" not in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: not the reference code
        return False


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    patch = model.x_embedder.patch_size
    patch = int(patch[0] if isinstance(patch, (tuple, list)) else patch)
    return Dit(patch, True, 154, 1.0, False), model.joint_blocks, ()


class PreAttention:
    """A block's ``attn.pre_attention`` (q, k, v as [B, S, heads * D], before the block joins
    text and image), shadowed on the instance; the image block's (``image``) pools k and v
    (no RoPE in SD3). The joint kernel takes no mask: the bias rides on ``count_channel``'s
    extra channel in both blocks' q, k, v (text keys 0), which ``PostAttention`` drops. With
    residual reuse both keep their unpooled q, k, v in the block's ``shared`` dict for
    ``PostAttention``'s refresh."""

    def __init__(self, original: Any, source: Any, index: int, kind: str, image: bool,
                 heads: int, shared: dict):
        self.original, self.source, self.index, self.kind = original, source, index, kind
        self.image, self.heads, self.shared = image, heads, shared

    def __call__(self, x: torch.Tensor) -> Any:
        q, k, v = self.original(x)
        plan = self.source.plan_for(self.index, self.kind)
        if plan is None:
            percall_calls.record(self.source, percall_calls.OUTSIDE if self.image else None)
            return q, k, v
        # A1111's ``split_qkv`` flattens q and k (normed) but hands v as [B, S, heads, D]; its
        # kernel views each with q's head width, so a flat v is the same call
        v = v.flatten(2) if v.dim() == 4 else v
        percall_calls.record(self.source, percall_calls.POOLED if self.image else None)
        if self.source.reuse.every:
            self.shared["image" if self.image else "text"] = (q, k, v)
        n = k.shape[1]
        pooled = self.image and n == plan.h * plan.w
        if pooled:
            k, v = plan.pool(k, 0, 1), plan.pool(v, 0, 1)
        if not plan.biased:
            return q, k, v
        bias = plan.bias(0, n, k.device) if pooled else k.new_zeros(k.shape[1], dtype=torch.float)
        d = self.shared["d"] = q.shape[-1] // self.heads
        q, k, v = count_channel(*(t.unflatten(-1, (self.heads, d)) for t in (q, k, v)),
                                bias, 1, channel_width(d) ** -0.5)
        return q.flatten(2), k.flatten(2), v.flatten(2)


class PostAttention:
    """The other half of ``PreAttention``: the kernel's output (this block's part) without the
    extra channels, plus the kept residual where the patch reuses residuals (a refresh runs
    the joint attention unpooled here, once per block call, from the kept q, k, v)."""

    def __init__(self, original: Any, source: Any, index: int, kind: str, image: bool,
                 heads: int, shared: dict):
        self.original, self.source, self.index, self.kind = original, source, index, kind
        self.image, self.heads, self.shared = image, heads, shared

    def __call__(self, x: torch.Tensor) -> Any:
        plan = self.source.plan_for(self.index, self.kind)
        if plan is not None and plan.biased:
            x = x.unflatten(-1, (self.heads, -1))[..., :self.shared["d"]].flatten(2)
        if plan is not None and "image" in self.shared:
            x = self.source.reuse.around((self, plan.factor), x, self._full,
                                         1, (0, x.shape[1]) if self.image else (0, 0))
        if self.image:  # the block's last call: nothing kept past it
            for key in ("text", "image", "full"):
                self.shared.pop(key, None)
        return self.original(x)

    def _full(self, rows: int | None = None) -> torch.Tensor:
        """This part of the unpooled joint attention ([text, image], as A1111's kernel);
        ``rows``: of this part's first query rows only (timing a refresh's share)."""
        (tq, tk, tv), (iq, ik, iv) = self.shared["text"], self.shared["image"]
        if rows is not None:
            q = (iq if self.image else tq)[:, :rows].unflatten(-1, (self.heads, -1))
            k, v = (torch.cat(p, 1).unflatten(-1, (self.heads, -1)).transpose(1, 2)
                    for p in ((tk, ik), (tv, iv)))
            return F.scaled_dot_product_attention(q.transpose(1, 2), k, v).transpose(1, 2) \
                .flatten(2)
        if self.shared.get("full") is None or self.shared["full"][0] is not iq:
            q, k, v = (torch.cat(p, 1).unflatten(-1, (self.heads, -1)).transpose(1, 2)
                       for p in ((tq, iq), (tk, ik), (tv, iv)))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
            self.shared["full"] = (iq, out)
        out = self.shared["full"][1]
        return out[:, tq.shape[1]:] if self.image else out[:, :tq.shape[1]]


def shadow(block: nn.Module, source: Any, index: int = 0, kind: str = "double"
           ) -> list[tuple[nn.Module, str, Any, Any]]:
    """Shadow both blocks' ``attn.pre_attention`` / ``post_attention`` with ours (one block
    call's head dim and, with reuse, q, k, v shared between them)."""
    shared: dict = {}
    heads = block.x_block.attn.num_heads  # the joint kernel's (block_mixing's)
    done = []
    for part, image in ((block.context_block, False), (block.x_block, True)):
        for name, cls in (("pre_attention", PreAttention), ("post_attention", PostAttention)):
            module = part.attn
            before = vars(module).get(name)
            original = before.original if isinstance(before, (PreAttention, PostAttention)) \
                else getattr(module, name)
            ours = cls(original, source, index, kind, image, heads, shared)
            setattr(module, name, ours)
            done.append((module, name, before, ours))
    return done


def check(attn: nn.Module) -> str | None:
    found = vars(attn).get("pre_attention")
    if isinstance(found, PreAttention):
        return "already pooled by another ToMe patch"
    if found is not None:
        return "pre_attention replaced on the instance by another extension"
    return None


def inputs(layout: Any, x: torch.Tensor, size: tuple[int, ...]) -> tuple[tuple, dict]:
    """A joint block's call: ``(context, x, c=)``."""
    text, temb = text_and_time(x, layout.dit.text_tokens)
    return (text, x), {"c": temb}


def image_attention(block: nn.Module) -> nn.Module | None:
    return getattr(getattr(block, "x_block", None), "attn", None)


FAMILY = Family("a1111 sd3", recognise, read,
                latent_call(("x", 0), ("context", 3), ("t", 1)),
                attentions=lambda block: [block.x_block.attn], check=check, shadow=shadow,
                inputs=inputs, attention=image_attention)
