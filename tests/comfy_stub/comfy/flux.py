"""A Flux-shaped DiT with the contract of ComfyUI's Flux blocks, written from observed
behaviour (upstream call sites as quoted by public custom nodes, 2026), not from ComfyUI's
code.

- ``FluxModel.forward(x, timestep, context, transformer_options={})``: the latent
  ``[B, C, H, W]`` is packed 2x2 into image tokens; text tokens come first in the joint
  sequence; positions ``(0, row, column)`` for the image, zeros for the text, turned by
  ``pe_embedder`` into one 2x2 rotation matrix per channel pair (``[B, 1, S, D/2, 2, 2]``);
  ``transformer_options`` gets ``block_type`` ("double", then "single"), ``block_index`` and
  ``img_slice = [text tokens, total]``.
- Each block projects q, k, v (``[B, heads, S, D]``, before RoPE) and, when
  ``calls_patches``, calls every attn1 patch as ``p(q, k, v, pe=pe, attn_mask=None,
  extra_options=options)`` and reads back ``q``, ``k``, ``v``, ``pe`` from the returned
  dict (``out.get("q", q)``); ``attention(q, k, v, pe)`` rotates q and k only when ``pe``
  is not None. ``calls_patches=False`` is ComfyUI 0.8.0's Flux (its blocks call no patches).
- ``rope_always=True`` is upstream ComfyUI's Qwen-Image after its attn1 patches: it rotates
  the queries and keys by the ``pe`` the patches hand back with no None check
  (``apply_rope1(q, pe)``, ``apply_rope1(k, pe)``), so a ``pe`` of None fails there.
"""

import math

import torch
import torch.nn.functional as F


def rope_matrices(pos, dim, theta=10000.0):
    """[..., S] positions -> [..., S, dim/2, 2, 2] rotations by pos * theta^(-2i/dim)."""
    freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = pos.double()[..., None] * freqs
    c, s = angle.cos(), angle.sin()
    return torch.stack([c, -s, s, c], -1).unflatten(-1, (2, 2)).float()


class PosEmbed(torch.nn.Module):
    def __init__(self, axes):
        super().__init__()
        self.axes = axes

    def forward(self, ids):
        parts = [rope_matrices(ids[..., i], d) for i, d in enumerate(self.axes)]
        return torch.cat(parts, dim=-3).unsqueeze(1)


def rotate(x, pe):
    pairs = x.float().unflatten(-1, (-1, 2))
    return (pe * pairs.unsqueeze(-2)).sum(-1).flatten(-2).type_as(x)


def attention(q, k, v, pe):
    if pe is not None:
        q, k = rotate(q, pe), rotate(k, pe)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


def _heads(t, heads):
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _patched(q, k, v, pe, options, calls_patches, rope_always=False):
    if calls_patches:
        for p in options.get("patches", {}).get("attn1_patch", []):
            out = p(q, k, v, pe=pe, attn_mask=None, extra_options=options)
            q, k, v, pe = out.get("q", q), out.get("k", k), out.get("v", v), out.get("pe", pe)
    if rope_always:
        q, k = rotate(q, pe), rotate(k, pe)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
    return attention(q, k, v, pe)


class DoubleBlock(torch.nn.Module):
    def __init__(self, dim, heads, calls_patches, rope_always=False):
        super().__init__()
        self.heads, self.calls_patches, self.rope_always = heads, calls_patches, rope_always
        self.img_qkv, self.txt_qkv = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, 3 * dim)
        self.img_out, self.txt_out = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, img, txt, pe, options):
        iq, ik, iv = (_heads(t, self.heads) for t in self.img_qkv(img).chunk(3, -1))
        tq, tk, tv = (_heads(t, self.heads) for t in self.txt_qkv(txt).chunk(3, -1))
        q, k, v = (torch.cat(p, dim=2) for p in ((tq, iq), (tk, ik), (tv, iv)))
        out = _patched(q, k, v, pe, options, self.calls_patches, self.rope_always)
        n = txt.shape[1]
        return img + self.img_out(out[:, n:]), txt + self.txt_out(out[:, :n])


class SingleBlock(torch.nn.Module):
    def __init__(self, dim, heads, calls_patches, rope_always=False):
        super().__init__()
        self.heads, self.calls_patches, self.rope_always = heads, calls_patches, rope_always
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x, pe, options):
        q, k, v = (_heads(t, self.heads) for t in self.qkv(x).chunk(3, -1))
        return x + self.out(_patched(q, k, v, pe, options, self.calls_patches,
                                     self.rope_always))


class FluxModel(torch.nn.Module):
    def __init__(self, channels=4, context_dim=12, dim=32, heads=2, double=2, single=2,
                 axes=(4, 6, 6), calls_patches=True, rope_always=False):
        super().__init__()
        self.img_in = torch.nn.Linear(4 * channels, dim)
        self.txt_in = torch.nn.Linear(context_dim, dim)
        self.double_blocks = torch.nn.ModuleList(
            [DoubleBlock(dim, heads, calls_patches, rope_always) for _ in range(double)])
        self.single_blocks = torch.nn.ModuleList(
            [SingleBlock(dim, heads, calls_patches, rope_always) for _ in range(single)])
        self.pe_embedder = PosEmbed(axes)
        self.final = torch.nn.Linear(dim, 4 * channels)

    def forward(self, x, timestep, context, transformer_options={}):  # noqa: B006 (as ComfyUI)
        b, c, hh, ww = x.shape
        h, w = math.ceil(hh / 2), math.ceil(ww / 2)
        x = F.pad(x, (0, 2 * w - ww, 0, 2 * h - hh))
        img = self.img_in(x.view(b, c, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w, -1))
        txt = self.txt_in(context)
        ids = torch.zeros(b, txt.shape[1] + h * w, 3)
        ids[:, txt.shape[1]:, 1] = torch.arange(h).repeat_interleave(w).float()
        ids[:, txt.shape[1]:, 2] = torch.arange(w).repeat(h).float()
        pe = self.pe_embedder(ids)
        options = dict(transformer_options)
        options["img_slice"] = [txt.shape[1], txt.shape[1] + h * w]
        options["block_type"] = "double"
        for i, block in enumerate(self.double_blocks):
            options["block_index"] = i
            img, txt = block(img, txt, pe, options)
        joint = torch.cat([txt, img], dim=1)
        options["block_type"] = "single"
        for i, block in enumerate(self.single_blocks):
            options["block_index"] = i
            joint = block(joint, pe, options)
        out = self.final(joint[:, txt.shape[1]:])
        out = out.view(b, h, w, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, 2 * h, 2 * w)
        return out[:, :, :hh, :ww]


def flux_call(patcher, x, context, sigma=1.0):
    """One sampling call of a Flux ModelPatcher: ``transformer_options`` from the patcher
    (patches, wrappers) plus ``sigmas``; the ``diffusion_model`` wrappers called with keyword
    arguments around the model, as ComfyUI's model base calls a DiT."""
    from comfy.sampling import DIFFUSION_MODEL, _Executor
    options = dict(patcher.model_options.get("transformer_options", {}))
    options["patches"] = {k: list(v) for k, v in options.get("patches", {}).items()}
    options["sigmas"] = torch.tensor([float(sigma)])
    around = [w for fns in patcher.wrappers.get(DIFFUSION_MODEL, {}).values() for w in fns]
    model = patcher.model.diffusion_model

    def forward(x, timestep, context=None, transformer_options={}):  # noqa: B006
        return model(x, timestep, context, transformer_options=transformer_options)

    return _Executor(forward, around).execute(x, options["sigmas"], context=context,
                                              transformer_options=options)
