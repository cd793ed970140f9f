"""``backend.nn.flux``: Forge Neo's Flux (also Flux2's and Chroma's blocks) at tiny width.

Faithful to Neo 2.26 where the ToMe swap meets it: ``attention_function`` is bound by name at
import, and the blocks call the module-level ``attention(q, k, v, pe=, mask=,
transformer_options=)`` with ``[B, heads, S, D]`` queries and keys **before** RoPE and ``pe``
the rotation matrices ``[B, 1, S, D/2, 2, 2]``; the joint sequence is ``[text, image,
references]`` in the double- and the single-stream blocks; the image tokens are the latent
padded to whole patches, ``ceil(H/p) x ceil(W/p)``; Kontext references come through
``dynamic_args.ref_latents`` (or ``ref_latents=``) and are appended after the image;
``transformer_options`` carries ``block_type`` and ``block_index``. The layers are our own.
"""

import math

import torch
from torch import nn

from backend.args import dynamic_args
from backend.attention import attention_function
from backend.utils import pad_to_patch_size


def apply_rope1(x, pe):
    """Rotate each channel pair of ``x`` (``[..., S, D]``) by its 2x2 matrix in ``pe``."""
    pairs = x.to(pe.dtype).unflatten(-1, (-1, 1, 2))
    out = pe[..., 0] * pairs[..., 0] + pe[..., 1] * pairs[..., 1]
    return out.flatten(-2).type_as(x)


def apply_rope(q, k, pe):
    return apply_rope1(q, pe), apply_rope1(k, pe)


def attention(q, k, v, pe, mask=None, transformer_options={}):  # noqa: B006 (as Neo)
    if pe is not None:
        q, k = apply_rope(q, k, pe)
    return attention_function(q, k, v, q.shape[1], skip_reshape=True, mask=mask,
                              transformer_options=transformer_options)


def rope(pos, dim, theta):
    """``[..., S]`` positions -> ``[..., S, dim/2, 2, 2]`` rotation matrices."""
    omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = pos.double()[..., None] * omega
    cos, sin = angle.cos(), angle.sin()
    return torch.stack([cos, -sin, sin, cos], -1).unflatten(-1, (2, 2)).float()


class EmbedND(nn.Module):
    def __init__(self, theta, axes_dim):
        super().__init__()
        self.theta, self.axes_dim = theta, list(axes_dim)

    def forward(self, ids):
        return torch.cat([rope(ids[..., i], d, self.theta) for i, d in enumerate(self.axes_dim)],
                         -3).unsqueeze(1)


def timestep_embedding(t, dim, time_factor=1000.0):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = time_factor * t[:, None].float() * freqs[None]
    return torch.cat([args.cos(), args.sin()], -1)


def heads_of(x, heads):
    """``[B, S, 3 * heads * D]`` -> q, k, v as ``[B, heads, S, D]``."""
    return x.unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)


class DoubleStreamBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.img_mod, self.txt_mod = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim)
        self.img_qkv, self.txt_qkv = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.img_proj, self.txt_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.img_mlp, self.txt_mlp = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, img, txt, vec, pe, attn_mask=None, transformer_options={}):  # noqa: B006
        parts = []
        for x, mod, qkv in ((txt, self.txt_mod, self.txt_qkv), (img, self.img_mod, self.img_qkv)):
            shift, scale = mod(nn.functional.silu(vec))[:, None].chunk(2, -1)
            parts.append(heads_of(qkv(nn.functional.layer_norm(x, x.shape[-1:]) * (1 + scale)
                                      + shift), self.heads))
        q, k, v = (torch.cat([parts[0][i], parts[1][i]], 2) for i in range(3))
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]
        img = img + self.img_proj(img_attn)
        img = img + self.img_mlp(nn.functional.gelu(img))
        txt = txt + self.txt_proj(txt_attn)
        txt = txt + self.txt_mlp(nn.functional.gelu(txt))
        return img, txt


class SingleStreamBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.mod = nn.Linear(dim, 2 * dim)
        self.linear1 = nn.Linear(dim, 4 * dim)
        self.linear2 = nn.Linear(2 * dim, dim)

    def forward(self, x, vec, pe, attn_mask=None, transformer_options={}):  # noqa: B006
        shift, scale = self.mod(nn.functional.silu(vec))[:, None].chunk(2, -1)
        qkv, mlp = self.linear1(nn.functional.layer_norm(x, x.shape[-1:]) * (1 + scale)
                                + shift).split([3 * x.shape[-1], x.shape[-1]], -1)
        q, k, v = heads_of(qkv, self.heads)
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        return x + self.linear2(torch.cat([attn, nn.functional.gelu(mlp)], -1))


class IntegratedFluxTransformer2DModel(nn.Module):
    def __init__(self, in_channels=16, hidden_size=32, num_heads=2, depth=2,
                 depth_single_blocks=2, axes_dim=(4, 6, 6), theta=10000, patch_size=2,
                 context_in_dim=32, vec_in_dim=16):
        super().__init__()
        self.patch_size, self.out_channels = patch_size, in_channels
        self.pe_embedder = EmbedND(theta, axes_dim)
        self.img_in = nn.Linear(in_channels * patch_size ** 2, hidden_size)
        self.txt_in = nn.Linear(context_in_dim, hidden_size)
        self.time_in = nn.Linear(256, hidden_size)
        self.vector_in = nn.Linear(vec_in_dim, hidden_size)
        self.double_blocks = nn.ModuleList([DoubleStreamBlock(hidden_size, num_heads)
                                            for _ in range(depth)])
        self.single_blocks = nn.ModuleList([SingleStreamBlock(hidden_size, num_heads)
                                            for _ in range(depth_single_blocks)])
        self.final_layer = nn.Linear(hidden_size, in_channels * patch_size ** 2)

    def process_img(self, x, index=0):
        p = self.patch_size
        x = pad_to_patch_size(x, (p, p))
        b, c, h, w = x.shape
        img = x.unflatten(3, (w // p, p)).unflatten(2, (h // p, p)).permute(0, 2, 4, 1, 3, 5)
        ids = torch.zeros(h // p, w // p, 3)
        ids[..., 0] = index
        ids[..., 1] = torch.arange(h // p, dtype=torch.float32)[:, None]
        ids[..., 2] = torch.arange(w // p, dtype=torch.float32)[None, :]
        return img.flatten(3).flatten(1, 2), ids.flatten(0, 1).expand(b, -1, -1)

    def forward(self, x, timestep, context, y=None, guidance=None, ref_latents=None,
                control=None, transformer_options={}, **kwargs):  # noqa: B006 (as Neo)
        b, _, h, w = x.shape
        p = self.patch_size
        img, img_ids = self.process_img(x)
        tokens = img.shape[1]
        for ref in ref_latents or dynamic_args.ref_latents:
            more, more_ids = self.process_img(ref.to(x).expand(b, -1, -1, -1), index=1)
            img, img_ids = torch.cat([img, more], 1), torch.cat([img_ids, more_ids], 1)
        txt_ids = torch.zeros(b, context.shape[1], 3)
        pe = self.pe_embedder(torch.cat([txt_ids, img_ids], 1))
        img, txt = self.img_in(img), self.txt_in(context)
        vec = self.time_in(timestep_embedding(timestep, 256).to(img.dtype))
        if y is not None:
            vec = vec + self.vector_in(y)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.double_blocks):
            transformer_options["block_index"] = i
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe,
                             attn_mask=kwargs.get("attention_mask"),
                             transformer_options=transformer_options)
        img = torch.cat([txt, img], 1)
        transformer_options["block_type"] = "single"
        for i, block in enumerate(self.single_blocks):
            transformer_options["block_index"] = i
            img = block(img, vec=vec, pe=pe, attn_mask=kwargs.get("attention_mask"),
                        transformer_options=transformer_options)
        out = self.final_layer(img[:, txt.shape[1]:txt.shape[1] + tokens])
        hp, wp = -(-h // p), -(-w // p)
        out = out.unflatten(2, (-1, p, p)).unflatten(1, (hp, wp)).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, -1, hp * p, wp * p)[:, :, :h, :w]
